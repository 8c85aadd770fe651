"""The engine-info bootstrap server (docs/protocol.md, "Bootstrap server"): ranks register,
trainers look them up."""

from __future__ import annotations

import logging
import threading
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import PlainTextResponse

from weightsync import __version__
from weightsync.control.models import (
    RegisterParallelismConfigRequest,
    RegisterTransferEngineInfoRequest,
    TransferEngineInfoResponse,
    WeightsInfo,
)
from weightsync.server.config import DEFAULT_MAX_BOOTSTRAP_BODY_BYTES
from weightsync.server.gate import require_key_before_body
from weightsync.server.http import (
    ERROR_RESPONSES,
    bearer_auth,
    install_error_handler,
    limit_body_size,
)

logger = logging.getLogger(__name__)


class BootstrapRegistry:
    """What each rank of a replica registered: transfer-engine info and parallelism config.

    Thread-safe: HTTP handlers write it, other threads of the process may read it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine_info: dict[int, tuple[str, WeightsInfo]] = {}
        self._parallelism: dict[int, dict[str, Any]] = {}

    def register_transfer_engine_info(
        self, tp_rank: int, session_id: str, weights_info: WeightsInfo
    ) -> None:
        """Record (or replace) rank `tp_rank`'s session id and parameter table."""
        with self._lock:
            self._engine_info[tp_rank] = (session_id, dict(weights_info))

    def register_parallelism_config(self, tp_rank: int, config: dict[str, Any]) -> None:
        """Record (or replace) rank `tp_rank`'s parallelism config."""
        with self._lock:
            self._parallelism[tp_rank] = dict(config)

    def transfer_engine_info(self, rank: int) -> tuple[str, WeightsInfo] | None:
        """Rank `rank`'s ``(session_id, weights_info)``, or ``None`` if it has not registered."""
        with self._lock:
            return self._engine_info.get(rank)

    def parallelism_config(self, rank: int) -> dict[str, Any] | None:
        """Rank `rank`'s parallelism config, or ``None`` if it has not registered."""
        with self._lock:
            return self._parallelism.get(rank)


def create_bootstrap_app(
    registry: BootstrapRegistry,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BOOTSTRAP_BODY_BYTES,
) -> FastAPI:
    """The bootstrap server's app over `registry`.

    Errors follow SGLang's bootstrap server: ``{"detail": ...}`` with 400 for a negative
    rank and 404 for a rank that has not registered. With `api_key`, every route but
    ``/health`` needs ``Authorization: Bearer <api_key>`` (401 ``{"error": {"message"}}``
    otherwise, judged before a body is read): the ``PUT`` routes change what trainers write
    to, and the ``GET`` routes reveal every parameter's address and the ranks'
    transfer-engine sessions. Bodies over `max_body_bytes` are answered 413.
    """
    app = FastAPI(
        title="weightsync engine-info bootstrap server",
        version=__version__,
        description="Per-rank transfer-engine info and parallelism config of one replica.",
    )
    install_error_handler(app)
    # Judged from the head, inside the body limit (a declared body over it is answered 413
    # first), before any route reads a body.
    require_key_before_body(app, api_key, open_paths=("/health",))
    limit_body_size(app, max_body_bytes, setting="weightsync serve --max-bootstrap-body-bytes")
    authorized = [Depends(bearer_auth(api_key))]

    @app.get("/health", response_class=PlainTextResponse)
    async def health() -> str:
        """``OK`` while the server runs."""
        return "OK"

    @app.put(
        "/register_transfer_engine_info",
        response_class=PlainTextResponse,
        dependencies=authorized,
        responses=ERROR_RESPONSES,
    )
    async def register_transfer_engine_info(body: RegisterTransferEngineInfoRequest) -> str:
        """Record a rank's transfer-engine session id and parameter table."""
        info = body.transfer_engine_info
        registry.register_transfer_engine_info(
            body.tp_rank, info.session_id, info.weights_info_dict
        )
        logger.info(
            "registered transfer engine info of tp rank %d: session %s, %d parameters",
            body.tp_rank,
            info.session_id,
            len(info.weights_info_dict),
        )
        return "OK"

    @app.put(
        "/register_parallelism_config",
        response_class=PlainTextResponse,
        dependencies=authorized,
        responses=ERROR_RESPONSES,
    )
    async def register_parallelism_config(body: RegisterParallelismConfigRequest) -> str:
        """Record a rank's parallelism config."""
        registry.register_parallelism_config(body.tp_rank, body.parallelism_config)
        logger.info("registered parallelism config of tp rank %d", body.tp_rank)
        return "OK"

    @app.get(
        "/get_transfer_engine_info",
        response_model=TransferEngineInfoResponse,
        # SGLang's body: the main server's registered_regions are not the bootstrap's to say.
        response_model_exclude_none=True,
        dependencies=authorized,
        responses=ERROR_RESPONSES,
    )
    async def get_transfer_engine_info(rank: int) -> dict[str, Any]:
        """``{"rank": N, "remote_instance_transfer_engine_info": [session_id, weights_info]}``."""
        if rank < 0:
            raise HTTPException(status_code=400, detail="Invalid rank parameter")
        info = registry.transfer_engine_info(rank)
        if info is None:
            raise HTTPException(status_code=404, detail=f"No transfer engine info for rank {rank}")
        return {"rank": rank, "remote_instance_transfer_engine_info": list(info)}

    @app.get("/get_parallelism_config", dependencies=authorized, responses=ERROR_RESPONSES)
    async def get_parallelism_config(rank: int) -> dict[str, Any]:
        """The parallelism config dict rank `rank` registered."""
        if rank < 0:
            raise HTTPException(status_code=400, detail="Invalid rank parameter")
        config = registry.parallelism_config(rank)
        if config is None:
            raise HTTPException(status_code=404, detail=f"No parallelism config for rank {rank}")
        return config

    return app
