"""The event loops weightsync runs on (`weightsync.control.loops`), and the settings that
choose them."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from weightsync.control.loops import event_loop_factory, new_event_loop
from weightsync.manager.config import ControlConfig
from weightsync.server.config import ServeConfig


@pytest.mark.parametrize(
    ("kind", "loop_type"), [("auto", uvloop.Loop), ("uvloop", uvloop.Loop), ("asyncio", None)]
)
def test_each_kind_makes_its_loop(kind: str, loop_type: type | None) -> None:
    loop = new_event_loop(kind)  # type: ignore[arg-type]
    try:
        if loop_type is None:
            assert not isinstance(loop, uvloop.Loop)
            assert isinstance(loop, asyncio.AbstractEventLoop)
        else:
            assert isinstance(loop, loop_type)
        assert loop.run_until_complete(asyncio.sleep(0, result="ran")) == "ran"
    finally:
        loop.close()


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="event loop 'trio': choose one of auto, asyncio, uvloop"):
        event_loop_factory("trio")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ControlConfig\.event_loop"):
        ControlConfig(event_loop="trio")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="event loop 'trio'"):
        ServeConfig(model_path="/m", event_loop="trio")


def test_uvloop_where_it_is_missing_says_what_to_do(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def without_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_uvloop)
    with pytest.raises(ValueError, match="uvloop is not installed"):
        event_loop_factory("uvloop")


def test_replies_are_polled_for_by_default_only_with_cpus_to_spare(monkeypatch) -> None:
    from weightsync.manager import config as control_config

    assert ControlConfig(poll_replies_s=0).reply_poll_s == 0.0
    assert ControlConfig(poll_replies_s=0.002).reply_poll_s == 0.002
    monkeypatch.setattr(control_config, "_usable_cpus", lambda: control_config.POLL_MIN_CPUS)
    assert ControlConfig().reply_poll_s == 0.005
    monkeypatch.setattr(control_config, "_usable_cpus", lambda: control_config.POLL_MIN_CPUS - 1)
    assert ControlConfig().reply_poll_s == 0.0
    for bad in (-1.0, 2.0, "5ms"):
        with pytest.raises(ValueError, match="poll_replies_s must be between 0 and 1"):
            ControlConfig(poll_replies_s=bad)  # type: ignore[arg-type]
