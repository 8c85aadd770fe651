"""The rollout side: `RolloutAgent` (weightsync's receiver inside any engine rank), the
weights checker, and the reference replica's servers (`weightsync serve`)."""

from weightsync.rollout.agent import RolloutAgent, UpdateSessionError, memory_regions
from weightsync.rollout.checker import CheckResult, ParamDiff, WeightsChecker

__all__ = [
    "CheckResult",
    "ParamDiff",
    "RolloutAgent",
    "UpdateSessionError",
    "WeightsChecker",
    "memory_regions",
]
