"""`TrainerSync`: one weight sync as a collective call over the trainer's ranks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from weightsync.manager.manager import SyncManager
from weightsync.manager.report import PushSummary, SyncReport
from weightsync.plan import SourceHolding, SyncPlan, TargetRank, build_plan
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
       the driver runs the lifecycle, broadcasts the targets when it is time to push, every
       rank builds (or reuses) the plan and writes its share, and the driver finishes the
       lifecycle; every rank returns the same `SyncReport` or raises the same error;
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
        self._plan: SyncPlan | None = None
        self._plan_key: tuple[int, tuple[SourceHolding, ...]] | None = None
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
            WeightSyncError / ValueError: as `SyncManager.update_weights` raised on the driver.
        """
        holdings = tuple(self._sender.gather_holdings(export))
        if self._manager is None:
            return self._follow(export, holdings)
        pushed = False

        async def push(targets: Sequence[TargetRank], epoch: int) -> PushSummary:
            nonlocal pushed
            pushed = True
            self._broadcast(("push", tuple(targets), epoch))
            return await asyncio.to_thread(self._push, export, holdings, targets, epoch)

        try:
            report = self.run(self._manager.update_weights(push, version=version))
        except BaseException as exc:
            if not pushed:
                self._broadcast(("abort", None, 0))
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

    def _follow(self, export: ModelExport, holdings: tuple[SourceHolding, ...]) -> SyncReport:
        kind, targets, epoch = self._broadcast(None)
        if kind == "push":
            self._push(export, holdings, targets, epoch)
        kind, payload, _ = self._broadcast(None)
        if kind == "failed":
            raise payload
        return payload

    def _push(
        self,
        export: ModelExport,
        holdings: tuple[SourceHolding, ...],
        targets: Sequence[TargetRank],
        epoch: int,
    ) -> PushSummary:
        """Every rank: build or reuse the plan, write this rank's share, report to the driver."""
        t0 = time.perf_counter()
        try:
            plan = self._plan_for(targets, epoch, holdings)
            outcome = _Outcome(
                rank=self._rank,
                stats=self._sender.push(plan.for_source(self._rank), export),
                error=None,
            )
        except Exception as exc:  # reported to the driver, which raises it for everyone
            outcome = _Outcome(rank=self._rank, stats=None, error=exc)
        outcomes = self._gather(outcome)
        if outcomes is None:
            return PushSummary(bytes_written=0, bytes_staged=0, num_writes=0, num_regions=0)
        failed = [o for o in outcomes if o.error is not None]
        if failed:
            raise failed[0].error
        return _summarize(outcomes, targets, time.perf_counter() - t0)

    def _plan_for(
        self, targets: Sequence[TargetRank], epoch: int, holdings: tuple[SourceHolding, ...]
    ) -> SyncPlan:
        key = (epoch, holdings)
        if self._plan is None or self._plan_key != key:
            self._plan = build_plan(
                hf_config=self._hf_config, targets=targets, sources=holdings, dtype=self._dtype
            )
            self._plan_key = key
        return self._plan

    def _broadcast(self, obj: Any) -> Any:
        if self._world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0), group=self._group)
        return box[0]

    def _gather(self, outcome: _Outcome) -> list[_Outcome] | None:
        if self._world_size == 1:
            return [outcome]
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * self._world_size if self._rank == 0 else None
        dist.gather_object(
            outcome, gathered, dst=dist.get_global_rank(self._group, 0), group=self._group
        )
        return gathered


def _summarize(
    outcomes: Sequence[_Outcome], targets: Sequence[TargetRank], seconds: float
) -> PushSummary:
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
    )
