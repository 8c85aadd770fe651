"""The control clients against a real bootstrap server (uvicorn in a thread) and against a
port where nothing listens. The main server's routes are exercised in test_serve.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from servers import app_in_thread
from weightsync.control import BootstrapClient, RolloutClient
from weightsync.errors import RemoteReplicaError
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.server.bootstrap import BootstrapRegistry, create_bootstrap_app

WEIGHTS_INFO = {"model.embed_tokens.weight": (4096, 640, 2), "lm_head.weight": (8192, 640, 2)}


@pytest.fixture(scope="module")
def bootstrap_url():
    with app_in_thread(create_bootstrap_app(BootstrapRegistry(), api_key="secret")) as url:
        yield url


def _run(coro):
    return asyncio.run(coro)


def test_register_and_read_back(bootstrap_url):
    config = ParallelismConfig(tp_size=4, tp_rank=3, ep_size=2)

    async def main():
        async with BootstrapClient(bootstrap_url, api_key="secret") as client:
            await client.health()
            await client.register_transfer_engine_info(3, "127.0.0.1:12345", WEIGHTS_INFO)
            await client.register_parallelism_config(3, config)
            return (
                await client.get_transfer_engine_info(3),
                await client.get_parallelism_config(3),
            )

    (session_id, weights_info), parallelism = _run(main())
    assert session_id == "127.0.0.1:12345"
    assert weights_info == WEIGHTS_INFO
    assert parallelism == config


def test_bootstrap_errors_name_replica_route_status_and_message(bootstrap_url):
    async def fails(call, api_key: str | None = "secret"):
        async with BootstrapClient(bootstrap_url, api_key=api_key) as client:
            with pytest.raises(RemoteReplicaError) as info:
                await call(client)
            return info.value

    unknown = _run(fails(lambda c: c.get_transfer_engine_info(7)))
    assert unknown.status_code == 404
    assert unknown.route == "/get_transfer_engine_info"
    assert unknown.replica == bootstrap_url
    assert "No transfer engine info for rank 7" in str(unknown)
    assert bootstrap_url in str(unknown) and "HTTP 404" in str(unknown)

    negative = _run(fails(lambda c: c.get_transfer_engine_info(-1)))
    assert negative.status_code == 400 and "Invalid rank parameter" in str(negative)

    no_config = _run(fails(lambda c: c.get_parallelism_config(5)))
    assert no_config.status_code == 404 and "No parallelism config for rank 5" in str(no_config)

    # Writes and reads alike need the key.
    for call in (
        lambda c: c.register_transfer_engine_info(0, "h:1", WEIGHTS_INFO),
        lambda c: c.get_transfer_engine_info(3),
    ):
        unauthorized = _run(fails(call, api_key=None))
        assert unauthorized.status_code == 401 and "Authorization: Bearer" in str(unauthorized)


def test_bootstrap_wrong_key_is_refused(bootstrap_url):
    async def main():
        async with BootstrapClient(bootstrap_url, api_key="wrong") as client:
            await client.register_parallelism_config(0, ParallelismConfig(tp_size=1, tp_rank=0))

    with pytest.raises(RemoteReplicaError, match="wrong API key") as info:
        _run(main())
    assert info.value.status_code == 401


def test_unreachable_replica_has_no_status():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on `port` any more.
    url = f"http://127.0.0.1:{port}"

    async def main():
        async with RolloutClient(url, timeout_s=5.0) as client:
            await client.pause_generation(mode="abort")

    with pytest.raises(RemoteReplicaError) as info:
        _run(main())
    assert info.value.status_code is None
    assert info.value.replica == url and info.value.route == "/pause_generation"
    assert "got no reply" in str(info.value)


def test_bad_client_arguments():
    with pytest.raises(ValueError, match="http"):
        RolloutClient("127.0.0.1:30000")
    with pytest.raises(ValueError, match="timeout_s"):
        BootstrapClient("http://127.0.0.1:1", timeout_s=0)
