"""Schedules a predicted sync is simulated with: who sends which bytes where, in which order.

A schedule is a model of the transfers, not a program: the sender executes the push program
lowered from a `SyncPlan` (`weightsync.plan`), and these schedules exist to be run on the
network model (`weightsync.predict.simulator`). Three are built here:

- `network_schedule`, the balanced, NIC-parallel order, computed from the work units
  (`weightsync.predict.traffic`), the tensors each trainer GPU holds and the network
  (`weightsync.predict.network`), deterministically (ranks, positions and sizes decide, never
  input order), in three steps:

  1. **Sources.** Every unit goes to one of the GPUs that hold its tensor, by the plan's
     byte-balanced, destination-contiguous assignment (`assign_units`), so every
     data-parallel copy of a stage sends about the same number of bytes.
  2. **Transfers.** A source's units are grouped per target and per layer window (the layers
     cut into `num_windows` contiguous windows, embeddings in the first, the output layer in
     the last): one transfer carries all the source's writes into one target for one window,
     so the writes to a target are grouped and neighbouring runs coalesce.
  3. **Order.** Windows go in layer order, so a layer-by-layer pipeline stays possible.
     Inside a window the order is found by running the sync on the network model
     (`weightsync.predict.simulator.Engine`): whenever a source is free, it takes, of its
     transfers left in the window, the one whose receiving port carries the fewest flows
     now, then the one whose port has the most bytes still to come (the receiver that would
     finish last), then the lower target. No receiver is hammered by two sources while
     another waits idle, and the receivers that bound the sync are kept busy from start to
     end.

- `round_robin_schedule`, the comparison: each rollout replica is fed by one data-parallel
  copy, round robin (replica ``r`` by copy ``r % dp``, as Miles deals engines to trainer
  ranks), and each source walks its targets in rank order.
- `plan_schedule`, a `SyncPlan` from `build_plan` read as a schedule, so the simulator can
  predict a sync that the senders really run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from weightsync.plan import CopyItem, SyncPlan, TargetRank
from weightsync.plan.assign import UnitKey, WorkUnit, assign_units
from weightsync.predict.network import NetworkModel
from weightsync.predict.simulator import Engine
from weightsync.predict.traffic import TrafficGroup, TrafficUnit
from weightsync.predict.transfers import Schedule, Transfer

DEFAULT_WINDOWS = 4


def network_schedule(
    groups: Sequence[TrafficGroup],
    units: Sequence[TrafficUnit],
    holders: Mapping[str, Sequence[int]],
    network: NetworkModel,
    *,
    num_windows: int = DEFAULT_WINDOWS,
) -> Schedule:
    """The balanced, NIC-parallel schedule (the rule is in the module docstring).

    Args:
        groups: the layout groups (`traffic_units`).
        units: the work units (`traffic_units`).
        holders: ``{hf_name: trainer ranks holding it}``.
        network: the model the order is found on.
        num_windows: layer windows; 1 orders by the network alone.

    Raises:
        ValueError: a unit's tensor held by no GPU, or ``num_windows < 1``.
    """
    _check(units, holders, num_windows)
    by_layout = {g.layout_id: g for g in groups}
    work_units = [
        WorkUnit(
            key=unit.key,
            holders=tuple(sorted(set(holders[unit.key[0]]))),
            num_bytes=unit.num_bytes * len(by_layout[unit.key[1]].target_indices),
            position=unit.position,
        )
        for unit in units
    ]
    assignment = assign_units(work_units)
    members = {g.layout_id: g.target_indices for g in groups}
    transfers = _transfers(
        units, lambda unit: ((assignment[unit.key], members[unit.key[1]]),), num_windows
    )
    return Schedule(
        name="network",
        num_targets=_num_targets(groups),
        queues=_greedy_order(transfers, network),
    )


def round_robin_schedule(
    groups: Sequence[TrafficGroup],
    units: Sequence[TrafficUnit],
    holders: Mapping[str, Sequence[int]],
    *,
    replica_of: Sequence[int],
    num_windows: int = DEFAULT_WINDOWS,
) -> Schedule:
    """Replica ``r`` fed by the ``r % n``-th holder of each tensor; targets in rank order.

    Args:
        groups: the layout groups (`traffic_units`).
        units: the work units (`traffic_units`).
        holders: ``{hf_name: trainer ranks holding it}``; the ``i``-th is data-parallel copy
            ``i`` when ranks grow with the copy index (`simulated_holders`).
        replica_of: the replica index of every target.
        num_windows: layer windows, as for `network_schedule`.

    Raises:
        ValueError: a unit's tensor held by no GPU, or ``num_windows < 1``.
    """
    _check(units, holders, num_windows)
    ranks = {name: sorted(set(values)) for name, values in holders.items()}
    by_layout = {g.layout_id: g for g in groups}
    classes: dict[tuple[int, int], tuple[tuple[int, tuple[int, ...]], ...]] = {}

    def split(unit: TrafficUnit) -> tuple[tuple[int, tuple[int, ...]], ...]:
        held = ranks[unit.key[0]]
        key = (unit.key[1], len(held))
        if key not in classes:
            by_index: dict[int, list[int]] = defaultdict(list)
            for target in by_layout[unit.key[1]].target_indices:
                by_index[replica_of[target] % len(held)].append(target)
            classes[key] = tuple((i, tuple(t)) for i, t in sorted(by_index.items()))
        return tuple((held[i], members) for i, members in classes[key])

    transfers = _transfers(units, split, num_windows)
    queues: dict[int, list[Transfer]] = defaultdict(list)
    for transfer in sorted(transfers, key=lambda t: (t.source, t.window, t.target)):
        queues[transfer.source].append(transfer)
    return Schedule(
        name="round-robin",
        num_targets=_num_targets(groups),
        queues={rank: tuple(queues[rank]) for rank in sorted(queues)},
    )


def _check(
    units: Sequence[TrafficUnit], holders: Mapping[str, Sequence[int]], num_windows: int
) -> None:
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    missing = sorted({u.key[0] for u in units if not holders.get(u.key[0])})
    if missing:
        raise ValueError(
            f"no trainer GPU holds {len(missing)} tensor(s) the rollout needs, e.g. "
            f"{missing[0]!r}: every tensor needs at least one holder"
        )


def _num_targets(groups: Sequence[TrafficGroup]) -> int:
    return sum(len(g.target_indices) for g in groups)


def _windows(units: Sequence[TrafficUnit], num_windows: int) -> dict[UnitKey, int]:
    """Window of each unit: layers -1 .. L cut into `num_windows` contiguous runs."""
    low = min(u.layer for u in units)
    span = max(u.layer for u in units) - low + 1
    windows = min(num_windows, span)
    return {u.key: (u.layer - low) * windows // span for u in units}


def _transfers(
    units: Sequence[TrafficUnit],
    split: Callable[[TrafficUnit], Sequence[tuple[int, tuple[int, ...]]]],
    num_windows: int,
) -> list[Transfer]:
    """Group each source's units per (window, target), coalescing position neighbours.

    `split` gives, for a unit, each source that sends it and the targets it sends it to;
    targets a source serves together receive the same transfers, so the units are walked
    once per such class of targets, not once per target.
    """
    if not units:
        return []
    window_of = _windows(units, num_windows)
    acc: dict[tuple[int, int, tuple[int, ...]], list] = {}
    last: dict[tuple[int, ...], tuple[int, int]] = {}  # class -> (source, param) of last unit
    for unit in units:
        window = window_of[unit.key]
        for source, members in split(unit):
            entry = acc.get((source, window, members))
            if entry is None:
                entry = acc[(source, window, members)] = [0, 0, []]
            entry[0] += unit.num_bytes
            # A unit that starts in the parameter where the same source's previous unit for
            # these targets ended continues that write (the sender merges adjacent runs).
            continues = last.get(members) == (source, unit.position[1])
            entry[1] += unit.num_writes - (1 if continues and unit.num_writes else 0)
            entry[2].append(unit.key)
            last[members] = (source, unit.position[1])
    transfers = []
    for (source, window, members), (num_bytes, num_writes, keys) in acc.items():
        for target in members:
            transfers.append(
                Transfer(
                    source=source,
                    target=target,
                    window=window,
                    num_bytes=num_bytes,
                    num_writes=max(num_writes, 1),
                    units=tuple(keys),
                )
            )
    transfers.sort(key=lambda t: (t.source, t.window, t.target))
    return transfers


def _greedy_order(
    transfers: Sequence[Transfer], network: NetworkModel
) -> dict[int, tuple[Transfer, ...]]:
    """Each source's order, found by running the sync on `network` (module docstring)."""
    pending: dict[int, dict[int, list[Transfer]]] = defaultdict(lambda: defaultdict(list))
    for transfer in transfers:
        pending[transfer.source][transfer.window].append(transfer)
    windows = {rank: sorted(by_window) for rank, by_window in pending.items()}
    engine = Engine(network)
    receive_of = {id(t): engine.route(t)[1] for t in transfers}
    to_come: dict = defaultdict(int)
    for transfer in transfers:
        to_come[receive_of[id(transfer)]] += transfer.num_bytes
    order: dict[int, list[Transfer]] = defaultdict(list)
    on_port = engine.on_port

    def choose(rank: int, now: float, engine: Engine) -> Transfer | None:
        if not windows[rank]:
            return None
        candidates = pending[rank][windows[rank][0]]
        best, best_key = 0, None
        for i, candidate in enumerate(candidates):
            receive = receive_of[id(candidate)]
            key = (len(on_port[receive]), -to_come[receive], candidate.target)
            if best_key is None or key < best_key:
                best, best_key = i, key
        transfer = candidates.pop(best)
        if not candidates:
            windows[rank].pop(0)
        to_come[receive_of[id(transfer)]] -= transfer.num_bytes
        order[rank].append(transfer)
        return transfer

    engine.run(sorted(pending), choose)
    return {rank: tuple(order[rank]) for rank in sorted(order)}


def plan_schedule(plan: SyncPlan) -> Schedule:
    """The schedule a `SyncPlan` from `build_plan` makes: what its senders do.

    One transfer per source and target carrying the source's items for the target's layout,
    with the writes the sender issues after merging runs adjacent in the destination (within
    one parameter), targets in the plan's order. Target index ``i`` is ``plan.targets[i]``;
    the source is its trainer rank.
    """
    index_of = {(t.replica, t.rank): i for i, t in enumerate(plan.targets)}
    queues: dict[int, tuple[Transfer, ...]] = {}
    for rank, source in plan.source_plans.items():
        items: dict[int, list] = defaultdict(list)
        for works in source.work.values():
            for work in works:
                items[work.layout_id].extend(work.items)
        transfers = []
        for layout_id, layout_items in items.items():
            units = tuple(sorted({(item.hf_name or "", layout_id, ()) for item in layout_items}))
            num_bytes = sum(item.num_bytes for item in layout_items)
            for target in source.targets[layout_id]:
                transfers.append(
                    Transfer(
                        source=rank,
                        target=index_of[(target.replica, target.rank)],
                        window=0,
                        num_bytes=num_bytes,
                        num_writes=_num_writes(target, layout_items),
                        units=units,
                    )
                )
        if transfers:
            queues[rank] = tuple(sorted(transfers, key=lambda t: t.target))
    return Schedule(name="plan", num_targets=len(plan.targets), queues=queues)


def _num_writes(target: TargetRank, items: Sequence[CopyItem]) -> int:
    """Writes into `target` after merging items adjacent in its memory, within a parameter."""
    runs = sorted(
        (target.weights_info[item.param_name][0] + item.dst_offset_bytes, item) for item in items
    )
    count, end, param = 0, None, None
    for start, item in runs:
        if start != end or item.param_name != param:
            count += 1
        end, param = start + item.num_bytes, item.param_name
    return count
