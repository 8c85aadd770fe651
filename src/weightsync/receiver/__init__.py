"""What an inference engine integrates to receive point-to-point weight syncs.

`RolloutAgent` (one per engine rank: registers the parameters, publishes them, serves the
update sessions, delta syncs and the weights checker), `WeightsChecker`, `DeltaResult` (what
applying a delta found), and the engine-side loader (`weightsync.receiver.loader`). No web
framework: an engine serves the routes its own way.
"""

from weightsync.receiver.agent import (
    RolloutAgent,
    SessionState,
    UpdateSessionError,
    memory_regions,
)
from weightsync.receiver.checker import CheckResult, ParamDiff, WeightsChecker
from weightsync.receiver.delta import DeltaResult
from weightsync.receiver.loader import load_hf_tensors, shard_state_dict

__all__ = [
    "CheckResult",
    "DeltaResult",
    "ParamDiff",
    "RolloutAgent",
    "SessionState",
    "UpdateSessionError",
    "WeightsChecker",
    "load_hf_tensors",
    "memory_regions",
    "shard_state_dict",
]
