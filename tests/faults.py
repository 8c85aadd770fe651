"""Helpers of the fault-injection tests: an export that stalls or acts mid-stream, an HTTP
proxy that rewrites what a real replica publishes, and the table of outcomes."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response

from weightsync.control import RolloutClient
from weightsync.errors import RemoteReplicaError
from weightsync.export import ExportDefaults

TABLE_ENV = "WEIGHTSYNC_FAULT_TABLE"


class StallingExport(ExportDefaults):
    """A `WeightExport` that runs `hook` after yielding `after` tensors of `inner` (to stall
    the push, or to break something while it runs), then yields the rest."""

    def __init__(self, inner: Any, *, after: int, hook: Callable[[], None]) -> None:
        self._inner = inner
        self._after = after
        self._hook = hook

    def holding(self) -> Mapping[str, Any]:
        return self._inner.holding()

    def geometry(self) -> Any:
        return self._inner.geometry()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for index, item in enumerate(self._inner):
            if index == self._after:
                self._hook()
            yield item


class HookedTransport:
    """A transport that runs a hook once, at the first write after `arm` (before the write
    goes out), and is otherwise `inner`: to act while a push that reads no stream (a
    replay) runs."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._hook: Callable[[], None] | None = None
        self.fired = 0

    def arm(self, hook: Callable[[], None]) -> None:
        """Run `hook` at the next write."""
        self._hook = hook

    def write(self, *args: Any, **kwargs: Any) -> Any:
        hook, self._hook = self._hook, None
        if hook is not None:
            self.fired += 1
            hook()
        return self._inner.write(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def rewriting_proxy(upstream: str, rewrite: Callable[[dict[str, Any]], None]) -> FastAPI:
    """An app that forwards every request to `upstream` and lets `rewrite` change the JSON
    of ``/remote_instance_transfer_engine_info`` replies: a replica that publishes wrong
    addresses."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT"])
    async def forward(path: str, request: Request) -> Response:
        async with (
            aiohttp.ClientSession(trust_env=False) as session,
            session.request(
                request.method,
                f"{upstream}/{path}",
                params=dict(request.query_params),
                data=await request.body(),
                headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
            ) as reply,
        ):
            body = await reply.read()
            if path == "remote_instance_transfer_engine_info" and reply.status == 200:
                data = json.loads(body)
                rewrite(data)
                body = json.dumps(data).encode()
            return Response(body, status_code=reply.status, media_type=reply.content_type)

    return app


def record(case: str, outcome: str, seconds: float) -> None:
    """Add one row to the fault table (``$WEIGHTSYNC_FAULT_TABLE``, JSON lines) when set."""
    path = os.environ.get(TABLE_ENV)
    if path:
        with Path(path).open("a") as table:
            table.write(json.dumps({"case": case, "outcome": outcome, "seconds": seconds}) + "\n")


class Stopwatch:
    """Seconds since it was made."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._start


def call(url: str, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call `RolloutClient` method `method` of replica `url` once, in a loop of its own."""

    async def run() -> Any:
        async with RolloutClient(url, timeout_s=30.0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run())


def serves(url: str) -> bool:
    """Whether replica `url` generates (not paused, not incomplete)."""
    try:
        call(url, "generate", [1, 2, 3], max_new_tokens=2, timeout_s=10.0)
    except RemoteReplicaError:
        return False
    return True
