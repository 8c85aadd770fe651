"""A push's fences: the replicas' begin digests that its writes must follow."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.cuda_events import IpcEvents
from weightsync.errors import TransferError
from weightsync.plan.items import SourcePlan


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

    def wait(self, plan: SourcePlan, fences: Mapping[str, str], timeout_s: float) -> None:
        """Return once the fence (an IPC event handle, by target session id) of every
        target `plan` writes to is reached.

        Raises:
            TransferError: a fence was not reached within `timeout_s` (nothing was written);
                ValueError: a fence's handle cannot be opened on this host.
        """
        sessions = sorted({t.session_id for ts in plan.targets.values() for t in ts})
        waited = [s for s in sessions if s in fences]
        if not waited:
            return
        if not self._events.wait([fences[s] for s in waited], timeout_s):
            raise TransferError(
                f"the begin digests of {', '.join(waited)} were not done within {timeout_s:g} s "
                "(a replica's GPU is stuck, or it is gone); nothing was written",
                target_session=waited[0],
            )
