"""A push's fences: the replicas' begin digests that its writes must follow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.cuda_events import IpcEvents
from weightsync.errors import TransferError
from weightsync.plan.items import SourcePlan


@dataclass(frozen=True, slots=True)
class Fence:
    """A CUDA event on this host that writes into one target must follow.

    Attributes:
        session_id: the target's transport session id.
        event: the IPC handle (hex) of the event (a replica's fenced begin digest).
    """

    session_id: str
    event: str


class PushFences:
    """Waits, on the host, for the fences of the targets a push writes to.

    A replica that begins a session with a fence (``weight_sync_fence``) queues the digest
    of what its parameters hold on its GPU and answers before it is done; a copy into its
    parameters before the digest read them would make it see bytes of the new weights as
    ones written outside any session. The digest takes microseconds of GPU work, so by the
    time a push starts the events are reached: the wait is a look at each.

    Args:
        device: the CUDA device of this rank's work (the events are opened there).
    """

    def __init__(self, device: torch.device) -> None:
        self._events = IpcEvents(device)

    def wait(self, plan: SourcePlan, fences: Sequence[Fence], timeout_s: float) -> None:
        """Return once every fence of a target `plan` writes to is reached (fences of other
        targets are not waited for).

        Raises:
            TransferError: a fence was not reached within `timeout_s` (nothing was written).
            ValueError: a fence's handle cannot be opened on this host.
        """
        sessions = {t.session_id for ts in plan.targets.values() for t in ts}
        waited = sorted((f for f in fences if f.session_id in sessions), key=lambda f: f.session_id)
        if not waited:
            return
        if not self._events.wait([f.event for f in waited], timeout_s):
            names = ", ".join(dict.fromkeys(f.session_id for f in waited))
            raise TransferError(
                f"the begin digests of {names} were not done within {timeout_s:g} s "
                "(a replica's GPU is stuck, or it is gone); nothing was written",
                target_session=waited[0].session_id,
            )
