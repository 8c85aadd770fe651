"""The fast path of a reference server's HTTP control plane: a few declared ``POST`` routes
(`DirectRoute`; the fused lifecycle calls) that `DirectHttpProtocol` answers straight from a
connection's bytes. Every other request takes the framework path: uvicorn's protocol, then
FastAPI's middleware and routes. On the trainer's side the same two calls go over the
client's own connection (`weightsync.control.connection`) and every other call over aiohttp.

Why a fast path: a fused call's own work takes about a tenth of a millisecond, and the
framework path costs several times that. Through it a request pays for an ASGI task, its
scope and message dicts, routing, dependency solving, the reply sent in two messages through
every middleware, and a turn of the event loop between them; the fast path parses the head
and body itself, validates with the route's model and writes the reply in one write.

A fused begin and end, back to back over one keep-alive connection, on loopback (uvloop on
both sides, the server in a process of its own, trivial handlers, a 64-digest end body),
median of 2,000 round trips per cell, twice, on a 2-core host:

    client:                     its own connection    aiohttp
    server's framework path     0.54 ms               0.79 ms
    server's fast path          0.18-0.19 ms          0.34-0.35 ms

so the fast path on both sides takes a fused sync's control plane from 0.79 ms to about
0.19 ms.

Each direct route is also a framework route over the same handler
(`DirectApp.add_direct_routes` requires one): the framework answers it wherever the fast
path does not (a connection handed to uvicorn for good, an app served without
`DirectHttpProtocol`), and both give the same reply, byte for byte: the API key, SGLang's 400
for a body that does not parse or validate, a number that is not finite, a `ControlError`, a
body over the limit, an exception no handler answered.
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
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError

from weightsync.server.gate import HeadGate
from weightsync.server.http import (
    PARSE_INLINE_BYTES,
    ControlError,
    control_error_response,
    internal_error_response,
    is_json,
    loads_finite,
    validation_error_response,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectRoute:
    """A ``POST`` route with a JSON body that the fast path answers (`DirectRoutes`).

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
    """The answers of the direct routes `routes`, in two steps: `refusal` (the body's
    declared size and the API key, judged from the head alone, so that neither an oversized
    nor an unauthorised body is read) and `answer` (the body parsed as the framework parses
    it, validated, handled).

    Args:
        routes: the direct routes.
        api_key: the key every direct route requires (None: no key).
        max_body_bytes: refuse bodies larger than this (413); None: no limit.
        setting: how an operator raises `max_body_bytes` (named in the 413).
    """

    def __init__(
        self,
        routes: Sequence[DirectRoute],
        *,
        api_key: str | None,
        max_body_bytes: int | None = None,
        setting: str = "",
    ):
        self.max_body_bytes = max_body_bytes
        self._routes = {route.path: route for route in routes}
        self._adapters = {
            route.path: TypeAdapter(route.body if route.body_required else route.body | None)
            for route in routes
        }
        self._gate = HeadGate(api_key=api_key, max_body_bytes=max_body_bytes, setting=setting)

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
    """A FastAPI app with direct routes (`add_direct_routes`): `direct_routes` is what a
    server's connections (`DirectHttpProtocol`) answer them with, ahead of the framework;
    the app's own routes answer every other request, and these routes too wherever the fast
    path does not. The body limit `limit_body_size` set bounds the direct routes too.

    Takes FastAPI's arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._direct: tuple[tuple[DirectRoute, ...], str | None] | None = None
        self._direct_routes: DirectRoutes | None = None

    def add_direct_routes(self, routes: Sequence[DirectRoute], *, api_key: str | None) -> None:
        """Answer `routes` on the fast path (`DirectRoutes`), requiring `api_key` (None: no
        key). Add the app's own ``POST`` route of each first, over the same handler.

        Raises:
            ValueError: a route's path has no ``POST`` route of the app's.
            RuntimeError: the app has served a request already, or a server's connections
                took its direct routes.
        """
        if self.middleware_stack is not None or self._direct_routes is not None:
            raise RuntimeError("direct routes must be added before the app serves a request")
        served = {
            route.path
            for route in self.router.routes
            if isinstance(route, APIRoute) and "POST" in route.methods
        }
        missing = [route.path for route in routes if route.path not in served]
        if missing:
            raise ValueError(
                f"direct routes {missing} have no POST route of the app's; add the framework "
                "route over the same handler first (it answers where the fast path does not)"
            )
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
                routes,
                api_key=api_key,
                max_body_bytes=gate.max_body_bytes,
                setting=gate.setting,
            )
        return self._direct_routes
