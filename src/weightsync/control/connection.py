"""`KeepAliveConnection`: one HTTP/1.1 connection for the calls a sync makes while
generation waits."""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

from weightsync.control.replies import HttpReply


class ConnectionClosedError(ConnectionError):
    """The server closed the connection before its reply was complete."""


class KeepAliveConnection:
    """One keep-alive HTTP/1.1 connection to a plain-HTTP server, a request at a time.

    aiohttp's request machinery (sessions, connectors, payload objects, timers) costs
    about 0.2 ms a call on loopback, as much as the server takes to run a fused lifecycle
    call; this writes the request itself and parses the reply with httptools (the parser
    uvicorn serves with), a third of that. The connection belongs to the event loop that
    opened it; it is opened again when that loop is gone, when the server closed it (an
    idle keep-alive timeout), and after any failure, which also closes it.

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
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None

    async def request(
        self, method: str, path: str, body: bytes | None, *, timeout_s: float
    ) -> HttpReply:
        """Send one request (`body` as JSON) and read its whole reply.

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
            self._streams, self._loop = None, loop
        async with lock:
            try:
                async with asyncio.timeout(timeout_s):
                    return await self._exchange(method, path, body)
            except BaseException:
                self._close()
                raise

    async def _exchange(self, method: str, path: str, body: bytes | None) -> HttpReply:
        reader, writer = await self._open()
        payload = body or b""
        head = f"{method} {path} HTTP/1.1\r\n".encode("latin-1") + self._head
        if body is not None:
            head += b"Content-Type: application/json\r\n"
        head += b"Content-Length: %d\r\n\r\n" % len(payload)
        writer.write(head + payload)
        reply = _Reply()
        parser = reply.parser = httptools.HttpResponseParser(reply)
        while not reply.complete:
            data = await reader.read(1 << 16)
            if not data:
                raise ConnectionClosedError("the server closed the connection before replying")
            try:
                parser.feed_data(data)
            except httptools.HttpParserError as exc:
                raise ConnectionError(f"the reply is not HTTP/1.1: {exc}") from exc
        if not reply.keep_alive:
            self._close()
        return HttpReply(
            status_code=parser.get_status_code(),
            reason_phrase=reply.reason.decode("latin-1"),
            content=b"".join(reply.body),
        )

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        streams = self._streams
        if (
            streams is not None
            and not streams[0].at_eof()
            and not streams[1].is_closing()
            and not _readable(streams[1])
        ):
            return streams
        self._close()
        reader, writer = await asyncio.open_connection(self._host, self._port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # A request is one write; without this a reply may wait on a delayed ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._streams = (reader, writer)
        return reader, writer

    def _close(self) -> None:
        streams, self._streams = self._streams, None
        if streams is not None:
            streams[1].close()

    async def aclose(self) -> None:
        """Close the connection (a later request opens a new one)."""
        if self._loop is asyncio.get_running_loop():
            self._close()
        else:  # a connection of another loop cannot be closed from this one
            self._streams = None


class _Reply:
    """httptools' callbacks: the status phrase and body of one reply."""

    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.reason = b""
        self.body: list[bytes] = []
        self.complete = False
        self.keep_alive = False

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        # Asked here: once the message is complete the parser no longer knows.
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()
        self.complete = True


def _readable(writer: asyncio.StreamWriter) -> bool:
    """Whether an idle connection has something to read: the server closed it (or sent what
    no request asked for), which the event loop may not have seen yet (its loop may not
    have run since); a request written into it would get no reply."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    readable, _, _ = select.select([sock.fileno()], [], [], 0)
    return bool(readable)
