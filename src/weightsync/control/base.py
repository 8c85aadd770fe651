"""What the rollout clients share: one `httpx.AsyncClient`, auth, timeouts, error mapping."""

from __future__ import annotations

from typing import Any, Self, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from weightsync.control.models import (
    ParallelismConfigModel,
    TransferEngineInfoResponse,
    WeightsInfo,
)
from weightsync.control.replies import check_reply, json_body, unreachable
from weightsync.errors import RemoteReplicaError
from weightsync.layout.parallelism import ParallelismConfig

ModelT = TypeVar("ModelT", bound=BaseModel)


class AsyncHttpClient:
    """An async HTTP client bound to one server (base class of the rollout clients).

    Args:
        base_url: the server's base URL, e.g. ``http://127.0.0.1:30000``.
        api_key: sent as ``Authorization: Bearer <api_key>`` when given.
        timeout_s: default timeout of each call in seconds; calls can override it.

    Raises:
        ValueError: `base_url` is not an http(s) URL or `timeout_s` is not positive.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 30.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self._base_url, headers=headers, timeout=timeout_s, trust_env=False
        )

    @property
    def base_url(self) -> str:
        """The server's base URL (no trailing slash)."""
        return self._base_url

    async def aclose(self) -> None:
        """Close the connection pool; the client cannot be used afterwards."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(
        self,
        method: str,
        route: str,
        *,
        body: BaseModel | dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """Send one request and return its 2xx reply.

        Raises:
            RemoteReplicaError: no reply, or a reply that is not a 2xx.
        """
        payload = body.model_dump(mode="json") if isinstance(body, BaseModel) else body
        try:
            response = await self._http.request(
                method,
                route,
                json=payload,
                params=params,
                timeout=timeout_s if timeout_s is not None else self._timeout_s,
            )
        except httpx.HTTPError as exc:
            raise unreachable(exc, replica=self._base_url, route=route) from exc
        check_reply(response, replica=self._base_url, route=route)
        return response

    def _json(self, response: httpx.Response, *, route: str) -> Any:
        """The JSON body of a reply.

        Raises:
            RemoteReplicaError: the body is not JSON.
        """
        return json_body(response, replica=self._base_url, route=route)

    def _parse(self, response: httpx.Response, model: type[ModelT], *, route: str) -> ModelT:
        """Validate a reply's JSON body as `model`.

        Raises:
            RemoteReplicaError: the body is not JSON or does not have `model`'s shape.
        """
        data = self._json(response, route=route)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise RemoteReplicaError(
                f"replica {self._base_url}: {route} answered with an unexpected body "
                f"({model.__name__} expected): {exc}",
                replica=self._base_url,
                route=route,
                status_code=response.status_code,
            ) from exc

    async def _transfer_engine_info(
        self, route: str, rank: int, timeout_s: float | None
    ) -> tuple[str, WeightsInfo]:
        """``GET route?rank=N`` answered with SGLang's transfer-engine-info body."""
        response = await self._call("GET", route, params={"rank": rank}, timeout_s=timeout_s)
        info = self._parse(response, TransferEngineInfoResponse, route=route)
        return info.remote_instance_transfer_engine_info

    async def _parallelism_config(
        self, route: str, rank: int, timeout_s: float | None
    ) -> ParallelismConfig:
        """``GET route?rank=N`` answered with a rank's parallelism config dict."""
        response = await self._call("GET", route, params={"rank": rank}, timeout_s=timeout_s)
        model = self._parse(response, ParallelismConfigModel, route=route)
        try:
            return ParallelismConfig.from_dict(model.model_dump())
        except ValueError as exc:
            raise RemoteReplicaError(
                f"{self.base_url}: {route} rank {rank} published an invalid parallelism "
                f"config: {exc}",
                replica=self.base_url,
                route=route,
                status_code=response.status_code,
            ) from exc
