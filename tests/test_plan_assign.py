"""Tests of the source assignment: destination-contiguous runs, balance, the greedy fallback."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings

from test_plan_properties import clusters
from weightsync.plan import SourceHolding, SyncPlan, build_plan, simulate_sources, simulate_targets
from weightsync.plan.assign import (
    DEFAULT_TOLERANCE,
    WorkUnit,
    assign_units,
    contiguous_runs,
    largest_first,
    max_load,
)
from weightsync.testing.presets import preset_config


def _units(sizes: list[int], holders: tuple[int, ...] = (0, 1)) -> list[WorkUnit]:
    return [
        WorkUnit(key=(f"t{i}", 0, ()), holders=holders, num_bytes=size, position=(0, i, 0))
        for i, size in enumerate(sizes)
    ]


def _loads(units: list[WorkUnit], assignment: dict) -> dict[int, int]:
    load: dict[int, int] = defaultdict(int)
    for unit in units:
        load[assignment[unit.key]] += unit.num_bytes
    return dict(load)


def _plan_units(plan: SyncPlan, sources: list[SourceHolding]) -> list[WorkUnit]:
    """The plan's units as the assignment sees them: bytes over all targets, holders, position."""
    holders: dict[str, list[int]] = defaultdict(list)
    for source in sorted(sources, key=lambda s: s.rank):
        for name in source.tensors:
            holders[name].append(source.rank)
    units = []
    for (hf_name, layout_id, box), rank in plan.assignments.items():
        (work,) = [w for w in plan.for_source(rank).work[hf_name] if w.layout_id == layout_id]
        group = plan.groups[layout_id]
        first = work.items[0]
        index = [p.name for p in group.params].index(first.param_name)
        units.append(
            WorkUnit(
                key=(hf_name, layout_id, box),
                holders=tuple(holders[hf_name]),
                num_bytes=work.num_bytes * len(group.targets),
                position=(layout_id, index, first.dst_offset_bytes),
            )
        )
    return units


def _writers_per_parameter(plan: SyncPlan) -> int:
    """Number of (target parameter, source) pairs: which sources write into each parameter."""
    pairs = set()
    for rank, source_plan in plan.source_plans.items():
        for works in source_plan.work.values():
            for work in works:
                for target in source_plan.targets[work.layout_id]:
                    for item in work.items:
                        pairs.add((rank, target.replica, target.rank, item.param_name))
    return len(pairs)


def test_equal_units_become_one_run_per_holder_in_destination_order() -> None:
    units = _units([4] * 10)
    assignment = assign_units(units)
    assert [assignment[u.key] for u in units] == [0] * 5 + [1] * 5
    # Largest-first deals them out alternately.
    assert [largest_first(units)[u.key] for u in units] == [0, 1] * 5


def _best_contiguous_max(sizes: list[int], num_holders: int) -> int:
    """Smallest possible fullest holder over every cut of `sizes` into `num_holders` runs."""
    if num_holders == 1:
        return sum(sizes)
    return min(
        max(sum(sizes[:cut]), _best_contiguous_max(sizes[cut:], num_holders - 1))
        for cut in range(len(sizes) + 1)
    )


@pytest.mark.parametrize("seed", range(6))
def test_contiguous_runs_are_blocks_in_rank_order_with_the_best_cut(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 9) for _ in range(rng.randint(4, 14))]
    holders = (2, 5, 7)
    while max(sizes) * len(holders) >= sum(sizes):  # no unit placed ahead of the cut
        sizes.append(rng.randint(1, 9))
    units = _units(sizes, holders=holders)
    assignment = contiguous_runs(units)
    ranks = [assignment[u.key] for u in units]
    assert ranks == sorted(ranks)
    assert max_load(units, assignment) == _best_contiguous_max(sizes, len(holders))
    shuffled = list(units)
    rng.shuffle(shuffled)
    assert contiguous_runs(shuffled) == assignment
    assert assign_units(shuffled) == assign_units(units)


def test_units_as_large_as_the_share_are_placed_first() -> None:
    # Cut in order, [10, 5 | 10, 5] leaves two holders with 15; placing the two big units
    # first and cutting the rest around them gives 10 each.
    units = _units([10, 5, 10, 5], holders=(0, 1, 2))
    assignment = contiguous_runs(units)
    assert _loads(units, assignment) == {0: 10, 1: 10, 2: 10}
    assert assignment[units[1].key] == assignment[units[3].key] == 2


def test_greedy_is_kept_when_contiguous_runs_balance_clearly_worse() -> None:
    units = _units([7, 7, 3, 3])
    assert max_load(units, contiguous_runs(units)) == 13
    assert max_load(units, largest_first(units)) == 10
    assert assign_units(units) == largest_first(units) != contiguous_runs(units)
    assert assign_units(units, tolerance=0.3) == contiguous_runs(units)
    # Equal balance: the contiguous runs win.
    units = _units([20, 20, 21, 19, 20, 21])
    assert max_load(units, contiguous_runs(units)) == max_load(units, largest_first(units)) == 61
    assert assign_units(units) == contiguous_runs(units) != largest_first(units)


def test_narrow_holder_sets_go_first_and_wider_ones_fill_around_them() -> None:
    only_zero = WorkUnit(key=("a", 0, ()), holders=(0,), num_bytes=10, position=(0, 0, 0))
    shared = [
        WorkUnit(key=(f"b{i}", 0, ()), holders=(0, 1), num_bytes=1, position=(0, 1 + i, 0))
        for i in range(20)
    ]
    units = [*shared, only_zero]
    assignment = assign_units(units)
    assert _loads(units, assignment) == {0: 15, 1: 15}
    assert [assignment[u.key] for u in shared] == [0] * 5 + [1] * 15
    # Source 0 is already the fuller one: source 1 takes the whole shared set.
    units = [*shared[:5], only_zero]
    assert _loads(units, assign_units(units)) == {0: 10, 1: 5}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"holders": ()}, "holders must be non-empty"),
        ({"holders": (1, 0)}, "sorted and unique"),
        ({"holders": (0, 0)}, "sorted and unique"),
        ({"num_bytes": -1}, "num_bytes must be >= 0"),
    ],
)
def test_work_unit_rejects_bad_fields(kwargs, message) -> None:
    fields = {"key": ("w", 0), "holders": (0,), "num_bytes": 1, "position": (0, 0, 0)} | kwargs
    with pytest.raises(ValueError, match=message):
        WorkUnit(**fields)


def test_assign_units_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        assign_units(_units([1]), tolerance=-0.1)
    with pytest.raises(ValueError, match="unit keys must be unique"):
        assign_units(_units([1]) * 2)


@pytest.mark.parametrize("num_experts", [64, 128])
@pytest.mark.parametrize("num_sources", [2, 4])
def test_moe_writes_are_per_parameter_not_per_expert(num_experts: int, num_sources: int) -> None:
    config = preset_config("tiny-moe", num_experts=num_experts, mlp_only_layers=[])
    targets = simulate_targets(config, tp=2, ep=2, replicas=2, dtype="bfloat16")
    sources = simulate_sources(config, num_sources=num_sources)
    plan = build_plan(hf_config=config, targets=targets, sources=sources, dtype="bfloat16")
    pairs = _writers_per_parameter(plan)
    num_params = sum(len(g.params) * len(g.targets) for g in plan.groups)
    # One or two writes per parameter and source, not one per expert.
    assert plan.num_write_regions <= 2 * pairs
    assert plan.num_write_regions < config["num_hidden_layers"] * num_experts
    # Most parameters have one writer; a run boundary may split one per source and layout.
    assert pairs <= num_params + num_sources * len(targets)
    assert plan.imbalance <= 1.1


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize(
    ("tp", "replicas", "num_sources", "pp"),
    [(1, 1, 2, 1), (1, 1, 8, 1), (2, 1, 8, 1), (2, 2, 4, 2), (4, 3, 8, 1), (4, 3, 8, 2)],
)
def test_dense_balance_is_within_the_tolerance_of_largest_first(
    preset: str, tp: int, replicas: int, num_sources: int, pp: int
) -> None:
    config = preset_config(preset)
    targets = simulate_targets(config, tp=tp, replicas=replicas)
    sources = simulate_sources(config, num_sources=num_sources, pp=pp)
    plan = build_plan(hf_config=config, targets=targets, sources=sources)
    units = _plan_units(plan, sources)
    greedy = max_load(units, largest_first(units))
    assert max(plan.bytes_written_per_source.values()) <= (1 + DEFAULT_TOLERANCE) * greedy


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_fullest_source_is_within_the_tolerance_of_largest_first(cluster) -> None:
    config, targets, sources, dtype = cluster
    plan = build_plan(hf_config=config, targets=targets, sources=sources, dtype=dtype)
    units = _plan_units(plan, sources)
    assert max_load(units, plan.assignments) == max(plan.bytes_written_per_source.values())
    greedy = max_load(units, largest_first(units))
    assert max_load(units, plan.assignments) <= (1 + DEFAULT_TOLERANCE) * greedy
