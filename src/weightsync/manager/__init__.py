"""The control side of a sync: `TrainerSync` (the front door), `SyncManager` (the update
lifecycle over every replica: `open_update` → push → `finish_update`), the update as data
(`OpenUpdate`, `PushResult`), and the typed driver↔rank messages (`collective`)."""

from weightsync.manager.config import ControlConfig, SyncConfig
from weightsync.manager.manager import SyncManager
from weightsync.manager.report import PhaseTimes, SyncReport
from weightsync.manager.trainer import TrainerSync
from weightsync.manager.update import Landing, OpenUpdate, PushResult

__all__ = [
    "ControlConfig",
    "Landing",
    "OpenUpdate",
    "PhaseTimes",
    "PushResult",
    "SyncConfig",
    "SyncManager",
    "SyncReport",
    "TrainerSync",
]
