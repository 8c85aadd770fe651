"""Settings every test process (and the processes it starts) shares."""

from __future__ import annotations

import os

# Mooncake reads these when an engine is created: quiet logs, and a transfer timeout short
# enough that a test with a dead peer fails in seconds.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
# gloo on loopback only; the machines that run the tests may have no other usable interface.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import fcntl
import importlib.util
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


def pytest_addoption(parser, pluginmanager) -> None:
    """Without pytest-xdist (not installed, or ``-p no:xdist``), take the ``--numprocesses`` and
    ``--dist`` of pyproject.toml's addopts and run the tests in this process, one after another
    (pytest reserves ``-n``, a short option, to plugins)."""
    if importlib.util.find_spec("xdist") is not None and not pluginmanager.is_blocked("xdist"):
        return  # xdist adds them (loaded after this file where a run names it with -p)
    group = parser.getgroup("xdist", "parallel runs (pytest-xdist; not loaded here)")
    ignored = "ignored: pytest-xdist is not loaded"
    group.addoption("--numprocesses", dest="numprocesses", default=None, help=ignored)
    group.addoption("--dist", dest="dist", default="no", help=ignored)


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


def _uses_sglang_servers(item: pytest.Item) -> bool:
    # The marker too: test_conformance.py asks for them by name (request.getfixturevalue).
    return (
        "sglang_servers" in getattr(item, "fixturenames", ())
        or item.get_closest_marker("sglang") is not None
    )


# Fixtures a run makes once per process, whose tests therefore share one xdist worker.
_SHARED_SCOPES = ("session", "package", "module", "class")
# Session fixtures cheap enough to make once per worker.
_PER_WORKER = frozenset({"sglang_checkpoint", "vllm_checkpoint", "tmp_path_factory"})


def _xdist_group(item: pytest.Item) -> str | None:
    """The worker group of `item` under ``--dist loadgroup`` (pyproject.toml's addopts), or None
    to let it run on either worker.

    Each xdist worker makes its own copy of a session or module fixture: a real server started
    in each would cost its start-up (most of a minute for vLLM and SGLang) and its memory twice,
    and a module fixture would be made again on the other worker. So the tests of the real
    SGLang servers form one group, those of the real vLLM servers another, and the tests of a
    module that share a fixture of a wider scope than the test run on one worker too."""
    if _uses_sglang_servers(item):
        return "sglang-servers"
    names = set(getattr(item, "fixturenames", ()))
    if "vllm_servers" in names:
        return "vllm-servers"
    # pytest keeps no public list of a test's fixture definitions; without it (another pytest),
    # every test runs on either worker, which is slower but as correct.
    info = getattr(item, "_fixtureinfo", None)
    definitions = getattr(info, "name2fixturedefs", {})
    for name in names - _PER_WORKER:
        if any(fixture.scope in _SHARED_SCOPES for fixture in definitions.get(name, ())):
            return item.nodeid.split("::", 1)[0]  # the module
    return None


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(session, config, items) -> Iterator[None]:
    """Run the tests that use the real SGLang servers last, together: even sleeping when
    idle, SGLang's CPU servers take memory and wake-ups the rest of the run need not share.
    Mark each test's xdist group (`_xdist_group`), before xdist reads the marks."""
    items.sort(key=_uses_sglang_servers)
    if config.pluginmanager.has_plugin("xdist"):  # else its marker is not registered
        for item in items:
            group = _xdist_group(item)
            if group is not None and item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(group))
    yield
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        for item in items:
            _name_group(item)


def _name_group(item: pytest.Item) -> None:
    """Append ``@group`` to the node id of a test with an ``xdist_group`` mark, where xdist's
    own hook could not: the id is how a worker tells the scheduler a test's group, and xdist
    3.8 writes it to ``Item._nodeid``, which pytest 9.2's node ids no longer read
    (pytest-dev/pytest-xdist#1386). Without this, grouped tests are scheduled one by one and
    each worker starts its own real servers."""
    names = set()
    for mark in item.iter_markers("xdist_group"):
        names.add(str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")))
    if not names:
        return
    suffix = "@" + "_".join(sorted(names))  # xdist's own form
    ident = getattr(item, "_id", None)
    if item.nodeid.endswith(suffix) or not hasattr(type(ident), "parse"):
        return  # xdist named it (a fixed release), or another pytest: nothing to correct
    item._id = type(ident).parse(item.nodeid + suffix)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist, a test marked ``serial`` (it bounds wall-clock times) runs alone: it waits
    for the other workers' tests in progress, and they wait for it. Every test holds a shared
    lock on a file of this run from its set-up to its teardown, a serial test the exclusive one;
    the turnstile before it keeps a worker that starts test after test from starving a serial
    test that waits."""
    run_dir = os.environ.get("PYTEST_XDIST_WORKER") and _xdist_run_dir(item.config)
    if not run_dir:
        return (yield)
    alone = item.get_closest_marker("serial") is not None
    with open(run_dir / "serial.lock", "a") as lock, open(run_dir / "turnstile.lock", "a") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)  # the lock goes with the file


def _xdist_run_dir(config: pytest.Config) -> Path | None:
    """The folder every worker of this xdist run shares (above each worker's basetemp)."""
    factory = getattr(config, "_tmp_path_factory", None)
    return None if factory is None else factory.getbasetemp().parent


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
