"""The control plane: the bodies of docs/protocol.md's routes (pydantic) and async clients
of its servers."""

from weightsync.control.bootstrap_client import BootstrapClient
from weightsync.control.client import RolloutClient
from weightsync.control.models import (
    GenerateResponse,
    ServerInfo,
    StatusResponse,
    SuccessResponse,
    UpdateWeightVersionResponse,
    WeightsInfo,
)

__all__ = [
    "BootstrapClient",
    "GenerateResponse",
    "RolloutClient",
    "ServerInfo",
    "StatusResponse",
    "SuccessResponse",
    "UpdateWeightVersionResponse",
    "WeightsInfo",
]
