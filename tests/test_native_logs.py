"""Mooncake's native start-up lines are logged by weightsync at DEBUG, not printed."""

from __future__ import annotations

import logging

from weightsync.transport import MooncakeConfig, MooncakeTransport
from weightsync.transport.mooncake.engine import _emit_captured


def test_engine_start_up_lines_go_to_the_debug_log_not_to_stderr(capfd, caplog):
    capfd.readouterr()
    with (
        caplog.at_level(logging.DEBUG, logger="weightsync.transport.mooncake.native"),
        MooncakeTransport(MooncakeConfig(protocol="tcp")),
    ):
        pass
    err = capfd.readouterr().err
    assert "transfer_metadata.cpp" not in err and "InitGoogleLogging" not in err, err
    native = [
        r.getMessage() for r in caplog.records if r.name == "weightsync.transport.mooncake.native"
    ]
    assert any("Local segment descriptor not found" in line for line in native), native
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name.endswith("native"))


def test_what_other_threads_wrote_while_captured_goes_back_to_stderr(capsys, caplog):
    glog = "E1201 11:07:19.381026 13675 transfer_metadata.cpp:1098] Local segment descriptor"
    with caplog.at_level(logging.DEBUG, logger="weightsync.transport.mooncake.native"):
        _emit_captured([glog, "WARNING: Logging before InitGoogleLogging() is written to STDERR",
                        "a warning of another thread"])  # fmt: skip
    assert capsys.readouterr().err == "a warning of another thread\n"
    assert [r.getMessage() for r in caplog.records] == [
        glog,
        "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    ]


def test_a_config_that_says_so_leaves_stderr_alone(tmp_path):
    import subprocess
    import sys

    probe = (
        "import os, stat, sys\n"
        "from weightsync.transport import MooncakeConfig, MooncakeTransport\n"
        "capture = sys.argv[1] == 'on'\n"
        "MooncakeTransport(MooncakeConfig(protocol='tcp', capture_native_logs=capture)).close()\n"
        "print(stat.S_ISFIFO(os.fstat(2).st_mode))\n"
    )
    seen = {}
    for mode in ("on", "off"):
        # stderr is a file: descriptor 2 becomes a pipe only where the capture takes it.
        with (tmp_path / f"{mode}.err").open("w") as err:
            done = subprocess.run(
                [sys.executable, "-c", probe, mode],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
            )
        assert done.returncode == 0, (tmp_path / f"{mode}.err").read_text()[-2000:]
        seen[mode] = done.stdout.strip().splitlines()[-1]
    assert seen == {"on": "True", "off": "False"}
