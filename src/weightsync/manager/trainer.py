"""`TrainerSync`: one weight sync as a collective call over the trainer's ranks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from weightsync.manager.manager import SyncManager
from weightsync.manager.report import PushSummary, SyncReport
from weightsync.plan import SourceHolding, SourcePlan, TargetRank, build_plan
from weightsync.sender import ModelExport, PushStats, WeightSender

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Outcome:
    """What one source rank reports back to the driver after its push."""

    rank: int
    stats: PushStats | None
    error: BaseException | None


class TrainerSync:
    """Runs `SyncManager.update_weights` with every trainer rank as a source.

    Call protocol (every rank of the trainer group, the same number of times):

    1. every rank builds ``TrainerSync(sender, hf_config=..., manager=...)``, passing the
       `SyncManager` on the driver rank (group rank 0) and ``None`` elsewhere;
    2. after each optimizer step every rank calls ``sync(export)`` with its PP-local export;
       the driver runs the lifecycle and, when it is time to push, builds and validates the
       plan (once per set of targets and holdings) and scatters each rank its share; every
       rank writes its share, and the driver finishes the lifecycle; every rank returns the
       same `SyncReport` or raises the same error;
    3. ``close()`` on every rank.

    The driver runs the manager's coroutines on an event loop of its own (a daemon thread),
    so a training loop without asyncio can drive it.
    """

    def __init__(
        self,
        sender: WeightSender,
        *,
        hf_config: Any,
        manager: SyncManager | None = None,
        dtype: str | None = None,
    ) -> None:
        """Bind a rank's sender to the trainer group.

        Args:
            sender: this rank's sender (its group is the trainer group).
            hf_config: the model's HF config (object or config.json dict).
            manager: the `SyncManager` on the driver rank (group rank 0), None elsewhere.
            dtype: the rollout dtype name; default: the config's.

        Raises:
            ValueError: a manager on a non-driver rank, or none on the driver.
        """
        self._sender = sender
        self._group = sender.group
        self._rank = sender.rank
        self._world_size = sender.world_size
        if (manager is not None) != (self._rank == 0):
            raise ValueError(
                f"TrainerSync: pass the SyncManager on trainer rank 0 only (this is rank "
                f"{self._rank}, manager {'given' if manager is not None else 'missing'})"
            )
        self._manager = manager
        self._hf_config = hf_config
        self._dtype = dtype
        self._plan: SourcePlan | None = None  # this rank's share of the current plan
        self._plan_key: tuple[int, tuple[SourceHolding, ...]] | None = None  # driver only
        self._loop: asyncio.AbstractEventLoop | None = None
        if manager is not None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(
                target=self._loop.run_forever, name="weightsync-manager", daemon=True
            ).start()

    @property
    def manager(self) -> SyncManager | None:
        """The manager on the driver rank, None elsewhere."""
        return self._manager

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the manager (e.g. ``remove_replica``) on the driver's loop."""
        if self._loop is None:
            raise ValueError("TrainerSync.run is for the driver rank (rank 0) only")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def sync(self, export: ModelExport, *, version: str | None = None) -> SyncReport:
        """Push this rank's weights into every replica; collective over the trainer group.

        Raises:
            LayoutMismatchError: the plan was refused before any write (every rank raises
                it; the replicas serve their previous weights).
            WeightSyncError / ValueError: as `SyncManager.update_weights` raised on the driver.
        """
        holdings = tuple(self._sender.gather_holdings(export))
        if self._manager is None:
            return self._follow(export)
        pushed = False

        async def push(targets: Sequence[TargetRank], epoch: int) -> PushSummary:
            nonlocal pushed
            # The driver builds (and validates) the plan before any rank writes, so a
            # mismatch fails the sync with nothing written.
            plans = await asyncio.to_thread(self._source_plans, targets, epoch, holdings)
            pushed = True
            self._broadcast(("push", plans is not None, 0))
            return await asyncio.to_thread(self._push, export, targets, plans)

        try:
            report = self.run(self._manager.update_weights(push, version=version))
        except BaseException as exc:
            if not pushed:
                self._broadcast(("abort", False, 0))
            self._broadcast(("failed", exc, 0))
            raise
        self._broadcast(("done", report, 0))
        return report

    def close(self) -> None:
        """Stop the driver's loop and free the sender's staging memory."""
        if self._loop is not None:
            if self._manager is not None:
                self.run(self._manager.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        self._sender.close()

    def _follow(self, export: ModelExport) -> SyncReport:
        kind, new_plan, _ = self._broadcast(None)
        if kind == "push":
            self._push(export, (), [None] * self._world_size if new_plan else None)
        kind, payload, _ = self._broadcast(None)
        if kind == "failed":
            raise payload
        return payload

    def _source_plans(
        self,
        targets: Sequence[TargetRank],
        epoch: int,
        holdings: tuple[SourceHolding, ...],
    ) -> list[SourcePlan] | None:
        """The driver: every rank's share of the plan, or None when the cached one holds."""
        key = (epoch, holdings)
        if self._plan_key == key:
            return None
        plan = build_plan(
            hf_config=self._hf_config, targets=targets, sources=holdings, dtype=self._dtype
        )
        self._plan_key = key
        return [plan.for_source(h.rank) for h in holdings]

    def _push(
        self,
        export: ModelExport,
        targets: Sequence[TargetRank],
        plans: list[SourcePlan | None] | None,
    ) -> PushSummary:
        """Every rank: receive its new plan (if any), write its share, report to the driver."""
        try:
            if plans is not None:
                self._plan = self._scatter(plans)
            if self._plan is None:
                raise ValueError(f"trainer rank {self._rank} has no plan to push")
            stats = self._sender.push(self._plan, export)
            outcome = _Outcome(rank=self._rank, stats=stats, error=None)
        except Exception as exc:  # reported to the driver, which raises it for everyone
            outcome = _Outcome(rank=self._rank, stats=None, error=exc)
        outcomes = self._gather(outcome)
        if outcomes is None:
            return PushSummary(bytes_written=0, bytes_staged=0, num_writes=0, num_regions=0)
        failed = [o for o in outcomes if o.error is not None]
        if failed:
            raise failed[0].error
        return _summarize(outcomes, targets)

    def _src(self) -> int:
        import torch.distributed as dist

        return 0 if self._group is None else dist.get_global_rank(self._group, 0)

    def _broadcast(self, obj: Any) -> Any:
        if self._world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._src(), group=self._group)
        return box[0]

    def _scatter(self, plans: list[SourcePlan | None]) -> SourcePlan:
        if self._world_size == 1:
            return plans[0]
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(
            box, plans if self._rank == 0 else None, src=self._src(), group=self._group
        )
        return box[0]

    def _gather(self, outcome: _Outcome) -> list[_Outcome] | None:
        if self._world_size == 1:
            return [outcome]
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * self._world_size if self._rank == 0 else None
        dist.gather_object(outcome, gathered, dst=self._src(), group=self._group)
        return gathered


def _summarize(outcomes: Sequence[_Outcome], targets: Sequence[TargetRank]) -> PushSummary:
    per_replica: dict[str, int] = {}
    session_to_replica = {t.session_id: t.replica for t in targets}
    for o in outcomes:
        for session_id, num_bytes in o.stats.bytes_per_target.items():
            replica = session_to_replica.get(session_id, session_id)
            per_replica[replica] = per_replica.get(replica, 0) + num_bytes
    return PushSummary(
        bytes_written=sum(o.stats.bytes_written for o in outcomes),
        bytes_staged=sum(o.stats.bytes_staged for o in outcomes),
        num_writes=sum(o.stats.num_writes for o in outcomes),
        num_regions=sum(o.stats.num_regions for o in outcomes),
        bytes_per_replica=per_replica,
        seconds_per_source={o.rank: o.stats.seconds for o in outcomes},
        replayed=all(o.stats.replayed for o in outcomes),
    )
