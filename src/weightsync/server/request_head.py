"""A request's head as `DirectHttpProtocol` reads it off a connection (`RequestHead`), and
whether a connection's client has gone (`client_left`)."""

from __future__ import annotations

import asyncio
import select
import socket
import urllib.parse

import httptools


class RequestHead:
    """A request's head, as far as judging it and answering a direct route need.

    Attributes:
        head_bytes: the head's length, its blank line included.
        method: the request's method.
        path: the path as uvicorn puts it in a request's scope (unescaped), which routes
            match.
        version: the HTTP version (``"1.1"``).
        authorization: the ``Authorization`` header, or None.
        content_type: the ``Content-Type`` header, or None.
        content_length: the declared body length, or None.
        keep_alive: whether the connection stays open after the reply, as the request
            asks (HTTP/1.0, ``Connection: close``).
        size: the whole request's length, head and declared body.
        chunked: the body is chunked (its end is not known from the head).
        expects_continue: the client waits for ``100 Continue`` before it sends the body.
        unusual: a body framed otherwise than by ``Content-Length`` (chunked), ``Expect``,
            or an upgrade.
        direct: answerable as a direct route: framed by ``Content-Length``, no query,
            nothing escaped in the path.
    """

    __slots__ = (
        "_parser",
        "_url",
        "authorization",
        "chunked",
        "content_length",
        "content_type",
        "direct",
        "expects_continue",
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
        self.chunked = False
        self.expects_continue = False
        self.unusual = False
        self.direct = False
        self._url = b""
        self._parser: httptools.HttpRequestParser | None = None

    @classmethod
    def parse(cls, data: bytes) -> RequestHead | None:
        """The head `data` (ending with its blank line), or None when it does not parse."""
        head = cls(len(data))
        head._parser = httptools.HttpRequestParser(head)
        try:
            head._parser.feed_data(data)
            url = httptools.parse_url(head._url)
            path = (url.path or b"").decode("ascii")
        except (httptools.HttpParserError, UnicodeDecodeError):
            return None
        head._parser = None
        if not head.method or not path:
            return None
        head.path = urllib.parse.unquote(path) if "%" in path else path
        head.direct = not (head.unusual or url.query or "%" in path)
        head.size = head.head_bytes + (head.content_length or 0)
        return head

    # httptools' callbacks

    def on_url(self, url: bytes) -> None:
        """A piece of the request target."""
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        """A header: the ones judging and answering a request need are kept."""
        match name.lower():
            case b"authorization":
                self.authorization = value.decode("latin-1")
            case b"content-type":
                self.content_type = value.decode("latin-1")
            case b"content-length":
                # llhttp has checked it: digits, and one value.
                self.content_length = int(value)
            case b"transfer-encoding":
                self.chunked = self.unusual = True
            case b"expect":
                self.expects_continue = value.strip().lower() == b"100-continue"
                self.unusual = True
            case b"upgrade":
                self.unusual = True

    def on_headers_complete(self) -> None:
        """The head is whole: read what the parser knows of it."""
        # Asked now: once a message without a body is complete, the parser has reset.
        parser = self._parser
        if parser is None:
            raise RuntimeError("RequestHead's parser callback ran outside RequestHead.parse")
        self.method = parser.get_method().decode("latin-1")
        self.version = parser.get_http_version()
        self.keep_alive = parser.should_keep_alive()
        self.unusual |= parser.should_upgrade()


def client_left(transport: asyncio.Transport) -> bool:
    """Whether the client closed the connection after its last request (or reset it): an
    end of stream is waiting to be read. A look at the socket, nothing read."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    fd = sock.fileno()
    if fd < 0:
        return False
    # poll, not select: a server holding hundreds of connections has descriptors past 1024.
    readable = select.poll()
    readable.register(fd, select.POLLIN)
    if not readable.poll(0):
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
