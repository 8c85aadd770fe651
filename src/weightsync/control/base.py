"""What the rollout clients share: auth, timeouts, errors, and the two ways a call goes
out, both chosen here.

- The framework path, `AsyncHttpClient._call`: aiohttp's keep-alive pool, for every route
  (on loopback a call costs about a third of what it cost through httpx, whose HTTP/1.1
  parser is pure Python).
- The fast path, `AsyncHttpClient._post_quick`: the client's own `KeepAliveConnection`, for
  the two fused lifecycle calls (`RolloutClient.begin_weight_sync` and
  `RolloutClient.end_weight_sync`), whose cost is all of a fused sync's control plane; over
  aiohttp for an https server. Why, with the measured costs of both paths on both sides:
  `weightsync.server.direct`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Self, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from weightsync.control.connection import KeepAliveConnection
from weightsync.control.models import (
    ParallelismConfigModel,
    TransferEngineInfoResponse,
    WeightsInfo,
)
from weightsync.control.replies import HttpReply, check_reply, json_body, unreachable
from weightsync.errors import RemoteReplicaError
from weightsync.layout.parallelism import ParallelismConfig

ModelT = TypeVar("ModelT", bound=BaseModel)
_JSON = {"Content-Type": "application/json"}


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
        self._api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A session belongs to the event loop it was made on, and a client may be made
        # outside any loop: the session is made by the first call, on that call's loop.
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        # The fast path's connection (the fused lifecycle calls); plain HTTP only.
        self._keep_alive = (
            KeepAliveConnection(self._base_url, headers=self._headers)
            if self._base_url.startswith("http://")
            else None
        )
        self._closed = False

    @property
    def base_url(self) -> str:
        """The server's base URL (no trailing slash)."""
        return self._base_url

    async def aclose(self) -> None:
        """Close the connection pool; the client cannot be used afterwards."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        if self._keep_alive is not None:
            await self._keep_alive.aclose()

    def _session_here(self) -> aiohttp.ClientSession:
        """The pool of the running event loop (a new one if the last call ran on another)."""
        if self._closed:
            raise RuntimeError(f"the client of {self._base_url} is closed")
        loop = asyncio.get_running_loop()
        session = self._session
        if session is None or session.closed or self._session_loop is not loop:
            # A pool of a loop that is gone cannot be closed from this one; its sockets go
            # with it.
            session = self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
                trust_env=False,
                json_serialize=json.dumps,
            )
            self._session_loop = loop
        return session

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(
        self,
        method: str,
        route: str,
        *,
        body: BaseModel | dict[str, Any] | bytes | None = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> HttpReply:
        """Send one request with a JSON `body` (a model, a dict, or bytes already encoded)
        and return its 2xx reply (any reply, without `check`).

        Raises:
            RemoteReplicaError: no reply, or (with `check`) a reply that is not a 2xx.
        """
        if isinstance(body, BaseModel):
            # pydantic's encoder: a sync's digests (hundreds of entries) in microseconds.
            body = body.model_dump_json().encode()
        json_body, data = (None, body) if isinstance(body, bytes) else (body, None)
        headers = _JSON if data is not None else None
        timeout = aiohttp.ClientTimeout(
            total=timeout_s if timeout_s is not None else self._timeout_s
        )
        try:
            async with self._session_here().request(
                method,
                self._base_url + route,
                json=json_body,
                data=data,
                headers=headers,
                params=params,
                timeout=timeout,
            ) as reply:
                response = HttpReply(
                    status_code=reply.status,
                    reason_phrase=reply.reason or "",
                    content=await reply.read(),
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise unreachable(exc, replica=self._base_url, route=route) from exc
        if check:
            check_reply(response, replica=self._base_url, route=route)
        return response

    async def _post_quick(
        self,
        route: str,
        body: bytes,
        *,
        timeout_s: float | None,
        poll_s: float = 0.0,
        poll_after: asyncio.Future[Any] | None = None,
    ) -> HttpReply:
        """``POST`` `body` (JSON) on the fast path: over the keep-alive connection (aiohttp
        for an https server); return the reply, whatever its status. `poll_s` and
        `poll_after` as `KeepAliveConnection.request` takes them (not over aiohttp).

        Raises:
            RemoteReplicaError: no reply.
        """
        if self._keep_alive is None:
            return await self._call("POST", route, body=body, timeout_s=timeout_s, check=False)
        if self._closed:
            raise RuntimeError(f"the client of {self._base_url} is closed")
        try:
            return await self._keep_alive.request(
                "POST",
                route,
                body,
                timeout_s=timeout_s if timeout_s is not None else self._timeout_s,
                poll_s=poll_s,
                poll_after=poll_after,
            )
        except OSError as exc:  # TimeoutError and ConnectionError among them
            raise unreachable(exc, replica=self._base_url, route=route) from exc

    def _json(self, response: HttpReply, *, route: str) -> Any:
        """The JSON body of a reply.

        Raises:
            RemoteReplicaError: the body is not JSON.
        """
        return json_body(response, replica=self._base_url, route=route)

    def _parse(self, response: HttpReply, model: type[ModelT], *, route: str) -> ModelT:
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
