"""`DirectHttpProtocol`: every HTTP/1.1 connection of a reference server. It reads each
request's head itself and judges the request before a byte of its body is read; it answers
a `DirectApp`'s direct routes straight from the connection's bytes, and hands every other
request to uvicorn's own protocol, one request at a time.

Judged from the head (`HeadGate`; `DirectRoutes.refusal` for a direct route): a declared
body over the limit (413), then a request without the API key to a path that needs it (401).
A refused request's body is read and dropped, never parsed: up to a mebibyte (a client still
writing it would otherwise see its connection reset before it read the reply), past that
the connection closes.

The server holds at most `ConnectionLimits.max_connections` connections. A connection that
has not yet sent a request with the key (`ConnectionLimits.unauthenticated_timeout_s`) has a
few seconds to send each request head, then as long for its body: 408 and closed otherwise,
and closed when idle that long; it is also the first to lose its seat to a new connection
when the server is full. A connection that has sent one keeps `keep_alive_s` (ten minutes)
between requests: a trainer keeps one connection for the fused calls and is idle between
syncs for as long as a training step takes. That is safe because a request whose client has
already closed the connection is dropped, not run: a replica that was frozen (stopped,
swapped out) and wakes up finds the calls its clients gave up on with their connections
closed behind them, and must not pause itself or open a session for a client that left.

Every other request is fed, exactly its bytes, to uvicorn's protocol
(`weightsync.server.framework_handoff`), which serves it through FastAPI as it serves any;
once it replied, the connection is this protocol's again. An authenticated request whose
body this protocol does not frame (chunked, ``Expect``, an upgrade) hands the connection to
uvicorn for good. Why the direct routes skip the framework, with the measured costs of both
paths: `weightsync.server.direct`.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any, cast

from fastapi import FastAPI, Response

from weightsync.server.connections import ConnectionLimits, ConnectionTable
from weightsync.server.direct import DirectApp, DirectRoutes
from weightsync.server.framework_handoff import FrameworkProtocol
from weightsync.server.gate import HeadGate
from weightsync.server.http import carries_api_key, error_response
from weightsync.server.request_head import RequestHead, client_left

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("uvicorn.access")

KEEP_ALIVE_S = 600.0
# The longest request head taken; a longer one is answered 431.
_MAX_HEAD_BYTES = 1 << 16
# The most of a refused request's body read and dropped; past it the connection closes.
_MAX_DISCARD_BYTES = 1 << 20
_HEAD_END = b"\r\n\r\n"


def direct_protocol(
    app: FastAPI, *, keep_alive_s: float = KEEP_ALIVE_S, limits: ConnectionLimits | None = None
) -> Callable[..., Any]:
    """The ``http`` protocol factory for ``uvicorn.Config`` that serves `app`'s connections
    with `DirectHttpProtocol`, within `limits` (default `ConnectionLimits()`).

    Make it once `app`'s key and body limit are set (`require_key_before_body`,
    `limit_body_size`): it reads them here. `keep_alive_s`: how long a connection that has
    sent an authenticated request stays open idle.
    """
    routes = app.direct_routes if isinstance(app, DirectApp) else None
    gate = HeadGate.of_app(app)
    return functools.partial(
        DirectHttpProtocol,
        routes=routes,
        gate=gate,
        # The key that authenticates a connection: the app's, else its direct routes'.
        api_key=gate.api_key if gate.api_key is not None or routes is None else routes.api_key,
        connections=ConnectionTable(limits or ConnectionLimits()),
        keep_alive_s=keep_alive_s,
    )


class DirectHttpProtocol(asyncio.Protocol):
    """One connection of a uvicorn server (see the module).

    Requests are answered one at a time, in order; a direct route's reply is one write. A
    connection closes after a reply when the request asked (``Connection: close``,
    HTTP/1.0), when the server shuts down, and after a refusal read from the head whose body
    is longer than a mebibyte.

    Args:
        config: uvicorn's config (given by uvicorn, as to any protocol).
        server_state: uvicorn's server state (its connections and tasks: shutdown waits for
            them).
        app_state: the lifespan state uvicorn gives its own protocol.
        routes: the direct routes answered here (None: every request goes to uvicorn).
        gate: what every other request is refused for from its head.
        api_key: the key whose presence in a request authenticates its connection (None:
            every request does).
        connections: the server's connections, within its limits (one table per server).
        keep_alive_s: how long an idle authenticated connection stays open.
    """

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        routes: DirectRoutes | None,
        gate: HeadGate,
        api_key: str | None,
        connections: ConnectionTable,
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        self._config = config
        self._server_state = server_state
        self._app_state = app_state
        self._loop = _loop or asyncio.get_event_loop()
        self._routes = routes
        self._gate = gate
        self._api_key = api_key
        self._connections = connections
        self._limits = connections.limits
        self._keep_alive_s = keep_alive_s
        # A client writing ahead of its replies is paused past this much.
        direct_max_body_bytes = routes.max_body_bytes if routes is not None else None
        self._max_buffer = _MAX_HEAD_BYTES + max(
            gate.max_body_bytes or 0, direct_max_body_bytes or 0
        )
        self._transport: asyncio.Transport | None = None
        self._client = ""
        self._buffer = bytearray()
        self._authenticated = False  # a request with the key came on this connection
        self._head: RequestHead | None = None  # the head of a direct request whose body is awaited
        self._discard = 0  # bytes of a refused request's body still to drop
        self._close_after_discard = False
        self._busy = False  # a direct request is being answered
        self._closing = False  # close once the direct request being answered is
        self._framework: FrameworkProtocol | None = None  # made on the first request it serves
        self._timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the connection, or refuse it (503) when the server is full."""
        # uvloop's transports are not asyncio.Transport subclasses, but serve its interface.
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self._client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        if not self._connections.admit(self):
            self._reply(None, self._limits.too_many_connections(), keep_alive=False)
            return
        self._server_state.connections.add(self)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection; a request being answered finishes, its reply unsent."""
        self._connections.release(self)
        self._server_state.connections.discard(self)
        self._disarm()
        if self._framework is not None:
            self._framework.connection_lost(exc)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        """Take bytes of the next requests; answer each once it is whole."""
        framework = self._framework
        if framework is not None and framework.for_good:
            framework.data_received(data)
            return
        if self._authenticated:
            self._disarm()
        if framework is not None and framework.remaining:
            data = framework.feed(data)
            if not framework.remaining:
                self._forwarded_all()
        self._buffer += data
        if self._busy or self._forwarded is not None:
            if len(self._buffer) > self._max_buffer:
                # A client writing ahead of its replies waits until they catch up.
                assert self._transport is not None
                self._transport.pause_reading()
            return
        self._next()

    def eof_received(self) -> bool | None:
        """The client closed its side: close the connection (a request being answered
        finishes, its reply unsent)."""
        return None

    def pause_writing(self) -> None:
        """The client reads slower than uvicorn writes: uvicorn waits."""
        if self._framework is not None:
            self._framework.pause_writing()

    def resume_writing(self) -> None:
        """The client caught up."""
        if self._framework is not None:
            self._framework.resume_writing()

    def shutdown(self) -> None:
        """Close the connection for a server shutdown: now when idle, else after the reply
        being written."""
        if self._busy:
            self._closing = True
        elif self._framework is not None and (
            self._framework.for_good or self._framework.request is not None
        ):
            self._framework.shutdown()
        elif self._transport is not None:
            self._transport.close()

    # ConnectionTable's seat

    @property
    def evictable(self) -> bool:
        """Whether the connection may be closed to make room: it has sent no request with
        the key and none of its requests is being answered."""
        return not (self._authenticated or self._busy or self._forwarded is not None)

    def evict(self) -> None:
        """Close the connection to make room for another."""
        logger.debug("closed the connection of %s to make room for another", self._client)
        if self._transport is not None:
            self._transport.close()

    # The requests

    def _next(self) -> None:
        """Judge the buffered request once its head is whole, and answer it once whole."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._busy:
            return
        if self._forwarded is not None:
            return
        if self._discard and not self._drop():
            return
        if not self._buffer:
            return
        head = self._head
        if head is None:
            end = self._buffer.find(_HEAD_END, 0, _MAX_HEAD_BYTES + len(_HEAD_END))
            if end < 0:
                if len(self._buffer) > _MAX_HEAD_BYTES:
                    message = (
                        f"request head too large: over {_MAX_HEAD_BYTES} bytes before its "
                        "blank line; send shorter headers"
                    )
                    self._reply(None, error_response(message, 431), keep_alive=False)
                return
            head = RequestHead.parse(bytes(self._buffer[: end + len(_HEAD_END)]))
            if head is None:
                message = "the request head does not parse as HTTP/1.1"
                self._reply(None, error_response(message, 400), keep_alive=False)
                return
            if not self._take(head):
                return
        if len(self._buffer) < head.size:
            return  # the rest of the body is on its way
        body = bytes(self._buffer[head.head_bytes : head.size])
        del self._buffer[: head.size]
        self._head = None
        if client_left(transport):
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

    def _take(self, head: RequestHead) -> bool:
        """Judge a request from its whole head: refuse it, hand it to uvicorn, or await its
        body here. True: it is a direct route's, and its body is awaited."""
        routes = self._routes
        direct = routes is not None and head.direct and routes.serves(head.method, head.path)
        if direct:
            assert routes is not None
            refusal = routes.refusal(
                head.path, authorization=head.authorization, content_length=head.content_length
            )
        else:
            refusal = self._gate.refusal(
                head.method,
                head.path,
                authorization=head.authorization,
                content_length=head.content_length,
            )
        if refusal is not None:
            self._refuse(head, refusal)
            return False
        if not self._authenticated and carries_api_key(head.authorization, self._api_key):
            self._authenticated = True
            self._connections.authenticated(self)
            self._disarm()
        if direct:
            self._head = head
            if not self._authenticated:
                self._arm()  # the body's time
            return True
        if not head.unusual:
            self._forward_request(head)
        elif self._authenticated:
            self._hand_over()
        else:
            message = (
                f"{head.method} {head.path}: a request with a chunked body, Expect or Upgrade "
                "is served only with the API key; send the body with a Content-Length"
            )
            self._reply(head, error_response(message, 400), keep_alive=False)
        return False

    def _refuse(self, head: RequestHead, refusal: Response) -> None:
        """Answer `refusal` from the head; drop the request's body as it comes, up to a
        mebibyte, then close when it was longer (or unknown, or the client asked)."""
        del self._buffer[: head.head_bytes]
        if head.expects_continue:
            size, close = 0, True  # its client sends no body after a refusal
        elif head.chunked:
            size, close = _MAX_DISCARD_BYTES, True  # its end is not known here
        else:
            size = head.content_length or 0
            close = size > _MAX_DISCARD_BYTES or not head.keep_alive
        self._discard = min(size, _MAX_DISCARD_BYTES)
        self._close_after_discard = close
        # Kept open while its body is dropped; closed after it when asked to.
        self._reply(head, refusal, keep_alive=not close, close=close and not self._discard)
        self._next()

    def _drop(self) -> bool:
        """Drop buffered bytes of a refused body; True once it is all dropped and the
        connection stays open."""
        dropped = min(self._discard, len(self._buffer))
        del self._buffer[:dropped]
        self._discard -= dropped
        if self._discard:
            return False
        if self._close_after_discard:
            assert self._transport is not None
            self._transport.close()
            return False
        self._arm()
        return True

    async def _answer(self, head: RequestHead, body: bytes) -> None:
        assert self._routes is not None
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

    def _reply(
        self,
        head: RequestHead | None,
        response: Response,
        *,
        keep_alive: bool,
        close: bool | None = None,
    ) -> None:
        """Write `response` in one write, saying ``connection: close`` unless `keep_alive`;
        close after it when `close` (by default: unless `keep_alive`)."""
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
        if head is not None and self._config.access_log:
            access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                self._client,
                head.method,
                head.path,
                head.version,
                status,
            )
        if keep_alive if close is None else not close:
            self._arm()
        else:
            transport.close()

    # Requests uvicorn serves

    @property
    def _forwarded(self) -> RequestHead | None:
        """The request uvicorn serves now, or None."""
        return self._framework.request if self._framework is not None else None

    def _framework_protocol(self) -> FrameworkProtocol:
        """uvicorn's protocol on this connection (made on first use)."""
        if self._framework is None:
            assert self._transport is not None
            self._framework = FrameworkProtocol(
                config=self._config,
                server_state=self._server_state,
                app_state=self._app_state,
                _loop=self._loop,
                front=self,
            )
            self._framework.connection_made(self._transport)
            # This protocol stands for the connection in the server's state.
            self._server_state.connections.discard(self._framework)
        return self._framework

    def _forward_request(self, head: RequestHead) -> None:
        """Hand `head`'s request to uvicorn: the bytes buffered now, the rest as they come."""
        framework = self._framework_protocol()
        data = bytes(self._buffer[: head.size])
        del self._buffer[: head.size]
        if head.size > len(data) and not self._authenticated:
            self._arm()  # the body's time
        else:
            self._disarm()
        framework.forward(head, data)
        if not framework.remaining:
            self._forwarded_all()

    def _forwarded_all(self) -> None:
        """uvicorn has every byte of its request."""
        framework = self._framework
        if framework is not None and framework.replied:
            self._forwarded_done()
        else:
            self._disarm()

    def framework_replied(self) -> None:
        """uvicorn answered the request it was handed (called by `FrameworkProtocol`)."""
        framework = self._framework
        if framework is not None and framework.remaining:
            return  # uvicorn drops the rest of its body as it comes
        self._forwarded_done()
        self._next()

    def _forwarded_done(self) -> None:
        if self._framework is not None:
            self._framework.done()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
            self._arm()

    def _hand_over(self) -> None:
        """Give the connection, with every byte not answered here, to uvicorn's protocol for
        good (an authenticated request whose body it frames itself)."""
        framework = self._framework_protocol()
        self._disarm()
        data, self._buffer = bytes(self._buffer), bytearray()
        assert self._transport is not None
        self._transport.resume_reading()
        framework.take_for_good(data)

    # Timers

    def _arm(self) -> None:
        """Start the wait for the next request (or, unauthenticated, the current one's
        body): `keep_alive_s` once authenticated, else the unauthenticated timeout."""
        self._disarm()
        if self._authenticated:
            self._timer = self._loop.call_later(self._keep_alive_s, self._close_idle)
        else:
            timeout_s = self._limits.unauthenticated_timeout_s
            self._timer = self._loop.call_later(timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close_idle(self) -> None:
        self._timer = None
        if not self._busy and self._transport is not None:
            self._transport.close()

    def _timed_out(self) -> None:
        """An unauthenticated connection's request did not arrive whole in time: 408 where
        no reply to it went out, and close."""
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing() or self._busy:
            return
        framework = self._framework
        forwarded = self._forwarded
        if framework is not None and forwarded is not None:
            if framework.remaining and not framework.response_started:
                what = f"body of {forwarded.method} {forwarded.path}"
                self._reply(forwarded, self._limits.request_timeout(what), keep_alive=False)
            else:
                transport.close()
        elif self._discard:
            transport.close()  # its refusal went out
        elif self._head is not None:
            what = f"body of {self._head.method} {self._head.path}"
            self._reply(self._head, self._limits.request_timeout(what), keep_alive=False)
        elif self._buffer:
            self._reply(None, self._limits.request_timeout("request head"), keep_alive=False)
        else:
            transport.close()  # idle


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
