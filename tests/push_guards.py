"""What a lowered push program costs, for fixed presets and layouts: the structure the guards
of `test_push_guards` hold, computed from shapes alone (no bytes are moved or generated)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from weightsync.plan import build_plan, simulate_targets
from weightsync.plan.geometry import StreamGeometry
from weightsync.plan.program import PushProgram, StagingSpec, lower_push
from weightsync.plan.types import SourceHolding
from weightsync.sender.config import SenderConfig
from weightsync.sender.staging import direct_spec
from weightsync.testing.presets import preset_config
from weightsync.testing.synthetic import synthetic_export
from weightsync.transport import WriteCost
from weightsync.transport.cuda_ipc.transport import WRITE_COST as CUDA_IPC_COST
from weightsync.transport.mooncake.engine import DEFAULT_WRITE_COSTS

# The transports a program is lowered for: their declared cost, and the device the trainer's
# tensors and the ring are on.
TRANSPORTS: dict[str, tuple[WriteCost, str]] = {
    "mooncake-tcp": (DEFAULT_WRITE_COSTS["tcp"], "cpu"),
    "mooncake-rdma": (DEFAULT_WRITE_COSTS["rdma"], "cpu"),
    "cuda-ipc": (CUDA_IPC_COST, "cuda:0"),
}
NETWORK = ("mooncake-tcp", "mooncake-rdma")

# Layouts: (replicas, rollout tp, trainer source ranks), as bench/sync.py runs them.
LAYOUTS: dict[str, tuple[int, int, int]] = {
    "2 replicas x tp2, 2 ranks": (2, 2, 2),
    "1 replica x tp1, 1 rank": (1, 1, 1),
}


# Per (preset, layout, transport), what every source rank's program does with the default
# `SenderConfig(direct="auto")`: (max writes per target, bytes direct, bytes staged, copies
# per byte). Over a network, whole tensors go direct and row-parallel slices (rows of 2 to
# 24 KiB here) are staged, except an expert's 128 KiB slices over RDMA, which pay a write
# each; over CUDA IPC everything goes direct, a slice one pitched copy.
EXPECTED: dict[tuple[str, str, str], tuple[int, int, int, float]] = {
    ("dense-1g", "2 replicas x tp2, 2 ranks", "mooncake-tcp"): (52, 395395584, 141557760, 1.132),
    ("dense-1g", "2 replicas x tp2, 2 ranks", "mooncake-rdma"): (52, 395395584, 141557760, 1.132),
    ("dense-1g", "2 replicas x tp2, 2 ranks", "cuda-ipc"): (52, 536953344, 0, 1.0),
    ("dense-1g", "1 replica x tp1, 1 rank", "mooncake-tcp"): (102, 1073824256, 0, 1.0),
    ("dense-1g", "1 replica x tp1, 1 rank", "mooncake-rdma"): (102, 1073824256, 0, 1.0),
    ("dense-1g", "1 replica x tp1, 1 rank", "cuda-ipc"): (102, 1073824256, 0, 1.0),
    ("moe-small", "2 replicas x tp2, 2 ranks", "mooncake-tcp"): (46, 20073472, 203423744, 1.455),
    ("moe-small", "2 replicas x tp2, 2 ranks", "mooncake-rdma"): (554, 154291200, 69206016, 1.155),
    ("moe-small", "2 replicas x tp2, 2 ranks", "cuda-ipc"): (806, 223497216, 0, 1.0),
    ("moe-small", "1 replica x tp1, 1 rank", "mooncake-tcp"): (83, 444353536, 2097152, 1.005),
    ("moe-small", "1 replica x tp1, 1 rank", "mooncake-rdma"): (91, 446450688, 0, 1.0),
    ("moe-small", "1 replica x tp1, 1 rank", "cuda-ipc"): (91, 446450688, 0, 1.0),
    ("dense-8b", "2 replicas x tp2, 2 ranks", "mooncake-tcp"): (25, 1748051968, 268435456, 1.067),
    ("dense-8b", "2 replicas x tp2, 2 ranks", "mooncake-rdma"): (25, 1748051968, 268435456, 1.067),
    ("dense-8b", "2 replicas x tp2, 2 ranks", "cuda-ipc"): (25, 2016487424, 0, 1.0),
    ("dense-8b", "1 replica x tp1, 1 rank", "mooncake-tcp"): (47, 4032899072, 0, 1.0),
    ("dense-8b", "1 replica x tp1, 1 rank", "mooncake-rdma"): (47, 4032899072, 0, 1.0),
    ("dense-8b", "1 replica x tp1, 1 rank", "cuda-ipc"): (47, 4032899072, 0, 1.0),
}


@dataclass(frozen=True, slots=True)
class Shape:
    """What one source rank's program does, over its targets.

    Attributes:
        max_writes_per_target: the most write requests one target gets.
        bytes_direct: bytes written from the trainer's tensors (each layout's once).
        bytes_staged: bytes copied into the ring (each layout's once).
        copies_per_byte: copies each written byte takes (1 direct, more staged).
        modelled_s: the sender's modelled fixed costs: writes times the transport's cost of
            a write, plus the staged bytes at the ring's copy rate.
    """

    max_writes_per_target: int
    bytes_direct: int
    bytes_staged: int
    copies_per_byte: float
    modelled_s: float


# Presets by name, as bench/sync.py serves them (untied embeddings); the 8B model cut to four
# layers, which are all alike.
PRESETS: dict[str, dict] = {
    name: preset_config(name, tie_word_embeddings=False, max_position_embeddings=4096, **overrides)
    for name, overrides in (
        ("dense-1g", {}),
        ("moe-small", {}),
        ("dense-8b", {"num_hidden_layers": 4}),
    )
}


@functools.cache
def _plan_and_geometry(preset: str, layout: str):
    """The sync plan of `preset` in `layout`, and a source's stream geometry (trainer tensors
    in bf16, MoE experts fused as the bench holds them; uninitialised, so nothing is made)."""
    config = PRESETS[preset]
    replicas, tp, num_sources = LAYOUTS[layout]
    export = synthetic_export(
        config, seed=0, dtype="bfloat16", values=False, fused_experts="num_experts" in config
    )
    plan = build_plan(
        hf_config=config,
        targets=simulate_targets(config, tp=tp, ep=1, replicas=replicas, dtype="bfloat16"),
        sources=[SourceHolding(rank=r, tensors=export.holding()) for r in range(num_sources)],
        dtype="bfloat16",
    )
    return plan, export.geometry()


@functools.cache
def programs(preset: str, layout: str, transport: str, direct: str = "auto") -> list[PushProgram]:
    """Every source rank's program for `preset` in `layout` over `transport`, lowered as a
    `WeightSender` with `SenderConfig(direct=direct)` and the bench's 256 MiB buckets
    would."""
    plan, geometry = _plan_and_geometry(preset, layout)
    cost, device = TRANSPORTS[transport]
    if device != "cpu":
        geometry = StreamGeometry(
            keys=geometry.keys, tensors=tuple(t._replace(device=device) for t in geometry.tensors)
        )
    sender = SenderConfig(bucket_bytes=256 << 20, direct=direct, pin_memory=False)
    staging = StagingSpec(
        device=device,
        num_slots=sender.num_slots,
        slot_bytes=sender.slot_bytes,
        chunk_bytes=sender.slot_chunk_bytes(torch.device(device)),
        direct=direct_spec(direct, cost, torch.device(device)),
    )
    return [lower_push(plan.for_source(r), geometry, staging) for r in plan.source_plans]


def shape(program: PushProgram, transport: str) -> Shape:
    """The `Shape` of one program over `transport`."""
    counters = program.counters
    cost, device = TRANSPORTS[transport]
    stage = direct_spec("auto", cost, torch.device(device)).stage_bytes_per_s
    return Shape(
        max_writes_per_target=max(counters.writes_per_target.values()),
        bytes_direct=counters.bytes_direct,
        bytes_staged=counters.bytes_staged,
        copies_per_byte=round(counters.copies_per_byte, 3),
        modelled_s=counters.num_writes * cost.write_s + counters.bytes_staged / stage,
    )


def problems(preset: str, layout: str, transport: str, direct: str = "auto") -> list[str]:
    """What a sender with `SenderConfig(direct=direct)` would do wrong in `layout` over
    `transport`, against `EXPECTED` and the cost model; empty when nothing.

    - every source rank's `Shape` is the expected one (writes per target, bytes direct and
      staged, copies per byte: a change that multiplies writes shows here first);
    - over a network transport, the program's modelled fixed costs are no more than 5%
      above the cheaper of staging everything and writing everything direct;
    - over CUDA IPC the program is all direct (the replayed CUDA graph needs that).
    """
    found = []
    expected = EXPECTED[(preset, layout, transport)]
    lowered = programs(preset, layout, transport, direct)
    for rank, program in enumerate(lowered):
        got = shape(program, transport)
        seen = (got.max_writes_per_target, got.bytes_direct, got.bytes_staged)
        if seen != expected[:3] or abs(got.copies_per_byte - expected[3]) > 1e-3:
            found.append(
                f"{preset}, {layout}, {transport}, rank {rank}: (max writes per target, bytes "
                f"direct, bytes staged, copies per byte) = {(*seen, got.copies_per_byte)}, "
                f"expected {expected}"
            )
        if transport in NETWORK:
            extremes = [
                shape(programs(preset, layout, transport, policy)[rank], transport).modelled_s
                for policy in ("always", "never")
            ]
            if got.modelled_s > 1.05 * min(extremes):
                found.append(
                    f"{preset}, {layout}, {transport}, rank {rank}: modelled fixed costs "
                    f"{got.modelled_s * 1e3:.2f} ms, above the cheaper of all direct and all "
                    f"staged ({min(extremes) * 1e3:.2f} ms)"
                )
        elif not program.all_direct:
            found.append(f"{preset}, {layout}, {transport}, rank {rank}: not all direct")
    return found
