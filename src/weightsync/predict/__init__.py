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
- `predict_delta_sync`, `delta_prediction` (`delta`): a delta sync on the same schedule, its
  payload bytes from `DeltaDensity` and its device work from `DeltaRates`.
"""

from weightsync.predict.cluster import TrainerShape, simulated_holders
from weightsync.predict.delta import (
    FP8_CODE_DENSITY_RATIO,
    H200_KERNELS,
    HOST_TENSOR_S,
    MEASURED_ELEMENT_DENSITY,
    MEASURED_FP8_SCALE_DENSITY,
    DeltaDensity,
    DeltaPrediction,
    DeltaRates,
    KernelTimes,
    delta_prediction,
    dense_section_bytes,
    expected_changes,
    payload_bytes,
    predict_delta_sync,
    run_section,
    sparse_section_bytes,
)
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
    ElementRun,
    TrafficGroup,
    TrafficUnit,
    fp8_num_bytes,
    is_fp8_weight,
    traffic_units,
)
from weightsync.predict.transfers import Schedule, Transfer

__all__ = [
    "DEFAULT_WINDOWS",
    "FP8_CODE_DENSITY_RATIO",
    "H200_KERNELS",
    "HOST_TENSOR_S",
    "MEASURED_ELEMENT_DENSITY",
    "MEASURED_FP8_SCALE_DENSITY",
    "DeltaDensity",
    "DeltaPrediction",
    "DeltaRates",
    "ElementRun",
    "KernelTimes",
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
    "delta_prediction",
    "dense_section_bytes",
    "expected_changes",
    "fp8_num_bytes",
    "ideal_lower_bound_s",
    "is_fp8_config",
    "is_fp8_weight",
    "lower_bound_s",
    "network_schedule",
    "payload_bytes",
    "plan_schedule",
    "predict_delta_sync",
    "predict_sync",
    "round_robin_schedule",
    "run_section",
    "simulate",
    "simulated_holders",
    "sparse_section_bytes",
    "traffic_units",
]
