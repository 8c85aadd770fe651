"""Interprocess CUDA events of this host: opened from their IPC handles, waited for on the host.

Two processes on one host order their GPU work through them without a stream of either
waiting on the other's:

- a trainer writes into a replica's parameters with copies on its own CUDA stream (CUDA IPC)
  and may announce the end of a session while they still run; it names, by IPC handle, the
  event it recorded after them, and the replica waits for it before it verifies what
  arrived;
- a replica that begins a session with a fence queues the digest of what its parameters
  hold and answers at once with the event the digest completes at; every trainer rank that
  writes into it waits for that event before its first copy.

The waits are on the host, with a deadline, rather than on a stream: a peer that never
reaches its event (stuck, or gone) must not stall the waiter's own GPU work.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

# A peer records the same event every sync: the handles seen last stay open.
_KEEP = 16
# How long `IpcEvents.wait` looks without sleeping.
_SPIN_S = 1e-3


def wait_reached(
    events: Sequence[torch.cuda.Event], timeout_s: float, *, spin_s: float = 0.0
) -> bool:
    """Wait on the host until the work before each event's last record is done; False when
    it was not within `timeout_s` (it may still finish later). The first `spin_s` the
    thread looks without sleeping, then it sleeps 50 µs between looks: a push of 16 GB on
    one GPU takes ~9 ms, so waking that often costs nothing and loses at most that much at
    the end."""
    started = time.monotonic()
    while not all(event.query() for event in events):
        waited = time.monotonic() - started
        if waited > timeout_s:
            return False
        if waited >= spin_s:
            time.sleep(5e-5)
    return True


class IpcEvents:
    """The interprocess CUDA events of other processes of this host, opened from their IPC
    handles on `device` and kept while they are used.

    Args:
        device: the CUDA device of this process's work (a replica's rank 0, a trainer
            rank's).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._opened: OrderedDict[str, torch.cuda.Event] = OrderedDict()

    def open(self, handles: Sequence[str]) -> list[torch.cuda.Event]:
        """The events of `handles` (IPC handles, in hex), opened here once and kept.

        Raises:
            ValueError: a handle is not one, or cannot be opened here (a process on another
                host, or one that is gone).
        """
        return [self._open(handle) for handle in handles]

    @staticmethod
    def reached(events: Sequence[torch.cuda.Event]) -> bool:
        """Whether the work before each event's last record is done (a look, no wait)."""
        return all(event.query() for event in events)

    def wait(self, handles: Sequence[str], timeout_s: float) -> bool:
        """Wait until the events of `handles` are reached; False when they were not within
        `timeout_s` (the work may still finish later). The thread looks without sleeping
        for the first `_SPIN_S`: the events waited for are a few microseconds of GPU work
        away.

        Raises:
            ValueError: a handle cannot be opened here (see `open`).
        """
        return wait_reached(self.open(handles), timeout_s, spin_s=_SPIN_S)

    def _open(self, handle: str) -> torch.cuda.Event:
        event = self._opened.get(handle)
        if event is not None:
            self._opened.move_to_end(handle)
            return event
        try:
            raw = bytes.fromhex(handle)
            event = torch.cuda.Event.from_ipc_handle(self._device, raw)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(
                f"the IPC event handle {handle[:16]}... cannot be opened on {self._device} "
                f"({exc}): events are for processes on one host, both alive"
            ) from exc
        self._opened[handle] = event
        while len(self._opened) > _KEEP:
            self._opened.popitem(last=False)
        return event
