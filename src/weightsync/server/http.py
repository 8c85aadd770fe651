"""HTTP plumbing both reference servers share: refusals as errors, bearer-key auth."""

# No `from __future__ import annotations` here: FastAPI must see the dependency's real
# annotation, which refers to a local variable.
import secrets
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from weightsync.control.models import ErrorResponse, SuccessResponse
from weightsync.errors import WeightSyncError


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
    """Answer every `ControlError` a route raises with its status and message, and a body that
    does not parse as SGLang does: 400 ``{"object": "error", "message", "type": "Bad
    Request", "param": null, "code": 400}``."""

    async def handle(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ControlError)
        return error_response(str(exc), exc.status_code)

    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
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

    app.add_exception_handler(ControlError, handle)
    app.add_exception_handler(RequestValidationError, invalid)


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
}


def bearer_auth(api_key: str | None) -> Callable[..., Awaitable[None]]:
    """A dependency that requires ``Authorization: Bearer <api_key>`` (none when `api_key`
    is ``None``); put it on every state-changing route.

    Raises (from the dependency):
        ControlError: 401 when the header is missing or holds another key.
    """
    scheme = HTTPBearer(
        auto_error=False,
        description="The server's --api-key; required by every POST/PUT route when set.",
    )

    async def require_api_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(scheme)],
    ) -> None:
        if api_key is None:
            return
        if credentials is None:
            raise ControlError(
                "this route needs 'Authorization: Bearer <api key>' (the server was started "
                "with --api-key)",
                status_code=401,
            )
        if not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise ControlError("wrong API key in the Authorization header", status_code=401)

    return require_api_key


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
