"""The built-in bit-exact check: snapshot and corrupt the replicas' weights before the
first update, and require that update to restore them bit for bit
(``ControlConfig.check_weight_update_equal``)."""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.errors import WeightSyncError
from weightsync.manager.config import ControlConfig
from weightsync.manager.lifecycle import ReplicaCalls, failures_of


class BitExactCheck:
    """Arms the check on the replicas of the first update and compares after it.

    Until an update restores them, armed replicas hold random weights: they count as
    dirty, and a retry does not snapshot them again.

    Args:
        calls: the calls to the replicas.
        config: the control plane's settings (whether the check runs at all).
    """

    def __init__(self, calls: ReplicaCalls, config: ControlConfig) -> None:
        self._calls = calls
        self._config = config
        self._checked = False
        self._armed: set[str] = set()

    def pending(self, replicas: Sequence[str]) -> bool:
        """Whether an update of `replicas` ends with the compare of replicas it corrupted."""
        return not self._checked and any(u in self._armed for u in replicas)

    def forget(self, url: str) -> None:
        """Replica `url` left the manager."""
        self._armed.discard(url)

    async def arm(self, replicas: Sequence[str], dirty: set[str]) -> None:
        """Snapshot and corrupt the weights of `replicas` not armed yet (once: until the
        check passes); they join `dirty`."""
        if not self._config.check_weight_update_equal or self._checked:
            return
        unarmed = [u for u in replicas if u not in self._armed]
        if unarmed:
            await self._calls.on_all(unarmed, "weights_checker", action="snapshot")
            dirty.update(unarmed)
            await self._calls.on_all(unarmed, "weights_checker", action="reset_tensors")
            self._armed.update(unarmed)

    async def compare(self, replicas: Sequence[str], dirty: set[str]) -> bool | None:
        """Compare the armed replicas among `replicas` with their snapshots; True when it
        ran and passed, None when it was not due.

        Raises:
            WeightSyncError: a replica does not hold its snapshot bit for bit (it joins
                `dirty`).
        """
        armed = [u for u in replicas if u in self._armed]
        if not armed or self._checked:
            return None
        results = await self._calls.call_all(
            armed,
            "weights_checker",
            action="compare",
            allow_quant_error=self._config.allow_quant_error,
            timeout_s=self._config.check_timeout_s,
        )
        failed = failures_of(results)
        if failed:
            dirty.update(u for u, _ in failed)
            url, exc = failed[0]
            raise WeightSyncError(
                f"bit-exact check failed on replica {url}: the first sync did not restore the "
                f"snapshotted weights: {exc}"
            ) from exc
        self._checked = True
        self._armed.clear()
        return True
