"""`WriterEvents`: waiting for writes another process queued on a GPU of this host.

A trainer on the same host writes into the replica's parameters with copies on its own CUDA
stream (CUDA IPC), and may announce the end of a session while they still run. It then
names, by IPC handle, the interprocess CUDA event it recorded after them; the replica opens
the event and waits for it before it verifies what arrived. The wait is on the host, with a
deadline, rather than on a stream of the replica's: a trainer that never reaches the event
(stuck, or gone) must not stall the replica's own GPU work.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

# A trainer records the same event every sync: the handles seen last stay open.
_KEEP = 16
# How long the host sleeps between two looks at the events: a 16 GB copy takes ~8 ms, and
# what this adds to the end of the wait is on the sync's critical path.
_POLL_S = 2e-5


class WriterEvents:
    """The interprocess CUDA events other processes' writes into this replica complete at,
    opened from their IPC handles on `device` and kept while they are used.

    Args:
        device: the replica's CUDA device (its rank 0's).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._opened: OrderedDict[str, torch.cuda.Event] = OrderedDict()

    @property
    def device(self) -> torch.device:
        """The device the events are opened on."""
        return self._device

    def wait(self, handles: Sequence[str], timeout_s: float) -> bool:
        """Wait until the work before each event's last record is done (blocking: call it
        from a worker thread); False when it was not within `timeout_s`.

        Args:
            handles: the events' IPC handles, in hex.
            timeout_s: how long to wait for all of them.

        Raises:
            ValueError: a handle is not one, or cannot be opened here (a process on another
                host, or one that is gone).
        """
        events = [self._open(handle) for handle in handles]
        deadline = time.monotonic() + timeout_s
        for event in events:
            while not event.query():
                if time.monotonic() > deadline:
                    return False
                time.sleep(_POLL_S)
        return True

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
                f"after_events: the IPC event handle {handle[:16]}... cannot be opened on "
                f"{self._device} ({exc}); events are for a trainer on this host whose "
                "copies are in flight: leave after_events out otherwise"
            ) from exc
        self._opened[handle] = event
        while len(self._opened) > _KEEP:
            self._opened.popitem(last=False)
        return event
