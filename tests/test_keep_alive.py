"""`KeepAliveConnection` against a real uvicorn server: one connection reused, opened again
when the server closed it (idle timeout, ``Connection: close``) or after a failure, whole
replies however they are framed, and failures the rollout client reports as no reply."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from servers import app_in_thread
from weightsync.control.base import AsyncHttpClient
from weightsync.control.connection import KeepAliveConnection
from weightsync.errors import RemoteReplicaError


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        # The client's port names the connection the request came on.
        return JSONResponse(
            {
                "port": request.client.port,
                "body": await request.json(),
                "auth": request.headers.get("authorization"),
                "type": request.headers.get("content-type"),
            },
            status_code=201,
        )

    @app.post("/chunked")
    async def chunked() -> StreamingResponse:
        async def parts():
            for part in (b'{"parts": ', b"[1, 2, ", b"3]}"):
                yield part

        return StreamingResponse(parts(), media_type="application/json")

    @app.post("/close")
    async def close() -> JSONResponse:
        return JSONResponse({"closing": True}, headers={"Connection": "close"})

    @app.post("/slow")
    async def slow() -> JSONResponse:
        await asyncio.sleep(1.0)
        return JSONResponse({})

    return app


@pytest.fixture(scope="module")
def url():
    with app_in_thread(_app(), timeout_keep_alive=1) as base:
        yield base


def _run(coroutine):
    return asyncio.run(coroutine)


async def _echo(connection: KeepAliveConnection, value: object) -> dict:
    reply = await connection.request("POST", "/echo", json.dumps(value).encode(), timeout_s=10)
    assert (reply.status_code, reply.reason_phrase) == (201, "Created")
    return reply.json()


def test_requests_share_one_connection_and_carry_the_headers(url) -> None:
    async def main() -> list[dict]:
        connection = KeepAliveConnection(url, headers={"Authorization": "Bearer k"})
        try:
            return [await _echo(connection, {"n": n}) for n in range(5)]
        finally:
            await connection.aclose()

    replies = _run(main())
    assert [r["body"] for r in replies] == [{"n": n} for n in range(5)]
    assert len({r["port"] for r in replies}) == 1
    assert {r["auth"] for r in replies} == {"Bearer k"}
    assert {r["type"] for r in replies} == {"application/json"}


def test_a_connection_the_server_closed_is_opened_again(url) -> None:
    async def main() -> tuple[int, int, int]:
        connection = KeepAliveConnection(url)
        first = (await _echo(connection, 1))["port"]
        await asyncio.sleep(1.5)  # past the server's idle keep-alive timeout (1 s)
        second = (await _echo(connection, 2))["port"]
        closing = await connection.request("POST", "/close", b"{}", timeout_s=10)
        assert closing.json() == {"closing": True}
        third = (await _echo(connection, 3))["port"]
        await connection.aclose()
        return first, second, third

    first, second, third = _run(main())
    assert len({first, second, third}) == 3


def test_a_connection_closed_while_its_loop_was_stopped_is_opened_again(url) -> None:
    # TrainerSync runs its loop only while a call lasts: the server's close of an idle
    # connection is not seen by the loop until it runs again, and must not cost a request.
    connection = KeepAliveConnection(url)
    loop = asyncio.new_event_loop()
    try:
        first = loop.run_until_complete(_echo(connection, 1))["port"]
        time.sleep(1.5)  # past the server's idle keep-alive timeout (1 s), loop stopped
        second = loop.run_until_complete(_echo(connection, 2))
        loop.run_until_complete(connection.aclose())
    finally:
        loop.close()
    assert second["body"] == 2 and second["port"] != first


def test_a_chunked_reply_is_read_whole(url) -> None:
    async def main() -> bytes:
        connection = KeepAliveConnection(url)
        reply = await connection.request("POST", "/chunked", None, timeout_s=10)
        await connection.aclose()
        return reply.content

    assert json.loads(_run(main())) == {"parts": [1, 2, 3]}


@pytest.mark.serial  # wall-clock bounds: not beside another test
def test_a_timeout_closes_the_connection_and_the_next_request_opens_one(url) -> None:
    async def main() -> tuple[int, int]:
        connection = KeepAliveConnection(url)
        before = (await _echo(connection, 0))["port"]
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await connection.request("POST", "/slow", b"{}", timeout_s=0.2)
        assert time.monotonic() - started < 0.9
        after = (await _echo(connection, 1))["port"]
        await connection.aclose()
        return before, after

    before, after = _run(main())
    assert before != after


def test_each_event_loop_gets_its_own_connection(url) -> None:
    connection = KeepAliveConnection(url)
    assert _run(_echo(connection, "a"))["body"] == "a"
    assert _run(_echo(connection, "b"))["body"] == "b"


def test_a_server_that_is_gone_is_no_reply_for_the_client() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        _run(
            KeepAliveConnection(f"http://127.0.0.1:{port}").request(
                "POST", "/x", b"{}", timeout_s=5
            )
        )

    async def through_the_client() -> None:
        client = AsyncHttpClient(f"http://127.0.0.1:{port}")
        try:
            await client._post_quick("/begin_weight_sync", b"{}", timeout_s=5)
        finally:
            await client.aclose()

    with pytest.raises(RemoteReplicaError, match="begin_weight_sync got no reply") as caught:
        _run(through_the_client())
    assert caught.value.status_code is None


def test_a_request_may_poll_for_its_reply_and_then_sleeps(url, monkeypatch) -> None:
    turns = []
    sleep = asyncio.sleep
    here = threading.get_ident()  # the server's loop runs in a thread of its own

    async def counted(delay: float, *args: object) -> object:
        if threading.get_ident() == here:
            turns.append(delay)
        return await sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", counted)

    async def main(**poll: object) -> tuple[dict, float]:
        connection = KeepAliveConnection(url)
        try:
            started = time.monotonic()
            slow = await connection.request("POST", "/slow", b"{}", timeout_s=10, **poll)
            took = time.monotonic() - started
            assert slow.json() == {}
            return await _echo(connection, "after"), took
        finally:
            await connection.aclose()

    reply, took = _run(main())
    assert reply["body"] == "after" and turns == []
    # Polled for 50 ms (many loop turns without sleeping), then slept until the reply.
    reply, took = _run(main(poll_s=0.05))
    assert reply["body"] == "after" and took >= 1.0
    polled = [d for d in turns if d == 0]
    assert len(polled) > 10 and len(turns) == len(polled)
    # Polling from when another future is done: none before it.
    turns.clear()

    async def after_a_future() -> tuple[int, int]:
        connection = KeepAliveConnection(url)
        loop = asyncio.get_running_loop()
        landed = loop.create_future()
        loop.call_later(0.5, landed.set_result, None)
        try:
            slow = connection.request(
                "POST", "/slow", b"{}", timeout_s=10, poll_s=0.05, poll_after=landed
            )
            task = asyncio.ensure_future(slow)
            await sleep(0.4)
            before = len(turns)
            await task
            # A reply that comes first ends the wait for the future.
            never = loop.create_future()
            fast = await connection.request(
                "POST", "/echo", b"1", timeout_s=10, poll_s=0.05, poll_after=never
            )
            assert fast.json()["body"] == 1
            return before, len(turns)
        finally:
            await connection.aclose()

    before, after = _run(after_a_future())
    assert before == 0 and after > 10


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="http://host"):
        KeepAliveConnection("https://127.0.0.1:1")
