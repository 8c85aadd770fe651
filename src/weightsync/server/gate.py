"""What a reference server refuses from a request's head alone, before it reads a byte of
the body: a declared body over the limit (413), then a missing or wrong API key (401).

`HeadGate` holds the rule; `KeyBeforeBody` applies its key half as ASGI middleware (so that
an app refuses an unauthorised request before its routes parse the body, under any server),
and `DirectHttpProtocol` applies the whole of it to every request of a connection, ahead
of the framework. Every path needs the key except the app's open paths (``/health``,
``/ready``, the OpenAPI document and its pages): a route added without the key's dependency
is still guarded here, and an unknown path is refused as any.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from weightsync.server.http import (
    BodySizeLimit,
    ControlError,
    carries_api_key,
    check_api_key,
    control_error_response,
    declared_body_refusal,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadGate:
    """The refusals of a server that need only a request's head.

    Attributes:
        api_key: the key every path but `open_paths` needs (``Authorization: Bearer``);
            None: no key.
        open_paths: the paths served without the key.
        max_body_bytes: the largest body the server reads; None: no limit.
        setting: how an operator raises `max_body_bytes` (named in the 413).
    """

    api_key: str | None = None
    open_paths: frozenset[str] = frozenset()
    max_body_bytes: int | None = None
    setting: str = ""

    @classmethod
    def of_app(cls, app: FastAPI) -> HeadGate:
        """The gate of `app`: its `KeyBeforeBody` and its smallest `BodySizeLimit` (call it
        once both are added; an app without them refuses nothing)."""
        gate = cls()
        for middleware in app.user_middleware:
            kwargs = middleware.kwargs
            if middleware.cls is KeyBeforeBody:
                gate = replace(gate, api_key=kwargs["api_key"], open_paths=kwargs["open_paths"])
            elif middleware.cls is BodySizeLimit and (
                gate.max_body_bytes is None or kwargs["max_body_bytes"] < gate.max_body_bytes
            ):
                gate = replace(
                    gate, max_body_bytes=kwargs["max_body_bytes"], setting=kwargs["setting"]
                )
        return gate

    def needs_key(self, path: str) -> bool:
        """Whether a request to `path` must carry the key."""
        return self.api_key is not None and path not in self.open_paths

    def carries_key(self, authorization: str | None) -> bool:
        """Whether the ``Authorization`` header `authorization` holds the key (always, when
        the server has none): a request that does authenticates its connection."""
        return carries_api_key(authorization, self.api_key)

    def key_refusal(self, method: str, path: str, authorization: str | None) -> JSONResponse | None:
        """The 401 for a `method` request to `path` that needs the key and lacks it, or
        None."""
        if not self.needs_key(path):
            return None
        try:
            check_api_key(authorization, self.api_key)
        except ControlError as exc:
            return control_error_response(exc, f"{method} {path}")
        return None

    def refusal(
        self, method: str, path: str, *, authorization: str | None, content_length: int | None
    ) -> JSONResponse | None:
        """The reply that refuses a `method` request to `path` from its head alone (413 for a
        declared body over the limit, then 401 for the key), or None to read its body."""
        if self.max_body_bytes is not None:
            oversized = declared_body_refusal(
                f"{method} {path}",
                content_length,
                max_body_bytes=self.max_body_bytes,
                setting=self.setting,
            )
            if oversized is not None:
                return oversized
        return self.key_refusal(method, path, authorization)


class KeyBeforeBody:
    """Pure ASGI middleware: a request to a path that needs the API key and lacks it is
    answered 401 ``{"error": {"message"}}`` before the app runs, so no route reads or parses
    its body (FastAPI parses a route's body before it checks the route's dependencies).

    Args:
        app: the ASGI app to guard.
        api_key: the key every path but `open_paths` needs.
        open_paths: the paths served without the key.
    """

    def __init__(self, app: ASGIApp, *, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.gate = HeadGate(api_key=api_key, open_paths=open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a request without the key; pass every other one on."""
        if scope["type"] == "http":
            authorization = Headers(scope=scope).get("authorization")
            refusal = self.gate.key_refusal(scope["method"], scope["path"], authorization)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def require_key_before_body(
    app: FastAPI, api_key: str | None, *, open_paths: Iterable[str]
) -> None:
    """Make every path of `app` but `open_paths` (and the app's OpenAPI document and pages)
    need ``Authorization: Bearer <api_key>``, judged from the head (`KeyBeforeBody`); no
    key: nothing to require. Add it before `limit_body_size`, whose 413 comes first."""
    if api_key is None:
        return
    documentation = (
        app.openapi_url,
        app.docs_url,
        app.redoc_url,
        app.swagger_ui_oauth2_redirect_url if app.docs_url else None,
    )
    paths = frozenset(open_paths) | {path for path in documentation if path}
    app.add_middleware(KeyBeforeBody, api_key=api_key, open_paths=paths)
