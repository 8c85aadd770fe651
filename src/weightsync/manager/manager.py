"""`SyncManager`: PROTOCOL.md's update lifecycle over every rollout replica."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from weightsync.control import RolloutClient
from weightsync.control.labels import check_label, numeric_label
from weightsync.control.models import BeginWeightUpdateResponse
from weightsync.control.protocol import (
    PARALLELISM_CONFIG,
    WEIGHT_SYNC_EVENTS,
    WEIGHT_SYNC_FENCE,
    WEIGHT_SYNC_FUSED,
    WEIGHT_UPDATE_DIGEST,
    WEIGHT_UPDATE_LEASE,
    ReplicaProtocol,
    derive_parallelism,
    num_ranks,
    refusal,
    served_dtype,
    served_fp8_block,
)
from weightsync.errors import (
    LayoutMismatchError,
    LifecycleStepError,
    PartialPushError,
    PartialSyncError,
    RemoteReplicaError,
    TensorChangedError,
    WeightsRefusedError,
    WeightSyncError,
)
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.manager.config import ControlConfig
from weightsync.manager.report import PhaseTimes, PushSummary, SyncReport
from weightsync.manager.versions import HeldLabel, next_label
from weightsync.plan import TargetRank

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A fused call's server-side budget is one call's deadline; the reply may take this longer.
_REPLY_MARGIN_S = 1.0

PushFn = Callable[[Sequence[TargetRank], int, Mapping[str, str]], Awaitable[PushSummary]]
"""Writes the new weights into `targets`; the int is the metadata epoch (it changes whenever
the targets do, so a caller may cache its plan per epoch); the mapping gives, by target session
id, the IPC handle (hex) of the CUDA event that writes into that rank must follow (its begin
digest, with ``update_weights(fence=True)``; empty otherwise)."""


class SyncManager:
    """Drives one weight update at a time through every rollout replica.

    The update order is PROTOCOL.md's (the Miles lifecycle):

    1. first contact (first update, a new replica, or after a failure): ``/server_info``
       and ``/model_info`` of the replica, to learn what it serves, refuse settings that
       one-sided writes cannot serve, and learn the weight version it serves;
    2. ``pause_generation`` and ``release_memory_occupation(["kv_cache"])`` on every replica;
    3. ``begin_weight_update`` on every replica; where the replica takes leases, the
       session is a lease of ``config.lease_s`` renewed while the sync runs;
    4. first update, or after `add_replica` / `remove_replica`: fetch every rank's transfer
       engine info and parallelism config (cached until membership changes); with
       ``check_weight_update_equal``, snapshot and corrupt the weights of every replica;
    5. ``push(targets, epoch, fences)``: the caller's trainer ranks write their share of the
       plan (after each rank's fence, where its replica fenced the begin); a
       `LayoutMismatchError` or `WeightsRefusedError` from it means the plan or the weights
       were refused before any write, and the replicas resume serving their previous weights;
    6. ``update_weight_version`` and ``end_weight_update`` on every replica, with the
       digests of what the push wrote where the replica verifies them (and, after the first
       update with the check on, ``weights_checker compare``);
    7. ``resume_memory_occupation``, ``flush_cache``, ``continue_generation``.

    A replica that advertises ``weight_sync_fused`` takes steps 2-3 as one
    ``begin_weight_sync`` and steps 6-7 as one ``end_weight_sync`` (the server runs the same
    calls in the same order and answers a refusal as the refusing call would); the others
    take the eight calls. While the bit-exact check still has to compare, steps 6-7 are the
    separate calls, so that ``compare`` runs before any replica serves again.

    With ``config.manage_generation=False`` steps 2 and 7 are the host's: the manager runs
    1 and 3-6 only, and never pauses or resumes a replica (the fused calls then skip their
    pause and resume steps).

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

    A replica is a URL and a process: the reference server's begin says which process
    (``instance``), and a new one behind a known URL (a restart) gets its metadata fetched
    again and a new plan epoch, so nothing planned for the old process is used for it.

    Membership changes (`add_replica`, `remove_replica`) asked while an update runs (a task
    on its loop) apply as it ends, to the next one.

    One `SyncManager` lives on the process that drives the control plane (a driver, or trainer
    rank 0); it is not thread-safe, and its coroutines must run on one event loop.
    """

    def __init__(self, replicas: Sequence[str] = (), config: ControlConfig | None = None) -> None:
        """Create a manager for `replicas` (base URLs of their main HTTP servers)."""
        self._config = config or ControlConfig()
        self._poll_s = self._config.reply_poll_s
        self._replicas: list[str] = []
        self._clients: dict[str, RolloutClient] = {}
        self._ranks: dict[str, tuple[TargetRank, ...]] = {}  # metadata, by replica
        self._epoch = 0
        self._epochs: dict[tuple[int, frozenset[tuple[str, str | None]]], int] = {}
        self._version = 0
        self._checked = False
        self._armed: set[str] = set()
        self._dirty: set[str] = set()
        self._unhealthy: dict[str, str] = {}
        self._protocols: dict[str, ReplicaProtocol] = {}
        self._server_infos: dict[str, dict[str, Any]] = {}
        self._warned: set[str] = set()
        # Per update: replicas whose KV cache it released (and so must resume), whose
        # generation it paused, and the session tokens of the sessions it began.
        self._released: set[str] = set()
        self._paused: set[str] = set()
        self._sessions: dict[str, str | None] = {}
        self._fence = False  # this update asks replicas that can for a fenced begin
        self._fences: dict[str, tuple[str, ...]] = {}  # the fenced begins' events, by URL
        self._membership = 0  # counts membership changes
        self._instances: dict[str, str] = {}  # each replica's process, where it says
        self._held: dict[str, HeldLabel] = {}  # what each replica holds, as last seen
        # Per update: what the begins' replies said, and the replicas found restarted.
        self._begun: dict[str, HeldLabel] = {}
        self._renewed: set[str] = set()
        self._given: set[str] = set()  # the labels this manager gave
        self._running: asyncio.Future[None] | None = None  # the update under way
        # Membership changes asked while it runs: applied as it ends.
        self._pending: list[tuple[Callable[[str], Any], str, asyncio.Future[None]]] = []
        for url in replicas:
            self._add(url)

    @property
    def config(self) -> ControlConfig:
        """The manager's configuration."""
        return self._config

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replicas the next update goes to, by base URL."""
        return tuple(self._replicas)

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
        return dict(self._protocols)

    @property
    def metadata_epoch(self) -> int:
        """Identifies the targets of the last push; changes whenever they change."""
        return self._epoch

    async def add_replica(self, url: str) -> None:
        """Add a replica (scale up); the next update fetches metadata again. Asked while an
        update runs, it applies as that update ends (and returns then).

        Raises:
            ValueError: the replica is already managed.
        """
        if self._updating():
            await self._after_update(self._add, url.rstrip("/"))
        else:
            self._add(url)

    def _updating(self) -> bool:
        return self._running is not None and not self._running.done()

    async def _after_update(self, change: Callable[[str], Any], url: str) -> None:
        """Queue a membership change for the end of the update under way (it runs there,
        before the update returns) and wait for it."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((change, url, done))
        await done

    async def _apply_pending(self) -> None:
        """Run the membership changes asked during the update that just ended."""
        pending, self._pending = self._pending, []
        for change, url, done in pending:
            try:
                result = change(url)
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(None)

    def _add(self, url: str) -> None:
        url = url.rstrip("/")
        if url in self._clients:
            raise ValueError(f"replica {url} is already managed")
        self._replicas.append(url)
        self._clients[url] = RolloutClient(
            url, api_key=self._config.api_key, timeout_s=self._config.http_timeout_s
        )
        self._membership_changed()

    async def remove_replica(self, url: str) -> None:
        """Stop managing a replica (scale down); it is no longer contacted. Asked while an
        update runs, it applies as that update ends (and returns then): the update finishes
        with the replica (its session, lease and label), and the next one runs without it.

        Raises:
            ValueError: the replica is not managed.
        """
        url = url.rstrip("/")
        if self._updating():
            if url not in self._clients:
                raise ValueError(f"replica {url} is not managed; managed: {self._replicas}")
            await self._after_update(self._remove, url)
        else:
            await self._remove(url)

    async def _remove(self, url: str) -> None:
        client = self._clients.pop(url, None)
        if client is None:
            raise ValueError(f"replica {url} is not managed; managed: {self._replicas}")
        self._replicas.remove(url)
        for state in (self._dirty, self._armed):
            state.discard(url)
        for table in (
            self._protocols,
            self._server_infos,
            self._unhealthy,
            self._ranks,
            self._instances,
            self._held,
        ):
            table.pop(url, None)
        self._membership_changed()
        await client.aclose()

    def _membership_changed(self) -> None:
        self._membership += 1

    async def aclose(self) -> None:
        """Close every replica's HTTP client."""
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))

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
        replicas = tuple(self._replicas)
        dropped: dict[str, str] = {}
        await self._first_contact(replicas, dropped)
        if dropped:
            self._raise_all_dropped(dropped, stage="first contact")
        missing = tuple(u for u in replicas if u not in self._ranks)
        fetched = await self._gather_targets(missing)
        failures = _failures(fetched)
        if failures:
            raise failures[0][1]
        self._ranks.update(fetched)
        return tuple(t for url in replicas for t in self._ranks[url])

    def protocol(self, url: str) -> ReplicaProtocol | None:
        """What replica `url` serves, once first contact learned it (else None)."""
        return self._protocols.get(url)

    async def update_weights(
        self,
        push: PushFn,
        *,
        version: str | None = None,
        fence: bool = False,
        rollback: bool = False,
    ) -> SyncReport:
        """Run one update through every replica; see the class docstring for the order.

        Args:
            push: writes the weights into the targets it is given and returns what it wrote.
            version: the new weight version; default: one more than the largest numeric
                version a replica holds or has held (or than this manager's last).
            fence: begin with a fence where a replica takes one (``weight_sync_fence``):
                its begin digest is not waited for, and `push` must make every write into
                a rank follow the event it is given for that rank (`WeightSender.push`'s
                ``fences`` do). Only for pushes written from this host over CUDA IPC.
            rollback: `version` may be a number at or below what a replica holds (the
                caller labels weights older than those, e.g. by a training step it resumes).

        Returns:
            What the update did, with seconds per phase, the replicas that verified it and
            those it dropped.

        Raises:
            ValueError: no replica is managed, or `version` is refused (one a replica
                holds, one this manager gave, or a number not above what a replica holds
                without `rollback`): the replicas serve their previous weights.
            RemoteReplicaError: every replica failed before any write (the first failure is
                named; all of them serve their previous weights), or a call failed after
                writing began.
            PartialSyncError: writing to some replicas, or verifying what they received,
                failed: those stay paused and dirty, the others were updated and serve the
                new version (``error.report`` says which).
            WeightSyncError: the push failed for every replica, or the bit-exact check
                failed.
        """
        if not self._replicas:
            raise ValueError("no rollout replica to update: add one with add_replica(url)")
        if self._updating():
            raise ValueError("an update is already running on this manager; await it first")
        running = self._running = asyncio.get_running_loop().create_future()
        try:
            return await self._update_weights(push, version, fence, rollback)
        finally:
            running.set_result(None)
            await self._apply_pending()

    async def _update_weights(
        self, push: PushFn, version: str | None, fence: bool, rollback: bool
    ) -> SyncReport:
        """`update_weights`, while no membership change may run."""
        t0 = time.perf_counter()
        dropped: dict[str, str] = {}
        self._released, self._paused, self._sessions = set(), set(), {}
        self._fence, self._fences = fence, {}
        self._begun, self._renewed = {}, set()
        if version is not None:
            check_label(version)
        live = await self._first_contact(tuple(self._replicas), dropped)
        # What the replicas were last seen to hold: refuse a bad label before pausing any.
        self._label(version, live, rollback)
        # Renewing from the start: a fused begin opens sessions while others' calls may still
        # run out their deadlines (and the failed ones are resumed), longer than a lease. A
        # timer starts the renewals a third of a lease in: most syncs end long before.
        loop = asyncio.get_running_loop()
        renewal: list[asyncio.Task[None]] = []
        timer = loop.call_later(
            self._config.lease_s / 3,
            lambda: renewal.append(loop.create_task(self._renew_leases(live))),
        )
        try:
            live = await self._open(live, dropped)
            live = await self._read_begins(live, dropped)
            try:
                new_version = self._label(version, live, rollback)
            except ValueError:
                await self._abandon(live, resume=not (self._dirty & set(live)))
                raise
            self._given.add(new_version)
            return await self._update(push, live, new_version, dropped, t0)
        finally:
            timer.cancel()
            for task in renewal:
                task.cancel()
            await asyncio.gather(*renewal, return_exceptions=True)
            self._unhealthy = dict(dropped)
            if dropped:
                logger.error(
                    "replicas dropped from this update (they serve their previous weights): %s",
                    "; ".join(f"{u}: {why}" for u, why in dropped.items()),
                )

    async def _update(
        self,
        push: PushFn,
        live: tuple[str, ...],
        new_version: str,
        dropped: dict[str, str],
        t0: float,
    ) -> SyncReport:
        """Steps 4-7 on the replicas that began a session."""
        cfg = self._config
        t_paused = time.perf_counter()
        refreshed = any(u not in self._ranks for u in live)
        try:
            targets = await self._live_targets(live, dropped)
            fences = await self._fences_of(targets, dropped)
            live = tuple(u for u in live if u not in dropped)
            targets = tuple(t for t in targets if t.replica in live)
            if cfg.check_weight_update_equal and not self._checked:
                # Snapshot and corrupt once; until a sync restores them, the replicas hold
                # random weights and a retry must not snapshot those.
                unarmed = [u for u in live if u not in self._armed]
                if unarmed:
                    await self._on_all(unarmed, "weights_checker", action="snapshot")
                    self._dirty.update(unarmed)
                    await self._on_all(unarmed, "weights_checker", action="reset_tensors")
                    self._armed.update(unarmed)
        except BaseException:
            await self._abandon(live, resume=not (self._dirty & set(live)))
            raise
        t_metadata = time.perf_counter()

        failed: dict[str, str] = {}
        overlap = False
        try:
            summary = await push(targets, self._epoch, fences)
            overlap = self._overlaps(summary, live, targets)
            if summary.landed is not None and not overlap:
                await summary.landed
        except (LayoutMismatchError, WeightsRefusedError):
            # Raised while the plan is built or the weights checked, before any byte is
            # written: replicas whose weights are intact may serve them again.
            await self._abandon(live, resume=not (self._dirty & set(live)))
            raise
        except PartialPushError as exc:
            # Writes to some replicas failed; every write to the others landed (their
            # digests say so at the end): finish those, keep the failed ones paused.
            for target in targets:
                if target.session_id in exc.failed:
                    failed.setdefault(target.replica, exc.failed[target.session_id])
            # A failure this update cannot place (a session of none of its targets) may be
            # any replica's: none of them is known to have received everything.
            known = {t.session_id for t in targets}
            unplaced = [s for s in exc.failed if s not in known]
            if unplaced or set(failed) >= set(live) or not isinstance(exc.result, PushSummary):
                self._dirty.update(live)
                await self._abandon(live, resume=False)
                exc.add_note(_stay_paused(live))
                raise
            self._dirty.update(failed)
            await self._abandon(tuple(failed), resume=False)
            live = tuple(u for u in live if u not in failed)
            summary = exc.result
        except BaseException as exc:
            self._dirty.update(live)
            await self._abandon(live, resume=False)
            exc.add_note(_stay_paused(live))
            raise
        t_pushed = time.perf_counter()

        fused = () if self._compare_pending(live) else tuple(u for u in live if self._fused(u))
        plain = tuple(u for u in live if u not in fused)
        finish_plain = self._finish(plain, new_version, summary, targets)
        finish_fused = self._finish_fused(
            fused, new_version, summary, targets, events=summary.events if overlap else ()
        )
        try:
            if plain and fused:
                (
                    (verified, unfinished),
                    (verified_fused, unfinished_fused, resume_failed),
                ) = await asyncio.gather(finish_plain, finish_fused)
            else:  # one of them has no replica and returns at once
                verified, unfinished = await finish_plain
                verified_fused, unfinished_fused, resume_failed = await finish_fused
        finally:
            if overlap:
                t_pushed = min(await _landing(summary), time.perf_counter())
        if overlap:
            await self._refuse_changed_while_landing(summary, live)
        verified += verified_fused
        unfinished |= unfinished_fused
        failed.update(unfinished)
        live = tuple(u for u in live if u not in unfinished)
        bit_exact: bool | None = None
        armed = [u for u in live if u in self._armed]
        if armed and not self._checked:
            await self._compare(armed)
            bit_exact = True
            self._checked = True
            self._armed.clear()
        self._dirty.difference_update(live)
        number = numeric_label(new_version)
        for url in live:
            highest = self._held[url].highest if url in self._held else None
            if number is not None:
                highest = max(number, highest or 0)
            self._held[url] = HeldLabel(label=new_version, highest=highest)
        if number is not None:
            self._version = max(self._version, number)
        t_final = time.perf_counter()

        await self._resume(tuple(u for u in live if u not in fused))
        if resume_failed:
            raise next(iter(resume_failed.values()))
        t_end = time.perf_counter()
        report = SyncReport(
            version=new_version,
            replicas=live,
            phases=PhaseTimes(
                pause=t_paused - t0,
                metadata=t_metadata - t_paused,
                push=t_pushed - t_metadata,
                finalize=t_final - t_pushed,
                resume=t_end - t_final,
            ),
            push=summary,
            metadata_refreshed=refreshed,
            bit_exact=bit_exact,
            verified=verified,
            dropped=dict(dropped),
        )
        if failed:
            message = "; ".join(f"{url}: {why}" for url, why in failed.items())
            error = PartialSyncError(
                f"weight version {new_version} failed on {len(failed)} replica(s) after "
                f"writing began ({message})",
                report=report,
                failed=failed,
            )
            error.add_note(_stay_paused(tuple(failed)))
            error.add_note(f"replicas {', '.join(live)} were updated and serve it")
            raise error
        unverified = len(live) - len(verified)
        logger.info(
            "weight version %s on %d replica(s)%s: %.3f GB in %.3f s (push %.3f s, %.2f GB/s)",
            new_version,
            len(live),
            f" ({len(verified)} verified, {unverified} unverified)",
            summary.bytes_written / 1e9,
            report.seconds,
            report.phases.push,
            report.gbps,
        )
        return report

    def _label(self, version: str | None, live: Sequence[str], rollback: bool) -> str:
        """The label of the update from what the replicas in `live` hold (`next_label`)."""
        held = {url: self._held.get(url, HeldLabel(label=None)) for url in live}
        return next_label(
            version,
            held,
            given=self._given,
            given_highest=self._version,
            rollback=rollback,
        )

    async def _read_begins(self, live: tuple[str, ...], dropped: dict[str, str]) -> tuple[str, ...]:
        """What each replica holds as its session began (its begin's reply, or ``/model_info``
        where the reply does not say, as SGLang's), and whether it is still the process this
        manager knew: a new one (a restart) has its server info and metadata fetched again.
        A replica that cannot say is dropped (and resumed) before any write."""
        timeout = self._config.lifecycle_timeout_s
        silent = [u for u in live if u not in self._begun]
        models = await self._call_all(silent, "get_model_info", timeout_s=timeout)
        for url, model in models.items():
            if not isinstance(model, BaseException):
                version = model.get("weight_version")
                self._begun[url] = HeldLabel(label=str(version) if version is not None else None)
        renewed = [u for u in live if u in self._renewed]
        if renewed:
            infos = await self._call_all(renewed, "get_server_info", timeout_s=timeout)
            for url, info in infos.items():
                reason = None if isinstance(info, BaseException) else refusal(info)
                if reason is not None:
                    infos[url] = RemoteReplicaError(
                        f"replica {url} restarted and cannot take point-to-point updates: {reason}",
                        replica=url,
                        route="/server_info",
                    )
                elif not isinstance(info, BaseException):
                    self._server_infos[url] = info
                    self._protocols[url] = ReplicaProtocol.from_server_info(info)
            models.update(infos)
        live = await self._drop_failed(live, models, dropped, "reading what it holds")
        if not live:
            self._raise_all_dropped(dropped, stage="begin")
        for url in live:
            self._held[url] = self._begun[url]
        return live

    def _note_begin(self, url: str, reply: BeginWeightUpdateResponse) -> None:
        """Keep what a begin's reply says the replica holds, and notice a new process behind
        `url` (its metadata is void: fetched again before the push)."""
        if reply.instance is None and reply.weight_version is None:
            return  # a server that does not say (SGLang): /model_info tells the label
        self._begun[url] = HeldLabel(
            label=reply.weight_version, highest=reply.highest_numeric_version
        )
        if reply.instance is None:
            return
        known = self._instances.get(url)
        if known is not None and known != reply.instance:
            logger.warning(
                "replica %s is a new process (instance %s, was %s): it restarted since the "
                "last update; its metadata is fetched again and it takes a full write",
                url,
                reply.instance,
                known,
            )
            self._ranks.pop(url, None)
            self._renewed.add(url)
        self._instances[url] = reply.instance

    async def _first_contact(
        self, replicas: Sequence[str], dropped: dict[str, str]
    ) -> tuple[str, ...]:
        """Learn what each replica not yet known serves (``/server_info``, ``/model_info``);
        returns the replicas that may take the update (the others are in `dropped`)."""
        unknown = [u for u in replicas if u not in self._server_infos or u in self._dirty]
        unknown += [u for u in replicas if u not in unknown and u in self._unhealthy]
        if unknown:
            timeout = self._config.lifecycle_timeout_s
            infos, models = await asyncio.gather(
                self._call_all(unknown, "get_server_info", timeout_s=timeout),
                self._call_all(unknown, "get_model_info", timeout_s=timeout),
            )
            for url in unknown:
                info, model = infos[url], models[url]
                failure = next((r for r in (info, model) if isinstance(r, BaseException)), None)
                if failure is not None:
                    dropped[url] = f"not reachable: {failure}"
                    continue
                reason = refusal(info)
                if reason is not None:
                    dropped[url] = f"cannot take point-to-point updates: {reason}"
                    continue
                protocol = ReplicaProtocol.from_server_info(info)
                # New, or failed last time (it may have restarted): fetch its ranks again.
                self._ranks.pop(url, None)
                self._server_infos[url] = info
                self._protocols[url] = protocol
                version = model.get("weight_version")
                known = self._held.get(url)
                self._held[url] = HeldLabel(
                    label=str(version) if version is not None else None,
                    highest=known.highest if known is not None else None,
                )
                instance = (info.get("weightsync") or {}).get("instance")
                if isinstance(instance, str):
                    self._instances[url] = instance
                self._warn_unenforced(url, protocol)
        live = tuple(u for u in replicas if u not in dropped)
        if not live:
            self._raise_all_dropped(dropped, stage="first contact")
        return live

    def _warn_unenforced(self, url: str, protocol: ReplicaProtocol) -> None:
        """Say once per replica which guarantees this replica cannot give."""
        missing = [c for c in (WEIGHT_UPDATE_LEASE, WEIGHT_UPDATE_DIGEST) if not protocol.serves(c)]
        if not missing or url in self._warned:
            return
        self._warned.add(url)
        logger.warning(
            "replica %s (%s) does not take %s: its sessions are not fenced (a trainer that "
            "dies mid-sync leaves it paused with a session open until a later update ends "
            "it, and another client may end or resume it) and it cannot verify what arrived "
            "(a sync it reports done is not checked against the trainers' digests); this "
            "manager keeps those rules on its side: it never resumes a replica it wrote to "
            "part-way, and labels are monotonic",
            url,
            protocol.describe(),
            " or ".join(missing),
        )

    def _fused(self, url: str) -> bool:
        return self._protocols[url].serves(WEIGHT_SYNC_FUSED)

    async def _open(self, replicas: tuple[str, ...], dropped: dict[str, str]) -> tuple[str, ...]:
        """Steps 2-3: pause, release and begin (fused where the replica takes it)."""
        fused = tuple(u for u in replicas if self._fused(u))
        if not fused:
            return await self._begin(await self._pause(replicas, dropped), dropped)
        plain = tuple(u for u in replicas if u not in fused)

        async def open_plain() -> tuple[str, ...]:
            if not plain:
                return ()
            paused = await self._pause(plain, dropped, must_remain=False)
            return await self._begin(paused, dropped, must_remain=False) if paused else ()

        if not plain:
            opened = ((), await self._begin_fused(fused, dropped))
        else:
            opened = await asyncio.gather(open_plain(), self._begin_fused(fused, dropped))
        live = tuple(u for u in replicas if u in opened[0] or u in opened[1])
        if not live:
            self._raise_all_dropped(dropped, stage="begin_weight_sync")
        return live

    async def _begin_fused(
        self, replicas: tuple[str, ...], dropped: dict[str, str]
    ) -> tuple[str, ...]:
        """``begin_weight_sync`` on every replica; drop (and resume) those that fail."""
        cfg = self._config
        timeout = cfg.lifecycle_timeout_s

        async def begin(url: str) -> str | None:
            leased = self._protocols[url].serves(WEIGHT_UPDATE_LEASE)
            try:
                reply = await self._clients[url].begin_weight_sync(
                    pause_mode=cfg.pause_mode if cfg.manage_generation else None,
                    release_kv_cache=cfg.release_kv_cache and cfg.manage_generation,
                    selector=cfg.selector,
                    lease_s=cfg.lease_s if leased else None,
                    # One call's deadline for the three (a lease must not lapse meanwhile).
                    budget_s=timeout,
                    fence=self._fence and self._protocols[url].serves(WEIGHT_SYNC_FENCE),
                    timeout_s=timeout + _REPLY_MARGIN_S,
                    poll_s=self._poll_s,
                )
            except LifecycleStepError as exc:
                if "/release_memory_occupation" in exc.completed:
                    self._released.add(url)
                raise
            except BaseException:
                # Unknown how far it got; a server with the fused calls resumes memory it
                # did not release harmlessly, so take it back to be sure.
                if cfg.release_kv_cache and cfg.manage_generation:
                    self._released.add(url)
                raise
            if cfg.release_kv_cache and cfg.manage_generation:
                self._released.add(url)
            # Held from now, not once every replica answered: the renewals start at once.
            self._sessions[url] = reply.session_token
            self._note_begin(url, reply)
            self._log_changed_outside(url, reply.changed_outside)
            if reply.fences:
                self._fences[url] = tuple(reply.fences)
            return reply.session_token

        if cfg.manage_generation:
            self._paused.update(replicas)
        results = await _settled(begin(u) for u in replicas)
        by_url = dict(zip(replicas, results, strict=True))
        return await self._drop_failed(replicas, by_url, dropped, "begin_weight_sync")

    async def _pause(
        self, replicas: tuple[str, ...], dropped: dict[str, str], *, must_remain: bool = True
    ) -> tuple[str, ...]:
        """Pause generation and release the KV cache; drop (and resume) those that fail
        (raise when none remains, with `must_remain`). Nothing when the host manages
        generation (``manage_generation=False``)."""
        cfg = self._config
        if not cfg.manage_generation:
            return replicas
        timeout = cfg.lifecycle_timeout_s
        results = await self._call_all(
            replicas, "pause_generation", mode=cfg.pause_mode, timeout_s=timeout
        )
        # A pause that timed out may still take effect: resume those too.
        self._paused.update(replicas)
        live = await self._drop_failed(replicas, results, dropped, "pause_generation")
        if cfg.release_kv_cache and live:
            results = await self._call_all(
                live, "release_memory_occupation", tags=["kv_cache"], timeout_s=timeout
            )
            # SGLang cannot resume what it did not release (it exits): only these resume.
            self._released.update(u for u, r in results.items() if not isinstance(r, BaseException))
            live = await self._drop_failed(live, results, dropped, "release_memory_occupation")
        if not live and must_remain:
            self._raise_all_dropped(dropped, stage="pause")
        return live

    async def _begin(
        self, replicas: tuple[str, ...], dropped: dict[str, str], *, must_remain: bool = True
    ) -> tuple[str, ...]:
        """Begin a session on every replica (a lease where it takes one); drop the others
        (raise when none remains, with `must_remain`)."""
        cfg = self._config

        async def begin(url: str) -> str | None:
            leased = self._protocols[url].serves(WEIGHT_UPDATE_LEASE)
            reply = await self._clients[url].begin_weight_update(
                cfg.selector,
                lease_s=cfg.lease_s if leased else None,
                timeout_s=cfg.lifecycle_timeout_s,
            )
            self._note_begin(url, reply)
            self._log_changed_outside(url, reply.changed_outside)
            return reply.session_token

        results = await _settled(begin(u) for u in replicas)
        by_url = dict(zip(replicas, results, strict=True))
        self._sessions.update({u: r for u, r in by_url.items() if not isinstance(r, BaseException)})
        live = await self._drop_failed(replicas, by_url, dropped, "begin_weight_update")
        if not live and must_remain:
            self._raise_all_dropped(dropped, stage="begin_weight_update")
        return live

    @staticmethod
    def _log_changed_outside(url: str, changed: Sequence[str]) -> None:
        if changed:
            logger.error(
                "replica %s: %d parameter(s) changed outside a weight-update session since "
                "its last update (bytes written into it without a session; it served them "
                "meanwhile): %s; this update overwrites them",
                url,
                len(changed),
                ", ".join(changed[:8]),
            )

    async def _live_targets(
        self, live: tuple[str, ...], dropped: dict[str, str]
    ) -> tuple[TargetRank, ...]:
        """The targets of the replicas still in the update (metadata fetched where not
        cached; a replica whose fetch fails is dropped); sets the epoch of the push."""
        missing = tuple(u for u in live if u not in self._ranks)
        fetched = await self._gather_targets(missing)
        self._ranks.update({u: r for u, r in fetched.items() if not isinstance(r, BaseException)})
        live = await self._drop_failed(live, fetched, dropped, "metadata")
        if not live:
            self._raise_all_dropped(dropped, stage="metadata")
        # Keyed by process too: a replica restarted behind its URL gets a new plan.
        key = (self._membership, frozenset((u, self._instances.get(u)) for u in live))
        self._epoch = self._epochs.setdefault(key, len(self._epochs) + 1)
        return tuple(t for u in live for t in self._ranks[u])

    async def _fences_of(
        self, targets: Sequence[TargetRank], dropped: dict[str, str]
    ) -> dict[str, str]:
        """The fenced begins' events by target session id. A replica that answered other
        than one event per rank is dropped (and resumed) before any write: its writes could
        race its digest."""
        ranks: dict[str, list[TargetRank]] = {}
        for target in targets:
            ranks.setdefault(target.replica, []).append(target)
        fences: dict[str, str] = {}
        wrong: dict[str, Any] = {}
        for url, events in self._fences.items():
            mine = ranks.get(url, [])
            if len(events) != len(mine) or any(t.rank >= len(events) for t in mine):
                wrong[url] = RemoteReplicaError(
                    f"replica {url}: begin_weight_sync answered {len(events)} fence(s) for "
                    f"{len(mine)} rank(s)",
                    replica=url,
                    route="/begin_weight_sync",
                )
                continue
            fences.update({t.session_id: events[t.rank] for t in mine})
        if wrong:
            live = tuple(u for u in ranks if u not in dropped)
            if not await self._drop_failed(live, wrong, dropped, "begin_weight_sync"):
                self._raise_all_dropped(dropped, stage="begin_weight_sync")
        return fences

    async def _gather_targets(self, replicas: tuple[str, ...]) -> dict[str, Any]:
        """Every replica's ranks (a tuple), or the exception its fetch raised (by URL)."""
        results = await asyncio.gather(
            *(self._replica_targets(url, self._server_infos[url]) for url in replicas),
            return_exceptions=True,
        )
        return dict(zip(replicas, results, strict=True))

    async def _drop_failed(
        self,
        replicas: tuple[str, ...],
        results: dict[str, Any],
        dropped: dict[str, str],
        route: str,
    ) -> tuple[str, ...]:
        """Drop the replicas whose result is an exception, putting each back to serving its
        previous weights; returns the others."""
        failed = [u for u in replicas if isinstance(results.get(u), BaseException)]
        for url in failed:
            exc = results[url]
            dropped[url] = f"{route} failed: {exc}"
            logger.error("replica %s dropped from this update: %s failed: %s", url, route, exc)
        if failed:
            # Nothing was written to them: end what this update began and serve again.
            await self._abandon(failed, resume=True)
        return tuple(u for u in replicas if u not in failed)

    def _raise_all_dropped(self, dropped: dict[str, str], *, stage: str) -> None:
        self._unhealthy = dict(dropped)
        url, why = next(iter(dropped.items()))
        others = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
        raise RemoteReplicaError(
            f"no replica could take the update: replica {url}{others} {why}; nothing was "
            "written and every replica serves its previous weights",
            replica=url,
            route=stage,
        )

    async def _renew_leases(self, replicas: tuple[str, ...]) -> None:
        """Renew the sessions' leases now and every third of the lease until cancelled; a
        renewal that fails is logged (the session's end then reports what happened)."""
        lease = self._config.lease_s
        while True:
            held = {
                u: t
                for u, t in self._sessions.items()
                if t is not None and u in replicas and u in self._clients
            }
            results = await asyncio.gather(
                *(
                    self._clients[u].renew_weight_update(
                        t, lease, timeout_s=self._config.lifecycle_timeout_s
                    )
                    for u, t in held.items()
                ),
                return_exceptions=True,
            )
            for url, result in zip(held, results, strict=True):
                if isinstance(result, BaseException):
                    logger.error("renewing the session lease on %s failed: %s", url, result)
            await asyncio.sleep(lease / 3)

    async def _finish(
        self,
        replicas: tuple[str, ...],
        new_version: str,
        summary: PushSummary,
        targets: Sequence[TargetRank],
    ) -> tuple[tuple[str, ...], dict[str, str]]:
        """Label the new weights and end every session (with the digests where the replica
        verifies them).

        Returns:
            The replicas that verified the digests, and ``{url: why}`` of those that refused
            the label or the end (their verification failed): they stay paused and dirty.
        """
        timeout = self._config.lifecycle_timeout_s
        digests = _digests_by_replica(summary, targets) if replicas else {}

        async def finish(url: str) -> bool:
            client, token = self._clients[url], self._sessions.get(url)
            verify, unverified = self._verification(url, digests, summary)
            await client.update_weight_version(
                new_version, abort_all_requests=False, session_token=token, timeout_s=timeout
            )
            await client.end_weight_update(
                session_token=token,
                digests=digests[url] if verify else None,
                unverified=unverified,
                timeout_s=timeout,
            )
            self._sessions.pop(url, None)
            return verify

        outcomes = await _settled(finish(u) for u in replicas)
        results = dict(zip(replicas, outcomes, strict=True))
        unfinished = await self._abandon_unfinished(results)
        return tuple(u for u, ok in results.items() if ok is True), unfinished

    async def _refuse_changed_while_landing(
        self, summary: PushSummary, live: tuple[str, ...]
    ) -> None:
        """After sessions that ended while the copies were in flight: where a trainer tensor
        changed before its copies landed (`TensorChangedError` from the landing), the
        replicas may hold a mix of two steps that their sampled digests passed. They are
        paused again, marked dirty and unlabelled here, and the sync fails.

        Raises:
            TensorChangedError: naming the tensor.
        """
        if summary.landed is None:
            return
        try:
            await summary.landed
        except TensorChangedError as exc:
            self._dirty.update(live)
            for url in live:
                self._held.pop(url, None)
            await self._call_all(
                live,
                "pause_generation",
                mode=self._config.pause_mode,
                timeout_s=self._config.lifecycle_timeout_s,
            )
            exc.add_note(_stay_paused(live))
            raise
        except Exception:
            return  # `_landing` logged it; the replicas verified what arrived

    def _verification(
        self, url: str, digests: Mapping[str, Any], summary: PushSummary
    ) -> tuple[bool, bool]:
        """``(verify, unverified)`` of replica `url`'s end: verify with its digests where it
        takes them and the push computed them for every one of its ranks; say it ends
        unverified where the trainers computed none (``SenderConfig(digest=False)``).

        Raises:
            WeightSyncError: it takes digests and the push computed some, but not for every
                rank of this replica: what arrived there cannot be verified, and labelling
                it would name weights nobody checked.
        """
        if not self._protocols[url].serves(WEIGHT_UPDATE_DIGEST):
            return False, False
        if url in digests:
            return True, False
        if summary.digests:
            raise WeightSyncError(
                f"replica {url}: the push has no digests of what it wrote to every rank of "
                "this replica, so what arrived cannot be verified; it stays paused and takes "
                "a full write next update"
            )
        return False, True

    async def _abandon_unfinished(self, results: dict[str, Any]) -> dict[str, str]:
        """The replicas whose finish raised, marked dirty and abandoned paused, with why."""
        unfinished = {u: str(r) for u, r in results.items() if isinstance(r, BaseException)}
        if unfinished:
            self._dirty.update(unfinished)
            for url in unfinished:
                self._held.pop(url, None)
            await self._abandon(tuple(unfinished), resume=False)
        return unfinished

    def _compare_pending(self, live: Sequence[str]) -> bool:
        """Whether this sync ends with the bit-exact compare of replicas it corrupted."""
        return not self._checked and any(u in self._armed for u in live)

    def _overlaps(
        self, summary: PushSummary, live: tuple[str, ...], targets: Sequence[TargetRank]
    ) -> bool:
        """Whether the sessions may end while the push's copies are still in flight: every
        replica takes the fused end, waits for the copies' events itself
        (``weight_sync_events``) and verifies every rank's digests, and no bit-exact
        compare is pending."""
        if summary.landed is None or not summary.events:
            return False
        if self._compare_pending(live):
            return False
        needed = (WEIGHT_SYNC_FUSED, WEIGHT_SYNC_EVENTS, WEIGHT_UPDATE_DIGEST)
        if not all(self._protocols[u].serves(c) for u in live for c in needed):
            return False
        return all(t.session_id in summary.digests for t in targets if t.replica in live)

    async def _finish_fused(
        self,
        replicas: tuple[str, ...],
        new_version: str,
        summary: PushSummary,
        targets: Sequence[TargetRank],
        *,
        events: Sequence[str] = (),
    ) -> tuple[tuple[str, ...], dict[str, str], dict[str, BaseException]]:
        """Steps 6-7 as one ``end_weight_sync`` per replica (sent while the push's copies
        are in flight when `events` names the events they complete at: the replica waits
        for them before it verifies).

        Returns:
            The replicas that verified the digests; ``{url: why}`` of those that refused the
            label or the end (they stay paused and dirty, as after `_finish`); and the
            errors of replicas whose session ended but whose resume refused.
        """
        timeout = self._config.lifecycle_timeout_s
        digests = _digests_by_replica(summary, targets) if replicas else {}

        async def finish(url: str) -> tuple[bool, BaseException | None]:
            token = self._sessions.get(url)
            verify, unverified = self._verification(url, digests, summary)
            try:
                reply = await self._clients[url].end_weight_sync(
                    new_version=new_version,
                    session_token=token,
                    digests=digests[url] if verify else None,
                    unverified=unverified,
                    resume=self._config.manage_generation,
                    resume_kv_cache=url in self._released,
                    after_events=list(events) if events else None,
                    budget_s=timeout,
                    timeout_s=timeout + _REPLY_MARGIN_S,
                    poll_s=self._poll_s,
                    # Sent while the copies run: no reply before they land.
                    poll_after=summary.landed if events else None,
                )
            except LifecycleStepError as exc:
                if "/end_weight_update" not in exc.completed:
                    raise
                # Verified and ended; serving again refused (as `_resume` would raise).
                self._sessions.pop(url, None)
                if "/resume_memory_occupation" in exc.completed:
                    self._released.discard(url)
                return verify, exc
            self._sessions.pop(url, None)
            self._released.discard(url)
            # A fenced begin's finding, known at the end.
            self._log_changed_outside(url, reply.changed_outside)
            return verify, None

        outcomes = await _settled(finish(u) for u in replicas)
        results = dict(zip(replicas, outcomes, strict=True))
        unfinished = await self._abandon_unfinished(results)
        done = {u: r for u, r in results.items() if not isinstance(r, BaseException)}
        verified = tuple(u for u, (ok, _) in done.items() if ok)
        resume_failed = {u: exc for u, (_, exc) in done.items() if exc is not None}
        return verified, unfinished, resume_failed

    async def _replica_targets(
        self, url: str, server_info: dict[str, Any]
    ) -> tuple[TargetRank, ...]:
        client = self._clients[url]
        protocol = ReplicaProtocol.from_server_info(server_info)
        try:
            ranks = range(num_ranks(server_info))
        except ValueError as exc:
            raise RemoteReplicaError(
                f"replica {url}: {exc}", replica=url, route="/server_info"
            ) from exc
        engine_infos = asyncio.gather(*(client.get_transfer_engine_reply(r) for r in ranks))
        parallelism = self._parallelism_of(client, protocol, server_info, ranks)
        infos, configs = await asyncio.gather(engine_infos, parallelism)
        self._protocols[url] = protocol
        dtype = served_dtype(server_info)
        try:
            fp8_block = served_fp8_block(server_info)
        except ValueError as exc:
            raise RemoteReplicaError(
                f"replica {url}: {exc}", replica=url, route="/server_info"
            ) from exc
        return tuple(
            TargetRank(
                replica=url,
                rank=rank,
                session_id=info.remote_instance_transfer_engine_info[0],
                parallelism=config,
                weights_info={
                    k: tuple(v) for k, v in info.remote_instance_transfer_engine_info[1].items()
                },
                dtype=dtype,
                fp8_block_size=fp8_block,
                regions=tuple(map(tuple, info.registered_regions))
                if info.registered_regions is not None
                else None,
            )
            for rank, info, config in zip(ranks, infos, configs, strict=True)
        )

    async def _parallelism_of(
        self,
        client: RolloutClient,
        protocol: ReplicaProtocol,
        server_info: dict[str, Any],
        ranks: range,
    ) -> list[ParallelismConfig]:
        """Each rank's parallelism: from ``/parallelism_config`` where served (advertised, or
        answered for rank 0 by a server that advertises nothing, such as SGLang with the
        Miles extensions), else derived from `server_info` as SGLang derives it."""
        url = client.base_url
        if protocol.kind == "sglang" and not protocol.serves(PARALLELISM_CONFIG):
            try:
                first = await client.get_parallelism_config(ranks[0])
            except RemoteReplicaError as exc:
                if exc.status_code != 404:
                    raise
                logger.info(
                    "replica %s (%s) has no /parallelism_config: derived from /server_info",
                    url,
                    protocol.describe(),
                )
                try:
                    return [derive_parallelism(server_info, rank) for rank in ranks]
                except ValueError as derive_error:
                    raise RemoteReplicaError(
                        f"replica {url}: {derive_error}", replica=url, route="/server_info"
                    ) from derive_error
            rest = await asyncio.gather(*(client.get_parallelism_config(r) for r in ranks[1:]))
            return [first, *rest]
        return list(await asyncio.gather(*(client.get_parallelism_config(r) for r in ranks)))

    async def _call_all(
        self, replicas: Sequence[str], method: str, **kwargs: Any
    ) -> dict[str, Any]:
        """Call `method` on every replica at once; each replica's result or exception."""
        results = await asyncio.gather(
            *(getattr(self._clients[url], method)(**kwargs) for url in replicas),
            return_exceptions=True,
        )
        return dict(zip(replicas, results, strict=True))

    async def _on_all(self, replicas: Sequence[str], method: str, **kwargs: Any) -> dict[str, Any]:
        """Call `method` on every replica at once; raise the first failure, naming it."""
        results = await self._call_all(replicas, method, **kwargs)
        failures = _failures(results)
        if failures:
            url, exc = failures[0]
            others = f" (and {len(failures) - 1} more replica(s))" if len(failures) > 1 else ""
            if isinstance(exc, RemoteReplicaError):
                raise exc
            raise RemoteReplicaError(
                f"{method} failed on replica {url}{others}: {exc}", replica=url, route=method
            ) from exc
        return results

    async def _abandon(self, replicas: Sequence[str], *, resume: bool) -> None:
        """End every session after a failure; resume serving only if no byte was written."""
        timeout = self._config.lifecycle_timeout_s
        began = [u for u in replicas if u in self._sessions]
        await asyncio.gather(
            *(
                self._clients[u].end_weight_update(
                    session_token=self._sessions.pop(u), timeout_s=timeout
                )
                for u in began
            ),
            return_exceptions=True,
        )
        if resume:
            await self._resume(replicas, best_effort=True)
        elif replicas:
            logger.error("%s", _stay_paused(replicas))

    async def _resume(self, replicas: Sequence[str], *, best_effort: bool = False) -> None:
        """Serve again: take back the KV cache where this update released it, flush, continue.
        Nothing when the host manages generation (``manage_generation=False``)."""
        if not self._config.manage_generation:
            return
        call = self._call_all if best_effort else self._on_all
        timeout = self._config.lifecycle_timeout_s
        released = [url for url in replicas if url in self._released]
        if released:
            await call(released, "resume_memory_occupation", tags=["kv_cache"], timeout_s=timeout)
            self._released.difference_update(released)
        for method in ("flush_cache", "continue_generation"):
            await call(replicas, method, timeout_s=timeout)

    async def _compare(self, replicas: Sequence[str]) -> None:
        results = await self._call_all(
            replicas,
            "weights_checker",
            action="compare",
            allow_quant_error=self._config.allow_quant_error,
            timeout_s=self._config.check_timeout_s,
        )
        failed = _failures(results)
        if failed:
            self._dirty.update(u for u, _ in failed)
            url, exc = failed[0]
            raise WeightSyncError(
                f"bit-exact check failed on replica {url}: the first sync did not restore the "
                f"snapshotted weights: {exc}"
            ) from exc


async def _settled(coroutines: Iterable[Awaitable[T]]) -> list[T | BaseException]:
    """``asyncio.gather(*coroutines, return_exceptions=True)``, but a lone coroutine is
    awaited in place: the task a gather makes for each costs a turn of the event loop, a few
    of them per sync while generation waits on one replica."""
    pending = list(coroutines)
    if len(pending) != 1:
        return list(await asyncio.gather(*pending, return_exceptions=True))
    try:
        return [await pending[0]]
    except Exception as exc:
        return [exc]


async def _landing(summary: PushSummary) -> float:
    """When the driver saw the push's in-flight copies land (now, if it could not: the
    replicas verified what arrived either way)."""
    if summary.landed is None:
        return time.perf_counter()
    try:
        return await summary.landed
    except Exception as exc:
        logger.warning("the trainer could not see its copies land: %s", exc)
        return time.perf_counter()


def _digests_by_replica(
    summary: PushSummary, targets: Sequence[TargetRank]
) -> dict[str, dict[int, dict[str, int]]]:
    """The push's digests per replica and rank, where the push computed them for every
    rank of the replica."""
    by_replica: dict[str, dict[int, dict[str, int]]] = {}
    incomplete: set[str] = set()
    for target in targets:
        digests = summary.digests.get(target.session_id)
        if digests is None:
            incomplete.add(target.replica)
            continue
        by_replica.setdefault(target.replica, {})[target.rank] = dict(digests)
    return {url: ranks for url, ranks in by_replica.items() if url not in incomplete}


def _stay_paused(replicas: Sequence[str]) -> str:
    return (
        f"the update failed after writing began: replicas {', '.join(replicas)} stay paused "
        "(they may hold mixed weights) until a later update to them succeeds"
    )


def _failures(results: dict[str, Any]) -> list[tuple[str, BaseException]]:
    return [(u, r) for u, r in results.items() if isinstance(r, BaseException)]
