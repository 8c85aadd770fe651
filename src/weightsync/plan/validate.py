"""Checks a plan's inputs and result; each problem is a sentence naming what, where and sizes.

The checks collect every problem they find, so one `LayoutMismatchError` reports all of them
(a wrong tensor-parallel size shows up as every parameter disagreeing, not as the first one).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence

from weightsync.errors import LayoutMismatchError
from weightsync.layout import layer_index
from weightsync.layout.dtypes import FLOAT_DTYPES
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.types import ParamLayout
from weightsync.plan.boxes import disjoint_or_equal
from weightsync.plan.engine_owned import EngineOwned
from weightsync.plan.items import CopyItem, LayoutGroup
from weightsync.plan.types import SourceHolding, TargetRank

# How many problems one error message lists before it only counts the rest.
_MAX_LISTED = 8


def raise_if_problems(problems: Sequence[str]) -> None:
    """Raise one `LayoutMismatchError` listing `problems`, if there are any.

    Raises:
        LayoutMismatchError: `problems` is not empty.
    """
    if not problems:
        return
    if len(problems) == 1:
        raise LayoutMismatchError(problems[0])
    listed = "\n".join(f"  - {p}" for p in problems[:_MAX_LISTED])
    more = len(problems) - _MAX_LISTED
    tail = f"\n  ... and {more} more" if more > 0 else ""
    raise LayoutMismatchError(f"{len(problems)} layout mismatches:\n{listed}{tail}")


def _where(target: TargetRank) -> str:
    p: ParallelismConfig = target.parallelism
    where = f"tp {p.tp_rank}/{p.tp_size}, ep {p.ep_rank}/{p.ep_size}"
    if p.attn_dp_size > 1:
        where += f", attn tp {p.attn_tp_rank}/{p.attn_tp_size} dp {p.attn_dp_rank}/{p.attn_dp_size}"
    if p.num_fused_shared_experts:
        where += f", {p.num_fused_shared_experts} fused shared expert(s)"
    if p.moe_dense_tp_size is not None:
        where += f", dense tp {p.moe_dense_tp_size}"
    return f"{target.label} [{where}]"


def _describe(param: ParamLayout) -> str:
    return (
        f"shape {param.shape}, numel {param.numel}, element size {param.element_size} "
        f"({param.dtype})"
    )


def check_targets(
    groups: Iterable[LayoutGroup], engine_owned: EngineOwned | None = None
) -> list[str]:
    """Compare every target's published ``weights_info`` with its layout.

    Args:
        groups: the layout groups and their targets.
        engine_owned: the published parameters no HF tensor feeds that the plan leaves
            alone (`weightsync.plan.engine_owned`); default the built-in kinds.

    Returns:
        One sentence per missing, unexpected (and not engine-owned) or mis-sized parameter.
    """
    owned = engine_owned if engine_owned is not None else EngineOwned()
    problems: list[str] = []
    for group in groups:
        expected = {param.name: param for param in group.params}
        for target in group.targets:
            info = target.weights_info
            wrong_size: list[tuple[ParamLayout, int]] = []
            for param in group.params:
                if param.name not in info:
                    problems.append(
                        f"{_where(target)}: parameter {param.name!r} is missing from "
                        f"weights_info: expected {_describe(param)}, actual: not published "
                        f"(the rank published {len(info)} parameters)"
                    )
                    continue
                _, numel, element_size = info[param.name]
                if numel != param.numel:
                    problems.append(
                        f"{_where(target)}: parameter {param.name!r} has the wrong number of "
                        f"elements: expected {param.numel} (shape {param.shape}), actual "
                        f"{numel}; does the rollout's model config or parallelism differ?"
                    )
                if element_size != param.element_size:
                    wrong_size.append((param, element_size))
            problems += _element_size_problems(target, wrong_size, len(group.params))
            for name, (_, numel, element_size) in info.items():
                if name not in expected and owned.kind_of(name, numel) is None:
                    problems.append(
                        f"{_where(target)}: published parameter {name!r} is unexpected: "
                        f"expected no such parameter in this layout ({len(expected)} "
                        f"parameters), actual numel {numel}, element size {element_size}; "
                        "if the engine computes it itself, declare it engine-owned "
                        "(build_plan's engine_owned)"
                    )
    return problems


def _element_size_problems(
    target: TargetRank, wrong: Sequence[tuple[ParamLayout, int]], num_params: int
) -> list[str]:
    # A rollout running another dtype makes every parameter disagree: say so once.
    if len(wrong) > 1 and len(wrong) == num_params and len({size for _, size in wrong}) == 1:
        param, size = wrong[0]
        return [
            f"{_where(target)}: parameter {param.name!r} and all {num_params - 1} others have "
            f"the wrong element size: expected {param.element_size} bytes ({param.dtype}), "
            f"actual {size} bytes; the rollout runs another dtype: plan with its dtype"
        ]
    return [
        f"{_where(target)}: parameter {param.name!r} has the wrong element size: expected "
        f"{param.element_size} bytes ({param.dtype}), actual {size} bytes; plan with the "
        "rollout's dtype"
        for param, size in wrong
    ]


def check_disjoint(targets: Iterable[TargetRank]) -> list[str]:
    """Check that no two parameters a rank published share a byte of memory.

    A parameter whose address lies inside another's (a stale or wrong ``weights_info``)
    would have its bytes overwritten by the other's, and serve them: refused before any
    write.

    Returns:
        One sentence per overlapping pair.
    """
    problems: list[str] = []
    for target in targets:
        spans = sorted(
            (addr, addr + numel * element_size, name)
            for name, (addr, numel, element_size) in target.weights_info.items()
            if numel
        )
        reach_end, reach_name = None, None
        for start, end, name in spans:
            if reach_end is not None and start < reach_end:
                problems.append(
                    f"{_where(target)}: parameter {name!r} at [{start:#x}, {end:#x}) overlaps "
                    f"parameter {reach_name!r}, which ends at {reach_end:#x}: every parameter "
                    "must own its bytes (the replica published aliased or stale addresses)"
                )
            if reach_end is None or end > reach_end:
                reach_end, reach_name = end, name
    return problems


def check_inside_regions(targets: Iterable[TargetRank]) -> list[str]:
    """Check that every parameter a rank published lies inside a memory region it registered
    (for ranks that publish their regions).

    A parameter past its rank's registered memory would be found only by the transport,
    after the writes before it had landed: refused before any write instead.

    Returns:
        One sentence per parameter outside every region (at most five per rank).
    """
    problems: list[str] = []
    for target in targets:
        if target.regions is None:
            continue
        regions = sorted(target.regions)
        starts = [start for start, _ in regions]
        outside = []
        for name, (addr, numel, element_size) in target.weights_info.items():
            end = addr + numel * element_size
            index = bisect.bisect_right(starts, addr) - 1
            if numel and (index < 0 or end > regions[index][0] + regions[index][1]):
                outside.append(f"{name!r} at [{addr:#x}, {end:#x})")
        if outside:
            shown = ", ".join(outside[:5]) + (
                f" and {len(outside) - 5} more" if len(outside) > 5 else ""
            )
            problems.append(
                f"{_where(target)}: parameters {shown} lie outside every memory region the "
                "rank registered with its transport: the replica published wrong addresses "
                "(restart it, or check the engine's weights_info)"
            )
    return problems


def check_source_dtypes(sources: Iterable[SourceHolding], rollout_dtype: str) -> list[str]:
    """Check that every tensor a source holds can be cast to the rollout's dtype without
    losing its meaning: floating point into floating point, integers into the same integers.

    Returns:
        One sentence per tensor of another kind (an int32 tensor for a bf16 rollout, bool).
    """
    problems: list[str] = []
    rollout_float = rollout_dtype in FLOAT_DTYPES
    for source in sources:
        for name, meta in source.tensors.items():
            held_float = meta.dtype in FLOAT_DTYPES
            if held_float != rollout_float or (not held_float and meta.dtype != rollout_dtype):
                problems.append(
                    f"source rank {source.rank}: HF tensor {name!r} is {meta.dtype}, which "
                    f"does not cast to the rollout's {rollout_dtype}: export the weights in a "
                    "floating-point dtype"
                )
    return problems


def check_source_names(
    sources: Iterable[SourceHolding],
    hf_shapes: Mapping[str, tuple[int, ...]],
    skip: Callable[[str], bool],
) -> list[str]:
    """Check that every tensor a source holds is one of the checkpoint's, or one the caller
    said to skip: a misspelled or extra name is a mistake the plan would otherwise hide.

    Returns:
        One sentence listing the unknown names of each source.
    """
    problems: list[str] = []
    for source in sources:
        unknown = [n for n in source.tensors if n not in hf_shapes and not skip(n)]
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:_MAX_LISTED])
            more = f" and {len(unknown) - _MAX_LISTED} more" if len(unknown) > _MAX_LISTED else ""
            problems.append(
                f"source rank {source.rank} holds {len(unknown)} tensor(s) the model's "
                f"checkpoint does not have: {shown}{more}; fix the names, or pass them as "
                "expected to be skipped (skip_tensors)"
            )
    return problems


def check_source_shapes(
    sources: Iterable[SourceHolding],
    hf_shapes: Mapping[str, tuple[int, ...]],
    users: Mapping[str, str],
) -> list[str]:
    """Compare the shape of every HF tensor a source holds with the model config's.

    Args:
        sources: the trainer's holdings.
        hf_shapes: the checkpoint's tensor shapes from the model config.
        users: ``{hf_name: description of a rollout parameter built from it}``.

    Returns:
        One sentence per wrongly shaped tensor.
    """
    problems: list[str] = []
    for source in sources:
        for name, meta in source.tensors.items():
            expected = hf_shapes.get(name)
            if expected is not None and tuple(meta.shape) != tuple(expected):
                used = f" (used by {users[name]})" if name in users else ""
                problems.append(
                    f"source rank {source.rank}: HF tensor {name!r}{used} has the wrong shape: "
                    f"expected {tuple(expected)} from the model config, actual "
                    f"{tuple(meta.shape)}"
                )
    return problems


def check_held_boxes(
    held: Mapping[str, Mapping[tuple[tuple[int, int], ...], Sequence[int]]],
    users: Mapping[str, str],
) -> list[str]:
    """Check that the boxes sources hold of each tensor are pairwise disjoint or equal.

    Every element must have one holder set (the ranks of one box), so that one unit of work
    serves it: a box that partly overlaps another, or a source holding the whole tensor
    beside sources holding boxes of it, has none.

    Args:
        held: ``{hf_name: {box: source ranks}}``, ``()`` for the whole tensor.
        users: ``{hf_name: description of a rollout parameter built from it}``.

    Returns:
        One sentence per tensor whose boxes overlap.
    """
    problems: list[str] = []
    for name, by_box in sorted(held.items()):
        if len(by_box) < 2:
            continue
        used = f" (used by {users[name]})" if name in users else ""
        if () in by_box:
            partial = sorted(box for box in by_box if box)
            problems.append(
                f"HF tensor {name!r}{used}: source ranks {list(by_box[()])} hold all of it while "
                f"ranks {sorted(r for box in partial for r in by_box[box])} hold boxes "
                f"{partial} of it; expected every source to hold it whole or all to hold "
                "disjoint (or equal) boxes"
            )
            continue
        overlap = disjoint_or_equal(list(by_box))
        if overlap is not None:
            a, b = overlap
            problems.append(
                f"HF tensor {name!r}{used}: source ranks {list(by_box[a])} hold box {a} and "
                f"ranks {list(by_box[b])} hold box {b}, which overlap without being equal; "
                "expected the sources holding an element to hold the same box"
            )
    return problems


def describe_holdings(
    sources: Iterable[SourceHolding], hf_shapes: Mapping[str, tuple[int, ...]]
) -> str:
    """What the sources hold, compactly: layer ranges, other tensors, unknown names."""
    layers: set[int] = set()
    others: set[str] = set()
    unknown: set[str] = set()
    for source in sources:
        for name in source.tensors:
            if name not in hf_shapes:
                unknown.add(name)
            elif (index := layer_index(name)) is not None:
                layers.add(index)
            else:
                others.add(name)
    parts = []
    if layers:
        parts.append(f"layers {int_ranges(layers)}")
    if others:
        parts.append(", ".join(sorted(others)))
    if unknown:
        example = sorted(unknown)[0]
        parts.append(f"{len(unknown)} tensors the model does not have (e.g. {example!r})")
    return "; ".join(parts) if parts else "nothing"


def int_ranges(values: Iterable[int], sep: str = ", ") -> str:
    """Integers as sorted runs: ``[0, 1, 2, 5, 7, 8]`` reads ``0-2, 5, 7-8``."""
    runs: list[list[int]] = []
    for value in sorted(set(values)):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_coverage(
    group: LayoutGroup,
    items_by_param: Mapping[str, Sequence[CopyItem]],
    hf_shapes: Mapping[str, tuple[int, ...]],
) -> list[str]:
    """Check that a layout's items cover every byte of every parameter exactly once.

    Also checks that each item's box lies inside its HF tensor and has as many elements as
    the item has bytes. These hold by construction; a failure is a bug in the layout rules
    or the planner, reported like any other mismatch.

    Returns:
        One sentence per parameter that is not covered exactly once, or per bad item.
    """
    problems: list[str] = []
    where = f"layout {group.layout_id} ({group.targets[0].label} and others like it)"
    params = {param.name: param for param in group.params}
    for name in items_by_param:
        if name not in params:
            problems.append(f"{where}: copy items write {name!r}, which the layout lacks")
    for param in group.params:
        items = sorted(items_by_param.get(param.name, ()), key=lambda i: i.dst_offset_bytes)
        position = 0
        for item in items:
            if item.dst_offset_bytes != position:
                kind = "an overlap" if item.dst_offset_bytes < position else "a gap"
                problems.append(
                    f"{where}: parameter {param.name!r} has {kind} at byte {position}: "
                    f"expected the next item there, actual item at {item.dst_offset_bytes}"
                )
            position = max(position, item.dst_offset_bytes + item.num_bytes)
            if item.hf_name is None:
                continue
            shape = hf_shapes.get(item.hf_name)
            in_bounds = shape is not None and len(shape) == len(item.src_box)
            in_bounds = in_bounds and all(
                stop <= dim for (_, stop), dim in zip(item.src_box, shape, strict=True)
            )
            if not in_bounds:
                problems.append(
                    f"{where}: parameter {param.name!r} reads box {item.src_box} of "
                    f"{item.hf_name!r}, outside its shape {shape}"
                )
            if item.src_numel * param.element_size != item.num_bytes:
                problems.append(
                    f"{where}: parameter {param.name!r} item at byte {item.dst_offset_bytes}: "
                    f"expected {item.src_numel * param.element_size} bytes from its box, "
                    f"actual {item.num_bytes}"
                )
        if position != param.num_bytes:
            problems.append(
                f"{where}: parameter {param.name!r} items cover {position} bytes: expected "
                f"{param.num_bytes} ({_describe(param)}), actual {position}"
            )
    return problems
