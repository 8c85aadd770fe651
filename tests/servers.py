"""Test helpers around servers: replicas of `weightsync serve`, and ASGI apps in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator, Mapping

import torch
import uvicorn

from weightsync.control import RolloutClient
from weightsync.layout import ParallelismConfig
from weightsync.receiver.checker import WeightsChecker
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.launcher import (
    ServedReplica,
    serve_replicas,
    start_replicas,
    wait_healthy,
)

__all__ = [
    "ServedReplica",
    "app_in_thread",
    "logged",
    "serve_replicas",
    "start_replicas",
    "wait_healthy",
]


def logged(replica: ServedReplica, text: str, *, timeout_s: float = 10.0) -> bool:
    """Whether `text` is in the replica's log within `timeout_s`: a line logged while the
    server answered a request is written right after the reply (`LineAfterTurn`), so a
    client may read the log before it is there."""
    deadline = time.monotonic() + timeout_s
    while text not in replica.log_path.read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@contextlib.contextmanager
def app_in_thread(
    app, *, host: str = "127.0.0.1", timeout_s: float = 30.0, **config
) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free port in a thread of this process; yield its
    base URL once it accepts connections, stop it on exit. `config`: more `uvicorn.Config`
    settings."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


def served_checksums(url: str, api_key: str | None) -> list[dict]:
    """Every rank's checksums of its parameters (the weights checker's ``checksum``
    action), in rank order."""

    async def main() -> list[dict]:
        async with RolloutClient(url, api_key=api_key, timeout_s=60.0) as client:
            reply = await client.weights_checker("checksum")
        return [rank["checksums"] for rank in json.loads(reply.message)["ranks"]]

    return asyncio.run(main())


def laid_out_checksums(
    state: Mapping[str, torch.Tensor], hf_config: Mapping, tp: int, dtype: str = "bfloat16"
) -> list[dict]:
    """Every rank's checksums were a tp-`tp` replica to hold `state` in `dtype`, laid out by
    `shard_state_dict` (what `served_checksums` reads back from a replica that holds it)."""
    return [
        WeightsChecker(
            shard_state_dict(state, hf_config, ParallelismConfig(tp_size=tp, tp_rank=r), dtype)
        )
        .checksum()
        .details["checksums"]
        for r in range(tp)
    ]
