"""The control side of a sync: `TrainerSync` (the front door), `SyncManager` (the update
lifecycle over every replica), and the typed driver↔rank messages (`collective`)."""

from weightsync.manager.config import ControlConfig, SyncConfig
from weightsync.manager.manager import PushFn, SyncManager
from weightsync.manager.report import PhaseTimes, PushSummary, SyncReport
from weightsync.manager.trainer import TrainerSync

__all__ = [
    "ControlConfig",
    "PhaseTimes",
    "PushFn",
    "PushSummary",
    "SyncConfig",
    "SyncManager",
    "SyncReport",
    "TrainerSync",
]
