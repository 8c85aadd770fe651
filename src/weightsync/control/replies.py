"""Turning a rollout server's HTTP replies into values or `RemoteReplicaError`s."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from weightsync.errors import RemoteReplicaError

# A compare report names every differing parameter; keep all of it, within reason.
_MAX_MESSAGE_CHARS = 65536


class Reply(Protocol):
    """What the helpers read of an HTTP reply (an `HttpReply`, or any response object with
    the same attributes)."""

    @property
    def status_code(self) -> int:
        """The HTTP status."""
        ...

    @property
    def reason_phrase(self) -> str:
        """The status line's phrase."""
        ...

    @property
    def is_success(self) -> bool:
        """Whether the status is a 2xx."""
        ...

    @property
    def text(self) -> str:
        """The body as text."""
        ...

    def json(self) -> Any:
        """The body parsed as JSON."""
        ...


@dataclass(frozen=True, slots=True)
class HttpReply:
    """A reply read whole: status, phrase and body bytes.

    Attributes:
        status_code: the HTTP status.
        reason_phrase: the status line's phrase.
        content: the body.
    """

    status_code: int
    reason_phrase: str
    content: bytes

    @property
    def is_success(self) -> bool:
        """Whether the status is a 2xx."""
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON.

        Raises:
            json.JSONDecodeError / UnicodeDecodeError: it is not JSON.
        """
        return json.loads(self.content)


def reply_message(response: Reply) -> str:
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


def check_reply(response: Reply, *, replica: str, route: str) -> None:
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


def json_body(response: Reply, *, replica: str, route: str) -> Any:
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


def unreachable(exc: BaseException, *, replica: str, route: str) -> RemoteReplicaError:
    """The error for a call that got no reply (connection refused, timeout, protocol error)."""
    timed_out = isinstance(exc, TimeoutError)
    kind = "timed out" if timed_out else "got no reply"
    return RemoteReplicaError(
        f"replica {replica}: {route} {kind}: {type(exc).__name__}: {exc}",
        replica=replica,
        route=route,
        status_code=None,
    )
