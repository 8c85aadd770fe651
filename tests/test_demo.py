"""`weightsync demo`, the main job, run as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from weightsync.cli.main import app

pytestmark = pytest.mark.slow
# A glog line (Mooncake's): severity and date, time, thread, file:line].
NATIVE_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.MULTILINE)
# The same line as weightsync logs it (`weightsync.transport.mooncake.native_log`).
NATIVE_RECORD = re.compile(
    r"mooncake\.native: DEBUG: [IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
)


def _demo(*args: str, timeout_s: float = 300) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync", "demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, json.loads(lines[-1]) if lines else {}, proc.stderr


def _refused(*args: str) -> str:
    """Run ``weightsync demo ARGS`` in this process (the checks run before anything starts)
    and return its stderr, asserting it exits 2 as bad input. (`test_demo_refuses_bad_options`
    runs one refusal as a user runs it, in a process of its own.)"""
    result = CliRunner().invoke(app, ["demo", *args], env={"COLUMNS": "500"})
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    return result.stderr


def test_demo_json_default_shape():
    code, result, stderr = _demo("--steps", "2")
    assert code == 0, stderr[-3000:]
    assert result["ok"] is True
    assert (result["replicas"], result["rollout_tp"], result["trainer_ranks"]) == (2, 2, 2)
    assert result["bit_exact"] is True and result["generation_match"] is True
    syncs = result["syncs"]
    assert [s["version"] for s in syncs] == ["1", "2", "3"]
    for sync in syncs:
        assert set(sync) >= {"version", "bytes", "seconds", "gbps"}
        assert sync["bytes"] > 0 and sync["seconds"] > 0 and sync["gbps"] > 0
        assert (sync["mode"], sync["writes"], sync["density"]) == ("full", {}, None)
    assert (result["delta"], result["lr"]) == (False, 2e-3)
    # Quiet by default: no native log line, and where Mooncake listens said once (by trainer
    # rank 0, not by both ranks).
    assert not NATIVE_LINE.search(stderr) and "InitGoogleLogging" not in stderr, stderr
    assert stderr.count("listens on every interface") == 1, stderr


def test_demo_delta_writes_only_what_changed_after_the_first_sync():
    code, result, stderr = _demo("--delta", "--steps", "2")
    assert code == 0, stderr[-3000:]
    assert result["ok"] is True and result["delta"] is True and result["lr"] == 1e-6
    assert result["bit_exact"] is True and result["generation_match"] is True
    first, *later = result["syncs"]
    assert [s["version"] for s in result["syncs"]] == ["1", "2", "3"]
    assert first["mode"] == "full" and first["bytes"] == first["full_bytes"]
    assert {w["mode"] for w in first["writes"].values()} == {"full"}
    assert len(first["writes"]) == 2 and first["density"] is None
    for sync in later:
        assert sync["mode"] == "delta", sync["writes"]
        assert {w["mode"] for w in sync["writes"].values()} == {"delta"}
        assert 0 < sync["density"] < 0.5
        assert 0 < sync["bytes"] < sync["full_bytes"] == first["full_bytes"]
    for sync in result["syncs"]:
        assert sync["bit_exact"] is True and sync["generation_match"] is True, sync


@pytest.mark.parametrize(
    ("args", "option", "why"),
    [
        (("--delta", "--dtype", "fp16"), "--delta", "bf16"),
        (("--delta", "--lr", "0"), "--lr", "positive"),
    ],
)
def test_demo_refuses_delta_where_it_cannot_work(args, option, why):
    stderr = _refused(*args)
    assert option in stderr and why in stderr, stderr


@pytest.fixture(scope="module")
def deepseek_demo() -> tuple[int, dict, str]:
    """One ``--verbose`` run of the demo at DeepSeek-V3's SGLang layouts: what the two tests
    below check of it does not depend on one another (``--verbose`` changes what the trainer
    ranks log, nothing else)."""
    return _demo(
        "--model", "tiny-deepseek", "--rollout-dp-attention", "2",
        "--rollout-fused-shared-experts", "--rollout-fp8", "--steps", "1", "--replicas", "1",
        "--verbose",
    )  # fmt: skip


def test_demo_verbose_shows_the_native_log_lines(deepseek_demo):
    code, result, stderr = deepseek_demo
    assert code == 0 and result["ok"], stderr[-3000:]
    # Shown as log records of weightsync's, never as glog's own lines on stderr.
    assert NATIVE_RECORD.search(stderr), stderr[-3000:]
    assert not NATIVE_LINE.search(stderr), stderr[-3000:]
    assert "transfer_metadata.cpp" in stderr and "InitGoogleLogging" in stderr


def test_demo_moe_with_expert_parallelism():
    code, result, stderr = _demo(
        "--model", "tiny-moe", "--rollout-tp", "2", "--rollout-ep", "2", "--steps", "1",
        "--replicas", "1", "--trainer-pp", "2",
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    assert result["ok"] and result["bit_exact"] and result["generation_match"]


def test_demo_deepseek_as_sglang_serves_it_at_scale(deepseek_demo):
    """A replica with two attention-DP groups and the shared expert fused into the experts,
    in block FP8 (tests/test_sync_deepseek_scale.py takes each layout apart): the first sync
    bit-exact after the checker's reset, generation equal to the trainer model's after every
    sync."""
    code, result, stderr = deepseek_demo
    assert code == 0, stderr[-3000:]
    assert result["ok"] and result["bit_exact"] and result["generation_match"]
    assert result["rollout_dp_attention"] == 2
    assert result["rollout_fused_shared_experts"] is True


@pytest.mark.megatron
def test_demo_megatron_trainer_syncs_from_its_slices():
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (scripts/setup --tests installs it)")
    code, result, stderr = _demo(
        "--trainer", "megatron", "--trainer-ranks", "2", "--trainer-tp", "2", "--steps", "1",
        "--replicas", "1", "--rollout-tp", "1", "--dtype", "fp32",
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    assert result["trainer"] == "megatron"
    assert result["ok"] and result["bit_exact"] and result["generation_match"]


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--trainer", "fsdp", "--trainer-pp", "2"), "--trainer-pp"),
        (("--trainer", "hf", "--trainer-tp", "2"), "--trainer-tp"),
        (("--trainer", "deepspeed"), "--trainer"),
    ],
)
def test_demo_refuses_bad_trainer_options(args, option):
    stderr = _refused(*args)
    assert option in stderr, stderr


def test_demo_megatron_trainer_without_megatron_core_says_how_to_install_it(monkeypatch):
    # As in an environment without megatron-core: no `megatron` package can be imported
    # (nor found, even were it imported already).
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    stderr = _refused("--trainer", "megatron")
    assert "./scripts/setup --megatron" in stderr, stderr
    pip = f"{sys.executable} -m pip install --ignore-requires-python megatron-core=="
    assert pip in stderr, stderr


def test_demo_refuses_bad_options():
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync", "demo", "--rollout-ep", "2", "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--rollout-ep" in proc.stderr and "MoE" in proc.stderr


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--rollout-dp-attention", "2", "--model", "tiny-moe"), "--rollout-dp-attention"),
        (("--rollout-dp-attention", "3", "--model", "tiny-deepseek"), "--rollout-dp-attention"),
        (("--rollout-fused-shared-experts", "--model", "tiny"), "--rollout-fused-shared-experts"),
    ],
)
def test_demo_refuses_deepseek_layouts_elsewhere(args, option):
    stderr = _refused(*args)
    assert option in stderr, stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_demo_cleans_up_every_process_when_interrupted(tmp_path, signum):
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync", "demo", "--steps", "100", "--replicas", "1",
         "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        # The first sync's table means replicas and trainer ranks are all up.
        for line in proc.stdout:
            if line.startswith("sync 1"):
                break
        else:
            pytest.fail(f"the demo ended before its first sync (exit {proc.wait()})")
        assert _processes_using(workdir), "the replicas should be running"
        proc.send_signal(signum)
        proc.stdout.read()
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _processes_using(workdir) == []


def _processes_using(workdir) -> list[str]:
    """Command lines of live replica processes serving the demo's checkpoint in `workdir`."""
    needle = f"--model {workdir / 'checkpoint'} "
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                cmdline = file.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            found.append(cmdline)
    return found


def test_demo_stops_waiting_for_ranks_blocked_on_one_that_failed(monkeypatch):
    """One trainer rank fails; the others, waiting in a collective for it, never exit: the
    demo reports the failure after its grace instead of hanging (it then ends them)."""
    import queue
    import time

    from rich.console import Console

    from weightsync.cli import demo_cmd

    class Blocked:
        def is_alive(self) -> bool:
            return True

    events: queue.Queue = queue.Queue()
    events.put({"kind": "error", "rank": 0, "message": "boom", "trace": "Traceback: boom"})
    events.put({"kind": "exit", "rank": 0})
    monkeypatch.setattr(demo_cmd, "PEERS_GRACE_S", 1.0)
    start = time.monotonic()
    failure = demo_cmd._collect(
        events, [Blocked(), Blocked()], {}, None, None, Console(quiet=True), True
    )
    assert failure == "trainer rank 0: boom"
    assert time.monotonic() - start < 10
