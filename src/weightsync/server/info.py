"""What a reference replica says about itself: ``/server_info`` and ``/model_info``."""

from __future__ import annotations

from typing import Any

from weightsync import __version__
from weightsync.control.labels import numeric_label
from weightsync.control.protocol import (
    GET_WEIGHT_VERSION,
    PARALLELISM_CONFIG,
    POST_LOAD_AT_UPDATE_END,
    WEIGHT_SYNC_DELTA,
    WEIGHT_SYNC_EVENTS,
    WEIGHT_SYNC_FENCE,
    WEIGHT_SYNC_FUSED,
    WEIGHT_UPDATE_DIGEST,
    WEIGHT_UPDATE_LEASE,
)
from weightsync.server.integrity import WeightIntegrity
from weightsync.server.replica_info import ReplicaInfo
from weightsync.server.session import ReplicaSession, ReplicaSessionState

# What the reference server serves beyond SGLang 0.5.23, advertised in /server_info.
CAPABILITIES = (
    PARALLELISM_CONFIG,
    GET_WEIGHT_VERSION,
    WEIGHT_UPDATE_LEASE,
    WEIGHT_UPDATE_DIGEST,
    POST_LOAD_AT_UPDATE_END,
)
# Advertised too unless the server was started with the fused lifecycle off.
FUSED_CAPABILITIES = (WEIGHT_SYNC_FUSED,)


class WeightLabel:
    """The label of the weights a replica holds, and the largest numeric label
    (`weightsync.control.labels`) this process has held.

    Args:
        version: the label of the weights the replica starts with.
    """

    def __init__(self, version: str) -> None:
        self.version = version
        self.highest = numeric_label(version)

    def take(self, version: str) -> None:
        """Take `version` as the label of the weights held (and the highest numeric one)."""
        self.version = version
        number = numeric_label(version)
        if number is not None and (self.highest is None or number > self.highest):
            self.highest = number


def capabilities(
    *, fused_lifecycle: bool, events: bool, fence: bool, delta: bool = False
) -> tuple[str, ...]:
    """What a replica advertises: `CAPABILITIES`, delta syncs where every rank has a delta
    region (`delta`), and with `fused_lifecycle` the fused calls, waiting for CUDA events
    (`events`) and fenced sessions (`fence`)."""
    served = CAPABILITIES + ((WEIGHT_SYNC_DELTA,) if delta else ())
    if not fused_lifecycle:
        return served
    fused = FUSED_CAPABILITIES + ((WEIGHT_SYNC_EVENTS,) if events else ())
    return served + fused + ((WEIGHT_SYNC_FENCE,) if fence else ())


def session_info(session: ReplicaSession | None, integrity: WeightIntegrity) -> dict[str, Any]:
    """``/server_info``'s ``weightsync.session``: the state of the session not yet closed
    (`session`), its lease, and what the last session's digests took."""
    if session is None or session.state is ReplicaSessionState.OPENING:
        state = session.state if session is not None else ReplicaSessionState.CLOSED
        return {"state": state.value, "leased": False, "last_digest_s": integrity.digest_s}
    return {
        "state": session.state.value,
        "leased": session.token is not None,
        "lease_s": session.lease_s,
        "expires_in_s": session.expires_in_s(),
        "versioned": session.versioned,
        "last_digest_s": integrity.digest_s,
    }


def server_info(
    info: ReplicaInfo,
    *,
    weight_version: str,
    instance: str,
    highest_version: int | None,
    capabilities: tuple[str, ...],
    integrity: WeightIntegrity,
    session: ReplicaSession | None,
    state: dict[str, Any],
) -> dict[str, Any]:
    """The server's arguments, state and version (``GET /server_info``): SGLang's keys for
    what it has, and what it serves beyond SGLang under ``"weightsync"``; `state` is the
    serving state (pause, session, memory, requests, engine)."""
    return {
        **info.server_args(),
        "status": "ready",
        "weight_version": weight_version,
        "weightsync": {
            "version": __version__,
            "instance": instance,
            "highest_numeric_version": highest_version,
            "capabilities": list(capabilities),
            "weights": integrity.describe(),
            "session": session_info(session, integrity),
        },
        "state": state,
    }


def model_info(info: ReplicaInfo, *, weight_version: str) -> dict[str, Any]:
    """``GET /model_info``: the model and the weight version it serves."""
    hf_config = info.hf_config
    return {
        "model_path": info.server_args()["model_path"],
        "weight_version": weight_version,
        "is_generation": True,
        "model_type": hf_config.get("model_type"),
        "architectures": hf_config.get("architectures"),
    }
