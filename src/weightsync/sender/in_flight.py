"""`InFlight`: the copies a replayed push left in flight, and the events they complete at.

A push replayed as a CUDA graph may return once its copies are queued
(``WeightSender.push(wait=False)``). It records an interprocess CUDA event after them, whose
IPC handle travels with its `PushStats` (``events``) so that a receiver on the same host can
wait for the copies itself; `InFlight.wait` waits for them on the trainer, and checks then the
pins of the tensors they read (`weightsync.sender.pins`).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from weightsync.cuda_events import wait_reached
from weightsync.errors import TransferError
from weightsync.sender.pins import PushPins
from weightsync.sender.stats import PushStats, partial_error


class InFlight:
    """One sender's copies in flight.

    Call protocol, per push: `settle` as it starts; for each part, `record` after a replay
    that leaves its copies in flight (with `keep_pins`), or `wait_recorded` before a part
    that waits for its writes; `finish` with the push's stats as it ends. `wait` once the
    caller needs the copies landed.

    Args:
        timeout_s: how long copies may take to land (``SenderConfig.timeout_s``).
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        # One interprocess event per device; its handle stays the same across records.
        self._events: dict[torch.device, tuple[torch.cuda.Event, str]] = {}
        # The event this push recorded, until `finish`.
        self._recorded: tuple[torch.cuda.Event, str] | None = None
        # The last push whose copies are in flight, with the event they complete at.
        self._in_flight: tuple[torch.cuda.Event, PushStats] | None = None
        # The pins of pushed parts whose copies are in flight, checked once they land.
        self._pins: list[PushPins] = []

    def record(self, device: torch.device) -> None:
        """Record `device`'s landing event on its current stream, after the copies queued."""
        landing = self._events.get(device)
        if landing is None:
            with torch.cuda.device(device):
                event = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream(device))
                landing = self._events[device] = (event, event.ipc_handle().hex())
        else:
            landing[0].record(torch.cuda.current_stream(device))
        self._recorded = landing

    def keep_pins(self, pins: PushPins) -> None:
        """Check `pins` once the copies in flight are seen landed."""
        self._pins.append(pins)

    def wait_recorded(self) -> None:
        """Before a part that waits for its writes: wait for the copies an earlier part of
        the push left in flight, so that the push returns with every write landed."""
        if self._recorded is None:
            return
        wait_reached((self._recorded[0],), self._timeout_s)
        self._recorded = None
        self.check_pins()

    def check_pins(self) -> None:
        """Check the pins of parts whose copies were in flight, now that they landed.

        Raises:
            TensorChangedError: a tensor they read changed before they landed.
        """
        pins, self._pins = self._pins, []
        for part in pins:
            part.check(until="its copies being seen landed")

    def finish(self, stats: PushStats) -> PushStats:
        """`stats` of a push that ended, with the event its copies complete at when they are
        in flight (those are then what `wait` waits for)."""
        recorded, self._recorded = self._recorded, None
        if not stats.in_flight:
            return stats
        if recorded is None:
            # A later part waited for its writes, and so for the copies before them.
            return dataclasses.replace(stats, in_flight=False)
        # The last part recorded the event on the stream every part's copies use.
        event, handle = recorded
        stats = dataclasses.replace(stats, events=(handle,))
        self._in_flight = (event, stats)
        return stats

    def settle(self) -> None:
        """Wait (up to the timeout) for copies left in flight that nobody waited for, and
        forget them (their pins unchecked, as `WeightSender.push` says): later work on the
        stream is ordered after them anyway."""
        pending, self._in_flight = self._in_flight, None
        self._pins = []
        if pending is not None:
            wait_reached((pending[0],), self._timeout_s)

    def wait(self) -> float:
        """Wait for the copies the last push left in flight (see `WeightSender.wait_landed`).

        Returns:
            The `time.perf_counter` at which they were seen done (now, when none were in
            flight).

        Raises:
            PartialPushError: they did not finish within the timeout.
            TensorChangedError: a tensor the copies read changed before they were seen done.
        """
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return time.perf_counter()
        event, stats = pending
        t0 = time.perf_counter()
        if wait_reached((event,), self._timeout_s):
            landed = time.perf_counter()
            self.check_pins()
            return landed
        waited = time.perf_counter() - t0
        failed = {
            session: TransferError(
                f"the copies into {session}'s mapped memory did not finish within "
                f"{self._timeout_s:g} s (waited {waited:.1f} s)",
                target_session=session,
            )
            for session in stats.bytes_per_target
        }
        raise partial_error(failed, stats, num_targets=len(failed))
