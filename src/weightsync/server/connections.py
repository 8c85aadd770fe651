"""How many connections a reference server holds, and how long a connection that has not
sent an authenticated request may take: `ConnectionLimits` (the settings),
`ConnectionTable` (one server's open connections) and the replies that name the limits.

A connection that has not yet sent a request carrying the API key costs its client nothing
to open and hold, so it gets little: a few seconds to send each request whole, and the first
seat to lose when the server is full. A connection that has sent one is a peer the key
vouches for; it keeps the long keep-alive the fused lifecycle calls rely on.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

from fastapi.responses import JSONResponse

from weightsync.server.config import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_UNAUTHENTICATED_TIMEOUT_S,
    check_unauthenticated_timeout,
)
from weightsync.server.http import error_response

logger = logging.getLogger(__name__)

# How often the refusal of a connection over the limit is logged, at most.
_WARN_EVERY_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """The connection limits of one server.

    Attributes:
        max_connections: the most connections the server holds open at once. A connection
            past it makes room by closing the oldest one that has not sent an
            authenticated request and is not being answered; where there is none, it is
            answered 503 and closed.
        unauthenticated_timeout_s: how long a connection that has not yet sent an
            authenticated request may take to send a whole request head (from when it
            opened, or got its last reply), and then the request's body; past it the
            request is answered 408 and the connection closed (an idle one is closed).
        max_connections_setting: how an operator raises `max_connections` (named in the
            503).
        timeout_setting: how an operator raises `unauthenticated_timeout_s` (named in the
            408).

    Raises:
        ValueError: a limit that is not positive.
    """

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    unauthenticated_timeout_s: float = DEFAULT_UNAUTHENTICATED_TIMEOUT_S
    max_connections_setting: str = ""
    timeout_setting: str = ""

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_connections, bool)
            or not isinstance(self.max_connections, int)
            or self.max_connections < 1
        ):
            raise ValueError(
                f"max_connections must be a positive int, got {self.max_connections!r}"
            )
        check_unauthenticated_timeout(self.unauthenticated_timeout_s)

    def too_many_connections(self) -> JSONResponse:
        """The 503 for a connection past `max_connections`."""
        message = (
            f"too many connections: this server holds at most {self.max_connections} open "
            "connections, and every one has sent an authenticated request or is being "
            "answered; retry shortly, or reuse a keep-alive connection"
        )
        if self.max_connections_setting:
            message += f" (the limit is set with {self.max_connections_setting})"
        response = error_response(message, 503)
        response.headers["Retry-After"] = "1"
        return response

    def request_timeout(self, what: str) -> JSONResponse:
        """The 408 for a request whose `what` (``"head"``, ``"body of POST /path"``) did not
        arrive within `unauthenticated_timeout_s`."""
        message = (
            f"request timeout: the {what} did not arrive within "
            f"{self.unauthenticated_timeout_s:g} s, this server's limit for a connection "
            "that has not yet sent a request with the API key; send each request whole, "
            "without pauses"
        )
        if self.timeout_setting:
            message += f", or raise the limit with {self.timeout_setting}"
        return error_response(message, 408)


class Seat(Protocol):
    """A connection as `ConnectionTable` sees it."""

    @property
    def evictable(self) -> bool:
        """Whether the connection may be closed to make room (not authenticated, not being
        answered)."""
        ...

    def evict(self) -> None:
        """Close the connection to make room for another."""
        ...


class ConnectionTable:
    """One server's open connections, within `limits.max_connections`.

    A server's connections call `admit` when they open (and close at once when refused),
    `authenticated` once they sent a request with the key, and `release` when they close.
    Runs on the server's event loop only.

    Args:
        limits: the limits.
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._open: set[Seat] = set()
        # Not yet authenticated, oldest first: the first to lose their seat.
        self._unauthenticated: dict[Seat, None] = {}
        self._warned_at = -math.inf

    def admit(self, seat: Seat) -> bool:
        """Take `seat`; when the server is full, close the oldest evictable connection to
        make room. False: none could be closed, refuse `seat`
        (`ConnectionLimits.too_many_connections`)."""
        if len(self._open) >= self.limits.max_connections:
            victim = next((held for held in self._unauthenticated if held.evictable), None)
            if victim is None:
                now = time.monotonic()
                if now - self._warned_at > _WARN_EVERY_S:
                    self._warned_at = now
                    logger.warning(
                        "refusing connections: %d are open, every one authenticated or being "
                        "answered (the limit is %d)",
                        len(self._open),
                        self.limits.max_connections,
                    )
                return False
            self.release(victim)
            victim.evict()
        self._open.add(seat)
        self._unauthenticated[seat] = None
        return True

    def authenticated(self, seat: Seat) -> None:
        """`seat` sent a request with the key: it keeps its place from now on."""
        self._unauthenticated.pop(seat, None)

    def release(self, seat: Seat) -> None:
        """`seat` closed (again: no-op)."""
        self._open.discard(seat)
        self._unauthenticated.pop(seat, None)
