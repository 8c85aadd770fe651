"""`DirectApp`'s direct routes, answered on the fast path (`DirectHttpProtocol`, from a
connection's bytes), answer as the framework routes over the same handlers do: the same
status and body for every request below, good and bad, sent over real HTTP to three uvicorn
servers (one where FastAPI serves the routes, and two where only the fast path does, whose
framework routes fail, so a request it let through would be a 500)."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from servers import app_in_thread
from weightsync.control.models import BeginWeightSyncRequest, EndWeightSyncRequest
from weightsync.server.direct import DirectApp, DirectRoute
from weightsync.server.direct_protocol import direct_protocol
from weightsync.server.http import (
    ControlError,
    bearer_auth,
    install_error_handler,
    limit_body_size,
)

KEY = "direct-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
MAX_BODY = 4096


async def begin(body: BeginWeightSyncRequest | None) -> JSONResponse:
    return JSONResponse({"body": None if body is None else body.model_dump()})


async def end(body: EndWeightSyncRequest) -> JSONResponse:
    match body.new_version:
        case "refused":
            raise ControlError("not now: the replica is busy", status_code=503)
        case "rank-failed":
            raise ControlError("CUDA error: an illegal memory access", status_code=500)
        case "bug":
            raise KeyError("internal detail")
    return JSONResponse({"body": body.model_dump()})


ROUTES = (
    DirectRoute("/begin", BeginWeightSyncRequest, begin, body_required=False),
    DirectRoute("/end", EndWeightSyncRequest, end),
)


def _framework_app() -> FastAPI:
    app = FastAPI()
    install_error_handler(app)
    authorized = [Depends(bearer_auth(KEY))]

    @app.post("/begin", dependencies=authorized)
    async def framework_begin(body: BeginWeightSyncRequest | None = None) -> JSONResponse:
        return await begin(body)

    @app.post("/end", dependencies=authorized)
    async def framework_end(body: EndWeightSyncRequest) -> JSONResponse:
        return await end(body)

    limit_body_size(app, MAX_BODY, setting="--max-body-bytes")
    return app


def _direct_app() -> DirectApp:
    app = DirectApp()
    install_error_handler(app)

    # Only there to answer other methods: a request the fast path let through fails.
    @app.post("/begin")
    @app.post("/end")
    async def unreachable() -> None:
        raise AssertionError("the framework route answered a direct route's request")

    app.add_direct_routes(ROUTES, api_key=KEY)
    limit_body_size(app, MAX_BODY, setting="--max-body-bytes")
    return app


@pytest.fixture(scope="module")
def urls():
    """The framework's server, then an app with direct routes served by `DirectHttpProtocol`
    (the direct routes answered from the bytes) under uvicorn's default loop (uvloop where
    installed) and under asyncio's."""
    served, again = _direct_app(), _direct_app()
    with (
        app_in_thread(_framework_app()) as framework,
        app_in_thread(served, http=direct_protocol(served)) as protocol,
        app_in_thread(again, http=direct_protocol(again), loop="asyncio") as on_asyncio,
    ):
        yield framework, protocol, on_asyncio


NESTED = "[" * 100_000 + "]" * 100_000
CASES = {
    "begin without a body": ("/begin", None, AUTH),
    "begin {}": ("/begin", "{}", AUTH | JSON),
    "begin null": ("/begin", "null", AUTH | JSON),
    "begin with fields": ("/begin", '{"lease_s": 5, "pause_mode": null}', AUTH | JSON),
    "begin, a field out of range": ("/begin", '{"lease_s": -1}', AUTH | JSON),
    "begin, NaN": ("/begin", '{"lease_s": NaN}', AUTH | JSON),
    "begin, a number past the float range": ("/begin", '{"budget_s": 1e309}', AUTH | JSON),
    "begin, NaN in a field it ignores": ("/begin", '{"later": NaN}', AUTH | JSON),
    "begin, an overflow without an exponent": (
        "/begin",
        '{"later": ' + "9" * 320 + ".5}",
        AUTH | JSON,
    ),
    "begin, an overflow with a short exponent": (
        "/begin",
        '{"later": 1' + "0" * 250 + "e99}",
        AUTH | JSON,
    ),
    "begin, a long integer": ("/begin", '{"later": ' + "7" * 400 + "}", AUTH | JSON),
    "begin, not UTF-8": ("/begin", b'{"selector": "\xff"}', AUTH | JSON),
    "begin, a lone surrogate": ("/begin", '{"selector": "\\ud800"}', AUTH | JSON),
    "begin, a duplicate key": ("/begin", '{"selector": "x", "selector": "all"}', AUTH | JSON),
    "begin, a number for a string": ("/begin", '{"selector": 5}', AUTH | JSON),
    "begin, a string for a bool": ("/begin", '{"release_kv_cache": "false"}', AUTH | JSON),
    "begin, an unknown mode": ("/begin", '{"pause_mode": "later"}', AUTH | JSON),
    "begin, not JSON": ("/begin", '{"lease_s": ', AUTH | JSON),
    "begin, a list": ("/begin", "[1, 2]", AUTH | JSON),
    "begin, nested too deep": ("/begin", NESTED, AUTH | JSON),
    "begin, JSON as text/plain": ("/begin", "{}", AUTH | {"Content-Type": "text/plain"}),
    "begin, JSON without a content type": ("/begin", "{}", AUTH),
    "begin, a +json content type": (
        "/begin",
        '{"selector": "all"}',
        AUTH | {"Content-Type": "application/vnd.api+json; charset=utf-8"},
    ),
    "end without a body": ("/end", None, AUTH),
    "end {}": ("/end", "{}", AUTH | JSON),
    "end null": ("/end", "null", AUTH | JSON),
    "end with digests": (
        "/end",
        '{"new_version": "7", "digests": {"0": {"a.weight": 12}, "1": {}}}',
        AUTH | JSON,
    ),
    "end, a digest rank that is not a number": (
        "/end",
        '{"digests": {"zero": {"a": 1}}}',
        AUTH | JSON,
    ),
    "end, two errors": ("/end", '{"resume": "maybe", "budget_s": 0}', AUTH | JSON),
    "end, a digest as a whole float": ("/end", '{"digests": {"0": {"a": 1e3}}}', AUTH | JSON),
    "end, a digest with a fraction": ("/end", '{"digests": {"0": {"a": 1.5}}}', AUTH | JSON),
    "end, a digest past int64": (
        "/end",
        '{"digests": {"0": {"a": 99999999999999999999999}}}',
        AUTH | JSON,
    ),
    "end, a refusal": ("/end", '{"new_version": "refused"}', AUTH | JSON),
    "end, a rank failed": ("/end", '{"new_version": "rank-failed"}', AUTH | JSON),
    "end, an unhandled exception": ("/end", '{"new_version": "bug"}', AUTH | JSON),
    "end, a body over the limit": (
        "/end",
        json.dumps({"new_version": "x" * MAX_BODY}),
        AUTH | JSON,
    ),
    "no API key": ("/end", "{}", JSON),
    "another API key": ("/end", "{}", JSON | {"Authorization": "Bearer other"}),
    "not a bearer token": ("/end", "{}", JSON | {"Authorization": f"Basic {KEY}"}),
    "a bearer without a token": ("/end", "{}", JSON | {"Authorization": "Bearer"}),
    "the key, lower-case scheme": ("/begin", "{}", JSON | {"Authorization": f"bearer {KEY}"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_direct_route_answers_as_the_framework_route(urls, case) -> None:
    route, body, headers = CASES[case]
    replies = [httpx.post(url + route, content=body, headers=headers, timeout=30.0) for url in urls]
    framework, *direct = ((r.status_code, r.headers.get("content-type"), r.text) for r in replies)
    assert direct == [framework] * len(direct)
    for reply in replies[1:]:
        assert "internal detail" not in reply.text
        assert "illegal memory access" not in reply.text


@pytest.mark.parametrize("loop", ["default", "asyncio"])
def test_the_api_key_is_checked_before_the_body_is_read(urls, loop) -> None:
    url = urls[1 if loop == "default" else 2]
    reply = httpx.post(url + "/end", content='{"new_version": ', headers=JSON)
    assert reply.status_code == 401
    assert reply.json() == {
        "error": {
            "message": "this route needs 'Authorization: Bearer <api key>' (the server was "
            "started with an API key); send the header with the server's key"
        }
    }


@pytest.mark.parametrize("loop", ["default", "asyncio"])
def test_other_requests_go_on_to_the_app(urls, loop) -> None:
    url = urls[1 if loop == "default" else 2]
    assert httpx.get(url + "/end", headers=AUTH).status_code == 405
    assert httpx.post(url + "/elsewhere", headers=AUTH).status_code == 404


def test_a_direct_route_needs_a_framework_route_over_the_same_handler() -> None:
    app = DirectApp()

    @app.post("/begin")
    async def framework_begin(body: BeginWeightSyncRequest | None = None) -> JSONResponse:
        return await begin(body)

    with pytest.raises(ValueError, match=r"\['/end'\] have no POST route"):
        app.add_direct_routes(ROUTES, api_key=KEY)
    assert app.direct_routes is None
