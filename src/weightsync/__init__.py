"""weightsync: move an RL trainer's weights into running inference engines, point to point."""

from weightsync.errors import (
    LayoutMismatchError,
    RemoteReplicaError,
    TransferError,
    WeightSyncError,
)

__version__ = "0.1.0"

__all__ = [
    "LayoutMismatchError",
    "RemoteReplicaError",
    "TransferError",
    "WeightSyncError",
    "__version__",
]
