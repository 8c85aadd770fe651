"""`build_plan`: from the rollout's targets and the trainer's holdings to a checked copy plan.

Steps, each a function below:

1. group the targets by layout key; one `rank_layout` call per group;
2. turn every parameter segment into a `CopyItem` and file it under its work unit
   ``(hf_name, layout_id)`` (padding goes with the parameter's first data tensor);
3. validate targets and sources (all problems collected, one `LayoutMismatchError`);
4. cut the units of tensors that sharded sources hold in boxes along those boxes, into units
   ``(hf_name, layout_id, box)`` (``box == ()`` where every holder holds the whole tensor),
   refusing boxes that overlap partially and elements nobody holds;
5. assign every unit to one source that holds its box, keeping each source's units
   contiguous in the destination and the bytes per source balanced (`assign_units`);
6. assemble one `SourcePlan` per source, check that the items cover every destination
   byte exactly once, and shift each box-holding source's reads to its own tensor's origin.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

from weightsync.layout import hf_tensor_shapes, rank_layout
from weightsync.layout.types import ParamLayout
from weightsync.plan import boxes as box_ops
from weightsync.plan.assign import UnitKey, WorkUnit, assign_units
from weightsync.plan.boxes import Box
from weightsync.plan.engine_owned import EngineOwned
from weightsync.plan.items import CopyItem, LayoutGroup, SourcePlan, StageWork
from weightsync.plan.merge import merge_items
from weightsync.plan.parts import (
    check_fp8_sources,
    combine_parts,
    layout_dtypes,
    only_dtype,
    targets_of_dtype,
)
from weightsync.plan.served import served_targets
from weightsync.plan.sync_plan import SyncPlan
from weightsync.plan.types import SourceHolding, TargetRank
from weightsync.plan.validate import (
    check_coverage,
    check_disjoint,
    check_held_boxes,
    check_inside_regions,
    check_source_dtypes,
    check_source_names,
    check_source_shapes,
    check_targets,
    describe_holdings,
    raise_if_problems,
)


def build_plan(
    *,
    hf_config: Any,
    targets: Sequence[TargetRank],
    sources: Sequence[SourceHolding],
    dtype: Any = None,
    skip_tensors: Collection[str] = (),
    param_dtype: str | None = None,
    engine_owned: Collection[str] = (),
) -> SyncPlan:
    """Plan which trainer source writes which bytes of which rollout rank, and check it.

    Args:
        hf_config: the model's transformers config or config.json dict.
        targets: every rollout rank to write (any number of replicas).
        sources: every trainer source rank and the HF tensors it can produce.
        dtype: the rollout dtype (torch dtype or name); default: the dtype the targets
            report (`TargetRank.dtype`) when they all report one, else the config's.
        skip_tensors: names (shell patterns, ``fnmatch``) of tensors a source may hold that
            are not the checkpoint's; any other such tensor is refused.
        param_dtype: plan only the rollout parameters of this dtype (the targets publish
            only those). A layout of several dtypes (DeepSeek's float32 router bias beside
            bf16, FP8 weights beside their float32 scales) gets one such plan per dtype, its
            `SyncPlan.parts` (`weightsync.plan.parts`).
        engine_owned: names (shell patterns) of further parameters a target may publish
            that no HF tensor feeds and that the plan leaves alone, beside the kinds it knows
            (FP8 KV-cache ``k_scale`` / ``v_scale``, `weightsync.plan.engine_owned`); each
            target's are named in `SyncPlan.engine_owned`.

    Returns:
        The validated plan; ``plan.for_source(rank)`` is what source `rank` executes.

    Raises:
        ValueError: no targets or sources, a duplicated target or source rank, or a config
            the layout rules reject.
        LayoutMismatchError: a target published a parameter table that differs from its
            layout (missing, unexpected and not engine-owned, wrong numel or element size,
            an expert ``w13_weight`` that is no whole number of expert slots or holds fused
            shared experts its parallelism contradicts) or parameters whose
            memory overlaps; a source holds a tensor with the wrong shape, of a dtype that does
            not cast to the rollout's, or that is not the checkpoint's (and not skipped); or a
            tensor the layout needs is held by no source; sources hold boxes of one tensor
            that overlap without being equal (or one holds it whole while others hold boxes);
            or elements of a tensor the layout reads lie in no source's box.
    """
    _check_unique(targets, sources)
    owned = EngineOwned.of(engine_owned)
    if param_dtype is None:
        # What SGLang's arguments cannot say (fused shared experts) the parameters do.
        targets, served_problems = served_targets(hf_config, targets)
        raise_if_problems(served_problems)
    if dtype is None:
        dtype = _reported_dtype(targets)
    groups = _group_targets(hf_config, targets, dtype)
    if param_dtype is not None:
        groups = only_dtype(groups, param_dtype)
        raise_if_problems(check_fp8_sources(groups, sources))
    elif len(layout_dtypes(groups)) > 1:
        # One plan per dtype; the whole table is checked here, each part checks its own.
        raise_if_problems(check_targets(groups, owned))
        parts = tuple(
            build_plan(
                hf_config=hf_config,
                targets=targets_of_dtype(groups, targets, part_dtype),
                sources=sources,
                dtype=dtype,
                skip_tensors=skip_tensors,
                param_dtype=part_dtype,
                engine_owned=engine_owned,
            )
            for part_dtype in layout_dtypes(groups)
        )
        combined = combine_parts(parts, targets=tuple(targets), groups=groups)
        return dataclasses.replace(combined, engine_owned=owned.of_groups(groups))
    hf_shapes = hf_tensor_shapes(hf_config)
    tensor_units, users = _work_units(groups, hf_shapes)
    held = _held_boxes(sources)

    problems = check_targets(groups, owned)
    problems += check_disjoint(targets)
    problems += check_inside_regions(targets)
    problems += check_source_names(sources, hf_shapes, _skipper(skip_tensors))
    problems += check_source_dtypes(sources, _resolved_dtype(groups))
    problems += check_source_shapes(sources, hf_shapes, users)
    problems += _check_held(tensor_units, held, users, sources, hf_shapes)
    problems += check_held_boxes(held, users)
    units, uncovered = _cut_along_boxes(tensor_units, held, users)
    raise_if_problems(problems + uncovered)

    holders = {key: held[key[0]][key[2]] for key in units}
    assignments = _assign(groups, units, holders)
    source_plans = _source_plans(groups, units, assignments, sources)
    # Checked on the assembled per-source plans, so that assignment bugs show up too; in HF
    # coordinates, before each source's reads are moved to its own tensor's origin.
    written: dict[int, dict[str, list[CopyItem]]] = defaultdict(lambda: defaultdict(list))
    for plan in source_plans.values():
        for works in plan.work.values():
            for work in works:
                for item in work.items:
                    written[work.layout_id][item.param_name].append(item)
    for group in groups:
        raise_if_problems(check_coverage(group, written[group.layout_id], hf_shapes))
    source_plans = {rank: _localised(plan) for rank, plan in source_plans.items()}
    return SyncPlan(
        dtype=_resolved_dtype(groups),
        targets=tuple(targets),
        groups=groups,
        assignments=assignments,
        source_plans=source_plans,
        num_write_regions=sum(_num_write_regions(sp) for sp in source_plans.values()),
        engine_owned=owned.of_groups(groups),
    )


def _skipper(patterns: Collection[str]) -> Callable[[str], bool]:
    compiled = [re.compile(fnmatch.translate(pattern)) for pattern in patterns]
    return lambda name: any(pattern.match(name) for pattern in compiled)


def _check_unique(targets: Sequence[TargetRank], sources: Sequence[SourceHolding]) -> None:
    if not targets:
        raise ValueError("build_plan needs at least one target rank")
    if not sources:
        raise ValueError("build_plan needs at least one trainer source")
    seen: set[tuple[str, int]] = set()
    for target in targets:
        if (target.replica, target.rank) in seen:
            raise ValueError(f"target replica {target.replica} rank {target.rank} given twice")
        seen.add((target.replica, target.rank))
    ranks = [source.rank for source in sources]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"source ranks must be unique, got {ranks}")


def _group_targets(
    hf_config: Any, targets: Sequence[TargetRank], dtype: Any
) -> tuple[LayoutGroup, ...]:
    by_key: dict[tuple[int, ...], list[TargetRank]] = defaultdict(list)
    for target in targets:
        by_key[target.parallelism.layout_key()].append(target)
    groups = []
    for layout_id, key in enumerate(sorted(by_key)):
        members = tuple(by_key[key])
        params = rank_layout(hf_config, members[0].parallelism, dtype)
        groups.append(
            LayoutGroup(
                layout_id=layout_id, layout_key=key, params=tuple(params.values()), targets=members
            )
        )
    return tuple(groups)


def _reported_dtype(targets: Sequence[TargetRank]) -> str | None:
    """The dtype every target reports, or None when one reports none.

    Raises:
        ValueError: targets report different dtypes (one plan writes one dtype).
    """
    reported = {target.dtype for target in targets}
    if None in reported:
        return None
    if len(reported) > 1:
        raise ValueError(
            f"the replicas serve different dtypes ({', '.join(sorted(reported))}); one plan "
            "writes one dtype: sync them separately"
        )
    return reported.pop()


def _resolved_dtype(groups: Sequence[LayoutGroup]) -> str:
    dtypes = {param.dtype for group in groups for param in group.params}
    if len(dtypes) != 1:
        raise ValueError(f"the layout must have one parameter dtype, got {sorted(dtypes)}")
    return dtypes.pop()


def _owners(params: Sequence[ParamLayout], hf_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The HF tensor whose work unit carries each parameter's padding.

    A parameter's padding goes with its first data segment's tensor. A parameter that is all
    padding (a vocabulary shard past the real rows) goes with the HF tensor of the same name
    if there is one, else with its nearest neighbour's tensor, so one source writes it.
    """
    firsts: list[str | None] = []
    for param in params:
        first = next((s.hf_name for s in param.segments if s.hf_name is not None), None)
        firsts.append(param.name if first is None and param.name in hf_shapes else first)
    known = [i for i, first in enumerate(firsts) if first is not None]
    if not known:
        raise ValueError("the layout has no parameter that reads checkpoint data")
    owners: list[str] = []
    for i, first in enumerate(firsts):
        nearest = firsts[min(known, key=lambda k: (abs(k - i), k))]
        owners.append(first if first is not None else nearest)  # type: ignore[arg-type]
    return owners


def _work_units(
    groups: Sequence[LayoutGroup], hf_shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[tuple[str, int], tuple[CopyItem, ...]], dict[str, str]]:
    """Every ``(hf_name, layout_id)`` unit's merged items, and for each HF tensor one
    parameter that reads it."""
    units: dict[tuple[str, int], list[tuple[int, CopyItem]]] = {}
    users: dict[str, str] = {}
    padding_users: dict[str, str] = {}
    for group in groups:
        where = group.targets[0].label
        for index, (param, owner) in enumerate(
            zip(group.params, _owners(group.params, hf_shapes), strict=True)
        ):
            element_size = param.element_size
            for segment in param.segments:
                if segment.numel == 0:
                    continue
                unit = segment.hf_name if segment.hf_name is not None else owner
                item = CopyItem(
                    hf_name=segment.hf_name,
                    src_box=segment.src_box,
                    param_name=param.name,
                    dst_offset_bytes=segment.dst_offset * element_size,
                    num_bytes=segment.numel * element_size,
                )
                units.setdefault((unit, group.layout_id), []).append((index, item))
                user = f"parameter {param.name!r} of {where}"
                if segment.hf_name is not None:
                    users.setdefault(unit, user)
                else:
                    padding_users.setdefault(unit, f"the padding of {user}")
    merged = {
        key: merge_items(
            [item for _, item in sorted(entries, key=lambda e: (e[0], e[1].dst_offset_bytes))]
        )
        for key, entries in units.items()
    }
    return merged, padding_users | users


def _held_boxes(sources: Sequence[SourceHolding]) -> dict[str, dict[Box, list[int]]]:
    """``{hf_name: {box: ranks}}``: who holds which box of each tensor, ``()`` for the whole."""
    held: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    for source in sorted(sources, key=lambda s: s.rank):
        for name, meta in source.tensors.items():
            held[name][meta.box or ()].append(source.rank)
    return {name: dict(by_box) for name, by_box in held.items()}


def _check_held(
    units: dict[tuple[str, int], tuple[CopyItem, ...]],
    held: dict[str, dict[Box, list[int]]],
    users: dict[str, str],
    sources: Sequence[SourceHolding],
    hf_shapes: dict[str, tuple[int, ...]],
) -> list[str]:
    missing = sorted({hf_name for hf_name, _ in units if hf_name not in held})
    if not missing:
        return []
    described = describe_holdings(sources, hf_shapes)
    return [
        f"no trainer source holds HF tensor {name!r}, needed by "
        f"{users[name]}: expected a source holding it with shape "
        f"{hf_shapes.get(name)}, actual: the sources hold {described}"
        for name in missing
    ]


def _cut_along_boxes(
    units: dict[tuple[str, int], tuple[CopyItem, ...]],
    held: dict[str, dict[Box, list[int]]],
    users: dict[str, str],
) -> tuple[dict[UnitKey, tuple[CopyItem, ...]], list[str]]:
    """Each unit cut into one unit per held box it reads, and the tensors with unheld elements.

    A tensor held whole keeps its unit (box ``()``). Padding goes with the box of the data
    run just before it in the destination (the first box read when none is), so that it is
    written together with that run. Tensors nobody holds, or whose boxes overlap partially,
    are reported by other checks and left out here.
    """
    cut: dict[UnitKey, tuple[CopyItem, ...]] = {}
    unheld: dict[str, int] = defaultdict(int)
    for (name, layout_id), items in units.items():
        by_box = held.get(name)
        if by_box is None:
            continue
        if list(by_box) == [()]:
            cut[(name, layout_id, ())] = items
            continue
        boxes = list(by_box)
        if () in by_box or box_ops.disjoint_or_equal(boxes) is not None:
            continue
        pieces: dict[Box, list[CopyItem]] = defaultdict(list)
        leading: list[CopyItem] = []
        last: Box | None = None
        for item in items:
            if item.is_padding:
                (pieces[last] if last is not None else leading).append(item)
                continue
            runs, missing = box_ops.cut(item, boxes)
            unheld[name] += missing
            ordered = sorted(
                (
                    (run.dst_offset_bytes, box, run)
                    for box, box_runs in runs.items()
                    for run in box_runs
                ),
                key=lambda entry: entry[0],
            )
            for _, box, run in ordered:
                pieces[box].append(run)
            if ordered:
                last = ordered[-1][1]
        if leading:
            first = min(pieces, key=lambda box: pieces[box][0].dst_offset_bytes, default=None)
            pieces[first if first is not None else min(boxes)][:0] = leading
        for box, box_items in pieces.items():
            cut[(name, layout_id, box)] = merge_items(box_items)
    problems = [
        f"{missing} elements of HF tensor {name!r} that {users.get(name, 'the rollout')} reads "
        f"lie in no trainer source's box: expected the boxes the sources hold to cover the "
        f"tensor, actual boxes {sorted(held[name])}"
        for name, missing in sorted(unheld.items())
        if missing
    ]
    return cut, problems


def _assign(
    groups: Sequence[LayoutGroup],
    units: dict[UnitKey, tuple[CopyItem, ...]],
    holders: dict[UnitKey, list[int]],
) -> dict[UnitKey, int]:
    """Each unit's source: contiguous runs in the destination, balanced bytes written."""
    param_index = {
        group.layout_id: {param.name: i for i, param in enumerate(group.params)} for group in groups
    }
    work_units = []
    for key, items in units.items():
        layout_id = key[1]
        first = items[0]
        work_units.append(
            WorkUnit(
                key=key,
                holders=tuple(holders[key]),
                num_bytes=sum(item.num_bytes for item in items) * len(groups[layout_id].targets),
                position=(
                    layout_id,
                    param_index[layout_id][first.param_name],
                    first.dst_offset_bytes,
                ),
            )
        )
    assignments = assign_units(work_units)
    return {key: assignments[key] for key in units}


def _source_plans(
    groups: Sequence[LayoutGroup],
    units: dict[UnitKey, tuple[CopyItem, ...]],
    assignments: dict[UnitKey, int],
    sources: Sequence[SourceHolding],
) -> dict[int, SourcePlan]:
    """One plan per source, its items still in HF coordinates."""
    by_source: dict[int, dict[str, list[UnitKey]]] = defaultdict(lambda: defaultdict(list))
    for key, rank in assignments.items():
        by_source[rank][key[0]].append(key)
    plan_dtype = _resolved_dtype(groups)
    plans: dict[int, SourcePlan] = {}
    for source in sorted(sources, key=lambda s: s.rank):
        mine = by_source.get(source.rank, {})
        # A source holds one box of a tensor, so its units of it differ in layout alone.
        work = {
            hf_name: tuple(
                StageWork(layout_id=key[1], items=units[key])
                for key in sorted(mine[hf_name], key=lambda k: k[1])
            )
            for hf_name in source.tensors
            if hf_name in mine
        }
        layout_ids = sorted({key[1] for keys in mine.values() for key in keys})
        plans[source.rank] = SourcePlan(
            rank=source.rank,
            dtype=plan_dtype,
            work=work,
            targets={layout_id: groups[layout_id].targets for layout_id in layout_ids},
            shapes={hf_name: source.tensors[hf_name].local_shape for hf_name in work},
            boxes={
                hf_name: box for hf_name in work if (box := source.tensors[hf_name].box) is not None
            },
        )
    return plans


def _localised(plan: SourcePlan) -> SourcePlan:
    """`plan` with the reads of each tensor it holds a box of relative to that box's start."""
    if not plan.boxes:
        return plan
    work = {}
    for hf_name, works in plan.work.items():
        box = plan.boxes.get(hf_name)
        if box is None:
            work[hf_name] = works
            continue
        origin = tuple(start for start, _ in box)
        work[hf_name] = tuple(
            StageWork(
                layout_id=w.layout_id,
                items=tuple(
                    item if item.is_padding else box_ops.shift(item, origin) for item in w.items
                ),
            )
            for w in works
        )
    return dataclasses.replace(plan, work=work)


def _num_write_regions(plan: SourcePlan) -> int:
    """Writes of one source if each layout's items share one staging slot.

    The sender orders a slot's pieces by destination address and merges runs that are
    adjacent there, within one parameter (a write never spans two parameters: each may be
    registered on its own); so here each target's items are sorted by their address and
    every break in the sequence starts a new write.
    """
    items_by_layout: dict[int, list[CopyItem]] = defaultdict(list)
    for works in plan.work.values():
        for work in works:
            items_by_layout[work.layout_id].extend(work.items)
    count = 0
    for layout_id, items in items_by_layout.items():
        for target in plan.targets[layout_id]:
            runs = sorted(
                (
                    (target.weights_info[item.param_name][0] + item.dst_offset_bytes, item)
                    for item in items
                ),
                key=lambda run: run[0],
            )
            end, param = None, None
            for start, item in runs:
                if start != end or item.param_name != param:
                    count += 1
                end, param = start + item.num_bytes, item.param_name
    return count
