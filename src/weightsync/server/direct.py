"""Direct routes: ``POST`` routes answered ahead of the framework, as its routes over the same
handlers answer them.

The fused lifecycle calls take a tenth of a millisecond of work each; the framework's
routing, dependency solving and per-layer wrapping cost more than that. `DirectRoutes`
answers them with the same replies (the API key, SGLang's 400 for a body that does not parse
or validate, a number that is not finite, a `ControlError`, a body over the limit, an
exception no handler answered), and serves two ways: as pure ASGI middleware in front of an
app's whole middleware stack (`DirectApp`), and to `DirectHttpProtocol`, which answers them
straight from a connection's bytes.
"""

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from weightsync.server.gate import HeadGate
from weightsync.server.http import (
    PARSE_INLINE_BYTES,
    BodySizeLimit,
    ControlError,
    InternalErrorGuard,
    control_error_response,
    internal_error_response,
    is_json,
    loads_finite,
    validation_error_response,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectRoute:
    """A ``POST`` route with a JSON body that `DirectRoutes` answers ahead of the framework.

    Attributes:
        path: the route's path.
        body: the body's model.
        handle: answers a validated body (``None`` for an empty one, unless required);
            raises `ControlError` to refuse.
        body_required: an empty body is refused (400 ``body: Field required``) rather than
            handed over as ``None``.
    """

    path: str
    body: type[BaseModel]
    handle: Callable[[Any], Awaitable[Response]]
    body_required: bool = True


class DirectRoutes:
    """Answers the requests of `routes`; as pure ASGI middleware it answers ``POST``
    requests to them itself and passes every other request on to `app`.

    A request is answered in two steps: `refusal` (the body's declared size and the API
    key, judged from the head alone, so that neither an oversized nor an unauthorised body
    is read) and `answer` (the body parsed as the framework parses it, validated, handled).

    Args:
        app: the app that answers every other request (None: only `refusal` and `answer`
            are used; `DirectApp` sets it when it builds its stack).
        routes: the direct routes.
        api_key: the key every direct route requires (None: no key).
        max_body_bytes: refuse bodies larger than this (`BodySizeLimit`); None: no limit.
        setting: how an operator raises `max_body_bytes` (named in the 413).
    """

    def __init__(
        self,
        app: ASGIApp | None,
        *,
        routes: Sequence[DirectRoute],
        api_key: str | None,
        max_body_bytes: int | None = None,
        setting: str = "",
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._routes = {route.path: route for route in routes}
        self._adapters = {
            route.path: TypeAdapter(route.body if route.body_required else route.body | None)
            for route in routes
        }
        self._gate = HeadGate(api_key=api_key, max_body_bytes=max_body_bytes, setting=setting)
        self._guarded: ASGIApp = InternalErrorGuard(self._serve)
        self._limit: BodySizeLimit | None = None
        if max_body_bytes is not None:
            self._guarded = self._limit = BodySizeLimit(
                self._guarded, max_body_bytes=max_body_bytes, setting=setting
            )

    @property
    def api_key(self) -> str | None:
        """The key every direct route requires (None: no key)."""
        return self._gate.api_key

    def serves(self, method: str, path: str) -> bool:
        """Whether a `method` request to `path` is a direct route's."""
        return method == "POST" and path in self._routes

    def refusal(
        self, path: str, *, authorization: str | None, content_length: int | None
    ) -> Response | None:
        """The reply that refuses a request to `path` from its head alone (413 for a
        declared body over the limit, 401 for the API key), or None to read its body."""
        return self._gate.refusal(
            "POST", path, authorization=authorization, content_length=content_length
        )

    async def answer(self, path: str, body: bytes, content_type: str | None) -> Response:
        """The reply to an authorised request to `path` whose whole body is `body`; an
        exception the handler did not answer is logged and answered 500. A body over
        `PARSE_INLINE_BYTES` is parsed and validated in a worker thread, so that the event
        loop keeps answering meanwhile."""
        route = self._routes[path]
        try:
            if len(body) > PARSE_INLINE_BYTES:
                value = await asyncio.to_thread(
                    self._validate, route, body, content_type, interruptible=True
                )
            else:
                value = self._validate(route, body, content_type)
            return await route.handle(value)
        except ControlError as exc:
            return control_error_response(exc, f"POST {path}")
        except RequestValidationError as exc:
            return validation_error_response(exc)
        except _UnparsableBodyError:
            # What the framework answers to a body its JSON parser gives up on.
            return JSONResponse({"detail": "There was an error parsing the body"}, 400)
        except Exception as exc:
            logger.exception("internal error in POST %s", path)
            return internal_error_response(f"POST {path}", exc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a direct route's request, or pass the request on."""
        if scope["type"] == "http" and self.serves(scope["method"], scope["path"]):
            await self._guarded(scope, receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        else:
            raise RuntimeError("DirectRoutes without an app received another request")

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        headers = Headers(scope=scope)
        # The body's size is BodySizeLimit's, further out: it also counts a chunked body.
        response = self.refusal(
            path, authorization=headers.get("authorization"), content_length=None
        )
        if response is None:
            body = await _read_body(receive)
            response = await self.answer(path, body, headers.get("content-type"))
        await response(scope, receive, send)

    def _validate(
        self,
        route: DirectRoute,
        body: bytes,
        content_type: str | None,
        *,
        interruptible: bool = False,
    ) -> Any:
        """The body as the route's model, parsed as the framework parses it: JSON only under
        a JSON content type (anything else, or no content type, is validated as bytes and
        refused); an empty body is missing. `interruptible`: as `loads_finite`'s."""
        if not body:
            if route.body_required:
                raise RequestValidationError(
                    [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
                )
            return None
        value: Any = body
        if is_json(content_type):
            try:
                value = loads_finite(body, interruptible=interruptible)
            except json.JSONDecodeError as exc:
                raise RequestValidationError(
                    [
                        {
                            "type": "json_invalid",
                            "loc": ("body", exc.pos),
                            "msg": "JSON decode error",
                            "input": {},
                            "ctx": {"error": exc.msg},
                        }
                    ]
                ) from exc
            except (ValueError, RecursionError) as exc:
                raise _UnparsableBodyError from exc
        try:
            return self._adapters[route.path].validate_python(value, from_attributes=True)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            raise RequestValidationError(
                [{**error, "loc": ("body", *error["loc"])} for error in errors]
            ) from exc


class _UnparsableBodyError(Exception):
    pass


class DirectApp(FastAPI):
    """A FastAPI app that answers its direct routes (`add_direct_routes`) ahead of its whole
    middleware stack, the framework's own layers (error pages, body limits, telemetry)
    included: each of those wraps every message of a request, which a lifecycle call whose
    steps take a tenth of a millisecond pays for. The body limit `limit_body_size` set bounds
    the direct routes too; everything else answers as before. `direct_routes` is what a
    server's connections (`DirectHttpProtocol`) answer them with.

    Takes FastAPI's arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direct: tuple[tuple[DirectRoute, ...], str | None] | None = None
        self._direct_routes: DirectRoutes | None = None

    def add_direct_routes(self, routes: Sequence[DirectRoute], *, api_key: str | None) -> None:
        """Answer `routes` directly (`DirectRoutes`), requiring `api_key` (None: no key).

        Raises:
            RuntimeError: the app has served a request already (its stack is built).
        """
        if self.middleware_stack is not None or self._direct_routes is not None:
            raise RuntimeError("direct routes must be added before the app serves a request")
        self._direct = (tuple(routes), api_key)

    @property
    def direct_routes(self) -> DirectRoutes | None:
        """The direct routes' answers (built on first use, after `limit_body_size`), or
        None when the app has none."""
        if self._direct is None:
            return None
        if self._direct_routes is None:
            routes, api_key = self._direct
            gate = HeadGate.of_app(self)
            self._direct_routes = DirectRoutes(
                None,
                routes=routes,
                api_key=api_key,
                max_body_bytes=gate.max_body_bytes,
                setting=gate.setting,
            )
        return self._direct_routes

    def build_middleware_stack(self) -> ASGIApp:
        """The framework's stack, with the direct routes in front of it."""
        stack = super().build_middleware_stack()
        direct = self.direct_routes
        if direct is None:
            return stack
        direct.app = stack
        return direct


async def _read_body(receive: Receive) -> bytes:
    """The whole request body (empty when the client went away)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
