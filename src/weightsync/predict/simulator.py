"""A discrete-event simulation of a schedule on a network model, and its lower bound.

Each source sends its transfers one after another, in the schedule's order. A transfer
first spends its fixed cost (`NetworkModel.setup_s`: latency, a cost per write and, where
the model says so, the source's staging copy) with no bytes on the wire, then moves its
bytes. While bytes move, a port shared by ``n`` flows gives each ``1 / n`` of its rate, and
a flow runs at the smaller of its two ports' shares;
rates change only when a flow starts or ends moving bytes, and only for the flows sharing a
port with it. A share one flow cannot use is not handed to the others, so the simulation
errs on the slow side, never below `lower_bound_s`.

`lower_bound_s` is what no execution of the schedule can beat: the busiest port's bytes
over its rate plus the smallest fixed cost paid before its first byte, or the busiest
source's fixed costs plus its bytes at its port's full rate. `ideal_lower_bound_s` is what
no schedule at all can beat: every rollout rank must receive its bytes through its port.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.predict.network import NetworkModel, Port
from weightsync.predict.traffic import TrafficGroup
from weightsync.predict.transfers import Schedule, Transfer


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineEntry:
    """When one transfer ran.

    Attributes:
        source: the sending trainer GPU.
        target: the rollout rank (GPU) written.
        window: the transfer's layer window.
        start_s: when its fixed cost began.
        data_start_s: when its first byte moved.
        end_s: when its last byte arrived.
        num_bytes: bytes it moved.
    """

    source: int
    target: int
    window: int
    start_s: float
    data_start_s: float
    end_s: float
    num_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationResult:
    """What a simulated sync did.

    Attributes:
        makespan_s: when the last byte arrived.
        port_busy_s: ``{port: seconds it carried bytes}``.
        port_bytes: ``{port: bytes it carried}``.
        timeline: every transfer, in the order they ended.
    """

    makespan_s: float
    port_busy_s: Mapping[Port, float] = field(hash=False)
    port_bytes: Mapping[Port, int] = field(hash=False)
    timeline: tuple[TimelineEntry, ...] = field(hash=False)

    def busiest(self, count: int = 3) -> list[tuple[Port, float, int]]:
        """The `count` ports that carried bytes longest: ``(port, busy_s, bytes)``."""
        ranked = sorted(self.port_busy_s.items(), key=lambda item: (-item[1], item[0]))
        return [(port, busy, self.port_bytes[port]) for port, busy in ranked[:count]]


# Picks a source's next transfer: (source rank, now, engine) -> a transfer or None when done.
Chooser = Callable[[int, float, "Engine"], "Transfer | None"]


def simulate(schedule: Schedule, network: NetworkModel) -> SimulationResult:
    """Execute `schedule` on `network` (the rules are in the module docstring)."""
    position = dict.fromkeys(schedule.queues, 0)

    def replay(rank: int, now: float, engine: Engine) -> Transfer | None:
        queue = schedule.queues[rank]
        if position[rank] == len(queue):
            return None
        position[rank] += 1
        return queue[position[rank] - 1]

    return Engine(network).run(sorted(schedule.queues), replay)


class Engine:
    """The event loop: flows, ports and their shares; `run` drives it with a chooser.

    `weightsync.predict.schedule` runs it with a greedy chooser to order a schedule, and
    `simulate` replays that order: the same dynamics, so the replay reproduces it.
    """

    def __init__(self, network: NetworkModel) -> None:
        self.network = network
        self.on_port: dict[Port, set[int]] = defaultdict(set)
        self._routes: dict[tuple[int, int], tuple[Port, Port]] = {}

    def route(self, transfer: Transfer) -> tuple[Port, Port]:
        """The (send, receive) ports of `transfer`, cached."""
        key = (transfer.source, transfer.target)
        if key not in self._routes:
            self._routes[key] = self.network.route(*key)
        return self._routes[key]

    def run(self, ranks: Sequence[int], choose: Chooser) -> SimulationResult:
        """Start every source in `ranks` at 0 and run until no chooser offers a transfer."""
        network, on_port = self.network, self.on_port
        # Flow: [source, transfer, remaining, rate, last update, version, start, data start, ports]
        flows: dict[int, list] = {}
        busy_since: dict[Port, float] = {}
        busy: dict[Port, float] = defaultdict(float)
        carried: dict[Port, int] = defaultdict(int)
        events: list[tuple[float, int, int, int]] = []  # (time, seq, flow id, version or -1)
        timeline: list[TimelineEntry] = []
        sequence = itertools.count()
        flow_ids = itertools.count(1)

        def push(time: float, flow_id: int, version: int) -> None:
            heapq.heappush(events, (time, next(sequence), flow_id, version))

        def start_next(rank: int, now: float) -> None:
            transfer = choose(rank, now, self)
            if transfer is None:
                return
            flow_id = next(flow_ids)
            ports = self.route(transfer)
            flows[flow_id] = [
                rank,
                transfer,
                float(transfer.num_bytes),
                0.0,
                now,
                0,
                now,
                None,
                ports,
            ]
            push(now + network.setup_s(transfer.num_writes, transfer.num_bytes), flow_id, -1)

        def rerate(ports: Sequence[Port], now: float) -> None:
            for flow_id in sorted({f for port in ports for f in on_port[port]}):
                flow = flows[flow_id]
                flow[2] = max(0.0, flow[2] - flow[3] * (now - flow[4]))
                flow[4] = now
                send, receive = flow[8]
                flow[3] = min(
                    network.capacity(send) / len(on_port[send]),
                    network.capacity(receive) / len(on_port[receive]),
                )
                flow[5] += 1
                push(now + flow[2] / flow[3], flow_id, flow[5])

        for rank in ranks:
            start_next(rank, 0.0)
        makespan = 0.0
        while events:
            now, _, flow_id, version = heapq.heappop(events)
            flow = flows.get(flow_id)
            if flow is None or (version >= 0 and version != flow[5]):
                continue
            ports = flow[8]
            if version < 0:
                flow[7] = now
                if flow[1].num_bytes > 0:
                    for port in ports:
                        if not on_port[port]:
                            busy_since[port] = now
                        on_port[port].add(flow_id)
                    rerate(ports, now)
                    continue
            transfer = flow[1]
            for port in ports:
                if flow_id in on_port[port]:
                    on_port[port].discard(flow_id)
                    if not on_port[port]:
                        busy[port] += now - busy_since.pop(port)
                carried[port] += transfer.num_bytes
            del flows[flow_id]
            rerate(ports, now)
            timeline.append(
                TimelineEntry(
                    source=transfer.source,
                    target=transfer.target,
                    window=transfer.window,
                    start_s=flow[6],
                    data_start_s=flow[7],
                    end_s=now,
                    num_bytes=transfer.num_bytes,
                )
            )
            makespan = max(makespan, now)
            start_next(flow[0], now)
        return SimulationResult(
            makespan_s=makespan,
            port_busy_s=dict(busy),
            port_bytes=dict(carried),
            timeline=tuple(timeline),
        )


def lower_bound_s(schedule: Schedule, network: NetworkModel) -> float:
    """What no execution of `schedule` on `network` can beat (module docstring)."""
    port_bytes: dict[Port, int] = defaultdict(int)
    first_cost: dict[Port, float] = {}
    bound = 0.0
    for queue in schedule.queues.values():
        source_s = 0.0
        for transfer in queue:
            send, receive = network.route(transfer.source, transfer.target)
            setup = network.setup_s(transfer.num_writes, transfer.num_bytes)
            source_s += setup + transfer.num_bytes / network.capacity(send)
            for port in (send, receive):
                port_bytes[port] += transfer.num_bytes
                first_cost[port] = min(first_cost.get(port, setup), setup)
        bound = max(bound, source_s)
    for port, num_bytes in port_bytes.items():
        bound = max(bound, num_bytes / network.capacity(port) + first_cost[port])
    return bound


def ideal_lower_bound_s(groups: Sequence[TrafficGroup], network: NetworkModel) -> float:
    """The busiest rollout receiving port's bytes over its rate: no schedule beats it.

    Colocated, a rollout rank's bytes may come over NVLink, so only the NIC bound of a
    separate rollout cluster is claimed; colocated clusters get 0.
    """
    if network.colocated:
        return 0.0
    port_bytes: dict[Port, int] = defaultdict(int)
    for group in groups:
        for target in group.target_indices:
            port_bytes[network.route(0, target)[1]] += group.num_bytes
    return max((b / network.nic_bytes_per_s for b in port_bytes.values()), default=0.0)
