"""The trainer side of a sync: execute a rank's push program into the rollout's memory.

`WeightSender` runs one trainer rank's `SourcePlan`, lowered into a push program
(`weightsync.plan.program`), through a staging ring and a `weightsync.transport.Transport`:
`preflight` checks a push and returns a `CheckedPush`, `push` runs it after the writes'
`Fence`s; `push_delta` writes only what changed since its last push
(`weightsync.sender.delta`).
"""

from weightsync.sender.checked import CheckedPush
from weightsync.sender.config import SenderConfig
from weightsync.sender.delta import DeltaStats, DeltaWrite, wrap_int64
from weightsync.sender.fences import Fence
from weightsync.sender.sender import WeightSender
from weightsync.sender.stats import PushStats

__all__ = [
    "CheckedPush",
    "DeltaStats",
    "DeltaWrite",
    "Fence",
    "PushStats",
    "SenderConfig",
    "WeightSender",
    "wrap_int64",
]
