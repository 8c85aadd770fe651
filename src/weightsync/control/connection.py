"""`KeepAliveConnection`: the control client's fast path, one HTTP/1.1 connection for the
calls a sync makes while generation waits (why, measured: `weightsync.server.direct`)."""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools

from weightsync.control.replies import HttpReply


class ConnectionClosedError(ConnectionError):
    """The server closed the connection before its reply was complete."""


class KeepAliveConnection:
    """One keep-alive HTTP/1.1 connection to a plain-HTTP server, a request at a time.

    It writes the request itself and parses the reply with httptools (the parser uvicorn
    serves with) as its bytes arrive, with none of aiohttp's request machinery (sessions,
    connectors, payload objects, timers). The connection belongs to the event loop that
    opened it; it is opened again when that loop is gone, when the server closed it (an
    idle keep-alive timeout), and after any failure, which also closes it.

    A request may poll for its reply (`request`'s ``poll_s``): the loop turns without
    sleeping, looking at the socket each turn, instead of sleeping until the kernel wakes
    it. A thread woken from sleep starts its work tens to hundreds of microseconds late on
    an idle host; a lifecycle call that generation waits on is short, and the loop has
    nothing else to do meanwhile.

    Args:
        base_url: ``http://host:port`` of the server.
        headers: sent with every request (auth).

    Raises:
        ValueError: `base_url` is not a plain-HTTP URL with a host.
    """

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(
                f"a keep-alive connection needs an http://host[:port] URL, got {base_url!r}"
            )
        self._host = parts.hostname
        self._port = parts.port or 80
        fixed = {"Host": parts.netloc, **(headers or {})}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._protocol: _ReplyProtocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout_s: float,
        poll_s: float = 0.0,
        poll_after: asyncio.Future[Any] | None = None,
    ) -> HttpReply:
        """Send one request (`body` as JSON) and read its whole reply.

        Args:
            method: the HTTP method.
            path: the request's path.
            body: the JSON body, or None for none.
            timeout_s: the whole exchange's deadline.
            poll_s: poll for the reply for up to this long (see the class docstring),
                then sleep until it comes.
            poll_after: start polling only once this future is done (a reply known not
                to come before it): the loop sleeps until then, or until the reply.

        Raises:
            TimeoutError: no whole reply within `timeout_s` (the connection is closed).
            OSError: the connection failed or the server closed it before replying (a
                `ConnectionClosedError`), or the reply is not HTTP.
        """
        loop = asyncio.get_running_loop()
        lock = self._lock
        if self._loop is not loop or lock is None:
            # A connection of a loop that is gone cannot be used or closed from this one.
            lock = self._lock = asyncio.Lock()
            self._protocol, self._loop = None, loop
        async with lock:
            try:
                async with asyncio.timeout(timeout_s):
                    return await self._exchange(method, path, body, poll_s, poll_after)
            except BaseException:
                self._close()
                raise

    async def _exchange(
        self,
        method: str,
        path: str,
        body: bytes | None,
        poll_s: float,
        poll_after: asyncio.Future[Any] | None,
    ) -> HttpReply:
        protocol = await self._open()
        payload = body or b""
        head = f"{method} {path} HTTP/1.1\r\n".encode("latin-1") + self._head
        if body is not None:
            head += b"Content-Type: application/json\r\n"
        head += b"Content-Length: %d\r\n\r\n" % len(payload)
        reply = protocol.send(head + payload)
        try:
            if poll_s > 0:
                if poll_after is not None and not poll_after.done():
                    await _first_of(reply, poll_after)
                deadline = time.monotonic() + poll_s
                while not reply.done() and time.monotonic() < deadline:
                    await asyncio.sleep(0)
            return await reply
        finally:
            # Interrupted (a timeout, a cancel): the reply is of no one's interest now.
            reply.cancel()

    async def _open(self) -> _ReplyProtocol:
        protocol = self._protocol
        if protocol is not None and protocol.usable():
            return protocol
        self._close()
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(_ReplyProtocol, self._host, self._port)
        self._protocol = protocol
        return protocol

    def _close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol.close()

    async def aclose(self) -> None:
        """Close the connection (a later request opens a new one)."""
        if self._loop is asyncio.get_running_loop():
            self._close()
        else:  # a connection of another loop cannot be closed from this one
            self._protocol = None


class _ReplyProtocol(asyncio.Protocol):
    """The connection's bytes, parsed into the reply of the request in flight as they
    arrive."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._reply: asyncio.Future[HttpReply] | None = None
        self._reason = b""
        self._body: list[bytes] = []
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a TCP connection's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # A request is one write; without this a reply may wait on a delayed ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def usable(self) -> bool:
        """Whether a request may be written into this idle connection: open, and with
        nothing to read (a server that closed it, or sent what no request asked for,
        which the event loop may not have seen yet: its loop may not have run since)."""
        transport = self._transport
        if self._lost or transport is None or transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
        return not readable

    def send(self, data: bytes) -> asyncio.Future[HttpReply]:
        """Write a request; the future of its whole reply."""
        if self._transport is None or self._reply is not None:
            raise RuntimeError("a request written into a connection not open or not idle")
        self._reason, self._body = b"", []
        self._parser = httptools.HttpResponseParser(self)
        self._reply = asyncio.get_running_loop().create_future()
        self._transport.write(data)
        return self._reply

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self._reply is None:
            # Bytes no request asked for: the connection is of no further use.
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"the reply is not HTTP/1.1: {exc}"))

    def eof_received(self) -> bool | None:
        self._lost = True
        self._fail(ConnectionClosedError("the server closed the connection before replying"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._fail(
            ConnectionClosedError("the server closed the connection before replying")
            if exc is None
            else exc
        )

    def close(self) -> None:
        """Close the connection; a reply still awaited fails."""
        self._lost = True
        if self._transport is not None:
            self._transport.close()
        self._fail(ConnectionClosedError("the connection was closed before the reply came"))

    # httptools' callbacks
    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser, reply = self._parser, self._reply
        assert parser is not None and reply is not None  # fed only while a reply is due
        # Asked here: once the message is complete the parser no longer knows.
        keep_alive = parser.should_keep_alive()
        self._parser = self._reply = None
        if not reply.done():
            reply.set_result(
                HttpReply(
                    status_code=parser.get_status_code(),
                    reason_phrase=self._reason.decode("latin-1"),
                    content=b"".join(self._body),
                )
            )
        if not keep_alive:
            self.close()

    def _fail(self, exc: BaseException) -> None:
        reply, self._parser, self._reply = self._reply, None, None
        if reply is not None and not reply.done():
            reply.set_exception(exc)


async def _first_of(*futures: asyncio.Future[Any]) -> None:
    """Wait until one of `futures` is done (without a task per future)."""
    waiter = asyncio.get_running_loop().create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for future in futures:
        future.add_done_callback(wake)
    try:
        await waiter
    finally:
        for future in futures:
            future.remove_done_callback(wake)
