"""The trainer side of `weightsync demo`: one process per trainer rank.

Every rank holds the whole model and trains it data-parallel (gradients all-reduced over a
gloo group), so all ranks hold the same weights; each rank exports only its pipeline stage's
layers (rank ``r`` is stage ``r % pp``), which is what a pipeline-parallel trainer's rank
holds. Every rank takes part in each sync as a source.
"""

from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass
from typing import Any

import httpx
import torch


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


def run_trainer_rank(rank: int, args: TrainerArgs, events: Any) -> None:
    """Entry point of trainer rank `rank`: train, sync after every step, report to `events`.

    Events are dicts put on the `events` queue: ``{"kind": "sync", ...}`` per sync (rank 0),
    ``{"kind": "error", "rank", "message"}`` on failure and ``{"kind": "exit", "rank"}``.
    """
    torch.set_num_threads(1)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
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

    from weightsync.checkpoint import load_config_dict
    from weightsync.manager import SyncConfig, SyncManager, TrainerSync
    from weightsync.sender import ModelExport, SenderConfig, WeightSender
    from weightsync.torch_dtypes import torch_dtype
    from weightsync.transport import MooncakeConfig, MooncakeTransport

    dist.init_process_group(
        "gloo", init_method=args.init_method, rank=rank, world_size=args.world_size
    )
    group = dist.group.WORLD
    torch.manual_seed(1234)
    hf_config = load_config_dict(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    export = ModelExport(model, pp_rank=rank % args.pp_size, pp_size=args.pp_size)

    transport = MooncakeTransport(MooncakeConfig(protocol="tcp", timeout_s=args.transfer_timeout_s))
    sender = WeightSender(
        SenderConfig(bucket_bytes=args.bucket_bytes, timeout_s=args.transfer_timeout_s),
        transport=transport,
        group=group,
    )
    manager = None
    if rank == 0:
        manager = SyncManager(
            args.replica_urls, SyncConfig(api_key=args.api_key, check_weight_update_equal=True)
        )
    sync = TrainerSync(sender, hf_config=hf_config, manager=manager, dtype=args.rollout_dtype)
    rollout_dtype = torch_dtype(args.rollout_dtype)
    try:
        for step in range(args.steps + 1):
            loss = _train_step(model, optimizer, rank, step, group) if step else None
            report = sync.sync(export)
            if rank == 0:
                expected = greedy_tokens(model, rollout_dtype, args.prompts, args.max_new_tokens)
                actual = {
                    url: [
                        _generate(url, p, args.max_new_tokens, args.api_key) for p in args.prompts
                    ]
                    for url in args.replica_urls
                }
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
        transport.close()
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


@torch.inference_mode()
def greedy_tokens(
    model: Any, dtype: torch.dtype, prompts: tuple[tuple[int, ...], ...], max_new_tokens: int
) -> list[list[int]]:
    """Greedy tokens of the trainer's model with its weights rounded to the rollout dtype.

    The rollout holds the weights in `dtype` and computes in float32, so rounding the trainer
    weights the same way gives the tokens a correct rollout must produce.
    """
    ref = copy.deepcopy(model).eval()
    for param in ref.parameters():
        param.data = param.data.to(dtype).to(torch.float32)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        new: list[int] = []
        for _ in range(max_new_tokens):
            token = int(ref(input_ids=ids).logits[0, -1].argmax())
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        outputs.append(new)
    return outputs


def _generate(url: str, prompt: tuple[int, ...], max_new_tokens: int, api_key: str) -> list[int]:
    response = httpx.post(
        f"{url}/generate",
        headers={"Authorization": f"Bearer {api_key}"},
        json={
            "input_ids": list(prompt),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        },
        timeout=120.0,
    )
    response.raise_for_status()
    return list(response.json()["output_ids"])
