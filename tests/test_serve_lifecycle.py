"""How `weightsync serve` starts, fails and stops: real processes, tp=2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from typer.testing import CliRunner

from servers import start_replicas
from weightsync.cli.main import app
from weightsync.testing.presets import preset_config, write_random_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"))


def _ranks(pid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(pid).children(recursive=True)
        if "weightsync.server.ranks.follower" in " ".join(p.cmdline())
    ]


def test_sigterm_stops_every_rank_cleanly(checkpoint, tmp_path):
    (replica,) = start_replicas(checkpoint, tp=2, log_dir=tmp_path)
    try:
        ranks = _ranks(replica.process.pid)
        assert len(ranks) == 1
        assert "listening on " + replica.url in replica.log_path.read_text()
        os.kill(replica.process.pid, signal.SIGTERM)
        assert replica.process.wait(60) == 0, replica.log_tail()
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive
        assert "tp1 weightsync.server.ranks.follower: stopped" in replica.log_path.read_text()
    finally:
        replica.stop()


def test_ranks_exit_when_rank0_is_killed(checkpoint, tmp_path):
    (replica,) = start_replicas(checkpoint, tp=2, log_dir=tmp_path)
    try:
        ranks = _ranks(replica.process.pid)
        replica.process.kill()
        replica.process.wait()
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, "a TP rank outlived rank 0"
    finally:
        replica.stop()


def test_failed_start_exits_non_zero_with_the_reason(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(preset_config("tiny")))
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        code = subprocess.run(
            [sys.executable, "-m", "weightsync", "serve", "--model", str(broken), "--tp", "2",
             "--port", "0", "--bootstrap-port", "0"],
            stdout=out, stderr=subprocess.STDOUT, timeout=120,
        ).returncode  # fmt: skip
    text = log.read_text()
    assert code == 1, text
    assert "tp rank 0 failed to start" in text and "no *.safetensors files" in text
    assert "listening on" not in text


def test_cli_rejects_bad_options(checkpoint):
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--model", str(checkpoint), "--tp", "2", "--ep", "3"])
    assert result.exit_code == 2
    assert "ep_size=3 must divide tp_size=2" in result.output
    result = runner.invoke(app, ["serve", "--model", str(checkpoint), "--dtype", "int4"])
    assert result.exit_code == 2 and "dtype must be one of" in result.output
    help_text = runner.invoke(app, ["serve", "--help"]).output
    options = (
        "--model --tp --ep --device --host --port --bootstrap-port --api-key --dtype "
        "--transport --mooncake-protocol --ready-file"
    )
    for option in options.split():
        assert option in help_text
