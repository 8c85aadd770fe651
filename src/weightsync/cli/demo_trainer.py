"""The trainer side of `weightsync demo`: one process per trainer rank.

Three trainers, each a source of the syncs on every rank:

- ``hf``: every rank holds the whole transformers model and trains it data-parallel
  (gradients all-reduced over a gloo group); each rank exports only its pipeline stage's
  layers (rank ``r`` is stage ``r % pp``), which is what a pipeline-parallel rank holds;
- ``fsdp``: the transformers model sharded with FSDP2 over all ranks; each rank exports its
  shards' rows (`weightsync.export.fsdp.FSDPExport`);
- ``megatron``: a Megatron-core ``GPTModel`` under TP / PP / EP (data parallel takes the rest
  of the ranks), loaded from the checkpoint; each rank exports the slices it holds
  (`weightsync.export.megatron.MegatronExport`).

Every trainer keeps float32 master weights and steps AdamW on them: at an RL learning rate
most updates then vanish when the weights are rounded to the rollout's 16-bit dtype, which is
what keeps a delta sync (``TrainerArgs.delta``) sparse.

After each sync rank 0 compares the replicas' greedy tokens with those of a transformers
model holding the trainer's weights (for the sharded trainers, gathered from every rank's
boxes: a collective the sync itself never runs).
"""

from __future__ import annotations

import asyncio
import copy
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightsync.cli.logs import configure_logging


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerArgs:
    """What every trainer rank of the demo needs to know.

    Attributes:
        checkpoint: the HF checkpoint folder the trainer starts from.
        replica_urls: the replicas every sync writes.
        api_key: the replicas' API key.
        world_size: trainer ranks.
        pp_size: pipeline stages the trainer exports.
        steps: optimizer steps (one sync after each, plus one before the first).
        rollout_dtype: the replicas' dtype name (``"bfloat16"``).
        init_method: the gloo group's rendezvous (``tcp://HOST:PORT``).
        bucket_bytes: the senders' bucket size.
        prompts: token ids whose greedy continuations are compared after every sync.
        max_new_tokens: tokens generated per prompt.
        transfer_timeout_s: the senders' and the transport's timeout.
        lr: AdamW's learning rate.
        delta: sync with ``SyncConfig(delta=True)``: after the first sync, write only the
            elements that changed into replicas that offer a delta region.
        trainer: which trainer, one of `TRAINER_KINDS`.
        tp_size: tensor-parallel size (the megatron trainer).
        ep_size: expert-parallel size (the megatron trainer, MoE models).
        fp8_block: the block of a block-FP8 rollout, 0 for none.
        verbose: log every rank's weightsync and Mooncake lines.
    """

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
    lr: float
    delta: bool = False
    trainer: str = "hf"
    tp_size: int = 1
    ep_size: int = 1
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
    trainer = _TRAINERS[args.trainer](args, rank, group)
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=args.bucket_bytes, timeout_s=args.transfer_timeout_s),
        control=ws.ControlConfig(api_key=args.api_key, check_weight_update_equal=True),
        transport=ws.MooncakeConfig(protocol="tcp", timeout_s=args.transfer_timeout_s),
        delta=args.delta,
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
            loss = trainer.step(step) if step else None
            report = sync.sync(trainer.export)
            reference = trainer.reference()
            if rank == 0:
                expected = greedy_tokens(
                    reference,
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
        trainer.close()
        dist.destroy_process_group()


class _HFTrainer:
    """The whole transformers model on every rank, data parallel; stage ``r % pp`` exported."""

    def __init__(self, args: TrainerArgs, rank: int, group: Any) -> None:
        from transformers import AutoModelForCausalLM

        import weightsync as ws

        self.rank, self.group = rank, group
        self.model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.export = ws.ModelExport(self.model, pp_rank=rank % args.pp_size, pp_size=args.pp_size)

    def step(self, step: int) -> float:
        return _train_step(self.model, self.optimizer, self.rank, step, self.group)

    def reference(self) -> Any:
        return self.model

    def close(self) -> None:
        pass


class _FSDPTrainer:
    """The transformers model sharded with FSDP2 over every rank (per layer, then the root)."""

    def __init__(self, args: TrainerArgs, rank: int, group: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        from weightsync.export.fsdp import FSDPExport

        self.rank = rank
        self.model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
        self._reference = copy.deepcopy(self.model).eval() if rank == 0 else None
        mesh = init_device_mesh("cpu", (args.world_size,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.export = FSDPExport(self.model)

    def step(self, step: int) -> float:
        gen = torch.Generator().manual_seed(1000 * step + self.rank)
        batch = torch.randint(0, self.model.config.vocab_size, (2, 16), generator=gen)
        loss = self.model(input_ids=batch, labels=batch).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # FSDP reduce-scatters the gradients
        self.optimizer.step()
        return float(loss.detach())

    def reference(self) -> Any:
        # full_tensor() is a collective: every rank takes part, rank 0 keeps the result.
        full = {name: p.full_tensor() for name, p in self.model.named_parameters()}
        if self._reference is not None:
            with torch.no_grad():
                for name, param in self._reference.named_parameters():
                    param.copy_(full[name])
        return self._reference

    def close(self) -> None:
        pass


class _MegatronTrainer:
    """A Megatron-core GPTModel under TP / PP / EP, loaded from the checkpoint."""

    def __init__(self, args: TrainerArgs, rank: int, group: Any) -> None:
        from safetensors.torch import load_file

        from weightsync.checkpoint import load_config_dict
        from weightsync.testing.megatron.trainer import MegatronTrainer, load_hf_state

        self.rank, self.group = rank, group
        self.config = load_config_dict(args.checkpoint)
        self.trainer = MegatronTrainer(
            self.config, tp=args.tp_size, pp=args.pp_size, ep=args.ep_size, lr=args.lr
        )
        state: dict[str, torch.Tensor] = {}
        for file in sorted(Path(args.checkpoint).glob("*.safetensors")):
            state.update(load_file(file))
        load_hf_state(self.trainer.chunks, state, hf_config=self.config)
        self.export = self.trainer.export()
        self._reference = None
        if rank == 0:
            from transformers import AutoModelForCausalLM

            self._reference = AutoModelForCausalLM.from_pretrained(
                args.checkpoint, dtype=torch.float32
            ).eval()

    def step(self, step: int) -> float | None:
        losses = self.trainer.train(1)
        return losses[-1] if losses else None

    def reference(self) -> Any:
        import weightsync as ws
        from weightsync.testing.gather import gather_hf_state

        full = gather_hf_state(self.export, self.group)
        if self._reference is not None and full is not None:
            with torch.no_grad():
                for name, view in ws.ModelExport(self._reference):
                    view.copy_(full[name])
        return self._reference

    def close(self) -> None:
        self.trainer.close()


_TRAINERS = {"hf": _HFTrainer, "fsdp": _FSDPTrainer, "megatron": _MegatronTrainer}
TRAINER_KINDS: tuple[str, ...] = tuple(_TRAINERS)
"""The trainers `weightsync demo --trainer` runs."""


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
