"""No process outlives what started it: a replica started by the launcher, and every process
of `weightsync demo`, are gone within seconds of their starter's SIGKILL (real processes;
their pids recorded from /proc before the kill); a test run stopped with SIGTERM runs its
fixtures' finalizers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from faults import Stopwatch, record
from weightsync.testing.presets import preset_config, write_random_checkpoint

pytestmark = pytest.mark.faults

GONE_WITHIN_S = 10.0
READY_TIMEOUT_S = 120.0

# Starts a tp=2 replica with the launcher, says its pid, then waits to be killed.
_LAUNCHER = """
import sys, time
from weightsync.testing.launcher import start_replicas
(replica,) = start_replicas(sys.argv[1], tp=2, log_dir=sys.argv[2], api_key="orphan-key")
print(replica.process.pid, flush=True)
time.sleep(600)
"""


# A test run for the SIGTERM case: its session fixture's finalizer leaves a mark.
_SLOW_RUN = """
import pathlib, time
import pytest

@pytest.fixture(scope="session")
def resource():
    yield
    pathlib.Path(__file__).with_name("finalized").write_text("yes")

def test_waits(resource):
    pathlib.Path(__file__).with_name("started").write_text("yes")
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"))


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (a zombie waiting to be reaped runs no more)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (alive := _alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _describe(processes: list[psutil.Process]) -> list[str]:
    described = []
    for process in processes:
        try:
            described.append(f"{process.pid}: {' '.join(process.cmdline())[:120]}")
        except psutil.Error:
            described.append(str(process.pid))
    return described


def _kill_all(processes: list[psutil.Process]) -> None:
    for process in _alive(processes):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def test_a_replica_stops_when_its_launcher_is_killed(checkpoint, tmp_path):
    logs = tmp_path / "logs"
    helper = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(checkpoint), str(logs)],
        stdout=subprocess.PIPE,
        text=True,
    )
    tree: list[psutil.Process] = []
    try:
        assert helper.stdout is not None
        line = helper.stdout.readline()
        assert line.strip().isdigit(), f"the launcher did not start a replica: {line!r}"
        replica = psutil.Process(int(line))
        tree = [replica, *replica.children(recursive=True)]
        assert len(tree) == 2, _describe(tree)  # rank 0 and tp rank 1
        assert replica.ppid() == helper.pid
        os.kill(helper.pid, signal.SIGKILL)
        helper.wait()
        clock = Stopwatch()
        left = _wait_gone(tree, GONE_WITHIN_S)
        assert not left, f"outlived their launcher: {_describe(left)}"
        record("replica launcher SIGKILLed", "replica and its ranks exit", clock.seconds)
        # Rank 0 got SIGTERM from the kernel and stopped in order.
        log = (logs / "replica0.log").read_text()
        assert "stopping: received SIGTERM" in log and "stopped" in log.splitlines()[-1], log[
            -2000:
        ]
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()
        _kill_all(tree)


def test_a_killed_demo_leaves_no_process(tmp_path):
    workdir = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "weightsync", "demo", "--replicas", "1", "--rollout-tp", "2",
         "--trainer-ranks", "1", "--steps", "10000", "--workdir", str(workdir), "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    tree: list[psutil.Process] = []
    try:
        root = psutil.Process(demo.pid)
        deadline = time.monotonic() + READY_TIMEOUT_S
        # Wait until the replica serves and the trainer rank runs: then every kind of
        # process the demo starts is up.
        while True:
            assert demo.poll() is None, f"the demo exited with {demo.returncode}"
            children = root.children(recursive=True)
            trainers = [p for p in children if _is_spawned(p)]
            if (workdir / "logs" / "replica0.ready.json").exists() and trainers:
                break
            assert time.monotonic() < deadline, "the demo did not start its processes in time"
            time.sleep(0.2)
        tree = root.children(recursive=True)
        followers = [p for p in tree if "weightsync.server.ranks.follower" in _cmdline(p)]
        assert followers, _describe(tree)
        os.kill(demo.pid, signal.SIGKILL)
        demo.wait()
        clock = Stopwatch()
        left = _wait_gone(tree, GONE_WITHIN_S)
        assert not left, f"outlived the demo: {_describe(left)}"
        record("weightsync demo SIGKILLed", "every process it started exits", clock.seconds)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        _kill_all(tree)


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _is_spawned(process: psutil.Process) -> bool:
    """Whether `process` is a multiprocessing worker (a trainer rank), not its tracker."""
    cmdline = _cmdline(process)
    return "multiprocessing.spawn" in cmdline and "resource_tracker" not in cmdline


def test_sigterm_runs_the_fixture_finalizers(tmp_path):
    (tmp_path / "test_slow.py").write_text(_SLOW_RUN)
    tests_dir = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir), *sys.path])}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_slow.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (tmp_path / "started").exists():
            assert run.poll() is None, run.communicate()[0]
            assert time.monotonic() < deadline, "the test run did not start"
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert (tmp_path / "finalized").exists(), output
    assert "received SIGTERM" in output, output
