"""Settings every test process (and the processes it starts) shares."""

from __future__ import annotations

import os

# Mooncake reads these when an engine is created: quiet logs, and a transfer timeout short
# enough that a test with a dead peer fails in seconds.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
# gloo on loopback only; the machines that run the tests may have no other usable interface.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

# The vLLM tests' checkpoint and servers (session-wide: each server starts once for every
# vLLM test module; defined in a module a test imports, they would start once per module).
from vllm_cpu.fixtures import vllm_checkpoint, vllm_servers, vllm_tp1, vllm_tp2

SGLANG_API_KEY = "sglang-key"
__all__ = ["SGLANG_API_KEY", "vllm_checkpoint", "vllm_servers", "vllm_tp1", "vllm_tp2"]


def pytest_sessionstart(session) -> None:
    """Make SIGTERM interrupt the run like Ctrl-C, so that fixture finalizers run and stop the
    servers they started. (SIGKILL cannot be caught: then the servers stop themselves, as
    their parent-death signal fires.)"""

    def interrupt(signum: int, frame) -> None:
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)


@pytest.fixture(autouse=True)
def _restore_weightsync_logging() -> Iterator[None]:
    """Commands run in-process configure the ``weightsync`` logger for the whole process
    (`weightsync.cli.logs.configure_logging`); put it back after each test, so that the next
    one's log capture sees its records."""
    import logging

    logger = logging.getLogger("weightsync")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]


def pytest_collection_modifyitems(session, config, items) -> None:
    """Run the tests that use the real SGLang servers last, together: even sleeping when
    idle, SGLang's CPU servers take memory and wake-ups the rest of the run need not share."""
    items.sort(
        key=lambda item: (
            "sglang_servers" in getattr(item, "fixturenames", ())
            or item.get_closest_marker("sglang") is not None
        )
    )


@pytest.fixture(scope="session")
def sglang_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3 in float32: SGLang computes in the weights' dtype, so greedy
    tokens equal the trainer's only in float32."""
    import torch

    from weightsync.testing.presets import preset_config, write_random_checkpoint

    path = tmp_path_factory.mktemp("sglang-qwen3")
    return write_random_checkpoint(path, preset_config("tiny"), dtype=torch.float32, seed=11)


@pytest.fixture(scope="session")
def sglang_servers(sglang_checkpoint, tmp_path_factory) -> Iterator[list]:
    """Two real SGLang 0.5.23 servers (tp 1, float32, API key) on this CPU, started together
    (each takes 30-80 s here); the first serves the conformance suite, both the sync tests.

    Skipped with the reason when SGLang's venv is not built (``scripts/setup --tests`` builds it).
    """
    from sglang_cpu.launch import start_sglang, venv_if_built

    venv = venv_if_built()
    if venv is None:
        pytest.skip("real SGLang's venv is not built here: run scripts/setup --tests")
    logs = tmp_path_factory.mktemp("sglang-logs")
    servers: list = []
    errors: list[BaseException] = []

    def wait(server) -> None:
        try:
            server.wait_ready(600.0)
        except BaseException as exc:  # raised below, on the test's thread
            errors.append(exc)

    try:
        # Launched from this (the main) thread, which outlives them (their parent-death
        # signal follows the thread that started them); they come up in parallel.
        for index in range(2):
            servers.append(
                start_sglang(
                    venv,
                    sglang_checkpoint,
                    api_key=SGLANG_API_KEY,
                    log_path=logs / f"sglang{index}.log",
                    # Idle schedulers sleep instead of polling: the tests beside them keep
                    # this machine's cores.
                    extra_args=["--sleep-on-idle"],
                    wait=False,
                )
            )
        waits = [threading.Thread(target=wait, args=(server,)) for server in servers]
        for thread in waits:
            thread.start()
        for thread in waits:
            thread.join()
        if errors:
            raise errors[0]
        yield servers
    finally:
        for server in servers:
            server.stop()
