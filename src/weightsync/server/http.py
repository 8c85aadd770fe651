"""HTTP plumbing both reference servers share: refusals as errors, bearer-key auth, and the
bounds every request meets (body size, finite numbers, no internal detail in a reply)."""

# No `from __future__ import annotations` here: FastAPI must see the dependency's real
# annotation, which refers to a local variable.
import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weightsync.control.models import ErrorResponse, SuccessResponse
from weightsync.errors import WeightSyncError

logger = logging.getLogger(__name__)


class ControlError(WeightSyncError):
    """A route refuses or fails; the server answers ``status_code`` and
    ``{"error": {"message": ...}}``.

    Attributes:
        status_code: the HTTP status (400 wrong for the state or bad input, 401 auth,
            404 unknown rank, 500 a rank failed, 503 not now: retry later).
    """

    def __init__(self, message: str, *, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def error_response(message: str, status_code: int) -> JSONResponse:
    """``{"error": {"message": ...}}`` with `status_code`."""
    body = ErrorResponse.model_validate({"error": {"message": message}})
    headers = {"WWW-Authenticate": "Bearer"} if status_code == 401 else None
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


def install_error_handler(app: FastAPI) -> None:
    """Answer every refusal and failure of `app`'s routes with a clear error, never with
    internal detail. Call it before adding routes (it sets the routes' class).

    - a `ControlError` gets its status and ``{"error": {"message": ...}}``; a 500 (a rank
      failed) says only which route failed, its message goes to the server log;
    - a body that does not parse, as SGLang answers: 400 ``{"object": "error", "message",
      "type": "Bad Request", "param": null, "code": 400}``; so does a JSON body holding a
      number that is not finite anywhere (``NaN``, ``Infinity``, ``1e309``), naming it;
    - any other exception: 500 ``{"error": {"message": "internal error in <route>:
      <ExceptionType>; see the server log"}}``, its traceback logged.
    """

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ControlError)
        return control_error_response(exc, scope_route(request.scope))

    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error_response(exc)

    app.router.route_class = FiniteJsonRoute
    app.add_exception_handler(ControlError, handle)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_middleware(InternalErrorGuard)


def control_error_response(exc: ControlError, route: str) -> JSONResponse:
    """The reply to `exc` raised by `route` (``"POST /path"``): its status and message,
    except that a 500 (a rank failed) says only which route failed and logs the message."""
    if exc.status_code == 500:
        # Rank failures carry the raw text of what failed (torch, the allocator); the log
        # keeps it, the reply does not.
        logger.error("internal error in %s: %s", route, exc)
        return error_response(
            f"internal error in {route}: the engine failed; see the server log", 500
        )
    return error_response(str(exc), exc.status_code)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """SGLang's 400 reply to a body or query that does not parse: ``{"object": "error",
    "message": "N validation error(s): <where>: <why>; ...", "type": "Bad Request", "param":
    null, "code": 400}``."""
    errors = exc.errors()
    details = "; ".join(
        f"{'.'.join(str(part) for part in error.get('loc', ()))}: {error.get('msg')}"
        for error in errors
    )
    return JSONResponse(
        {
            "object": "error",
            "message": f"{len(errors)} validation error(s): {details}",
            "type": "Bad Request",
            "param": None,
            "code": 400,
        },
        status_code=400,
    )


def scope_route(scope: Scope) -> str:
    """``"METHOD /path"`` of an ASGI request scope, as error replies and logs name it."""
    return f"{scope.get('method', '')} {scope.get('path', '')}".strip()


def internal_error_response(route: str, exc: BaseException) -> JSONResponse:
    """The 500 for `exc`, which no handler of `route` answered (log it first: the reply
    names only its type)."""
    message = f"internal error in {route}: {type(exc).__name__}; see the server log"
    return error_response(message, 500)


def body_too_large_response(
    route: str, what: str, *, max_body_bytes: int, setting: str
) -> JSONResponse:
    """The 413 for a body of `route` that `what` (``"declares N bytes, over"``,
    ``"passed"``) the limit of `max_body_bytes`; `setting` says how to raise it. Logged."""
    limit = f"{max_body_bytes} bytes"
    if max_body_bytes >= 1 << 20:
        limit += f" ({max_body_bytes / (1 << 20):g} MiB)"
    message = (
        f"request body too large: the body of {route} {what} this server's limit "
        f"of {limit}; send less, or raise the limit with {setting}"
    )
    logger.warning("%s", message)
    return error_response(message, 413)


class InternalErrorGuard:
    """Pure ASGI middleware: an exception no handler answered becomes a 500
    ``{"error": {"message": "internal error in <route>: <ExceptionType>; see the server
    log"}}``, and its traceback goes to the log, not to the client.

    Args:
        app: the ASGI app to guard.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; answer what escapes it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        began = time.perf_counter() if logger.isEnabledFor(logging.DEBUG) else None

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
            if began is not None:
                took = (time.perf_counter() - began) * 1e3
                logger.debug("%s answered in %.2f ms", scope_route(scope), took)
        except BodyTooLargeError:
            raise  # answered by BodySizeLimit, further out
        except Exception as exc:
            route = scope_route(scope)
            logger.exception("internal error in %s", route)
            if started:
                return  # the reply is under way; the server closes the connection
            await internal_error_response(route, exc)(scope, receive, send)


class BodyTooLargeError(WeightSyncError):
    """A request body passed the server's limit (raised into the app while it reads)."""


class BodySizeLimit:
    """Pure ASGI middleware: refuse request bodies larger than `max_body_bytes` with 413
    ``{"error": {"message": ...}}``, naming the limit and `setting`.

    A declared ``Content-Length`` over the limit is refused before the app runs; the bytes
    of a body without one (chunked) are counted as the app reads them, and the request is
    refused as soon as they pass the limit, so no route ever holds more than the limit.

    Args:
        app: the ASGI app to guard.
        max_body_bytes: the largest body accepted, in bytes.
        setting: how an operator raises the limit (named in the reply).
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, setting: str) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.setting = setting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app with the body's size bounded."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.declared_refusal(scope_route(scope), _content_length(scope))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        num_bytes = 0
        started = refused = False

        async def receive_counted() -> Message:
            nonlocal num_bytes, refused
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    if not started:
                        refused = True
                        await self._refuse(scope, receive, send, "passed")
                    raise BodyTooLargeError(
                        f"request body of {scope_route(scope)} passed {self.max_body_bytes} bytes"
                    )
            return message

        async def send_unless_refused(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out; what the app answers to the abort is dropped
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive_counted, send_unless_refused)
        except BodyTooLargeError:
            if not refused:
                raise
        except Exception:
            if not refused:
                raise
            logger.debug(
                "%s after its oversized body was refused", scope_route(scope), exc_info=True
            )

    def declared_refusal(self, route: str, content_length: int | None) -> JSONResponse | None:
        """The 413 for a request of `route` whose declared ``Content-Length`` is over the
        limit, or None."""
        return declared_body_refusal(
            route, content_length, max_body_bytes=self.max_body_bytes, setting=self.setting
        )

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        response = body_too_large_response(
            scope_route(scope), what, max_body_bytes=self.max_body_bytes, setting=self.setting
        )
        await response(scope, receive, send)


def declared_body_refusal(
    route: str, content_length: int | None, *, max_body_bytes: int, setting: str
) -> JSONResponse | None:
    """The 413 for a request of `route` whose declared ``Content-Length`` is over
    `max_body_bytes` (`setting` says how to raise it), or None."""
    if content_length is None or content_length <= max_body_bytes:
        return None
    return body_too_large_response(
        route,
        f"declares {content_length} bytes, over",
        max_body_bytes=max_body_bytes,
        setting=setting,
    )


def limit_body_size(app: FastAPI, max_body_bytes: int, *, setting: str) -> None:
    """Refuse request bodies over `max_body_bytes` on every route of `app` (`BodySizeLimit`);
    `setting` tells the operator how to raise the limit."""
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes, setting=setting)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server itself refuses a malformed length
    return None


class FiniteJsonRoute(APIRoute):
    """A route whose JSON body is refused (400, naming the field) when it holds a number
    that is not finite: ``NaN``, ``Infinity``, or a literal beyond the float range such as
    ``1e309``, which JSON parsers turn into infinity. The body is parsed once."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        """The route's handler, checking the body first."""
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            request = _FiniteJsonRequest(request.scope, request.receive)
            if is_json(request.headers.get("content-type")):
                # A body that is not JSON is left to the route's own parsing (400).
                with contextlib.suppress(ValueError, RecursionError):
                    await request.json()
            return await handler(request)

        return handle


class _FiniteJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_finite_json"):
            self._finite_json = await parse_json(await self.body())
        return self._finite_json


# A body up to this size parses in the event loop's thread within about 10 ms (JSON at
# ~25 MB/s); a larger one is parsed in a worker thread, interruptibly, so that the loop
# keeps answering. The fused lifecycle calls' bodies stay well under it.
PARSE_INLINE_BYTES = 1 << 18


async def parse_json(body: bytes) -> Any:
    """`loads_finite` of `body`; one over `PARSE_INLINE_BYTES` is parsed in a worker thread
    (`loads_finite(interruptible=True)`), so that the server's event loop (``/health``,
    every other connection) keeps answering while a large body parses.

    Raises:
        RequestValidationError: a number that is not finite (`loads_finite`).
        ValueError: the body is not JSON.
    """
    if len(body) <= PARSE_INLINE_BYTES:
        return loads_finite(body)
    return await asyncio.to_thread(loads_finite, body, interruptible=True)


def is_json(content_type: str | None) -> bool:
    """Whether `content_type` is JSON (``application/json`` or ``application/*+json``)."""
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def loads_finite(body: bytes | str, *, interruptible: bool = False) -> Any:
    """Parse a JSON body, refusing numbers that are not finite.

    With `interruptible`, every integer and object also goes through a Python function,
    where the interpreter may hand the GIL to another thread: a large body parsed in a
    worker thread then lets the event loop run meanwhile (the C parser holds the GIL from
    start to end otherwise), at about 2.5 times the parse time.

    Raises:
        RequestValidationError: a ``NaN``, ``Infinity`` or overflowing number; its location
            is the path to it (``body.sampling_params.temperature``).
        ValueError: the body is not JSON (`json.JSONDecodeError`).
    """
    seen = False

    def constant(name: str) -> float:
        nonlocal seen
        seen = True
        return float(name.replace("Infinity", "inf"))

    def number(text: str) -> float:
        nonlocal seen
        value = float(text)
        seen |= not math.isfinite(value)
        return value

    hooks: dict[str, Callable[..., Any]] = {}
    if interruptible:
        hooks = {"parse_int": _integer, "object_pairs_hook": _object}
    value = json.loads(body, parse_constant=constant, parse_float=number, **hooks)
    if seen:
        path, bad = _first_non_finite(value)
        raise RequestValidationError(
            [
                {
                    "type": "finite_number",
                    "loc": ("body", *path),
                    "msg": (
                        f"must be a finite number, got {bad} (NaN, Infinity and numbers "
                        "beyond the float range, such as 1e309, are refused)"
                    ),
                    "input": None,
                }
            ]
        )
    return value


# Python functions, not the builtins: a call into Python code is where the interpreter
# may switch threads; a builtin is C and runs through.
def _integer(text: str) -> int:
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def _first_non_finite(value: Any) -> tuple[tuple[Any, ...], float]:
    # Iterative: a deeply nested body must not exhaust the stack.
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path, item
        if isinstance(item, dict):
            stack.extend(((*path, key), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(
                ((*path, index), child) for index, child in reversed(list(enumerate(item)))
            )
    raise AssertionError("a non-finite number was parsed but not found")


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
}


def bearer_auth(api_key: str | None) -> Callable[..., Awaitable[None]]:
    """A dependency that requires ``Authorization: Bearer <api_key>`` (none when `api_key`
    is ``None``); put it on every route that changes state or reveals addresses.

    Raises (from the dependency):
        ControlError: 401 when the header is missing or holds another key.
    """
    scheme = HTTPBearer(
        auto_error=False,
        description="The server's API key (--api-key-file or $WEIGHTSYNC_API_KEY); required "
        "by every route but /health and /ready when set.",
    )

    async def require_api_key(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Security(scheme)],
    ) -> None:
        check_api_key(request.headers.get("authorization"), api_key)

    return require_api_key


def check_api_key(authorization: str | None, api_key: str | None) -> None:
    """Require the ``Authorization`` header `authorization` to be ``Bearer <api_key>`` (any
    header passes when `api_key` is None).

    Raises:
        ControlError: 401 when the header is missing, not a bearer token, or holds another
            key.
    """
    if api_key is None:
        return
    scheme, credentials = get_authorization_scheme_param(authorization)
    if not (authorization and credentials) or scheme.lower() != "bearer":
        raise ControlError(
            "this route needs 'Authorization: Bearer <api key>' (the server was started "
            "with an API key); send the header with the server's key",
            status_code=401,
        )
    if not secrets.compare_digest(credentials.encode(), api_key.encode()):
        raise ControlError(
            "wrong API key in the Authorization header; send the key the server was started with",
            status_code=401,
        )


def carries_api_key(authorization: str | None, api_key: str | None) -> bool:
    """Whether the ``Authorization`` header `authorization` passes `check_api_key` (always,
    when `api_key` is None)."""
    try:
        check_api_key(authorization, api_key)
    except ControlError:
        return False
    return True


def error_responses(*codes: int, auth: bool = True) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route: ``{"error": {"message"}}`` bodies for `codes`, and
    401 when the route needs the API key."""
    responses: dict[int | str, dict[str, Any]] = dict(ERROR_RESPONSES) if auth else {}
    for code in codes:
        responses[code] = {"model": ErrorResponse}
    return responses


SUCCESS_400: dict[int | str, dict[str, Any]] = {400: {"model": SuccessResponse}}
"""OpenAPI ``responses`` entry of the routes that answer 400 as ``{"success": false}``."""


def success_body(success: bool, message: str, **extra: Any) -> JSONResponse:
    """``{"success", "message", ...}`` with 200, or 400 when it did not succeed."""
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


async def success_reply(message: Awaitable[str], **extra: Any) -> JSONResponse:
    """Await a route's work and answer ``{"success": true, "message"}``; a refusal with HTTP
    400 is answered ``{"success": false, "message"}`` (SGLang's convention for these routes),
    other refusals propagate to the error handler.
    """
    try:
        return success_body(True, await message, **extra)
    except ControlError as exc:
        if exc.status_code != 400:
            raise
        return success_body(False, str(exc))


_INVALID_DESCRIPTION = "a body or query that does not parse (SGLang's error body)"


def describe_validation_as_400(app: FastAPI) -> None:
    """Make `app`'s OpenAPI document what `install_error_handler` answers: FastAPI lists a
    422 for every route with parameters; these servers answer 400 instead."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses.setdefault("400", {"description": _INVALID_DESCRIPTION})
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
