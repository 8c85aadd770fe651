"""Plans of layouts with parameters of several dtypes: one part per dtype.

A push program stages one dtype (its ring is typed, its copies cast into it). DeepSeek's
router bias is float32 in a bf16 rollout, and an FP8 rollout holds e4m3 weights beside their
float32 scales, so `build_plan` plans such a layout as one part per parameter dtype: each
part is an ordinary plan of that dtype's parameters, its targets publishing only those, and
the sender pushes a source's parts one after the other into the same targets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from weightsync.plan.items import LayoutGroup, SourcePlan
from weightsync.plan.sync_plan import SyncPlan
from weightsync.plan.types import SourceHolding, TargetRank


def layout_dtypes(groups: Sequence[LayoutGroup]) -> list[str]:
    """The parameter dtypes of the layouts, in the order their first parameters appear."""
    dtypes: dict[str, None] = {}
    for group in groups:
        for param in group.params:
            dtypes.setdefault(param.dtype)
    return list(dtypes)


def only_dtype(groups: Sequence[LayoutGroup], dtype: str) -> tuple[LayoutGroup, ...]:
    """The groups with only their parameters of `dtype`."""
    return tuple(
        dataclasses.replace(group, params=tuple(p for p in group.params if p.dtype == dtype))
        for group in groups
    )


def targets_of_dtype(
    groups: Sequence[LayoutGroup], targets: Sequence[TargetRank], dtype: str
) -> list[TargetRank]:
    """`targets` publishing only their parameters of `dtype` (by their layout group)."""
    names = {
        group.layout_key: {p.name for p in group.params if p.dtype == dtype} for group in groups
    }
    return [
        dataclasses.replace(
            target,
            weights_info={
                name: entry
                for name, entry in target.weights_info.items()
                if name in names[target.parallelism.layout_key()]
            },
        )
        for target in targets
    ]


def check_fp8_sources(groups: Sequence[LayoutGroup], sources: Sequence[SourceHolding]) -> list[str]:
    """Check that every FP8 parameter reads FP8 tensors: a cast to FP8 without its block
    scale would write wrong weights, so a bf16 trainer quantises first
    (`weightsync.export.Fp8Export`).

    Returns:
        One sentence per source tensor of another dtype that an FP8 parameter reads.
    """
    wanted: dict[str, tuple[str, str]] = {}
    for group in groups:
        for param in group.params:
            if param.dtype.startswith("float8"):
                for segment in param.segments:
                    if segment.hf_name is not None:
                        wanted.setdefault(segment.hf_name, (param.dtype, param.name))
    problems = []
    for source in sources:
        for name, meta in source.tensors.items():
            if name in wanted and meta.dtype != wanted[name][0]:
                dtype, param_name = wanted[name]
                problems.append(
                    f"source rank {source.rank}: HF tensor {name!r} is {meta.dtype}, but the "
                    f"rollout's {param_name!r} is {dtype} with block scales: quantise the "
                    "export to the rollout's FP8 (weightsync.export.Fp8Export)"
                )
    return problems


def combine_parts(
    parts: Sequence[SyncPlan], *, targets: tuple[TargetRank, ...], groups: tuple[LayoutGroup, ...]
) -> SyncPlan:
    """One plan of `parts` (one per dtype): each source's plan pushes its parts in order.

    Its `SyncPlan.dtype` is the dtype of the part that writes the most bytes.
    """
    main = max(parts, key=lambda part: part.num_bytes_written)
    by_id = {group.layout_id: group.targets for group in groups}
    source_plans = {}
    for rank in main.source_plans:
        mine = tuple(part.source_plans[rank] for part in parts)
        layout_ids = sorted({layout_id for plan in mine for layout_id in plan.targets})
        source_plans[rank] = SourcePlan(
            rank=rank,
            dtype=main.dtype,
            work={},
            targets={layout_id: by_id[layout_id] for layout_id in layout_ids},
            shapes={name: shape for plan in mine for name, shape in plan.shapes.items()},
            boxes={name: box for plan in mine for name, box in plan.boxes.items()},
            parts=mine,
        )
    assignments = {key: rank for part in parts for key, rank in part.assignments.items()}
    return SyncPlan(
        dtype=main.dtype,
        targets=targets,
        groups=groups,
        assignments=assignments,
        source_plans=source_plans,
        num_write_regions=sum(part.num_write_regions for part in parts),
        parts=tuple(parts),
    )
