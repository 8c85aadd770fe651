"""The control side of a sync: the update lifecycle over every replica, and the trainer glue."""

from weightsync.manager.config import SyncConfig
from weightsync.manager.manager import PushFn, SyncManager
from weightsync.manager.report import PhaseTimes, PushSummary, SyncReport
from weightsync.manager.trainer import TrainerSync

__all__ = [
    "PhaseTimes",
    "PushFn",
    "PushSummary",
    "SyncConfig",
    "SyncManager",
    "SyncReport",
    "TrainerSync",
]
