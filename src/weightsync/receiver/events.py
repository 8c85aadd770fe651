"""`WriterEvents`: waiting for writes another process queued on a GPU of this host.

A trainer on the same host writes into the replica's parameters with copies on its own CUDA
stream (CUDA IPC), and may announce the end of a session while they still run. It then
names, by IPC handle, the interprocess CUDA event it recorded after them; the replica opens
the event and waits for it before it verifies what arrived. The wait is on the host, with a
deadline (the replica's event loop looks at the events between its other work), rather than
on a stream of the replica's: a trainer that never reaches the event (stuck, or gone) must
not stall the replica's own GPU work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

# A trainer records the same event every sync: the handles seen last stay open.
_KEEP = 16


class WriterEvents:
    """The interprocess CUDA events other processes' writes into this replica complete at,
    opened from their IPC handles on `device` and kept while they are used.

    Args:
        device: the replica's CUDA device (its rank 0's).
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
