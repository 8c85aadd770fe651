"""Fault injection: checkpoints that lie, pushed by a careless or hostile operator with
`weightsync push` (a real process) into a real `weightsync serve` replica over Mooncake TCP.

A checkpoint whose header lies (a tensor with no bytes but a full shape, tensors sharing
bytes, a truncated file) is refused before the replica is touched: exit 2, one line naming
the file and the tensor, no traceback, and the replica serves its old weights under its old
label. A file truncated while it is pushed fails the push cleanly (no SIGBUS): the replica
stays paused and incomplete, serves nothing under a new label, and the next good push
recovers it. ``WEIGHTSYNC_FAULT_TABLE=path`` collects case, outcome and time to fail.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from faults import Stopwatch, call, record, serves
from servers import ServedReplica, serve_replicas
from weightsync.checkpoint import read_safetensors_header
from weightsync.testing.presets import preset_config, write_random_checkpoint

pytestmark = pytest.mark.faults

TINY = preset_config("tiny")
HERE = Path(__file__).parent
# A push that fails takes a process start and, mid-push, a few lifecycle calls: seconds. The
# deadline leaves room for a loaded machine; the timeout stops a push that hangs.
FAIL_DEADLINE_S = 60.0
PUSH_TIMEOUT_S = 120
# A line the command's logging writes (`weightsync.cli.logs`).
LOG_RECORD = re.compile(r"^weightsync[\w.]*: (DEBUG|INFO|WARNING|ERROR|CRITICAL): ")


def weights_state(url: str) -> dict[str, Any]:
    return call(url, "get_server_info")["weightsync"]


def push(folder: Path, url: str, *, truncate: str | None = None) -> subprocess.CompletedProcess:
    """`weightsync push` of `folder` into `url` in a process of its own; with `truncate`,
    the checkpoint is cut inside that tensor while the push writes (`truncating_push.py`)."""
    args = ["push", str(folder), "--replica", url, "--transport", "tcp", "--bucket-mb", "1"]
    if truncate is None:
        command = [sys.executable, "-m", "weightsync", *args]
    else:
        command = [sys.executable, str(HERE / "truncating_push.py"), truncate, *args[1:]]
    return subprocess.run(command, capture_output=True, text=True, timeout=PUSH_TIMEOUT_S)


def lying_copy(good: Path, folder: Path, lie: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of checkpoint `good` in `folder` whose model.safetensors header `lie` edited
    (the data section is kept as it is)."""
    shutil.copytree(good, folder)
    file = folder / "model.safetensors"
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    lie(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    return file


def assert_one_line_naming(done: subprocess.CompletedProcess, *names: str) -> str:
    """The failed push's one error line on stderr, which names every one of `names` (the
    other lines are log records: warnings and errors the library logs on the way)."""
    assert done.returncode != 0, done.stderr
    assert done.returncode > 0, f"killed by signal {-done.returncode}: {done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not LOG_RECORD.match(line)]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(("weightsync push: ", "push failed: ")), done.stderr
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


def requests_of_a_push(replica: ServedReplica, log_before: str) -> list[str]:
    """The access-log lines since `log_before` of the requests by which a push pauses a
    replica and learns where to write (``/begin_weight_sync`` or ``/pause_generation``,
    the transfer-engine info). The test's own earlier requests (``/server_info``,
    ``/model_info``, ``/generate``) may still be logged late, and are not among them."""
    log = replica.log_path.read_text()
    assert log.startswith(log_before)
    routes = ("weight_sync", "pause", "weight_update", "transfer_engine_info", "parallelism")
    return [
        line
        for line in log[len(log_before) :].splitlines()
        if "uvicorn.access" in line and any(route in line for route in routes)
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY, seed=0)


@pytest.fixture(scope="module")
def replica(checkpoint, tmp_path_factory) -> Iterator[ServedReplica]:
    with serve_replicas(checkpoint, log_dir=tmp_path_factory.mktemp("replica")) as (served,):
        yield served


def _empty_offsets(header: dict[str, Any]) -> None:
    begin = header["lm_head.weight"]["data_offsets"][0]
    header["lm_head.weight"]["data_offsets"] = [begin, begin]


def _overlap(header: dict[str, Any]) -> None:
    aliased = header["model.layers.0.mlp.up_proj.weight"]["data_offsets"]
    header["model.layers.1.mlp.up_proj.weight"]["data_offsets"] = list(aliased)


@pytest.mark.parametrize(
    ("case", "lie", "tensor", "match"),
    [
        ("a tensor with empty offsets and a full shape", _empty_offsets, "lm_head.weight",
         "hold 0"),
        ("a tensor aliasing another's bytes", _overlap, "model.layers.1.mlp.up_proj.weight",
         "overlap those of tensor 'model.layers.0.mlp.up_proj.weight'"),
    ],
)  # fmt: skip
def test_a_lying_header_is_refused_before_the_replica_is_touched(
    checkpoint, replica, tmp_path, case, lie, tensor, match
) -> None:
    url = replica.url
    before = call(url, "served_weight_version")
    file = lying_copy(checkpoint, tmp_path / "lying", lie)
    log_before = replica.log_path.read_text()
    clock = Stopwatch()
    done = push(file.parent, url)
    took = clock.seconds
    line = assert_one_line_naming(done, str(file), repr(tensor), match)
    assert done.returncode == 2, line
    assert took < FAIL_DEADLINE_S, took
    # Never paused nor written: the push sent the replica nothing, and it serves its old
    # weights under their label.
    assert requests_of_a_push(replica, log_before) == []
    state = weights_state(url)
    assert state["weights"]["complete"] and state["session"]["state"] == "closed"
    assert call(url, "served_weight_version") == before and serves(url)
    record(f"checkpoint: {case}", "refused before any write (exit 2, one line)", took)


def test_a_truncated_file_is_refused_before_the_replica_is_touched(
    checkpoint, replica, tmp_path
) -> None:
    url = replica.url
    before = call(url, "served_weight_version")
    shutil.copytree(checkpoint, tmp_path / "cut")
    file = tmp_path / "cut" / "model.safetensors"
    last = read_safetensors_header(file)[-1]
    with file.open("r+b") as handle:
        handle.truncate(last.offset + last.num_bytes - 100)
    log_before = replica.log_path.read_text()
    clock = Stopwatch()
    done = push(file.parent, url)
    took = clock.seconds
    line = assert_one_line_naming(done, str(file), repr(last.name), "truncated")
    assert done.returncode == 2, line
    assert took < FAIL_DEADLINE_S, took
    assert requests_of_a_push(replica, log_before) == []
    assert call(url, "served_weight_version") == before and serves(url)
    record("checkpoint: a truncated file", "refused before any write (exit 2, one line)", took)


def test_a_file_truncated_mid_push_fails_cleanly_and_the_next_push_recovers(
    replica, tmp_path
) -> None:
    url = replica.url
    before = call(url, "served_weight_version")
    # Other weights than the replica serves, so that what lands before the cut changes it.
    other = write_random_checkpoint(tmp_path / "other", TINY, seed=1)
    shutil.copytree(other, tmp_path / "cut")
    file = tmp_path / "cut" / "model.safetensors"
    # The last tensor in the file: the buckets before it are written when the file is cut.
    last = read_safetensors_header(file)[-1]
    log_before = replica.log_path.read_text()
    clock = Stopwatch()
    done = push(file.parent, url, truncate=last.name)
    took = clock.seconds
    line = assert_one_line_naming(done, str(file), repr(last.name), "changed while it was read")
    assert done.returncode == 1, line
    assert f"replicas {url} stay paused" in line, line
    # Paused and incomplete: it serves nothing, and no new label names what it holds.
    info = call(url, "get_server_info")
    assert info["state"]["paused"], info["state"]
    assert not info["weightsync"]["weights"]["complete"], info["weightsync"]
    assert not serves(url)
    assert call(url, "served_weight_version") == before
    # This push did reach the replica (the check the refused pushes pass is not vacuous).
    deadline = time.monotonic() + 10
    while not requests_of_a_push(replica, log_before):
        assert time.monotonic() < deadline, "the push's requests are not in the replica's log"
        time.sleep(0.02)
    # The next good push recovers it.
    recovered = push(other, url)
    assert recovered.returncode == 0, recovered.stderr
    assert weights_state(url)["weights"]["complete"] and serves(url)
    assert call(url, "served_weight_version") != before
    assert took < FAIL_DEADLINE_S, took
    record("checkpoint truncated mid-push", "push fails (exit 1): replica paused, incomplete", took)
