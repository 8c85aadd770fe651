"""Waiting on rank 0's event loop for the trainers' copies into a replica to land."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from weightsync.cuda_events import IpcEvents
from weightsync.server.http import ControlError

logger = logging.getLogger(__name__)

LANDING_TIMEOUT_S = 60.0
"""How long a fused end without a budget waits for the trainers' in-flight copies."""
# For how long of a wait the event loop looks at the events without sleeping.
_SPIN_S = 0.05


class NotLandedError(ControlError):
    """The trainers' events a fused end was to wait for cannot be, or were not, reached."""


async def await_landing(events: IpcEvents | None, handles: Sequence[str], timeout_s: float) -> None:
    """Wait until the trainers' events (`handles`, opened with `events`) are reached,
    looking at them between the loop's other work: the end starts the moment the copies
    land (a worker thread would add a wake-up of this loop, a quarter of a millisecond,
    after them). The loop turns without sleeping for the first `_SPIN_S` (a colocated
    copy takes milliseconds), then a millisecond at a time.

    Raises:
        NotLandedError: the events cannot be waited for here (400: `events` is None, or a
            handle does not open), or were not reached within `timeout_s` (504).
    """
    if events is None:
        raise NotLandedError(
            "after_events: this replica cannot wait for CUDA events (its weights are not "
            "on a GPU; it does not advertise weight_sync_events)",
            status_code=400,
        )
    try:
        opened = events.open(handles)
    except ValueError as exc:
        raise NotLandedError(str(exc), status_code=400) from exc
    started = time.monotonic()
    while not events.reached(opened):
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise NotLandedError(
                f"the trainers' copies (after_events) did not finish within {timeout_s:g} s",
                status_code=504,
            )
        await asyncio.sleep(0 if waited < _SPIN_S else 1e-3)
    logger.debug("the trainers' copies landed (waited %.2f ms)", (time.monotonic() - started) * 1e3)
