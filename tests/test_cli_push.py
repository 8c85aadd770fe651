"""`weightsync push`'s failures: bad input exits 2 with the option named; a replica that does
not take the update exits 1, with ``ok: false`` in ``--json``. (Pushes that land are in the
conformance suite, into the reference server and real SGLang; deltas between checkpoints in
test_cli_push_delta.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from weightsync.cli.main import app
from weightsync.testing.presets import preset_config, write_random_checkpoint


def _push(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightsync", "push", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"))


def _push_here(*args: str):
    """`weightsync push ARGS` in this process: for input refused before any replica is
    contacted (`test_an_unreachable_replica_exits_1` runs the command in a process of its
    own)."""
    return CliRunner().invoke(app, ["push", *args], env={"COLUMNS": "500"})


def test_bad_input_exits_2_naming_it(checkpoint: Path, tmp_path: Path) -> None:
    bad = _push_here(str(checkpoint), "--replica", "http://127.0.0.1:1", "--transport", "ib")
    assert bad.exit_code == 2 and "--transport must be one of tcp, rdma, auto" in bad.stderr
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny")))
    empty = _push_here(str(tmp_path), "--replica", "http://127.0.0.1:1")
    assert empty.exit_code == 2 and "no *.safetensors files" in empty.stderr
    missing = _push_here(str(checkpoint))
    assert missing.exit_code == 2 and "--replica" in missing.stderr


def test_an_unreachable_replica_exits_1(checkpoint: Path) -> None:
    done = _push(str(checkpoint), "--replica", "http://127.0.0.1:1", "--transport", "tcp", "--json")
    assert done.returncode == 1
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and result["bit_exact"] is None
    assert result["mode"] == "full" and result["bytes"] == result["full_bytes"] == 0
    assert "http://127.0.0.1:1" in result["error"] and "got no reply" in result["error"]
