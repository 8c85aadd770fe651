"""`SyncManager`: the update lifecycle of docs/protocol.md over every rollout replica."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from weightsync.control.labels import check_label
from weightsync.control.protocol import (
    WEIGHT_SYNC_EVENTS,
    WEIGHT_SYNC_FUSED,
    WEIGHT_UPDATE_DIGEST,
    ReplicaProtocol,
)
from weightsync.errors import (
    LayoutMismatchError,
    PartialPushError,
    PartialSyncError,
    TensorChangedError,
    WeightsRefusedError,
)
from weightsync.manager.check import BitExactCheck
from weightsync.manager.config import ControlConfig
from weightsync.manager.delta import DeltaBase, DeltaChoice, DeltaSyncs, replica_writes
from weightsync.manager.delta_loader import LoaderCalls
from weightsync.manager.lifecycle import (
    Finished,
    FusedLifecycle,
    Lifecycle,
    PlainLifecycle,
    ReplicaCalls,
    failures_of,
    raise_all_dropped,
)
from weightsync.manager.replicas import PendingChanges, ReplicaSet
from weightsync.manager.report import PhaseTimes, SyncReport
from weightsync.manager.update import OpenUpdate, PushResult, stay_paused
from weightsync.manager.versions import LabelBook
from weightsync.plan import TargetRank
from weightsync.transport import MooncakeTransport, Transport

logger = logging.getLogger(__name__)


class SyncManager:
    """Drives one weight update at a time through every rollout replica.

    One update is two calls with the push between them, on the driver's event loop:

    .. code-block:: python

        update = await manager.open_update()          # steps 1-4
        try:
            result = await push(update)                # the trainer ranks write (step 5)
        except BaseException as error:
            await manager.finish_update(update, error)  # raises: the replicas are made safe
        report = await manager.finish_update(update, result)  # steps 6-7

    The order is the Miles lifecycle (docs/protocol.md, "One update, in order"):

    1. first contact with a replica not known yet (or failed last time): ``/server_info``
       and ``/model_info``, to refuse settings one-sided writes cannot serve;
    2. pause generation and release the KV cache; 3. begin a session on every replica (a
       lease of ``config.lease_s`` where it takes one, renewed until the update is finished,
       while the loop runs: a push that blocks must run in a worker thread);
    4. fetch the ranks' metadata where not cached (until membership or a process changes);
       with ``check_weight_update_equal``, snapshot and corrupt the weights (`BitExactCheck`);
    5. the push writes into ``update.targets`` after ``update.fences``; a
       `LayoutMismatchError` or `WeightsRefusedError` from it is a refusal before any write;
    6. label the version and end every session with the push's digests (then the
       bit-exact compare, once); 7. resume the KV cache, flush, continue generation.

    Each replica's calls are its `Lifecycle`: `FusedLifecycle` (steps 2-3 and 6-7 as one
    call each) where it advertises ``weight_sync_fused`` and no compare is due, else
    `PlainLifecycle`. With ``config.manage_generation=False`` steps 2 and 7 are the host's.

    Every per-replica call is issued to all replicas at once, each with a deadline
    (``config.lifecycle_timeout_s``). A replica that fails before anything was written (it
    cannot be reached, refuses, times out, or serves with a setting writes cannot serve) is
    dropped from this update: it is put back to serving its previous weights and reported
    in `SyncReport.dropped`, and the others are updated. An opened session is always ended.
    When the push or anything after it fails, the written replicas stay paused rather than
    serve half-written weights, are marked dirty until a later update succeeds, and the error
    names the replica (and, for transfer failures, the parameter); replicas that take leases
    also mark their weights incomplete themselves. A failure confined to some replicas (a
    write to one failed, or its verification) leaves only those paused: the others are
    finished, verified and resumed, and `PartialSyncError` reports both.

    Labels are read from the replicas at every begin (`weightsync.manager.versions`): the
    default next version is one more than the largest numeric version any replica holds or
    has held (and than any this manager gave); a label a replica holds, one this manager
    gave before, or a numeric one not above what a replica holds (unless ``rollback``) is
    refused before any write, so one label never names two weight sets.

    A replica is a URL and a process (`weightsync.manager.replicas`): a new process behind
    a known URL (a restart) gets its metadata fetched again and a new plan epoch.

    Membership changes (`add_replica`, `remove_replica`) asked while an update is open
    apply as it finishes, to the next one.

    One `SyncManager` lives on the process that drives the control plane (a driver, or trainer
    rank 0); it is not thread-safe, and its coroutines must run on one event loop.
    """

    def __init__(
        self,
        replicas: Sequence[str] = (),
        config: ControlConfig | None = None,
        *,
        transport: Transport | None = None,
    ) -> None:
        """Create a manager for `replicas` (base URLs of their main HTTP servers).

        `transport`, a Mooncake transport of this process (a trainer's), lets it make delta
        calls into SGLang replicas started with the delta loader (`weightsync.delta_wire`):
        their ranks write their replies into memory registered with it. Without one, such
        replicas take full bytes. The manager does not close it.
        """
        self._config = config or ControlConfig()
        self._known = ReplicaSet(
            api_key=self._config.api_key, http_timeout_s=self._config.http_timeout_s
        )
        self._calls = ReplicaCalls(self._known, self._config)
        self._plain: Lifecycle = PlainLifecycle(self._calls)
        self._fused: Lifecycle = FusedLifecycle(self._calls)
        self._check = BitExactCheck(self._calls, self._config)
        self._deltas = DeltaSyncs(
            self._known,
            timeout_s=self._config.lifecycle_timeout_s,
            check=self._config.delta_check,
            when=self._config.delta_when,
            loader=(
                LoaderCalls(transport, timeout_s=self._config.lifecycle_timeout_s)
                if isinstance(transport, MooncakeTransport)
                else None
            ),
        )
        self._labels = LabelBook()
        self._epoch = 0
        self._dirty: set[str] = set()
        self._unhealthy: dict[str, str] = {}
        self._open: OpenUpdate | None = None  # the update under way
        self._renewal: list[asyncio.Task[None] | asyncio.TimerHandle] = []
        self._pending = PendingChanges()  # membership changes asked while it is open
        for url in replicas:
            self._add(url)

    @property
    def config(self) -> ControlConfig:
        """The manager's configuration."""
        return self._config

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replicas the next update goes to, by base URL."""
        return tuple(self._known.urls)

    @property
    def dirty_replicas(self) -> frozenset[str]:
        """Replicas whose last update failed part-way; they hold mixed weights until a later
        update to them succeeds."""
        return frozenset(self._dirty)

    @property
    def unhealthy_replicas(self) -> dict[str, str]:
        """Replicas the last update dropped before any write, with why (by URL)."""
        return dict(self._unhealthy)

    @property
    def protocols(self) -> dict[str, ReplicaProtocol]:
        """What each replica serves, as learned at first contact (by URL)."""
        return dict(self._known.protocols)

    @property
    def metadata_epoch(self) -> int:
        """Identifies the targets of the last update; changes whenever they change."""
        return self._epoch

    def protocol(self, url: str) -> ReplicaProtocol | None:
        """What replica `url` serves, once first contact learned it (else None)."""
        return self._known.protocols.get(url)

    async def add_replica(self, url: str) -> None:
        """Add a replica (scale up); the next update fetches metadata again. Asked while an
        update is open, it applies as that update finishes (and returns then).

        Raises:
            ValueError: the replica is already managed.
        """
        if self._open is not None:
            await self._pending.after_update(self._add, url.rstrip("/"))
        else:
            self._add(url)

    async def remove_replica(self, url: str) -> None:
        """Stop managing a replica (scale down); it is no longer contacted. Asked while an
        update is open, it applies as that update finishes (and returns then): the update
        finishes with the replica (its session, lease and label), and the next one runs
        without it.

        Raises:
            ValueError: the replica is not managed.
        """
        url = url.rstrip("/")
        if self._open is not None:
            if url not in self._known.clients:
                raise ValueError(f"replica {url} is not managed; managed: {self._known.urls}")
            await self._pending.after_update(self._remove, url)
        else:
            await self._remove(url)

    def _add(self, url: str) -> None:
        self._known.add(url)

    async def _remove(self, url: str) -> None:
        await self._known.remove(url)
        self._dirty.discard(url)
        self._check.forget(url)
        self._deltas.forget((url,))
        self._unhealthy.pop(url, None)
        self._labels.forget((url,))

    async def aclose(self) -> None:
        """Close every replica's HTTP client (and free the delta calls' reply memory)."""
        self._deltas.close()
        await self._known.aclose()

    async def __aenter__(self) -> SyncManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def targets(self) -> tuple[TargetRank, ...]:
        """Every rollout rank of every replica, fetched once and cached until membership
        changes.

        Raises:
            RemoteReplicaError: a replica could not be reached or published something
                invalid (named).
        """
        replicas = tuple(self._known.urls)
        dropped: dict[str, str] = {}
        await self._first_contact(replicas, dropped)
        missing = tuple(u for u in replicas if u not in self._known.ranks)
        failures = failures_of(await self._known.fetch_targets(missing))
        if failures:
            raise failures[0][1]
        return tuple(t for url in replicas for t in self._known.ranks[url])

    async def open_update(
        self, *, version: str | None = None, fence: bool = False, rollback: bool = False
    ) -> OpenUpdate:
        """Open one update on every replica (steps 1-4 of the class docstring): the
        returned update holds the targets to write into and must be finished with
        `finish_update`, whatever the push does.

        Args:
            version: the new weight version; default: one more than the largest numeric
                version a replica holds or has held (or than this manager's last).
            fence: begin with a fence where a replica takes one (``weight_sync_fence``):
                its begin digest is not waited for, and every write into a rank must
                follow that rank's event in ``update.fences`` (`WeightSender.push`'s
                ``fences`` do). Only for pushes written from this host over CUDA IPC.
            rollback: `version` may be a number at or below what a replica holds (the
                caller labels weights older than those, e.g. by a training step it resumes).

        Raises:
            ValueError: no replica is managed, an update is already open, or `version` is
                refused (one a replica holds, one this manager gave, or a number not above
                what a replica holds without `rollback`): the replicas serve their previous
                weights.
            RemoteReplicaError: every replica failed before any write (the first failure is
                named; all of them serve their previous weights).
        """
        if not self._known.urls:
            raise ValueError("no rollout replica to update: add one with add_replica(url)")
        if self._open is not None:
            raise ValueError("an update is already open on this manager; finish it first")
        update = self._open = OpenUpdate()
        update.sessions.fenced = fence
        try:
            if version is not None:
                check_label(version)
            await self._open_sessions(update, version, rollback)
            await self._prepare(update)
        except BaseException:
            await self._close(update)
            raise
        return update

    async def _open_sessions(self, update: OpenUpdate, version: str | None, rollback: bool) -> None:
        """Steps 1-3, and the update's label from what the replicas hold as they begin."""
        live = await self._first_contact(tuple(self._known.urls), update.dropped)
        # What the replicas were last seen to hold: refuse a bad label before pausing any.
        self._labels.next(version, live, rollback=rollback)
        # Renewing from the start: a fused begin opens sessions while others' calls may still
        # run out their deadlines (and the failed ones are resumed), longer than a lease. A
        # timer starts the renewals a third of a lease in: most syncs end long before.
        loop = asyncio.get_running_loop()
        self._renewal = [
            loop.call_later(
                self._config.lease_s / 3,
                lambda: self._renewal.append(loop.create_task(self._calls.renew_leases(update))),
            )
        ]
        live = await self._begin(update, live)
        live = await self._calls.read_begins(update, live)
        for url in live:
            self._labels.began(url, update.sessions.begun[url])
        try:
            update.version = self._labels.next(version, live, rollback=rollback)
        except ValueError:
            await self._calls.abandon(update, live, resume=not (self._dirty & set(live)))
            raise
        self._labels.give(update.version)
        update.replicas = live

    async def _prepare(self, update: OpenUpdate) -> None:
        """Step 4: the targets (metadata fetched where not cached) and their fences, and the
        bit-exact check armed where due."""
        live = update.replicas
        update.paused_at = time.perf_counter()
        update.metadata_refreshed = any(u not in self._known.ranks for u in live)
        try:
            targets = await self._live_targets(update, live)
            fences = await self._calls.fences(update, targets)
            live = tuple(u for u in live if u not in update.dropped)
            update.replicas = live
            update.targets = tuple(t for t in targets if t.replica in live)
            update.fences = tuple(f for f in fences if f.session_id in _sessions(update))
            update.epoch = self._epoch
            await self._check.arm(live, self._dirty)
        except BaseException:
            await self._calls.abandon(update, live, resume=not (self._dirty & set(live)))
            raise
        update.opened = time.perf_counter()

    def adopt_delta_base(self, url: str, base: DeltaBase) -> None:
        """Take `base` as what replica `url` must prove it holds to take the next update as
        a delta (`DeltaSyncs.adopt`)."""
        self._deltas.adopt(url, base)

    async def choose_deltas(
        self, update: OpenUpdate, *, token: int, reference: int | None
    ) -> DeltaChoice:
        """Decide which replicas of `update` take a delta (`weightsync.manager.delta`): those
        that serve deltas and prove, by their checksums now, that they hold the push the
        trainers' reference holds; the others take full bytes. `finish_update` then applies
        the deltas, checks them and keeps every verified replica's new base.

        Args:
            update: this manager's open update.
            token: the label this update's push gives the trainers' reference.
            reference: the label of the push the trainers' reference holds (None: none).

        Raises:
            ValueError: `update` is not this manager's open update.
        """
        if update is not self._open or update.finished:
            raise ValueError("choose_deltas takes the open update, before it is finished")
        return await self._deltas.choose(update, token=token, reference=reference)

    async def finish_update(
        self, update: OpenUpdate, outcome: PushResult | BaseException
    ) -> SyncReport:
        """Finish `update` with what its push did (steps 6-7 of the class docstring), or
        make the replicas safe after the error it raised.

        Args:
            update: the update `open_update` returned (each is finished once).
            outcome: the push's `PushResult`, or the exception the push raised.

        Returns:
            What the update did, with seconds per phase, the replicas that verified it and
            those it dropped.

        Raises:
            ValueError: `update` is not this manager's open update.
            BaseException: `outcome` itself, when it is an exception and not a
                `PartialPushError` that left some replicas whole; a refusal before any
                write (`LayoutMismatchError`, `WeightsRefusedError`) resumes the replicas,
                any other failure leaves them paused and dirty.
            PartialSyncError: writing to some replicas, or verifying what they received,
                failed: those stay paused and dirty, the others were updated and serve the
                new version (``error.report`` says which).
            RemoteReplicaError: a call failed after writing began.
            WeightSyncError: the bit-exact check failed.
        """
        if update is not self._open or update.finished:
            raise ValueError("finish_update takes the update open_update returned, once")
        update.finished = True
        try:
            return await self._finish(update, outcome)
        finally:
            await self._close(update)

    async def _close(self, update: OpenUpdate) -> None:
        """Stop renewing the update's leases, keep what it dropped, and run the membership
        changes asked meanwhile."""
        renewal, self._renewal = self._renewal, []
        tasks = []
        for item in renewal:
            item.cancel()
            if isinstance(item, asyncio.Task):
                tasks.append(item)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._unhealthy = dict(update.dropped)
        if update.dropped:
            logger.error(
                "replicas dropped from this update (they serve their previous weights): %s",
                "; ".join(f"{u}: {why}" for u, why in update.dropped.items()),
            )
        self._open = None
        await self._pending.apply()

    async def _finish(self, update: OpenUpdate, outcome: PushResult | BaseException) -> SyncReport:
        live, targets = update.replicas, update.targets
        failed: dict[str, str] = {}
        overlap = False
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            result = outcome
            overlap = self._overlaps(result, live, targets)
            if result.landing is not None and not overlap:
                await result.landing.seen
        except (LayoutMismatchError, WeightsRefusedError):
            # Raised while the plan is built or the weights checked, before any byte is
            # written: replicas whose weights are intact may serve them again.
            await self._calls.abandon(update, live, resume=not (self._dirty & set(live)))
            raise
        except PartialPushError as exc:
            # Writes to some replicas failed; every write to the others landed (their
            # digests say so at the end): finish those, keep the failed ones paused.
            for target in targets:
                if target.session_id in exc.failed:
                    failed.setdefault(target.replica, exc.failed[target.session_id])
            # A failure this update cannot place (a session of none of its targets) may be
            # any replica's: none of them is known to have received everything.
            unplaced = [s for s in exc.failed if s not in _sessions(update)]
            if unplaced or set(failed) >= set(live) or not isinstance(exc.result, PushResult):
                self._dirty.update(live)
                await self._calls.abandon(update, live, resume=False)
                exc.add_note(stay_paused(live))
                raise
            self._dirty.update(failed)
            await self._calls.abandon(update, tuple(failed), resume=False)
            live = tuple(u for u in live if u not in failed)
            result = exc.result
        except BaseException as exc:
            self._dirty.update(live)
            await self._calls.abandon(update, live, resume=False)
            exc.add_note(stay_paused(live))
            raise
        if update.delta is not None:
            if result.landing is not None:
                await result.landing.seen
            result, wrong = await self._deltas.apply(update, result, live)
            if wrong:
                self._dirty.update(wrong)
                await self._calls.abandon(update, tuple(wrong), resume=False)
                failed.update(wrong)
                live = tuple(u for u in live if u not in wrong)
        t_pushed = time.perf_counter()

        groups = self._lifecycles(live)
        events = result.landing.events if overlap and result.landing is not None else ()
        finishing = [lc.finish(update, urls, result, events=events) for lc, urls in groups]
        try:
            if len(finishing) == 1:
                finished = await finishing[0]
            else:
                finished = sum(await asyncio.gather(*finishing), Finished())
        finally:
            if overlap and result.landing is not None:
                t_pushed = min(await result.landing.wait(), time.perf_counter())
        if overlap:
            await self._refuse_changed_while_landing(result, live)
        if finished.unfinished:
            self._dirty.update(finished.unfinished)
            self._labels.forget(finished.unfinished)
        failed.update(finished.unfinished)
        live = tuple(u for u in live if u not in finished.unfinished)
        bit_exact = await self._check.compare(live, self._dirty)
        self._deltas.record(
            update, finished.verified, reference=result.delta_token, push_s=t_pushed - update.opened
        )
        self._dirty.difference_update(live)
        self._labels.hold(update.version, live)
        t_final = time.perf_counter()

        for lifecycle, urls in groups:
            await lifecycle.resume(update, tuple(u for u in urls if u in live))
        if finished.resume_failed:
            raise next(iter(finished.resume_failed.values()))
        t_end = time.perf_counter()
        report = SyncReport(
            version=update.version,
            replicas=live,
            phases=PhaseTimes(
                pause=update.paused_at - update.started,
                metadata=update.opened - update.paused_at,
                push=t_pushed - update.opened,
                finalize=t_final - t_pushed,
                resume=t_end - t_final,
            ),
            push=result,
            metadata_refreshed=update.metadata_refreshed,
            bit_exact=bit_exact,
            verified=finished.verified,
            dropped=dict(update.dropped),
            writes=replica_writes(update, result, live),
        )
        if failed:
            message = "; ".join(f"{url}: {why}" for url, why in failed.items())
            error = PartialSyncError(
                f"weight version {update.version} failed on {len(failed)} replica(s) after "
                f"writing began ({message})",
                report=report,
                failed=failed,
            )
            error.add_note(stay_paused(tuple(failed)))
            error.add_note(f"replicas {', '.join(live)} were updated and serve it")
            raise error
        logger.info(
            "weight version %s on %d replica(s) (%d verified, %d unverified): %.3f GB in "
            "%.3f s (push %.3f s, %.2f GB/s)",
            update.version,
            len(live),
            len(finished.verified),
            len(live) - len(finished.verified),
            result.bytes_written / 1e9,
            report.seconds,
            report.phases.push,
            report.gbps,
        )
        return report

    def _lifecycles(
        self, replicas: Sequence[str], compare_pending: bool | None = None
    ) -> list[tuple[Lifecycle, tuple[str, ...]]]:
        """`replicas` grouped by the dialect each is driven in (the plain calls while the
        bit-exact compare is due: it runs between the end and the resume)."""
        if compare_pending is None:
            compare_pending = self._check.pending(replicas)
        groups: dict[int, tuple[Lifecycle, list[str]]] = {}
        for url in replicas:
            fused = self._known.protocols[url].serves(WEIGHT_SYNC_FUSED) and not compare_pending
            lifecycle = self._fused if fused else self._plain
            groups.setdefault(id(lifecycle), (lifecycle, []))[1].append(url)
        return [(lifecycle, tuple(urls)) for lifecycle, urls in groups.values()]

    async def _first_contact(
        self, replicas: Sequence[str], dropped: dict[str, str]
    ) -> tuple[str, ...]:
        """Learn what each replica not yet known (or failed last time) serves; returns the
        replicas that may take the update (the others are in `dropped`)."""
        known = self._known
        unknown = [u for u in replicas if u not in known.server_infos or u in self._dirty]
        unknown += [u for u in replicas if u not in unknown and u in self._unhealthy]
        if unknown:
            models = await known.first_contact(
                unknown, dropped, timeout_s=self._config.lifecycle_timeout_s
            )
            for url, model in models.items():
                version = model.get("weight_version")
                label = str(version) if version is not None else None
                self._labels.seen(url, label, keep_highest=True)
        live = tuple(u for u in replicas if u not in dropped)
        if not live:
            self._unhealthy = dict(dropped)
            raise_all_dropped(dropped, stage="first contact")
        return live

    async def _begin(self, update: OpenUpdate, replicas: tuple[str, ...]) -> tuple[str, ...]:
        """Steps 2-3 on every replica, each in its dialect, all at once."""
        groups = self._lifecycles(replicas, compare_pending=False)
        if len(groups) == 1:
            lifecycle, urls = groups[0]
            return await lifecycle.open(update, urls, must_remain=True)
        opened = await asyncio.gather(
            *(lc.open(update, urls, must_remain=False) for lc, urls in groups)
        )
        began = {u for urls in opened for u in urls}
        live = tuple(u for u in replicas if u in began)
        if not live:
            raise_all_dropped(update.dropped, stage="begin_weight_sync")
        return live

    async def _live_targets(
        self, update: OpenUpdate, live: tuple[str, ...]
    ) -> tuple[TargetRank, ...]:
        """The targets of the replicas still in the update (metadata fetched where not
        cached; a replica whose fetch fails is dropped); sets the epoch of the push."""
        missing = tuple(u for u in live if u not in self._known.ranks)
        fetched = await self._known.fetch_targets(missing)
        live = await self._calls.drop_failed(update, live, fetched, "metadata")
        if not live:
            raise_all_dropped(update.dropped, stage="metadata")
        self._epoch = self._known.epoch(live)
        return tuple(t for u in live for t in self._known.ranks[u])

    async def _refuse_changed_while_landing(
        self, result: PushResult, live: tuple[str, ...]
    ) -> None:
        """After sessions that ended while the copies were in flight: where a trainer tensor
        changed before its copies landed (`TensorChangedError` from the landing), the
        replicas may hold a mix of two steps that their sampled digests passed. They are
        paused again, marked dirty and unlabelled here, and the sync fails.

        Raises:
            TensorChangedError: naming the tensor.
        """
        if result.landing is None:
            return
        try:
            await result.landing.seen
        except TensorChangedError as exc:
            self._dirty.update(live)
            self._labels.forget(live)
            await self._calls.call_all(
                live,
                "pause_generation",
                mode=self._config.pause_mode,
                timeout_s=self._config.lifecycle_timeout_s,
            )
            exc.add_note(stay_paused(live))
            raise
        except Exception:
            return  # `Landing.wait` logged it; the replicas verified what arrived

    def _overlaps(
        self, result: PushResult, live: tuple[str, ...], targets: Sequence[TargetRank]
    ) -> bool:
        """Whether the sessions may end while the push's copies are still in flight: every
        replica takes the fused end, waits for the copies' events itself
        (``weight_sync_events``) and verifies every rank's digests, and no bit-exact
        compare is pending."""
        if result.landing is None or not result.landing.events:
            return False
        if self._check.pending(live):
            return False
        needed = (WEIGHT_SYNC_FUSED, WEIGHT_SYNC_EVENTS, WEIGHT_UPDATE_DIGEST)
        protocols = self._known.protocols
        if not all(protocols[u].serves(c) for u in live for c in needed):
            return False
        return all(t.session_id in result.digests for t in targets if t.replica in live)


def _sessions(update: OpenUpdate) -> set[str]:
    """The transport session ids of the update's targets."""
    return {t.session_id for t in update.targets}
