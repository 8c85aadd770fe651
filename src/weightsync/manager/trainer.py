"""`TrainerSync`: the front door. One weight sync as a collective call over the trainer's ranks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from weightsync.control.loops import new_event_loop
from weightsync.errors import LayoutMismatchError, PartialPushError, WeightsRefusedError
from weightsync.export.base import WeightExport
from weightsync.export.consistency import box_digests, replica_mismatches
from weightsync.export.fp8 import Fp8Export, fp8_holding
from weightsync.layout.config import config_data, model_dims
from weightsync.layout.families import family_for
from weightsync.layout.quant import fp8_quantization_config as fp8_config
from weightsync.manager.collective import (
    Collective,
    CollectiveError,
    NoPush,
    PushOrder,
    RankOutcome,
    SyncDone,
    SyncFailed,
)
from weightsync.manager.config import SyncConfig
from weightsync.manager.delta import DeltaBase, replica_checksums
from weightsync.manager.manager import SyncManager
from weightsync.manager.report import SyncReport
from weightsync.manager.update import Landing, OpenUpdate, PushResult, add_checksums
from weightsync.plan import (
    SourceHolding,
    SourcePlan,
    TargetRank,
    build_plan,
)
from weightsync.sender import CheckedPush, WeightSender
from weightsync.sender.base_checksums import LaidOutChecksums, TappedExport
from weightsync.transport import Transport, open_transport

T = TypeVar("T")


class TrainerSync:
    """Pushes every trainer rank's weights into every rollout replica after each step.

    It builds and owns what a sync needs: the rank's transport (from ``config.transport``),
    its `WeightSender`, and on the driver rank (group rank 0) the `SyncManager` that runs the
    update lifecycle over the replicas; `close` (or leaving the ``with`` block) closes them.

    Call protocol (every rank of the trainer group, the same number of times):

    1. every rank builds ``TrainerSync(config, hf_config=..., group=..., replicas=...)``
       (the replicas matter on the driver; other ranks may pass the same list);
    2. after each optimizer step every rank calls ``sync(export)`` with its PP-local
       `WeightExport`: the driver runs the lifecycle and, when it is time to push, builds
       and validates the plan (once per set of targets and holdings) and hands every rank its
       share (`weightsync.manager.collective`); every rank writes its share, and the driver
       finishes the lifecycle; every rank returns the same `SyncReport` or raises the same
       error;
    3. ``add_replica`` / ``remove_replica`` between syncs (they act on the driver and do
       nothing elsewhere, so SPMD code may call them on every rank);
    4. ``close()`` on every rank.

    With ``config.delta``, ``adopt_base(export)`` on every rank, before a sync, makes weights
    the replicas already serve (a checkpoint they loaded) the base of that sync's deltas,
    without writing them: ``sync(new_export, require_delta=True)`` then writes only what
    differs, into replicas that prove they hold them, or refuses before any write.

    The driver runs the manager's coroutines on an event loop of its own, in the calling
    thread while a call lasts (see `run`), so a training loop without asyncio can drive it;
    blocking work (the collectives, the push) runs in worker threads, never on that loop.

    Args:
        config: the sender, control-plane and transport settings.
        hf_config: the model's HF config (object or config.json dict).
        group: the trainer's torch.distributed process group, or None for one process.
        replicas: the rollout replicas' base URLs (used on the driver rank).
        dtype: the rollout dtype name; default: the dtype the replicas report, else the
            config's.
        transport: a transport opened by the caller, used instead of one built from
            ``config.transport`` (the caller then closes it).
        skip_tensors: shell patterns of tensors the exports hold that are not the model's
            checkpoint's (and are to be left out); any other such tensor fails the plan.

    Raises:
        ValueError: a bad config or replica URL.
        WeightSyncError: the transport could not start.
    """

    def __init__(
        self,
        config: SyncConfig | None = None,
        *,
        hf_config: Any,
        group: Any = None,
        replicas: Sequence[str] = (),
        dtype: str | None = None,
        transport: Transport | None = None,
        skip_tensors: Sequence[str] = (),
    ) -> None:
        self._config = config or SyncConfig()
        self._owns_transport = transport is None
        self._transport = (
            transport if transport is not None else open_transport(self._config.transport)
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        # Held while a thread runs the loop: a call from another thread (a membership change
        # during a sync) waits for it rather than run the loop twice.
        self._loop_lock = threading.Lock()
        self._manager: SyncManager | None = None
        try:
            self._sender = WeightSender(self._config.sender, transport=self._transport, group=group)
            self._collective = Collective(
                group,
                rank=self._sender.rank,
                world_size=self._sender.world_size,
                timeout_s=self._config.collective_timeout_s,
            )
            if self._collective.is_driver:
                # The driver's transport takes the replies of SGLang's delta loader.
                self._manager = SyncManager(
                    replicas, self._config.control, transport=self._transport
                )
                self._loop = new_event_loop(self._config.control.event_loop)
        except BaseException:
            if self._owns_transport:
                self._transport.close()
            raise
        self._hf_config = hf_config
        self._dtype = dtype
        self._skip_tensors = tuple(skip_tensors)
        self._plan: SourcePlan | None = None  # this rank's share of the current plan
        self._plan_key: tuple[int, tuple[SourceHolding, ...], int] | None = None  # driver only
        self._fp8: Fp8Export | None = None  # the last export quantised for an FP8 rollout
        # This rank's plan restricted to the targets that take full bytes, per delta set.
        self._full_plans: dict[frozenset[str], SourcePlan] = {}
        self._full_plans_of: SourcePlan | None = None
        self._delta_pushes = 0  # driver: delta pushes ordered so far (their tokens)
        self._delta_reference: int | None = None  # driver: the push every reference holds
        self._closed = False

    @property
    def rank(self) -> int:
        """This process's rank in the trainer group."""
        return self._collective.rank

    @property
    def is_driver(self) -> bool:
        """Whether this rank drives the control plane (group rank 0)."""
        return self._collective.is_driver

    @property
    def manager(self) -> SyncManager | None:
        """The manager on the driver rank, None elsewhere."""
        return self._manager

    @property
    def sender(self) -> WeightSender:
        """This rank's sender."""
        return self._sender

    @property
    def transport(self) -> Transport:
        """This rank's transport."""
        return self._transport

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the manager on the driver's event loop and return its result.

        The loop runs in the calling thread for the call (no thread hand-off each way on a
        sync's critical path), or in a thread of its own when the caller is itself inside a
        running event loop. A call from another thread while one runs (`add_replica` or
        `remove_replica` during a `sync`) waits for it to return, then runs.

        Raises:
            ValueError: not the driver rank, or the sync is closed.
        """
        loop = self._loop
        if loop is None:
            coro.close()
            raise ValueError("TrainerSync.run is for the driver rank (rank 0) of an open sync")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            with self._loop_lock:
                return _run_to_end(loop, coro)

        def locked() -> T:
            with self._loop_lock:
                return _run_to_end(loop, coro)

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightsync") as pool:
            return pool.submit(locked).result()

    def add_replica(self, url: str) -> None:
        """Add a rollout replica (scale up); the next sync fetches its metadata.

        Acts on the driver rank; a no-op elsewhere. Thread-safe: called while a sync runs
        (from another thread), it waits for the sync to end and applies to the next.

        Raises:
            ValueError: the replica is already managed.
        """
        if self._manager is not None:
            self.run(self._manager.add_replica(url))

    def remove_replica(self, url: str) -> None:
        """Stop writing to a rollout replica (scale down).

        Acts on the driver rank; a no-op elsewhere. Thread-safe: called while a sync runs
        (from another thread), it waits for the sync to end and applies to the next.

        Raises:
            ValueError: the replica is not managed.
        """
        if self._manager is not None:
            self.run(self._manager.remove_replica(url))

    def sync(
        self,
        export: WeightExport,
        *,
        version: str | None = None,
        rollback: bool = False,
        require_delta: bool = False,
    ) -> SyncReport:
        """Push this rank's weights into every replica; collective over the trainer group.

        Args:
            export: this rank's PP-local weights (a `weightsync.WeightExport`).
            version: the new weight version; default: one more than every numeric label a
                replica holds or has held (`weightsync.manager.versions`).
            rollback: `version` may be a number at or below what a replica holds (a
                trainer that labels by its step and resumes an earlier one).
            require_delta: every replica must take a delta (``config.delta``): when one
                would take full bytes (it does not prove it holds the base, or serves no
                deltas), the sync is refused before any write and every replica serves
                its previous weights again.

        Returns:
            What the sync did, with every rank's `PushStats` in ``report.push.per_source``.

        Raises:
            LayoutMismatchError: the plan was refused before any write (every rank raises
                it; the replicas serve their previous weights).
            WeightSyncError / ValueError: as `SyncManager.open_update` or `finish_update`
                raised on the driver.
            WeightsRefusedError: with `require_delta`, a replica would take full bytes (the
                message names each such replica and why: for a base it does not hold, the
                rank and the first parameter that differs); nothing was written.
            CollectiveError: a trainer rank did not take part within
                ``config.collective_timeout_s`` (dead, stopped, or not calling `sync`).
        """
        if self._closed:
            raise ValueError("sync() on a closed TrainerSync")
        if require_delta and not self._config.delta:
            raise ValueError("sync(require_delta=True) needs SyncConfig(delta=True)")
        with export.pinned():
            return self._sync(export, version, rollback, require_delta)

    def adopt_base(self, export: WeightExport) -> None:
        """Make `export` the base of the next sync's deltas without writing it anywhere:
        weights the replicas are meant to serve already (a checkpoint they loaded, or one
        pushed earlier); collective over the trainer group, between syncs.

        Every rank records `export` as its delta reference (`WeightSender.push_delta` with
        no target) and computes, per rollout rank it writes to, the checksum of each
        parameter were it to hold `export`'s bytes (`weightsync.delta_codec.checksum_tensor`
        of the parameter as the plan lays it out, one parameter at a time); the driver adds
        up the ranks' shares and keeps them as each replica's base
        (`weightsync.manager.delta.DeltaSyncs.adopt`). Nothing is taken on trust: the next
        `sync` gives a replica a delta only if the checksums it reports once its session
        began equal these, every byte of every parameter (``sync(require_delta=True)``
        refuses the sync otherwise).

        Host memory: the reference (one copy of this rank's share of the rollout weights,
        ``SenderConfig.delta_reference``) and the parameters of each rollout layout that are
        still being filled (those of a layer or so, in HF order).

        Args:
            export: this rank's PP-local weights of the base (a `weightsync.WeightExport`).

        Raises:
            ValueError: the sync keeps no delta reference (``SyncConfig(delta=False)``), or
                is closed.
            LayoutMismatchError: the plan was refused (as in `sync`).
            RemoteReplicaError: a replica's metadata could not be fetched.
            CollectiveError: a trainer rank did not take part in time.
        """
        if self._closed:
            raise ValueError("adopt_base() on a closed TrainerSync")
        if not self._config.delta:
            raise ValueError("adopt_base() needs SyncConfig(delta=True)")
        with export.pinned():
            self._adopt_base(export)

    def _adopt_base(self, export: WeightExport) -> None:
        """`adopt_base` as steps: every rank gathers the holdings; the driver fetches the
        targets, builds the plan and broadcasts a `PushOrder` whose ``delta_token`` labels
        the reference (or `SyncFailed`); every rank takes its plan, records the reference
        and sends its checksum shares (`_BaseShare`); the driver adopts the bases and
        broadcasts `_BaseAdopted` (or `SyncFailed`)."""
        holdings = tuple(
            sorted(self._collective.all_gather(self._sender.holding(export)), key=lambda h: h.rank)
        )
        manager = self._manager
        if manager is None:
            order = self._collective.broadcast(None, (PushOrder, SyncFailed))
            if isinstance(order, SyncFailed):
                raise order.error
            self._collective.gather(self._base_share(export, order, None), _BaseShare)
            done = self._collective.broadcast(None, (_BaseAdopted, SyncFailed))
            if isinstance(done, SyncFailed):
                raise done.error
            return
        try:
            targets = self.run(manager.targets())
            plans = self._source_plans(targets, manager.metadata_epoch, holdings)
        except BaseException as exc:
            self._collective.broadcast(SyncFailed(error=exc), (SyncFailed,))
            raise
        self._delta_pushes += 1
        # The references are overwritten from here on: until every rank recorded the base,
        # they hold no push a replica can take a delta against.
        self._delta_reference = None
        order = PushOrder(
            new_plan=plans is not None,
            fp8_block_size=rollout_fp8(targets),
            delta_token=self._delta_pushes,
        )
        self._collective.broadcast(order, (PushOrder,))
        shares = self._collective.gather(self._base_share(export, order, plans), _BaseShare)
        assert shares is not None  # the driver's gather
        try:
            failed = [share.error for share in shares if share.error is not None]
            if failed:
                raise failed[0]
            sums = add_checksums([share.checksums or {} for share in shares])
            for url, checksums in replica_checksums(targets, sums).items():
                # Kept where the manager keeps every replica's base: `choose` proves it.
                manager.adopt_delta_base(
                    url, DeltaBase(token=self._delta_pushes, checksums=checksums)
                )
        except BaseException as exc:
            self._collective.broadcast(SyncFailed(error=exc), (SyncFailed,))
            raise
        self._delta_reference = self._delta_pushes
        self._collective.broadcast(_BaseAdopted(), (_BaseAdopted,))

    def _base_share(
        self, export: WeightExport, order: PushOrder, plans: list[SourcePlan] | None
    ) -> _BaseShare:
        """Every rank: take its plan, record `export` as its reference (labelled
        ``order.delta_token``) and checksum it as each of its targets lays it out."""
        try:
            if order.new_plan:
                self._plan = self._collective.scatter(plans, SourcePlan)
            plan = self._plan
            if plan is None:
                raise ValueError(f"trainer rank {self.rank} has no plan to record a base with")
            export = self._for_rollout(export, order.fp8_block_size)
            sums = LaidOutChecksums(plan)
            export.begin_push()
            stats = self._sender.push_delta(
                plan, TappedExport(export, sums.add), (), token=order.delta_token
            )
            if stats.token != order.delta_token:
                raise ValueError(f"trainer rank {self.rank} did not record the whole base")
            return _BaseShare(rank=self.rank, checksums=sums.per_session())
        except CollectiveError:
            raise
        except Exception as exc:  # reported to the driver, which raises it for everyone
            return _BaseShare(rank=self.rank, error=exc)

    def _sync(
        self, export: WeightExport, version: str | None, rollback: bool, require_delta: bool
    ) -> SyncReport:
        """`sync` as steps (`weightsync.manager.collective` gives the messages): every rank
        gathers the holdings (and checks replica digests); the driver opens the update,
        builds the plan and broadcasts the order; every rank takes its share, preflights,
        agrees and pushes; the driver gathers the outcomes, finishes the update and
        broadcasts the report."""
        holdings = tuple(
            sorted(self._collective.all_gather(self._sender.holding(export)), key=lambda h: h.rank)
        )
        if self._config.check_replicas:
            # Every rank sees every digest and so raises the same error, before any write.
            digests = self._collective.all_gather(
                box_digests(export), what="all-gather of the replica digests"
            )
            problems = replica_mismatches(digests)
            if problems:
                raise WeightsRefusedError("; ".join(problems))
        if self._manager is None:
            return self._follow(export)
        manager, ordered = self._manager, False

        def order_and_push(update: OpenUpdate) -> PushResult:
            nonlocal ordered
            # The plan is built (and validated) before any rank writes, so a mismatch fails
            # the sync with nothing written.
            plans = self._source_plans(update.targets, update.epoch, holdings)
            choice = update.delta
            order = PushOrder(
                new_plan=plans is not None,
                fp8_block_size=rollout_fp8(update.targets),
                fences=update.fences,
                delta_token=choice.token if choice is not None else None,
                delta_sessions=choice.sessions(update.targets) if choice else frozenset(),
                delta_pulls=choice.pulls(update.targets) if choice else frozenset(),
                laid_out_sessions=choice.laid_out(update.targets) if choice else frozenset(),
            )
            ordered = True
            self._collective.broadcast(order, (PushOrder,))
            # Only the driver's copies may stay in flight: it waits for them (the other
            # ranks' land before their outcomes reach it).
            return self._push(export, update.targets, order, plans, wait=False)

        async def update_replicas() -> SyncReport:
            # Every rank's sender waits for the fences of the targets it writes to.
            update = await manager.open_update(version=version, fence=True, rollback=rollback)
            if self._config.delta:
                self._delta_pushes += 1
                choice = await manager.choose_deltas(
                    update, token=self._delta_pushes, reference=self._delta_reference
                )
                full = {
                    url: choice.full.get(
                        url, "it serves no delta syncs (or offers no delta region)"
                    )
                    for url in update.replicas
                    if url not in choice.delta
                }
                if require_delta and full:
                    # A refusal before any write: finishing with it resumes every replica.
                    why = "; ".join(f"{url}: {reason}" for url, reason in full.items())
                    refused = WeightsRefusedError(
                        f"the sync must be a delta, but {len(full)} replica(s) cannot take one "
                        f"({why}); nothing was written, every replica serves its previous "
                        "weights"
                    )
                    return await manager.finish_update(update, refused)
            outcome = await self._off_loop(lambda: order_and_push(update))
            if self._config.delta:
                self._delta_reference = _delta_token(outcome)
            return await manager.finish_update(update, outcome)

        try:
            # One call on the loop: a membership change from another thread waits for it.
            report = self.run(update_replicas())
        except BaseException as exc:
            try:
                if not ordered:
                    self._collective.broadcast(NoPush(), (NoPush,))
                self._collective.broadcast(SyncFailed(error=exc), (SyncFailed,))
            except CollectiveError as lost:
                # The ranks that did not hear the outcome raise a CollectiveError of their own.
                exc.add_note(f"the other trainer ranks could not be told: {lost}")
            raise
        self._collective.broadcast(SyncDone(report=report), (SyncDone,))
        return report

    async def _off_loop(self, push: Callable[[], PushResult]) -> PushResult | BaseException:
        """Run `push` in a worker thread while the driver's loop goes on (it renews the
        sessions' leases); its result, or what it raised. A push that leaves copies in
        flight hands its result over at once, with a `Landing` the thread settles once it
        saw them land (`WeightSender.wait_landed`)."""
        loop = asyncio.get_running_loop()
        queued: asyncio.Future[PushResult] = loop.create_future()
        seen: asyncio.Future[float] = loop.create_future()
        seen.add_done_callback(_retrieved)

        def work() -> None:
            try:
                result = push()
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, queued, exc)
                return
            events = tuple(e for s in result.per_source.values() for e in s.events)
            if not events:
                loop.call_soon_threadsafe(_settle, queued, result)
                return
            landing = Landing(events=events, seen=seen)
            loop.call_soon_threadsafe(_settle, queued, dataclasses.replace(result, landing=landing))
            try:
                landed: float | BaseException = self._sender.wait_landed()
            except BaseException as exc:
                landed = exc
            loop.call_soon_threadsafe(_settle, seen, landed)

        # The worker is joined through the futures it settles.
        loop.run_in_executor(None, contextvars.copy_context().run, work)
        try:
            return await queued
        except Exception as exc:
            return exc

    def close(self) -> None:
        """Close the manager (driver), the sender's staging memory and the transport it owns."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._loop is not None and self._manager is not None:
                manager = self._manager

                async def shut_down() -> None:
                    await manager.aclose()
                    await asyncio.get_running_loop().shutdown_default_executor()

                self.run(shut_down())
                self._loop.close()
                self._loop = None
            self._sender.close()
        finally:
            if self._owns_transport:
                self._transport.close()

    def __enter__(self) -> TrainerSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_post_load(self, targets: Sequence[TargetRank]) -> None:
        """Refuse, before any write, replicas whose ``end_weight_update`` does not run the
        post-load processing this model's derived state needs (MLA's ``w_kc`` / ``w_vc``
        from ``kv_b_proj``): they would serve stale weights after a one-sided write.

        Raises:
            LayoutMismatchError: naming the replicas and what to run instead.
        """
        assert self._manager is not None  # the driver's
        stale = []
        for url in sorted({target.replica for target in targets}):
            protocol = self._manager.protocol(url)
            if protocol is not None and not protocol.runs_post_load():
                stale.append(f"{url} ({protocol.describe()})")
        if stale:
            raise LayoutMismatchError(
                f"replicas {', '.join(stale)} do not run post-load processing at "
                "end_weight_update, so MLA's w_kc / w_vc would stay those of the old weights "
                "after this sync; serve with SGLang >= 0.5.23 or weightsync serve"
            )

    def _for_rollout(self, export: WeightExport, fp8_block_size: int) -> WeightExport:
        """`export` as the rollout serves it: through an `Fp8Export` (kept while the same
        export is synced, so its buffers and the push program stay) for an FP8 rollout."""
        if not fp8_block_size:
            return export
        fp8 = self._fp8
        if fp8 is None or fp8.export is not export or fp8.block != fp8_block_size:
            fp8 = self._fp8 = Fp8Export(export, block=fp8_block_size)
        return fp8

    def _follow(self, export: WeightExport) -> SyncReport:
        order = self._collective.broadcast(None, (PushOrder, NoPush))
        if isinstance(order, PushOrder):
            self._push(export, (), order, None)
        outcome = self._collective.broadcast(None, (SyncDone, SyncFailed))
        if isinstance(outcome, SyncFailed):
            raise outcome.error
        return outcome.report

    def _source_plans(
        self,
        targets: Sequence[TargetRank],
        epoch: int,
        holdings: tuple[SourceHolding, ...],
    ) -> list[SourcePlan] | None:
        """The driver: every rank's share of the plan, or None when the cached one holds."""
        block = rollout_fp8(targets)
        key = (epoch, holdings, block)
        if self._plan_key == key:
            return None
        if block or family_for(model_dims(self._hf_config).model_type).mla:
            self._require_post_load(targets)
        hf_config = self._hf_config
        sources: Sequence[SourceHolding] = holdings
        if block:
            # The rollout's checkpoint is the trainer's architecture quantised to its blocks.
            hf_config = {**config_data(hf_config), "quantization_config": fp8_config(block)}
            sources = [
                SourceHolding(rank=h.rank, tensors=fp8_holding(h.tensors, block)) for h in holdings
            ]
        plan = build_plan(
            hf_config=hf_config,
            targets=targets,
            sources=sources,
            dtype=self._dtype,
            skip_tensors=self._skip_tensors,
        )
        self._plan_key = key
        return [plan.for_source(h.rank) for h in holdings]

    def _push(
        self,
        export: WeightExport,
        targets: Sequence[TargetRank],
        order: PushOrder,
        plans: list[SourcePlan] | None,
        *,
        wait: bool = True,
    ) -> PushResult:
        """Every rank: receive its new plan (if any), write its share, report to the driver
        (`wait`: as `WeightSender.push`)."""
        try:
            if order.new_plan:
                self._plan = self._collective.scatter(plans, SourcePlan)
            if self._plan is None:
                raise ValueError(f"trainer rank {self.rank} has no plan to push")
            plan = self._plan
            export = self._for_rollout(export, order.fp8_block_size)
            refused: Exception | None = None
            try:
                checked = self._sender.preflight(self._full_plan(order.delta_sessions), export)
            except (ValueError, WeightsRefusedError) as exc:
                refused = exc
            # No rank writes unless every rank's checks passed: then a refusal leaves every
            # replica untouched.
            verdicts = [v for v in self._collective.all_gather(refused) if v is not None]
            if verdicts:
                raise verdicts[0]
            outcome = self._push_full_and_delta(checked, plan, export, order, wait=wait)
        except CollectiveError:
            raise
        except Exception as exc:  # reported to the driver, which raises it for everyone
            outcome = RankOutcome(rank=self.rank, error=exc)
        outcomes = self._collective.gather(outcome, RankOutcome)
        if outcomes is None:
            return PushResult.empty()
        failed = [o for o in outcomes if o.error is not None]
        delta_failed = {s: why for o in outcomes if o.delta for s, why in o.delta.failed.items()}
        if not failed and not delta_failed:
            return _summarize(outcomes, targets)
        partial = [o.error for o in failed if isinstance(o.error, PartialPushError)]
        if len(partial) < len(failed):
            raise next(o.error for o in failed if not isinstance(o.error, PartialPushError))
        # Only some targets failed: what every rank wrote, so the others can be finished.
        written = [
            RankOutcome(
                rank=o.rank,
                stats=o.stats if o.error is None else o.error.result,
                delta=o.delta,
                laid_out=o.laid_out,
            )
            for o in outcomes
        ]
        sessions = {s: why for error in partial for s, why in error.failed.items()}
        sessions.update(delta_failed)
        first = partial[0] if partial else None
        raise PartialPushError(
            str(first) if first is not None else next(iter(delta_failed.values())),
            failed=sessions,
            result=_summarize(written, targets),
            target_session=first.target_session if first is not None else None,
            byte_ranges=first.byte_ranges if first is not None else (),
            return_code=first.return_code if first is not None else None,
            param_name=first.param_name if first is not None else None,
        ) from first

    def _full_plan(self, delta_sessions: frozenset[str]) -> SourcePlan:
        """This rank's plan without the targets that take a delta (kept per delta set)."""
        plan = self._plan
        assert plan is not None  # _push checked
        if not delta_sessions:
            return plan
        if self._full_plans_of is not plan:
            self._full_plans, self._full_plans_of = {}, plan
        kept = self._full_plans.get(delta_sessions)
        if kept is None:
            everyone = {t.session_id for t in _plan_targets(plan)}
            kept = self._full_plans[delta_sessions] = plan.restricted(everyone - delta_sessions)
        return kept

    def _push_full_and_delta(
        self,
        checked: CheckedPush,
        plan: SourcePlan,
        export: WeightExport,
        order: PushOrder,
        *,
        wait: bool,
    ) -> RankOutcome:
        """The full push to the targets that take full bytes, then, when the sync keeps a
        delta reference, the delta push (also after a full push some targets failed: the
        others still take their delta)."""
        error: PartialPushError | None = None
        stats = None
        try:
            stats = self._sender.push(checked, wait=wait, fences=order.fences)
        except PartialPushError as exc:
            error = exc
        delta = None
        laid_out: dict[str, dict[str, int]] = {}
        if order.delta_token is not None:
            targets = [t for t in _plan_targets(plan) if t.session_id in order.delta_sessions]
            sums = None
            if order.laid_out_sessions:
                # The delta push reads the stream once more: it checksums what was written.
                sums = LaidOutChecksums(plan.restricted(order.laid_out_sessions))
                export = TappedExport(export, sums.add)
            delta = self._sender.push_delta(
                plan, export, targets, token=order.delta_token, pulls=order.delta_pulls
            )
            if sums is not None:
                laid_out = sums.per_session()
        return RankOutcome(rank=self.rank, stats=stats, error=error, delta=delta, laid_out=laid_out)


def rollout_fp8(targets: Sequence[TargetRank]) -> int:
    """The FP8 block the targets serve (0: unquantised), from their published metadata.

    Raises:
        ValueError: replicas serve different quantisations (one plan writes one).
    """
    blocks = {target.fp8_block_size for target in targets}
    if len(blocks) > 1:
        raise ValueError(
            f"the replicas serve different quantisations (FP8 blocks {sorted(blocks)}; 0 is "
            "unquantised): sync them separately"
        )
    return blocks.pop() if blocks else 0


def _summarize(outcomes: Sequence[RankOutcome], targets: Sequence[TargetRank]) -> PushResult:
    return PushResult.of_ranks(
        {o.rank: o.stats for o in outcomes if o.stats is not None},
        targets,
        {o.rank: o.delta for o in outcomes if o.delta is not None},
        [o.laid_out for o in outcomes if o.laid_out],
    )


def _plan_targets(plan: SourcePlan) -> list[TargetRank]:
    """Every target `plan` writes to, once each, as it published itself (a part's targets
    publish only that part's parameters)."""
    seen: dict[str, TargetRank] = {}
    for ranks in plan.targets.values():
        for target in ranks:
            seen.setdefault(target.session_id, target)
    return list(seen.values())


def _delta_token(outcome: PushResult | BaseException) -> int | None:
    """The push every rank's delta reference holds after `outcome` (None: not all hold one)."""
    if isinstance(outcome, PushResult):
        return outcome.delta_token
    if isinstance(outcome, PartialPushError) and isinstance(outcome.result, PushResult):
        return outcome.result.delta_token
    return None


def _run_to_end(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on `loop` in this thread; a call interrupted (Ctrl-C) cancels it, so that
    nothing of it runs on the loop's next call."""
    task = loop.create_task(coro)
    try:
        return loop.run_until_complete(task)
    except BaseException:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                loop.run_until_complete(task)
        raise


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    """Resolve `future` with `result`, or fail it when `result` is an exception."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a landing's failure seen: a sync that failed before waiting for it has reported
    its own error."""
    if not future.cancelled():
        future.exception()


@dataclass(frozen=True, slots=True, kw_only=True)
class _BaseShare:
    """One rank's part of `TrainerSync.adopt_base`, gathered by the driver.

    Attributes:
        rank: the trainer rank.
        checksums: per target session id, ``{param_name: checksum}`` of what this rank
            writes there, zero elsewhere (the ranks' shares add up, wrapping, to the whole).
        error: what the rank raised instead.
    """

    rank: int
    checksums: Mapping[str, Mapping[str, int]] | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _BaseAdopted:
    """The driver adopted the base: `TrainerSync.adopt_base` returns on every rank."""
