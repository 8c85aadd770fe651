"""The trainer side of `weightsync demo`: one process per trainer rank.

Every rank holds the whole model and trains it data-parallel (gradients all-reduced over a
gloo group), so all ranks hold the same weights; each rank exports only its pipeline stage's
layers (rank ``r`` is stage ``r % pp``), which is what a pipeline-parallel trainer's rank
holds. Every rank takes part in each sync as a source.
"""

from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.cli.logs import configure_logging


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerArgs:
    """What every trainer rank of the demo needs to know."""

    checkpoint: str
    replica_urls: tuple[str, ...]
    api_key: str
    world_size: int
    pp_size: int
    steps: int
    rollout_dtype: str
    init_method: str
    bucket_bytes: int
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    transfer_timeout_s: float
    fp8_block: int = 0
    verbose: bool = False


def run_trainer_rank(rank: int, args: TrainerArgs, events: Any) -> None:
    """Entry point of trainer rank `rank`: train, sync after every step, report to `events`.

    Events are dicts put on the `events` queue: ``{"kind": "sync", ...}`` per sync (rank 0),
    ``{"kind": "error", "rank", "message"}`` on failure and ``{"kind": "exit", "rank"}``.
    """
    torch.set_num_threads(1)
    # Every rank would log the same warnings (where Mooncake listens): rank 0 says them.
    configure_logging(
        verbose=args.verbose, prefix=f"trainer rank {rank}: ", quiet_warnings=rank > 0
    )
    quiet_transformers()
    try:
        _train_and_sync(rank, args, events)
    except BaseException as exc:
        events.put(
            {"kind": "error", "rank": rank, "message": f"{exc}", "trace": traceback.format_exc()}
        )
    finally:
        events.put({"kind": "exit", "rank": rank})


def quiet_transformers() -> None:
    """Silence transformers' per-file progress bars; the demo shows its own progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _train_and_sync(rank: int, args: TrainerArgs, events: Any) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import weightsync as ws
    from weightsync.checkpoint import load_config_dict
    from weightsync.testing.reference import greedy_tokens, served_tokens
    from weightsync.torch_dtypes import torch_dtype

    dist.init_process_group(
        "gloo", init_method=args.init_method, rank=rank, world_size=args.world_size
    )
    group = dist.group.WORLD
    torch.manual_seed(1234)
    hf_config = load_config_dict(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    export = ws.ModelExport(model, pp_rank=rank % args.pp_size, pp_size=args.pp_size)
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=args.bucket_bytes, timeout_s=args.transfer_timeout_s),
        control=ws.ControlConfig(api_key=args.api_key, check_weight_update_equal=True),
        transport=ws.MooncakeConfig(protocol="tcp", timeout_s=args.transfer_timeout_s),
    )
    sync = ws.TrainerSync(
        config,
        hf_config=hf_config,
        group=group,
        replicas=args.replica_urls,
        dtype=args.rollout_dtype,
    )
    rollout_dtype = torch_dtype(args.rollout_dtype)
    try:
        for step in range(args.steps + 1):
            loss = _train_step(model, optimizer, rank, step, group) if step else None
            report = sync.sync(export)
            if rank == 0:
                expected = greedy_tokens(
                    model,
                    rollout_dtype,
                    args.prompts,
                    args.max_new_tokens,
                    fp8_block=args.fp8_block,
                )
                actual = asyncio.run(
                    served_tokens(
                        args.replica_urls,
                        args.prompts,
                        max_new_tokens=args.max_new_tokens,
                        api_key=args.api_key,
                    )
                )
                events.put(
                    {
                        "kind": "sync",
                        "step": step,
                        "loss": loss,
                        "report": report.to_dict(),
                        "generation_match": all(a == expected for a in actual.values()),
                        "expected": expected,
                        "actual": actual,
                    }
                )
    finally:
        sync.close()
        dist.destroy_process_group()


def _train_step(model: Any, optimizer: Any, rank: int, step: int, group: Any) -> float:
    """One data-parallel optimizer step on a random token batch."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 * step + rank)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (2, 16), generator=gen)
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    world = dist.get_world_size(group)
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(world)
    optimizer.step()
    return float(loss.detach())
