"""The framework path of a connection: `FrameworkProtocol`, uvicorn's own protocol serving
the requests a `DirectHttpProtocol` hands it (every request but a direct route's), exactly
their bytes, through the app's whole ASGI stack.

A request is handed over one at a time (`forward`): once uvicorn has replied and has every
byte of it, the connection is the front's again. An authenticated request whose body only
uvicorn frames (chunked, ``Expect``, an upgrade) hands the connection over for good
(`take_for_good`); uvicorn then serves every later request on it, direct routes included,
through the app's framework routes.
"""

from __future__ import annotations

from typing import Any, Protocol

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from weightsync.server.request_head import RequestHead


class Front(Protocol):
    """The protocol that owns the connection and hands requests over."""

    def framework_replied(self) -> None:
        """uvicorn's reply to the request handed over went out."""
        ...


class FrameworkProtocol(HttpToolsProtocol):
    """uvicorn's protocol on one connection of a `DirectHttpProtocol` (its `front`), which
    keeps the connection and times it between handed requests, unless it handed the
    connection over for good.

    Takes uvicorn's protocol arguments, and:

    Args:
        front: told when each handed request's reply went out.

    Attributes:
        request: the request handed over and not yet done (replied, and every byte of it
            handed), or None.
        remaining: bytes of `request` still to hand over as they arrive.
        replied: uvicorn's reply to `request` went out.
        for_good: uvicorn serves the connection from now on.
    """

    def __init__(self, *args: Any, front: Front, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._front = front
        self.request: RequestHead | None = None
        self.remaining = 0
        self.replied = False
        self.for_good = False

    def forward(self, head: RequestHead, data: bytes) -> None:
        """Serve `head`'s request, whose first bytes (the head and what is buffered of its
        body, `head.size` at most) are `data`; the rest follows through `feed`."""
        self.request, self.replied = head, False
        self.remaining = head.size - len(data)
        self.data_received(data)

    def feed(self, data: bytes) -> bytes:
        """Hand over the bytes of the current request still due out of `data`; returns the
        bytes that follow them (the next requests')."""
        chunk, rest = data[: self.remaining], data[self.remaining :]
        self.remaining -= len(chunk)
        self.data_received(chunk)
        return rest

    def done(self) -> None:
        """The current request is over: replied, and every byte handed."""
        self.request, self.replied = None, False

    def take_for_good(self, data: bytes) -> None:
        """Serve the connection from now on, starting with `data` (every byte the front has
        not answered)."""
        self.for_good = True
        if data:
            self.data_received(data)

    @property
    def response_started(self) -> bool:
        """Whether uvicorn began its reply to the request it serves."""
        cycle = self.cycle
        return cycle is not None and cycle.response_started

    def on_response_complete(self) -> None:
        """The reply went out: the connection is the front's again."""
        super().on_response_complete()
        if not (self.for_good or self.transport.is_closing()):
            self.replied = True
            self._front.framework_replied()

    def timeout_keep_alive_handler(self) -> None:
        """Close an idle connection, only where it is uvicorn's for good (the front times
        the connection otherwise)."""
        if self.for_good:
            super().timeout_keep_alive_handler()
