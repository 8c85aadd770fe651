"""`BootstrapClient`: the engine-info bootstrap server's routes (docs/protocol.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightsync.control.base import AsyncHttpClient
from weightsync.control.models import (
    RegisterParallelismConfigRequest,
    RegisterTransferEngineInfoRequest,
    TransferEngineInfo,
    WeightsInfo,
)
from weightsync.layout.parallelism import ParallelismConfig


class BootstrapClient(AsyncHttpClient):
    """Async client of a replica's engine-info bootstrap server.

    Rollout ranks ``PUT`` their transfer-engine info and parallelism config here at start-up;
    trainers ``GET`` them per rank. Errors raise `RemoteReplicaError` as in `RolloutClient`
    (an unknown rank is HTTP 404, a negative rank HTTP 400, a missing or wrong key HTTP 401).

    Args:
        base_url: the bootstrap server, e.g. ``http://127.0.0.1:6789``.
        api_key: sent as ``Authorization: Bearer <api_key>`` with every call: a reference
            server started with an API key requires it on every route but ``/health``, reads
            included (they reveal parameter addresses). SGLang's bootstrap server checks
            none.
        timeout_s: default timeout of each call in seconds.
    """

    async def health(self, *, timeout_s: float | None = None) -> None:
        """``GET /health``: return when the bootstrap server answers ``OK``."""
        await self._call("GET", "/health", timeout_s=timeout_s)

    async def register_transfer_engine_info(
        self,
        tp_rank: int,
        session_id: str,
        weights_info: Mapping[str, Sequence[int]],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """``PUT /register_transfer_engine_info`` for rank `tp_rank`."""
        body = RegisterTransferEngineInfoRequest(
            tp_rank=tp_rank,
            transfer_engine_info=TransferEngineInfo(
                session_id=session_id,
                weights_info_dict={k: tuple(v) for k, v in weights_info.items()},
            ),
        )
        await self._call("PUT", "/register_transfer_engine_info", body=body, timeout_s=timeout_s)

    async def register_parallelism_config(
        self, tp_rank: int, config: ParallelismConfig, *, timeout_s: float | None = None
    ) -> None:
        """``PUT /register_parallelism_config`` for rank `tp_rank`."""
        body = RegisterParallelismConfigRequest(
            tp_rank=tp_rank, parallelism_config=config.to_dict()
        )
        await self._call("PUT", "/register_parallelism_config", body=body, timeout_s=timeout_s)

    async def get_transfer_engine_info(
        self, rank: int, *, timeout_s: float | None = None
    ) -> tuple[str, WeightsInfo]:
        """``GET /get_transfer_engine_info?rank=N``: ``(session_id, weights_info)``."""
        return await self._transfer_engine_info("/get_transfer_engine_info", rank, timeout_s)

    async def get_parallelism_config(
        self, rank: int, *, timeout_s: float | None = None
    ) -> ParallelismConfig:
        """``GET /get_parallelism_config?rank=N``."""
        return await self._parallelism_config("/get_parallelism_config", rank, timeout_s)
