"""What a sync moves, per work unit: bytes, writes and destination runs, without copy items.

The network schedule (`weightsync.predict.schedule`) plans at the granularity `build_plan`
assigns sources at, one unit per ``(hf_name, layout_id)``, but keeps only what the network
sees: the bytes each target of the layout receives for the unit, how many writes carry them,
its layer and where it lands. That is cheap enough for a 1T-parameter model into a hundred
rollout ranks, and it takes the rollout's layout rules unchanged (`rank_layout`), including
parameters whose dtype differs from the model's (DeepSeek's float32 router bias).

FP8 rollout (``fp8=True``, DeepSeek-V3 and Kimi-K2 as they ship): every decoder projection
weight (a 2-D ``*_proj.weight`` inside a layer) is sent as e4m3, one byte per element, plus
a float32 scale per 128x128 block of each destination run (`fp8_num_bytes`); the rest keeps
its rollout dtype. A config that ships block FP8 (``quantization_config``) already lays its
projections out as e4m3 parameters beside their float32 ``weight_scale_inv`` parameters, each
counted as the layout has it, so no scale is counted twice.

Each unit also lists its `ElementRun`s, the elements it writes per destination parameter and
their kind (other elements, FP8 codes, FP8 scales): what a delta sync's payload size
depends on (`weightsync.predict.delta`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from weightsync.layout import layer_index, rank_layout
from weightsync.layout.quant import FP8_DTYPE, SCALE_SUFFIX
from weightsync.plan import TargetRank
from weightsync.plan.assign import UnitKey

FP8_BLOCK = 128
FP8_SCALE_BYTES = 4

# What a run's elements are, for the density a delta sync applies to them.
ElementKind = Literal["elements", "fp8_codes", "fp8_scales"]


def fp8_num_bytes(extents: Sequence[int]) -> int:
    """Bytes of a weight box of `extents` as FP8 e4m3 with float32 128x128 block scales.

    The last two dims are blocked; leading dims (stacked experts) repeat the blocks.
    """
    numel = math.prod(extents)
    if len(extents) < 2:
        return numel
    *lead, rows, cols = extents
    blocks = math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * math.prod(lead)
    return numel + FP8_SCALE_BYTES * blocks


def is_fp8_weight(hf_name: str, shape: Sequence[int]) -> bool:
    """Whether an FP8 checkpoint (DeepSeek-V3 style) stores HF tensor `hf_name` as e4m3."""
    return len(shape) == 2 and layer_index(hf_name) is not None and hf_name.endswith("_proj.weight")


@dataclass(frozen=True, slots=True, kw_only=True)
class ElementRun:
    """Elements of one destination parameter that a unit writes into each target.

    Attributes:
        kind: ``"fp8_codes"`` (e4m3 weights), ``"fp8_scales"`` (their float32 block scales)
            or ``"elements"`` (everything else: bf16, fp16, float32 parameters).
        start: index of the first element in its parameter (where a sparse delta's
            65,536-element blocks fall); for the scales of a weight counted as FP8 here
            (``fp8=True`` over a bf16 layout), which no table places, the weight's start
            over the elements of a block.
        numel: elements.
        element_size: bytes per element.
    """

    kind: ElementKind
    start: int
    numel: int
    element_size: int

    @property
    def num_bytes(self) -> int:
        """Bytes of the run's elements."""
        return self.numel * self.element_size


@dataclass(frozen=True, slots=True, kw_only=True)
class TrafficGroup:
    """Targets that share one layout, and each target's bytes.

    Attributes:
        layout_id: index of the group, ordered by layout key as `build_plan` orders them.
        target_indices: positions of the group's targets in the list given.
        num_bytes: bytes each target receives.
    """

    layout_id: int
    target_indices: tuple[int, ...]
    num_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TrafficUnit:
    """One HF tensor's writes into every target of one layout.

    Attributes:
        key: ``(hf_name, layout_id, ())``, as `build_plan` keys the units of a tensor held
            whole.
        layer: the decoder layer the tensor belongs to; -1 before the first (embeddings),
            the number of layers after the last (final norm, output layer).
        position: ``(layout_id, parameter index, byte offset)`` of its first run.
        num_bytes: bytes each target of the layout receives for it.
        num_writes: contiguous destination runs per target (one per parameter it lands in).
        runs: ``(param_name, dst_offset_bytes, num_bytes)`` per run, in the rollout dtype;
            empty for FP8 traffic, whose bytes no destination table describes yet.
        element_runs: the elements it writes per destination run, by kind (padding, which
            a delta never changes, left out).
    """

    key: UnitKey
    layer: int
    position: tuple[int, int, int]
    num_bytes: int
    num_writes: int
    runs: tuple[tuple[str, int, int], ...] = field(default=(), hash=False)
    element_runs: tuple[ElementRun, ...] = field(default=(), hash=False)


def traffic_units(
    hf_config: Any, targets: Sequence[TargetRank], *, dtype: Any = None, fp8: bool = False
) -> tuple[tuple[TrafficGroup, ...], tuple[TrafficUnit, ...]]:
    """The layout groups of `targets` and every work unit's traffic.

    A parameter's padding (a vocabulary shard past the real rows) goes with the unit of its
    first data segment, or of the parameter before it, as `build_plan` files it.

    Args:
        hf_config: the model's transformers config or config.json dict.
        targets: the rollout ranks; only their parallelism is read.
        dtype: the rollout dtype; default the config's.
        fp8: count decoder projection weights as FP8 with block scales.

    Returns:
        ``(groups, units)``; units ordered by position.

    Raises:
        ValueError: no targets, or a parallelism the layout rules reject.
    """
    if not targets:
        raise ValueError("traffic_units needs at least one target rank")
    by_key: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for index, target in enumerate(targets):
        by_key[target.parallelism.layout_key()].append(index)
    groups: list[TrafficGroup] = []
    units: list[TrafficUnit] = []
    num_layers = 0
    for layout_id, key in enumerate(sorted(by_key)):
        members = by_key[key]
        params = rank_layout(hf_config, targets[members[0]].parallelism, dtype)
        acc: dict[str, dict[str, Any]] = {}
        owner: str | None = None
        for param_index, param in enumerate(params.values()):
            size = param.element_size
            for segment in param.segments:
                if segment.numel == 0:
                    continue
                name = segment.hf_name if segment.hf_name is not None else owner
                if name is None:
                    name = next(s.hf_name for s in param.segments if s.hf_name is not None)
                owner = name
                entry = acc.setdefault(
                    name,
                    {
                        "position": (layout_id, param_index, segment.dst_offset * size),
                        "runs": [],
                        "elements": [],
                        "wire_bytes": 0,
                    },
                )
                extents = tuple(stop - start for start, stop in segment.src_box)
                if (
                    fp8
                    and segment.hf_name is not None
                    and param.dtype != FP8_DTYPE
                    and is_fp8_weight(name, extents)
                ):
                    num_bytes = fp8_num_bytes(extents)
                else:
                    num_bytes = segment.numel * size
                entry["wire_bytes"] += num_bytes
                if segment.hf_name is not None:
                    entry["elements"].extend(
                        _element_runs(
                            segment.hf_name,
                            param.dtype,
                            size,
                            segment.dst_offset,
                            extents,
                            num_bytes,
                        )
                    )
                entry["runs"].append((param.name, segment.dst_offset * size, segment.numel * size))
        group_bytes = 0
        for name, entry in acc.items():
            runs = entry["runs"]
            layer = layer_index(name)
            if layer is not None:
                num_layers = max(num_layers, layer + 1)
            num_bytes = entry["wire_bytes"]
            group_bytes += num_bytes
            units.append(
                TrafficUnit(
                    key=(name, layout_id, ()),
                    layer=-1 if layer is None else layer,
                    position=entry["position"],
                    num_bytes=num_bytes,
                    num_writes=_num_runs(runs),
                    runs=() if fp8 else tuple(runs),
                    element_runs=tuple(entry["elements"]),
                )
            )
        groups.append(
            TrafficGroup(layout_id=layout_id, target_indices=tuple(members), num_bytes=group_bytes)
        )
    # Tensors outside the layers: embeddings first, the output side (norm, lm_head) last.
    units = [_place(unit, num_layers) if unit.layer == -1 else unit for unit in units]
    units.sort(key=lambda u: (u.position, u.key))
    return tuple(groups), tuple(units)


def _element_runs(
    hf_name: str, dtype: str, size: int, start: int, extents: Sequence[int], num_bytes: int
) -> tuple[ElementRun, ...]:
    """The element runs of one segment of HF tensor `hf_name`, whose wire bytes are
    `num_bytes`."""
    numel = math.prod(extents)
    if dtype == FP8_DTYPE:
        return (ElementRun(kind="fp8_codes", start=start, numel=numel, element_size=size),)
    if hf_name.endswith(SCALE_SUFFIX):
        return (ElementRun(kind="fp8_scales", start=start, numel=numel, element_size=size),)
    if num_bytes == numel * size:
        return (ElementRun(kind="elements", start=start, numel=numel, element_size=size),)
    # Counted as FP8 over a bf16 layout: e4m3 codes, then the float32 scales of its blocks.
    scales = (num_bytes - numel) // FP8_SCALE_BYTES
    return (
        ElementRun(kind="fp8_codes", start=start, numel=numel, element_size=1),
        ElementRun(
            kind="fp8_scales",
            start=start // (FP8_BLOCK * FP8_BLOCK),
            numel=scales,
            element_size=FP8_SCALE_BYTES,
        ),
    )


def _place(unit: TrafficUnit, num_layers: int) -> TrafficUnit:
    if "embed" in unit.key[0]:
        return unit
    return dataclasses.replace(unit, layer=num_layers)


def _num_runs(runs: Sequence[tuple[str, int, int]]) -> int:
    """Contiguous runs after merging neighbours within one parameter."""
    count, end, param = 0, None, None
    for name, offset, num_bytes in sorted(runs):
        if name != param or offset != end:
            count += 1
        param, end = name, offset + num_bytes
    return count
