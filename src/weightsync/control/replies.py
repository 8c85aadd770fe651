"""Turning a rollout server's HTTP replies into values or `RemoteReplicaError`s."""

from __future__ import annotations

import json
from typing import Any

import httpx

from weightsync.errors import RemoteReplicaError

# A compare report names every differing parameter; keep all of it, within reason.
_MAX_MESSAGE_CHARS = 65536


def reply_message(response: httpx.Response) -> str:
    """The server's own explanation in a reply, whichever convention it used.

    SGLang and the reference server explain a refusal as ``{"error": {"message": ...}}``,
    ``{"success": false, "message": ...}``, FastAPI's ``{"detail": ...}`` or plain text.
    """
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text.strip()[:_MAX_MESSAGE_CHARS]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:_MAX_MESSAGE_CHARS]
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])[:_MAX_MESSAGE_CHARS]
    return json.dumps(body)[:_MAX_MESSAGE_CHARS]


def check_reply(response: httpx.Response, *, replica: str, route: str) -> None:
    """Raise if the reply is not a 2xx.

    Raises:
        RemoteReplicaError: naming the replica, the route, the status and the server's message.
    """
    if response.is_success:
        return
    message = reply_message(response) or response.reason_phrase
    raise RemoteReplicaError(
        f"replica {replica}: {route} failed with HTTP {response.status_code}: {message}",
        replica=replica,
        route=route,
        status_code=response.status_code,
    )


def json_body(response: httpx.Response, *, replica: str, route: str) -> Any:
    """The JSON body of a successful reply.

    Raises:
        RemoteReplicaError: the reply is not a 2xx or not JSON.
    """
    check_reply(response, replica=replica, route=route)
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RemoteReplicaError(
            f"replica {replica}: {route} answered HTTP {response.status_code} with a body that "
            f"is not JSON: {response.text[:200]!r}",
            replica=replica,
            route=route,
            status_code=response.status_code,
        ) from exc


def unreachable(exc: httpx.HTTPError, *, replica: str, route: str) -> RemoteReplicaError:
    """The error for a call that got no reply (connection refused, timeout, protocol error)."""
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "got no reply"
    return RemoteReplicaError(
        f"replica {replica}: {route} {kind}: {type(exc).__name__}: {exc}",
        replica=replica,
        route=route,
        status_code=None,
    )
