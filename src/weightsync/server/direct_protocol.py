"""`DirectHttpProtocol`: a server's HTTP/1.1 connections, answering the direct routes of a
`DirectApp` straight from their bytes.

A fused lifecycle call's own work takes a tenth of a millisecond; through uvicorn it also
pays for an ASGI task, its scope and message dicts, a reply object sent in two messages
through every layer, and a turn of the event loop between them (about 0.2 ms on loopback,
twice that on a host that was idle). This protocol parses a request's head itself, answers a
direct route's request with `DirectRoutes` and writes the reply in one write; the first
request that is anything else (another route, a chunked or ``Expect`` body, a head it does
not take) hands the connection, with every byte it has not answered, to uvicorn's own
protocol, which serves it from then on exactly as it serves any connection.

A trainer keeps one connection for the fused calls and is idle between syncs for as long as
a training step takes, so these connections stay open `keep_alive_s` (ten minutes) instead
of uvicorn's five seconds. That is safe because a request whose client has already closed
the connection is dropped, not run: a replica that was frozen (stopped, swapped out) and
wakes up finds the calls its clients gave up on with their connections closed behind them,
and must not pause itself or open a session for a client that left.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
import select
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any, cast

import httptools
from fastapi import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from weightsync.server.direct import DirectApp, DirectRoutes

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("uvicorn.access")

KEEP_ALIVE_S = 600.0
# The longest request head taken here; a longer one goes to uvicorn, which refuses it.
_MAX_HEAD_BYTES = 1 << 16
# The most of a refused request's body read and dropped; past it the connection closes.
_MAX_DISCARD_BYTES = 1 << 20
_HEAD_END = b"\r\n\r\n"


def direct_protocol(app: DirectApp, *, keep_alive_s: float = KEEP_ALIVE_S) -> Callable[..., Any]:
    """The ``http`` protocol factory for ``uvicorn.Config`` that serves `app`'s connections
    with `DirectHttpProtocol`."""
    return functools.partial(DirectHttpProtocol, app=app, keep_alive_s=keep_alive_s)


class DirectHttpProtocol(asyncio.Protocol):
    """One connection of a uvicorn server whose app is a `DirectApp` (see the module).

    Requests are answered one at a time, in order; a reply is one write. A connection stays
    open `keep_alive_s` after its last reply, and closes after a reply when the request
    asked (``Connection: close``, HTTP/1.0), when the server shuts down, and after a refusal
    read from the head (401, 413) whose body is longer than a mebibyte: a refused body is
    read and dropped, not handled (a client still writing it would otherwise see its
    connection reset before it read the reply), up to that much.

    Args:
        config: uvicorn's config (given by uvicorn, as to any protocol).
        server_state: uvicorn's server state (its connections and tasks: shutdown waits for
            them).
        app_state: the lifespan state uvicorn gives its own protocol.
        app: the app whose direct routes are answered here.
        keep_alive_s: how long an idle connection stays open.
    """

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        app: DirectApp,
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        self._config = config
        self._server_state = server_state
        self._app_state = app_state
        self._loop = _loop or asyncio.get_event_loop()
        routes = app.direct_routes
        if routes is None:
            raise ValueError("DirectHttpProtocol serves a DirectApp with direct routes")
        self._routes: DirectRoutes = routes
        self._keep_alive_s = keep_alive_s
        self._transport: asyncio.Transport | None = None
        self._client = ""
        self._buffer = bytearray()
        self._head: _Head | None = None  # the head of the request whose body is awaited
        self._discard = 0  # bytes of a refused request's body still to drop
        self._close_after_discard = False
        self._busy = False  # a request is being answered
        self._closing = False  # close once the request being answered is
        self._idle: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the connection (uvicorn shuts it down with the server)."""
        # uvloop's transports are not asyncio.Transport subclasses, but serve its interface.
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self._client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        self._server_state.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection; a request being answered finishes, its reply unsent."""
        self._server_state.connections.discard(self)
        self._disarm_idle()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        """Take bytes of the next requests; answer each once it is whole."""
        self._disarm_idle()
        self._buffer += data
        if self._busy:
            if len(self._buffer) > _MAX_HEAD_BYTES + (self._routes.max_body_bytes or 0):
                # A client writing ahead of its replies waits until they catch up.
                assert self._transport is not None
                self._transport.pause_reading()
            return
        self._next()

    def eof_received(self) -> bool | None:
        """The client closed its side: close the connection (a request being answered
        finishes, its reply unsent)."""
        return None

    def shutdown(self) -> None:
        """Close the connection for a server shutdown: now when idle, else after the reply
        being written."""
        if self._busy:
            self._closing = True
        elif self._transport is not None:
            self._transport.close()

    # The requests

    def _next(self) -> None:
        """Answer the buffered request if it is whole, or hand the connection over."""
        transport = self._transport
        if transport is None or transport.is_closing() or not self._buffer:
            return
        if self._discard:
            dropped = min(self._discard, len(self._buffer))
            del self._buffer[:dropped]
            self._discard -= dropped
            if self._discard:
                return
            if self._close_after_discard:
                transport.close()
                return
            if not self._buffer:
                return
        head = self._head
        if head is None:
            end = self._buffer.find(_HEAD_END, 0, _MAX_HEAD_BYTES + len(_HEAD_END))
            if end < 0:
                if len(self._buffer) > _MAX_HEAD_BYTES or not _may_be_direct(self._buffer):
                    self._hand_over()
                return
            head = _Head.parse(bytes(self._buffer[: end + len(_HEAD_END)]))
            if head is None or not self._routes.serves(head.method, head.path):
                self._hand_over()
                return
            refusal = self._routes.refusal(
                head.path, authorization=head.authorization, content_length=head.content_length
            )
            if refusal is not None:
                size = head.content_length or 0
                del self._buffer[: head.head_bytes]
                self._discard = min(size, _MAX_DISCARD_BYTES)
                self._close_after_discard = size > _MAX_DISCARD_BYTES or not head.keep_alive
                # Kept open while its body is dropped; closed after it when asked to.
                self._reply(head, refusal, keep_alive=True)
                self._next()
                return
            self._head = head
        if len(self._buffer) < head.size:
            return  # the rest of the body is on its way
        body = bytes(self._buffer[head.head_bytes : head.size])
        del self._buffer[: head.size]
        self._head = None
        if _client_left(transport):
            # The client gave up on it (its timeout passed while this replica could not
            # read) and closed the connection: running it now would act for nobody.
            logger.warning(
                "dropped %s %s from %s: its client closed the connection before it ran",
                head.method,
                head.path,
                self._client,
            )
            transport.close()
            return
        self._busy = True
        task = _start(self._loop, self._answer(head, body))
        if not task.done():
            self._server_state.tasks.add(task)
            task.add_done_callback(self._server_state.tasks.discard)

    async def _answer(self, head: _Head, body: bytes) -> None:
        try:
            response = await self._routes.answer(head.path, body, head.content_type)
        except BaseException:
            # Only cancellation (server shutdown) gets here: `answer` answers the rest.
            self._busy = False
            if self._transport is not None:
                self._transport.close()
            raise
        self._busy = False
        self._server_state.total_requests += 1
        self._reply(head, response, keep_alive=head.keep_alive and not self._closing)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
            self._next()

    def _reply(self, head: _Head, response: Response, *, keep_alive: bool) -> None:
        """Write `response` in one write; close after it unless `keep_alive`."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        status = response.status_code
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))]
        lines += [b"%s: %s\r\n" % pair for pair in self._server_state.default_headers]
        lines += [b"%s: %s\r\n" % pair for pair in response.raw_headers]
        if not keep_alive:
            lines.append(b"connection: close\r\n")
        lines += [b"\r\n", response.body]
        transport.write(b"".join(lines))
        if self._config.access_log:
            access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                self._client,
                head.method,
                head.path,
                head.version,
                status,
            )
        if keep_alive:
            self._arm_idle()
        else:
            transport.close()

    def _hand_over(self) -> None:
        """Give the connection, with every byte not answered here, to uvicorn's protocol."""
        transport = self._transport
        assert transport is not None
        self._server_state.connections.discard(self)
        self._disarm_idle()
        self._transport = None
        protocol = HttpToolsProtocol(
            config=self._config,
            server_state=self._server_state,
            app_state=self._app_state,
            _loop=self._loop,
        )
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        data, self._buffer = bytes(self._buffer), bytearray()
        transport.resume_reading()
        if data:
            protocol.data_received(data)

    def _arm_idle(self) -> None:
        self._disarm_idle()
        self._idle = self._loop.call_later(self._keep_alive_s, self._close_idle)

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _close_idle(self) -> None:
        self._idle = None
        if not self._busy and self._transport is not None:
            self._transport.close()


class _Head:
    """A request's head, as far as a direct route needs it."""

    __slots__ = (
        "_parser",
        "_url",
        "authorization",
        "content_length",
        "content_type",
        "head_bytes",
        "keep_alive",
        "method",
        "path",
        "size",
        "unusual",
        "version",
    )

    def __init__(self, head_bytes: int) -> None:
        self.head_bytes = head_bytes
        self.method = ""
        self.path = ""
        self.version = ""
        self.authorization: str | None = None
        self.content_type: str | None = None
        self.content_length: int | None = None
        self.keep_alive = False
        self.size = head_bytes
        # A header this protocol leaves to uvicorn (a chunked body, Expect, an upgrade).
        self.unusual = False
        self._url = b""
        self._parser: httptools.HttpRequestParser | None = None

    @classmethod
    def parse(cls, data: bytes) -> _Head | None:
        """The head `data` (ending with its blank line), or None when it is not one this
        protocol answers: it does not parse, has a query or a body it does not take."""
        head = cls(len(data))
        head._parser = httptools.HttpRequestParser(head)
        try:
            head._parser.feed_data(data)
        except httptools.HttpParserError:
            return None
        head._parser = None
        if head.unusual or not head.method or b"?" in head._url or b"%" in head._url:
            return None
        head.path = head._url.decode("latin-1")
        head.size = head.head_bytes + (head.content_length or 0)
        return head

    # httptools' callbacks

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        match name.lower():
            case b"authorization":
                self.authorization = value.decode("latin-1")
            case b"content-type":
                self.content_type = value.decode("latin-1")
            case b"content-length":
                # llhttp has checked it: digits, and one value.
                self.content_length = int(value)
            case b"transfer-encoding" | b"expect" | b"upgrade":
                self.unusual = True

    def on_headers_complete(self) -> None:
        # Asked now: once a message without a body is complete, the parser has reset.
        parser = self._parser
        assert parser is not None
        self.method = parser.get_method().decode("latin-1")
        self.version = parser.get_http_version()
        self.keep_alive = parser.should_keep_alive()
        self.unusual |= parser.should_upgrade()


def _may_be_direct(buffer: bytearray) -> bool:
    """Whether a request that starts with `buffer` (its head incomplete) may be a direct
    route's: only those are worth waiting for here."""
    start = bytes(buffer[:5])
    return b"POST "[: len(start)] == start


def _client_left(transport: asyncio.Transport) -> bool:
    """Whether the client closed the connection after its last request (or reset it): an
    end of stream is waiting to be read. A look at the socket, nothing read."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    fd = sock.fileno()
    if fd < 0 or not select.select([fd], [], [], 0)[0]:
        return False
    # Readable: more bytes (a request written ahead) or the end of the stream. A duplicate of
    # the descriptor peeks without touching the event loop's own socket object.
    with socket.socket(fileno=socket.dup(fd)) as peek:
        try:
            return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


@functools.cache
def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode("latin-1")
    except ValueError:
        return b""


if sys.version_info >= (3, 12):

    def _start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run `coro` as a task, in this turn of the loop until it first waits: a fused
        call whose steps do not wait is answered without waiting for the loop's next turn."""
        return asyncio.Task(coro, loop=loop, eager_start=True)

else:

    def _start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run `coro` as a task (from the loop's next turn)."""
        return loop.create_task(coro)
