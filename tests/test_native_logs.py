"""Mooncake's native start-up lines are logged by weightsync at DEBUG, not printed."""

from __future__ import annotations

import logging

from weightsync.transport import MooncakeConfig, MooncakeTransport


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
