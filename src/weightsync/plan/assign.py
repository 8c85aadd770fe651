"""Which trainer source writes each work unit: contiguous in the destination, balanced in bytes.

A work unit is one HF tensor's copies for one destination layout, or, where sharded sources
hold boxes of the tensor, the copies one held box serves; a source must hold the whole tensor
(or that box) to take it. Two goals pull apart. Balance wants equal bytes per source, which a
largest-first greedy gets nearly perfect. Coalescing wants each source's units to sit next to
each other in the destination: the sender merges adjacent runs of one parameter into one
write, so the 64 experts of a fused ``w13_weight`` written by one source are one write, while
experts dealt alternately to two sources cost a write per expert half.

`assign_units` takes the contiguous assignment unless it is clearly less balanced:

1. Units are grouped by holder set (the sources that hold the tensor: all data-parallel
   copies of a pipeline stage). Sets are taken smallest first, so a later, wider set fills
   around the load the narrower ones left.
2. Within a set of several holders, a unit at least as large as its layout group's
   per-source share (the group's bytes in the set over the number of holders; in dense
   models, ``embed_tokens`` and ``lm_head``) is placed first, largest first, on the
   least-loaded holder: it fills a run on its own anyway, and cutting the others around it
   keeps them balanced.
3. The other units are split by layout group and ordered by destination position (parameter
   order, then destination offset of the unit's first copy). Each group's sequence is cut
   into one contiguous run per holder; the holder taking the first run rotates from group to
   group, so that every source works on every stretch of the tensor stream and writes to
   every target. Each holder's bytes in a group are its share of the group in proportion to
   what it still lacks to reach the set's common fill level (earlier groups' cut errors are
   made up in later ones). The cut first minimises the fullest holder after the group
   (counting load from earlier sets and groups), then puts each boundary as close as it can
   to where those shares would end.
4. Tie-break against balance: if the fullest source of that assignment writes more than
   ``1 + tolerance`` times the fullest source of the largest-first greedy (`largest_first`),
   the greedy assignment is used instead.

When every source holds every tensor, both assignments keep the fullest source at or below
the mean plus the largest unit. Everything is decided by unit keys, positions, sizes
and ranks, never by input order.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# (hf_name, layout_id, box): box is () where the holders hold the whole tensor.
UnitKey = tuple[str, int, tuple[tuple[int, int], ...]]

DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkUnit:
    """What the assignment needs to know about one ``(hf_name, layout_id, box)`` unit.

    Attributes:
        key: ``(hf_name, layout_id, box)``; ``box`` is ``()`` for a tensor held whole.
        holders: the ranks of the sources that hold the HF tensor (or the unit's box of it),
            sorted, without repeats.
        num_bytes: bytes written for the unit over all targets of its layout.
        position: where its first copy lands, ``(layout_id, parameter index, byte offset)``;
            units of one layout are ordered by it.

    Raises:
        ValueError: no holders, unsorted or repeated holders, or ``num_bytes < 0``.
    """

    key: UnitKey
    holders: tuple[int, ...]
    num_bytes: int
    position: tuple[int, int, int]

    def __post_init__(self) -> None:
        holders = tuple(self.holders)
        object.__setattr__(self, "holders", holders)
        if not holders or list(holders) != sorted(set(holders)):
            raise ValueError(
                f"unit {self.key}: holders must be non-empty, sorted and unique, got {holders}"
            )
        if self.num_bytes < 0:
            raise ValueError(f"unit {self.key}: num_bytes must be >= 0, got {self.num_bytes}")


def assign_units(
    units: Iterable[WorkUnit], *, tolerance: float = DEFAULT_TOLERANCE
) -> dict[UnitKey, int]:
    """Assign every unit to one of its holders (the rule is in the module docstring).

    Args:
        units: the work units; keys must be unique.
        tolerance: how much fuller (relative) the fullest source of the contiguous assignment
            may be than that of the largest-first greedy before the greedy one is used.

    Returns:
        ``{unit key: source rank}``.

    Raises:
        ValueError: a negative tolerance or a repeated unit key.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    units = list(units)
    if len({unit.key for unit in units}) != len(units):
        raise ValueError("unit keys must be unique")
    contiguous = contiguous_runs(units)
    greedy = largest_first(units)
    if max_load(units, contiguous) > (1 + tolerance) * max_load(units, greedy):
        return greedy
    return contiguous


def largest_first(units: Sequence[WorkUnit]) -> dict[UnitKey, int]:
    """Greedy largest-first: each unit, biggest first, to its least-loaded holder.

    Ties go to the lower rank; equal-size units are taken in position order.
    """
    load: dict[int, int] = defaultdict(int)
    assignment: dict[UnitKey, int] = {}
    for unit in sorted(units, key=lambda u: (-u.num_bytes, u.position, u.key)):
        rank = min(unit.holders, key=lambda r: (load[r], r))
        load[rank] += unit.num_bytes
        assignment[unit.key] = rank
    return assignment


def contiguous_runs(units: Sequence[WorkUnit]) -> dict[UnitKey, int]:
    """One destination-contiguous, byte-balanced run of units per holder and layout (steps 1-3)."""
    by_holders: dict[tuple[int, ...], list[WorkUnit]] = defaultdict(list)
    for unit in units:
        by_holders[unit.holders].append(unit)
    load: dict[int, int] = defaultdict(int)
    assignment: dict[UnitKey, int] = {}
    for holders in sorted(by_holders, key=lambda h: (len(h), h)):
        members = sorted(by_holders[holders], key=lambda u: (u.position, u.key))
        group_bytes: dict[int, int] = defaultdict(int)
        for unit in members:
            group_bytes[unit.position[0]] += unit.num_bytes
        large = {
            u.key
            for u in members
            if len(holders) > 1 and u.num_bytes * len(holders) >= group_bytes[u.position[0]]
        }
        for unit in sorted(members, key=lambda u: (-u.num_bytes, u.position, u.key)):
            if unit.key in large:
                rank = min(holders, key=lambda r: (load[r], r))
                load[rank] += unit.num_bytes
                assignment[unit.key] = rank
        rest = [u for u in members if u.key not in large]
        quotas = _fill_targets([load[r] for r in holders], sum(u.num_bytes for u in rest))
        remaining = dict(zip(holders, quotas, strict=True))
        layouts: dict[int, list[WorkUnit]] = defaultdict(list)
        for unit in rest:
            layouts[unit.position[0]].append(unit)
        for index, layout_id in enumerate(sorted(layouts)):
            # Rotating the first holder spreads each source over the stream of tensors.
            offset = index * len(holders) // len(layouts)
            order = holders[offset:] + holders[:offset]
            run = layouts[layout_id]
            size = sum(u.num_bytes for u in run)
            wanted = [max(0.0, remaining[r]) for r in order]
            scale = size / sum(wanted) if sum(wanted) > 0 else 0.0
            targets = [w * scale for w in wanted] if scale else [size / len(order)] * len(order)
            start = 0
            for rank, end in zip(order, _cut(run, order, load, targets), strict=True):
                for unit in run[start:end]:
                    assignment[unit.key] = rank
                    load[rank] += unit.num_bytes
                    remaining[rank] -= unit.num_bytes
                start = end
    return assignment


def max_load(units: Sequence[WorkUnit], assignment: dict[UnitKey, int]) -> int:
    """Bytes written by the fullest source under `assignment` (0 for no units)."""
    load: dict[int, int] = defaultdict(int)
    for unit in units:
        load[assignment[unit.key]] += unit.num_bytes
    return max(load.values(), default=0)


def _cut(
    units: Sequence[WorkUnit],
    holders: Sequence[int],
    load: dict[int, int],
    targets: Sequence[float],
) -> list[int]:
    """End index (exclusive) of each holder's run of `units`, holders taking runs in order.

    First the smallest cap C such that the runs fit with every holder at most C (counting
    its prior `load`); then, holder by holder, the end closest to where the runs would end
    if each took its `targets` bytes, among the ends that still let the rest fit under C.
    """
    prefix = [0]
    for unit in units:
        prefix.append(prefix[-1] + unit.num_bytes)
    total, count = prefix[-1], len(units)

    def fits(cap: int) -> bool:
        start = 0
        for rank in holders:
            start = bisect_right(prefix, prefix[start] + max(0, cap - load[rank]), lo=start) - 1
        return start == count

    low, high = 0, max(load[r] for r in holders) + total
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    cap = low
    # earliest[k]: the first unit index from which holders k.. can still take the rest.
    earliest = [count] * (len(holders) + 1)
    for k in range(len(holders) - 1, -1, -1):
        room = max(0, cap - load[holders[k]])
        earliest[k] = bisect_left(prefix, prefix[earliest[k + 1]] - room)
    ends: list[int] = []
    start, cumulative = 0, 0.0
    for k, rank in enumerate(holders):
        cumulative += targets[k]
        room = max(0, cap - load[rank])
        latest = bisect_right(prefix, prefix[start] + room, lo=start) - 1
        lowest = max(start, earliest[k + 1])
        near = min(max(bisect_left(prefix, cumulative), lowest), latest)
        candidates = [i for i in (near - 1, near) if lowest <= i <= latest]
        end = min(candidates, key=lambda i: (abs(prefix[i] - cumulative), i))
        ends.append(end)
        start = end
    assert start == count, "the minimal cap must let every unit fit"
    return ends


def _fill_targets(loads: Sequence[int], total: int) -> list[float]:
    """Bytes each holder takes if all fill up to one common level (water filling)."""
    if total == 0:
        return [0.0] * len(loads)
    order = sorted(loads)
    level = float(order[-1])
    for k in range(1, len(order) + 1):
        # Fill the k emptiest up to the next one's load (or spread what is left over them).
        candidate = (total + sum(order[:k])) / k
        if k == len(order) or candidate <= order[k]:
            level = candidate
            break
    return [max(0.0, level - value) for value in loads]
