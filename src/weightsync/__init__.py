"""weightsync: move an RL trainer's weights into running inference engines, point to point.

The front door::

    import weightsync as ws

    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 30),
        control=ws.ControlConfig(check_weight_update_equal=True),
        transport=ws.MooncakeConfig(protocol="auto"),
    )
    with ws.TrainerSync(config, hf_config=model.config, group=group, replicas=urls) as sync:
        for step in range(num_steps):
            train_step(model)
            report = sync.sync(ws.ModelExport(model, pp_rank=pp_rank, pp_size=pp_size))

The low-level pieces (`weightsync.plan`, `weightsync.sender`, `weightsync.manager`,
`weightsync.transport`, `weightsync.receiver`) stay importable for those who need them.
Names here are imported on first use, so ``import weightsync`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from weightsync.errors import (
    CollectiveError,
    LayoutMismatchError,
    PartialPushError,
    PartialSyncError,
    RemoteReplicaError,
    TensorChangedError,
    TransferError,
    WeightsRefusedError,
    WeightSyncError,
)

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "ControlConfig": "weightsync.manager.config",
    "SyncConfig": "weightsync.manager.config",
    "SyncManager": "weightsync.manager.manager",
    "SyncReport": "weightsync.manager.report",
    "TrainerSync": "weightsync.manager.trainer",
    "SenderConfig": "weightsync.sender.config",
    "PushStats": "weightsync.sender.stats",
    "WeightExport": "weightsync.export.base",
    "ModelExport": "weightsync.export.hf",
    "MooncakeConfig": "weightsync.transport",
    "CudaIpcConfig": "weightsync.transport",
    "WriteCost": "weightsync.transport",
}

if TYPE_CHECKING:
    from weightsync.export.base import WeightExport
    from weightsync.export.hf import ModelExport
    from weightsync.manager.config import ControlConfig, SyncConfig
    from weightsync.manager.manager import SyncManager
    from weightsync.manager.report import SyncReport
    from weightsync.manager.trainer import TrainerSync
    from weightsync.sender.config import SenderConfig
    from weightsync.sender.stats import PushStats
    from weightsync.transport import CudaIpcConfig, MooncakeConfig, WriteCost


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CollectiveError",
    "ControlConfig",
    "CudaIpcConfig",
    "LayoutMismatchError",
    "ModelExport",
    "MooncakeConfig",
    "PartialPushError",
    "PartialSyncError",
    "PushStats",
    "RemoteReplicaError",
    "SenderConfig",
    "SyncConfig",
    "SyncManager",
    "SyncReport",
    "TensorChangedError",
    "TrainerSync",
    "TransferError",
    "WeightExport",
    "WeightSyncError",
    "WeightsRefusedError",
    "WriteCost",
    "__version__",
]
