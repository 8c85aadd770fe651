"""Prediction of a sync on a model of the cluster: network, traffic, schedules, simulator.

Nothing here moves a byte or runs on the sender: these are pure functions over the model's
shapes and a model of the cluster's network, used by ``weightsync plan --simulate`` and the
benchmarks to say how long a sync's data phase would take on a cluster we do not have.

- `NetworkModel` (`network`): NICs and NVLink per node, fixed costs per transfer and write.
- `traffic_units` (`traffic`): the bytes and writes each work unit puts on the network.
- `TrainerShape`, `simulated_holders` (`cluster`): which trainer GPU holds which tensor.
- `network_schedule`, `round_robin_schedule`, `plan_schedule` (`schedule`): transfer orders
  to simulate, the last read off a `SyncPlan` the senders execute.
- `simulate`, `lower_bound_s`, `ideal_lower_bound_s` (`simulator`): the discrete-event
  simulation and what no execution or no schedule can beat.
- `predict_sync` (`prediction`): all of it for one cluster, against round robin and a
  broadcast.
"""

from weightsync.predict.cluster import TrainerShape, simulated_holders
from weightsync.predict.network import NetworkModel, Port
from weightsync.predict.prediction import (
    SyncPrediction,
    broadcast_seconds,
    is_fp8_config,
    predict_sync,
)
from weightsync.predict.schedule import (
    DEFAULT_WINDOWS,
    network_schedule,
    plan_schedule,
    round_robin_schedule,
)
from weightsync.predict.simulator import (
    SimulationResult,
    TimelineEntry,
    ideal_lower_bound_s,
    lower_bound_s,
    simulate,
)
from weightsync.predict.traffic import (
    TrafficGroup,
    TrafficUnit,
    fp8_num_bytes,
    is_fp8_weight,
    traffic_units,
)
from weightsync.predict.transfers import Schedule, Transfer

__all__ = [
    "DEFAULT_WINDOWS",
    "NetworkModel",
    "Port",
    "Schedule",
    "SimulationResult",
    "SyncPrediction",
    "TimelineEntry",
    "TrafficGroup",
    "TrafficUnit",
    "TrainerShape",
    "Transfer",
    "broadcast_seconds",
    "fp8_num_bytes",
    "ideal_lower_bound_s",
    "is_fp8_config",
    "is_fp8_weight",
    "lower_bound_s",
    "network_schedule",
    "plan_schedule",
    "predict_sync",
    "round_robin_schedule",
    "simulate",
    "simulated_holders",
    "traffic_units",
]
