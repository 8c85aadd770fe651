"""The event loops weightsync's own async code runs on: uvloop where it is installed."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from typing import Literal

EventLoopKind = Literal["auto", "asyncio", "uvloop"]
EVENT_LOOP_KINDS: tuple[str, ...] = ("auto", "asyncio", "uvloop")


def event_loop_factory(kind: EventLoopKind = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new event loop of `kind`: ``uvloop`` (its loop runs a lifecycle call's
    I/O in a fraction of asyncio's Python), ``asyncio``, or ``auto``: uvloop where it is
    installed, else asyncio's.

    Raises:
        ValueError: an unknown kind, or ``uvloop`` where it is not installed.
    """
    if kind not in EVENT_LOOP_KINDS:
        raise ValueError(f"event loop {kind!r}: choose one of {', '.join(EVENT_LOOP_KINDS)}")
    if kind == "asyncio" or (kind == "auto" and importlib.util.find_spec("uvloop") is None):
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        raise ValueError(
            "event loop 'uvloop': uvloop is not installed (pip install uvloop), or choose 'asyncio'"
        ) from exc
    return uvloop.new_event_loop


def new_event_loop(kind: EventLoopKind = "auto") -> asyncio.AbstractEventLoop:
    """A new event loop of `kind` (see `event_loop_factory`), not set as the thread's.

    Raises:
        ValueError: an unknown kind, or ``uvloop`` where it is not installed.
    """
    return event_loop_factory(kind)()
