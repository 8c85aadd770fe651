"""`DirectHttpProtocol` on its own: requests in order on one connection, the hand-over to
uvicorn's protocol, keep-alive and shutdown, the request whose client left before it ran,
and the guards of a keyed server (refusals from the head, the unauthenticated timeout, the
connection limit), over raw sockets to real uvicorn servers (under asyncio's loop and
uvloop's). What each reply says is `test_direct_routes`' business."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import socket
import time
from urllib.parse import urlsplit

import pytest
from fastapi import Request
from fastapi.responses import JSONResponse

from servers import app_in_thread
from weightsync.control.models import BeginWeightSyncRequest, EndWeightSyncRequest
from weightsync.server.connections import ConnectionLimits
from weightsync.server.direct import DirectApp, DirectRoute
from weightsync.server.direct_protocol import KEEP_ALIVE_S, direct_protocol
from weightsync.server.gate import require_key_before_body
from weightsync.server.http import limit_body_size

KEY = "protocol-key"
LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])


class Recorder:
    """The routes' handlers: what they were asked, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def begin(
        self, body: BeginWeightSyncRequest | None, *, framework: bool = False
    ) -> JSONResponse:
        selector = body.selector if body is not None else None
        self.calls.append(f"begin {selector}" + (" (framework)" if framework else ""))
        return JSONResponse({"selector": selector})

    async def end(self, body: EndWeightSyncRequest, *, framework: bool = False) -> JSONResponse:
        self.calls.append(f"end {body.new_version}" + (" (framework)" if framework else ""))
        if body.new_version == "stall":
            # Blocks the server's event loop, as a replica that cannot run (stopped) would.
            time.sleep(0.5)
        return JSONResponse({"new_version": body.new_version})


def _app(recorder: Recorder) -> DirectApp:
    app = DirectApp()

    @app.get("/other")
    async def other() -> dict[str, str]:
        return {"served": "by the framework"}

    # Where the fast path does not answer them (a connection handed to uvicorn for good).
    @app.post("/begin")
    async def framework_begin(body: BeginWeightSyncRequest | None = None) -> JSONResponse:
        return await recorder.begin(body, framework=True)

    @app.post("/end")
    async def framework_end(body: EndWeightSyncRequest) -> JSONResponse:
        return await recorder.end(body, framework=True)

    app.add_direct_routes(
        (
            DirectRoute("/begin", BeginWeightSyncRequest, recorder.begin, body_required=False),
            DirectRoute("/end", EndWeightSyncRequest, recorder.end),
        ),
        api_key=KEY,
    )
    return app


@pytest.fixture(params=LOOPS)
def served(request):
    recorder = Recorder()
    app = _app(recorder)
    with app_in_thread(app, loop=request.param, http=direct_protocol(app)) as url:
        parts = urlsplit(url)
        yield (parts.hostname, parts.port), recorder


def _request(
    path: str, body: dict | None = None, *, method: str = "POST", extra: str = ""
) -> bytes:
    payload = b"" if body is None else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{extra}\r\n"
    )
    return head.encode() + payload


def _replies(sock: socket.socket, count: int, timeout_s: float = 10.0) -> list[tuple[int, dict]]:
    """Read `count` whole replies (status, JSON body) from `sock`."""
    sock.settimeout(timeout_s)
    data = b""
    replies: list[tuple[int, dict]] = []
    while len(replies) < count:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            head = data[:end].decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in head[1:])
            size = end + 4 + int(headers["content-length"])
            if len(data) >= size:
                replies.append((int(head[0].split()[1]), json.loads(data[end + 4 : size])))
                data = data[size:]
                continue
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"closed after {len(replies)} replies")
        data += chunk
    return replies


def _closed(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the server closed `sock` (within `timeout_s`)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True  # closed with bytes of this client's unread
    except TimeoutError:
        return False


def test_requests_written_ahead_are_answered_in_order(served) -> None:
    address, recorder = served
    with socket.create_connection(address) as sock:
        sock.sendall(
            _request("/begin", {"selector": "all"})
            + _request("/end", {"new_version": "7"})
            + _request("/begin")
        )
        assert _replies(sock, 3) == [
            (200, {"selector": "all"}),
            (200, {"new_version": "7"}),
            (200, {"selector": None}),
        ]
    assert recorder.calls == ["begin all", "end 7", "begin None"]


def test_a_request_in_pieces_is_answered_once_whole(served) -> None:
    address, recorder = served
    data = _request("/end", {"new_version": "pieces"})
    with socket.create_connection(address) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index in range(0, len(data), 7):
            sock.sendall(data[index : index + 7])
            time.sleep(0.002)
        assert _replies(sock, 1) == [(200, {"new_version": "pieces"})]
    assert recorder.calls == ["end pieces"]


def test_another_route_hands_the_connection_to_uvicorn(served) -> None:
    address, recorder = served
    with socket.create_connection(address) as sock:
        sock.sendall(_request("/begin", {"selector": "target"}))
        assert _replies(sock, 1) == [(200, {"selector": "target"})]
        # A framework route, then a direct one again: uvicorn serves the framework route,
        # then the connection is the fast path's again.
        sock.sendall(_request("/other", method="GET") + _request("/end", {"new_version": "8"}))
        assert _replies(sock, 2) == [
            (200, {"served": "by the framework"}),
            (200, {"new_version": "8"}),
        ]
    assert recorder.calls == ["begin target", "end 8"]


def test_a_chunked_body_hands_the_connection_to_the_framework(served) -> None:
    address, recorder = served
    body = json.dumps({"new_version": "chunked"}).encode()
    head = (
        f"POST /end HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    with socket.create_connection(address) as sock:
        sock.sendall(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        assert _replies(sock, 1) == [(200, {"new_version": "chunked"})]
        # uvicorn has the connection for good: its framework routes answer from now on.
        sock.sendall(_request("/begin", {"selector": "all"}))
        assert _replies(sock, 1) == [(200, {"selector": "all"})]
    assert recorder.calls == ["end chunked (framework)", "begin all (framework)"]


def test_connection_close_is_honoured(served) -> None:
    address, _ = served
    with socket.create_connection(address) as sock:
        sock.sendall(_request("/begin", extra="Connection: close\r\n"))
        assert _replies(sock, 1) == [(200, {"selector": None})]
        assert _closed(sock)


def test_a_refusal_from_the_head_drops_the_body_and_keeps_the_connection(served) -> None:
    address, recorder = served
    with socket.create_connection(address) as sock:
        # The key is judged from the head: the reply comes before the body.
        sock.sendall(b"POST /end HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n")
        assert _replies(sock, 1)[0][0] == 401
        # The body, read and dropped; the next request is answered as any.
        sock.sendall(b"x" * 100 + _request("/end", {"new_version": "after"}))
        assert _replies(sock, 1) == [(200, {"new_version": "after"})]
    assert recorder.calls == ["end after"]


def test_a_refused_body_past_a_mebibyte_closes_the_connection(served) -> None:
    address, recorder = served
    size = 4 << 20
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST /end HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n" % size)
        assert _replies(sock, 1)[0][0] == 401
        # Dropped up to a mebibyte, then the connection closes under the client writing on.
        try:
            for _ in range(size >> 16):
                sock.sendall(b"x" * (1 << 16))
        except OSError:
            pass  # closed while this wrote
        assert _closed(sock)
    assert recorder.calls == []


def test_a_request_whose_client_left_is_not_run(served, caplog) -> None:
    address, recorder = served
    with socket.create_connection(address) as first, socket.create_connection(address) as second:
        # `second` is taken by the server before its loop stalls.
        second.sendall(_request("/begin", {"selector": "target"}))
        assert _replies(second, 1) == [(200, {"selector": "target"})]
        with caplog.at_level(logging.WARNING, logger="weightsync.server.direct_protocol"):
            first.sendall(_request("/end", {"new_version": "stall"}))
            time.sleep(0.1)  # the server's loop is stalled now, for 0.5 s
            # A request written, then given up on while the server could not read it.
            second.sendall(_request("/begin", {"selector": "all"}))
            second.close()
            assert _replies(first, 1) == [(200, {"new_version": "stall"})]
            deadline = time.monotonic() + 5.0
            while "closed the connection before it ran" not in caplog.text:
                assert time.monotonic() < deadline, "the dropped request was not logged"
                time.sleep(0.01)
    assert recorder.calls == ["begin target", "end stall"]


@pytest.mark.serial  # wall-clock bounds: not beside another test
def test_an_authenticated_connection_outlives_uvicorns_keep_alive() -> None:
    app = _app(Recorder())
    limits = ConnectionLimits(unauthenticated_timeout_s=0.3)
    config = {"http": direct_protocol(app, keep_alive_s=2.0, limits=limits)}
    with app_in_thread(app, timeout_keep_alive=0.2, **config) as url:
        parts = urlsplit(url)
        address = (parts.hostname, parts.port)
        with (
            socket.create_connection(address) as direct,
            socket.create_connection(address) as framework,
            socket.create_connection(address) as idle,
        ):
            direct.sendall(_request("/begin"))
            framework.sendall(_request("/other", method="GET"))
            assert _replies(direct, 1) == [(200, {"selector": None})]
            assert _replies(framework, 1) == [(200, {"served": "by the framework"})]
            # The one that sent nothing closes after the unauthenticated timeout; the two
            # that sent the key stay past it and past uvicorn's own keep-alive.
            assert _closed(idle, timeout_s=3.0)
            assert not _closed(framework, timeout_s=0.5)
            framework.sendall(_request("/other", method="GET"))
            assert _replies(framework, 1) == [(200, {"served": "by the framework"})]
            direct.sendall(_request("/end", {"new_version": "later"}))
            assert _replies(direct, 1) == [(200, {"new_version": "later"})]
            started = time.monotonic()
            assert _closed(direct)
            assert 1.5 < time.monotonic() - started < 4.0
    assert KEEP_ALIVE_S >= 600.0  # a trainer's step between two syncs


def test_shutdown_closes_idle_connections_at_once() -> None:
    app = _app(Recorder())
    with app_in_thread(app, http=direct_protocol(app)) as url:
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname, parts.port))
        sock.sendall(_request("/begin"))
        assert _replies(sock, 1) == [(200, {"selector": None})]
        started = time.monotonic()
    try:
        # uvicorn waits for its open connections before it stops: this one closed at once.
        assert time.monotonic() - started < 5.0
        assert _closed(sock)
    finally:
        sock.close()


# Every connection of a keyed server: judged from the head, timed until authenticated, and
# counted against the connection limit.

TIMEOUT_S = 0.5


def _keyed_app(recorder: Recorder) -> DirectApp:
    """`_app` behind the key as the reference servers put it: every path but the open ones
    needs it, judged from the head; bodies up to a mebibyte."""
    app = _app(recorder)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/echo")
    @app.post("/open")
    async def echo(request: Request) -> dict[str, int]:
        recorder.calls.append(request.url.path)
        return {"size": len(await request.body())}

    require_key_before_body(app, KEY, open_paths=("/health", "/open"))
    limit_body_size(app, 1 << 20, setting="--max-body-bytes")
    return app


@contextlib.contextmanager
def _keyed_server(*, loop: str = "auto", **limits):
    recorder = Recorder()
    app = _keyed_app(recorder)
    protocol = direct_protocol(
        app, limits=ConnectionLimits(unauthenticated_timeout_s=TIMEOUT_S, **limits)
    )
    with app_in_thread(app, http=protocol, loop=loop) as url:
        parts = urlsplit(url)
        yield (parts.hostname, parts.port), recorder


@pytest.fixture(scope="module", params=LOOPS)
def keyed(request):
    with _keyed_server(loop=request.param) as served:
        yield served


def _head(path: str, *, method: str = "POST", size: int = 0, key: bool = False) -> bytes:
    auth = f"Authorization: Bearer {KEY}\r\n" if key else ""
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\n{auth}Content-Length: {size}\r\n\r\n"
    return head.encode()


def test_a_framework_route_without_the_key_is_refused_from_its_head(keyed) -> None:
    address, recorder = keyed
    recorder.calls.clear()
    with socket.create_connection(address) as sock:
        sock.sendall(_head("/echo", size=100))
        [(status, body)] = _replies(sock, 1)
        assert status == 401 and "Authorization: Bearer" in body["error"]["message"]
        # Unknown paths need the key too; a declared body over the limit is a 413 first.
        sock.sendall(b"x" * 100 + _head("/nowhere", method="GET"))
        assert _replies(sock, 1)[0][0] == 401
        sock.sendall(_head("/echo", size=2 << 20, key=True))
        [(status, body)] = _replies(sock, 1)
        assert status == 413 and "--max-body-bytes" in body["error"]["message"]
    with socket.create_connection(address) as sock:
        sock.sendall(_head("/echo", size=5, key=True) + b"12345")
        assert _replies(sock, 1) == [(200, {"size": 5})]
    assert recorder.calls == ["/echo"]


def test_requests_of_both_kinds_written_ahead_are_answered_in_order(keyed) -> None:
    address, _ = keyed
    with socket.create_connection(address) as sock:
        sock.sendall(
            _request("/other", method="GET")
            + _request("/end", {"new_version": "9"})
            + _head("/echo", size=3, key=True)
            + b"abc"
            + _request("/begin")
        )
        assert _replies(sock, 4) == [
            (200, {"served": "by the framework"}),
            (200, {"new_version": "9"}),
            (200, {"size": 3}),
            (200, {"selector": None}),
        ]


def test_an_unauthenticated_connection_has_seconds_for_each_request(keyed) -> None:
    address, _ = keyed
    with (
        socket.create_connection(address) as idle,
        socket.create_connection(address) as half_head,
        socket.create_connection(address) as half_body,
        socket.create_connection(address) as prober,
    ):
        started = time.monotonic()
        half_head.sendall(b"POST /end HTTP/1.1\r\nHost: te")
        half_body.sendall(_head("/open", size=100) + b"x" * 10)
        prober.sendall(_head("/health", method="GET"))
        assert _replies(prober, 1) == [(200, {"status": "ok"})]
        for sock, what in ((half_head, "the request head"), (half_body, "body of POST /open")):
            [(status, body)] = _replies(sock, 1)
            assert status == 408, body
            message = body["error"]["message"]
            assert f"{what} did not arrive within {TIMEOUT_S:g} s" in message, message
            assert _closed(sock)
        assert _closed(idle)
        # A request to an open path does not authenticate: its connection is timed as any.
        assert _closed(prober)
        assert time.monotonic() - started < TIMEOUT_S + 2.0


def test_past_the_limit_the_oldest_unauthenticated_connection_makes_room() -> None:
    with _keyed_server(max_connections=3) as (address, _):
        idle = [socket.create_connection(address) for _ in range(3)]
        try:
            with socket.create_connection(address) as newcomer:
                newcomer.sendall(_head("/health", method="GET"))
                assert _replies(newcomer, 1) == [(200, {"status": "ok"})]
                assert _closed(idle[0], timeout_s=1.0)
        finally:
            for sock in idle:
                sock.close()
        # Three that sent the key keep their seats: a fourth connection is refused.
        held = [socket.create_connection(address) for _ in range(3)]
        try:
            for sock in held:
                sock.sendall(_request("/begin"))
                assert _replies(sock, 1) == [(200, {"selector": None})]
            with socket.create_connection(address) as refused:
                [(status, body)] = _replies(refused, 1)
                assert status == 503
                assert "at most 3 open connections" in body["error"]["message"]
                assert _closed(refused)
        finally:
            for sock in held:
                sock.close()
