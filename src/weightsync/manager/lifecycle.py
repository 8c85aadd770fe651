"""How one replica's update session opens and closes: the `Lifecycle` protocol, and its two
dialects, chosen per replica by what it serves.

- `PlainLifecycle`, the eight calls of the Miles lifecycle (docs/protocol.md): opening is
  ``pause_generation``, ``release_memory_occupation(["kv_cache"])`` and
  ``begin_weight_update``; finishing is ``update_weight_version`` and
  ``end_weight_update``; resuming is ``resume_memory_occupation``, ``flush_cache`` and
  ``continue_generation``.
- `FusedLifecycle`, for a replica that advertises ``weight_sync_fused``: opening is one
  ``begin_weight_sync`` and finishing (with the resume) one ``end_weight_sync``, which the
  server runs as the same calls in the same order; it answers a refusal as the refusing
  call would.

A third engine's routes are a third implementation. Every implementation records in the
update's `Sessions` what it began and released, so that `ReplicaCalls.abandon` can undo it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from weightsync.control.protocol import (
    WEIGHT_SYNC_FENCE,
    WEIGHT_UPDATE_DIGEST,
    WEIGHT_UPDATE_LEASE,
    ReplicaProtocol,
    refusal,
)
from weightsync.errors import LifecycleStepError, RemoteReplicaError, WeightSyncError
from weightsync.manager.config import ControlConfig
from weightsync.manager.replicas import ReplicaSet
from weightsync.manager.update import OpenUpdate, PushResult, stay_paused
from weightsync.manager.versions import HeldLabel
from weightsync.plan import TargetRank
from weightsync.sender import Fence

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A fused call's server-side budget is one call's deadline; the reply may take this longer.
_REPLY_MARGIN_S = 1.0


@dataclass(frozen=True, slots=True)
class Finished:
    """What finishing some replicas' sessions did.

    Attributes:
        verified: the replicas that verified the push's digests.
        unfinished: ``{url: why}`` of those that refused the label or the end (they stay
            paused and dirty).
        resume_failed: errors of replicas whose session ended but whose resume refused.
    """

    verified: tuple[str, ...] = ()
    unfinished: dict[str, str] = field(default_factory=dict)
    resume_failed: dict[str, BaseException] = field(default_factory=dict)

    def __add__(self, other: Finished) -> Finished:
        return Finished(
            self.verified + other.verified,
            {**self.unfinished, **other.unfinished},
            {**self.resume_failed, **other.resume_failed},
        )


class Lifecycle(Protocol):
    """Opens, finishes and resumes update sessions on replicas that speak one dialect."""

    async def open(
        self, update: OpenUpdate, replicas: tuple[str, ...], *, must_remain: bool
    ) -> tuple[str, ...]:
        """Pause generation, release the KV cache and begin a session on every replica;
        returns those that began (the others are in ``update.dropped``, serving again).

        Raises:
            RemoteReplicaError: none began and `must_remain`.
        """
        ...

    async def finish(
        self,
        update: OpenUpdate,
        replicas: tuple[str, ...],
        result: PushResult,
        *,
        events: Sequence[str] = (),
    ) -> Finished:
        """Label the new weights and end the sessions with the push's digests (sent while
        the copies that complete at `events` are in flight, where given)."""
        ...

    async def resume(self, update: OpenUpdate, replicas: tuple[str, ...]) -> None:
        """Serve again after `finish` (nothing where finishing resumed).

        Raises:
            RemoteReplicaError: a replica refused to serve again.
        """
        ...


def _keeps_verdict(protocol: ReplicaProtocol | None) -> bool:
    """Whether the replica judges its weights complete or not across sessions."""
    return protocol is not None and protocol.serves(WEIGHT_UPDATE_LEASE)


class ReplicaCalls:
    """The calls every dialect shares: issue to all at once, drop the failed ones, abandon
    and resume.

    Args:
        replicas: the managed replicas.
        config: the control plane's settings.
    """

    def __init__(self, replicas: ReplicaSet, config: ControlConfig) -> None:
        self.replicas = replicas
        self.config = config

    async def call_all(self, replicas: Sequence[str], method: str, **kwargs: Any) -> dict[str, Any]:
        """Call `method` on every replica at once; each replica's result or exception."""
        return await self.replicas.call_all(replicas, method, **kwargs)

    async def on_all(self, replicas: Sequence[str], method: str, **kwargs: Any) -> dict[str, Any]:
        """Call `method` on every replica at once; raise the first failure, naming it."""
        results = await self.call_all(replicas, method, **kwargs)
        failures = failures_of(results)
        if failures:
            url, exc = failures[0]
            others = f" (and {len(failures) - 1} more replica(s))" if len(failures) > 1 else ""
            if isinstance(exc, RemoteReplicaError):
                raise exc
            raise RemoteReplicaError(
                f"{method} failed on replica {url}{others}: {exc}", replica=url, route=method
            ) from exc
        return results

    async def drop_failed(
        self, update: OpenUpdate, replicas: tuple[str, ...], results: Mapping[str, Any], route: str
    ) -> tuple[str, ...]:
        """Drop the replicas whose result is an exception, putting each back to serving its
        previous weights; returns the others."""
        failed = [u for u in replicas if isinstance(results.get(u), BaseException)]
        for url in failed:
            exc = results[url]
            update.dropped[url] = f"{route} failed: {exc}"
            logger.error("replica %s dropped from this update: %s failed: %s", url, route, exc)
        if failed:
            # Nothing was written to them: end what this update began and serve again.
            await self.abandon(update, failed, resume=True)
        return tuple(u for u in replicas if u not in failed)

    async def abandon(self, update: OpenUpdate, replicas: Sequence[str], *, resume: bool) -> None:
        """End every session after a failure; resume serving only if no byte was written.

        Without `resume` (writes may have begun), a replica that keeps a verdict on its
        weights (``weight_update_lease``) is told the session is abandoned: a write still in
        flight may land after the end, so whatever the end saw, the weights are incomplete.
        """
        timeout = self.config.lifecycle_timeout_s
        tokens = update.sessions.tokens
        began = [u for u in replicas if u in tokens]
        protocols = self.replicas.protocols
        why = None if resume else "its holder's update failed; its writes may have begun"
        await asyncio.gather(
            *(
                self.replicas.clients[u].end_weight_update(
                    session_token=tokens.pop(u),
                    abandoned=why if _keeps_verdict(protocols.get(u)) else None,
                    timeout_s=timeout,
                )
                for u in began
            ),
            return_exceptions=True,
        )
        if resume:
            await self.resume(update, replicas, best_effort=True)
        elif replicas:
            logger.error("%s", stay_paused(replicas))

    async def resume(
        self, update: OpenUpdate, replicas: Sequence[str], *, best_effort: bool = False
    ) -> None:
        """Serve again: take back the KV cache where the update released it, flush,
        continue. Nothing when the host manages generation (``manage_generation=False``)."""
        if not self.config.manage_generation or not replicas:
            return
        call = self.call_all if best_effort else self.on_all
        timeout = self.config.lifecycle_timeout_s
        released = [url for url in replicas if url in update.sessions.released]
        if released:
            await call(released, "resume_memory_occupation", tags=["kv_cache"], timeout_s=timeout)
            update.sessions.released.difference_update(released)
        for method in ("flush_cache", "continue_generation"):
            await call(replicas, method, timeout_s=timeout)

    def verification(
        self, url: str, digests: Mapping[str, Any], result: PushResult
    ) -> tuple[bool, bool]:
        """``(verify, unverified)`` of replica `url`'s end: verified by its own check of a
        delta it applied; else verify with its digests where it takes them and the push
        computed them for every one of its ranks; say it ends unverified where the trainers
        computed none (``SenderConfig(digest=False)``).

        Raises:
            WeightSyncError: it takes digests and the push computed some, but not for every
                rank of this replica: labelling what arrived would name weights nobody
                checked.
        """
        if url in result.delta_verified:
            # Its ranks checked every byte of what they applied (`weightsync.manager.delta`)
            # and remember it: the end judges the session verified without digests.
            return True, False
        if not self.replicas.protocols[url].serves(WEIGHT_UPDATE_DIGEST):
            return False, False
        if url in digests:
            return True, False
        if result.digests:
            raise WeightSyncError(
                f"replica {url}: the push has no digests of what it wrote to every rank of "
                "this replica, so what arrived cannot be verified; it stays paused and takes "
                "a full write next update"
            )
        return False, True

    async def unfinished(self, update: OpenUpdate, results: Mapping[str, Any]) -> dict[str, str]:
        """The replicas whose finish raised, with why; abandoned paused (the caller marks
        them dirty)."""
        unfinished = {u: str(r) for u, r in results.items() if isinstance(r, BaseException)}
        if unfinished:
            await self.abandon(update, tuple(unfinished), resume=False)
        return unfinished

    async def renew_leases(self, update: OpenUpdate) -> None:
        """Renew the update's session leases now and every third of the lease until
        cancelled; a renewal that fails is logged (the session's end then says what
        happened)."""
        lease = self.config.lease_s
        clients = self.replicas.clients
        while True:
            held = {
                u: t for u, t in update.sessions.tokens.items() if t is not None and u in clients
            }
            results = await asyncio.gather(
                *(
                    clients[u].renew_weight_update(
                        t, lease, timeout_s=self.config.lifecycle_timeout_s
                    )
                    for u, t in held.items()
                ),
                return_exceptions=True,
            )
            for url, result in zip(held, results, strict=True):
                if isinstance(result, BaseException):
                    logger.error("renewing the session lease on %s failed: %s", url, result)
            await asyncio.sleep(lease / 3)

    async def fences(self, update: OpenUpdate, targets: Sequence[TargetRank]) -> tuple[Fence, ...]:
        """The fenced begins' events, one per target. A replica that answered other than
        one event per rank is dropped (and resumed) before any write: its writes could race
        its digest."""
        ranks: dict[str, list[TargetRank]] = {}
        for target in targets:
            ranks.setdefault(target.replica, []).append(target)
        fences: list[Fence] = []
        wrong: dict[str, Any] = {}
        for url, events in update.sessions.fence_events.items():
            mine = ranks.get(url, [])
            if len(events) != len(mine) or any(t.rank >= len(events) for t in mine):
                wrong[url] = RemoteReplicaError(
                    f"replica {url}: begin_weight_sync answered {len(events)} fence(s) for "
                    f"{len(mine)} rank(s)",
                    replica=url,
                    route="/begin_weight_sync",
                )
                continue
            fences += [Fence(session_id=t.session_id, event=events[t.rank]) for t in mine]
        if wrong:
            live = tuple(u for u in ranks if u not in update.dropped)
            if not await self.drop_failed(update, live, wrong, "begin_weight_sync"):
                raise_all_dropped(update.dropped, stage="begin_weight_sync")
        return tuple(fences)

    async def read_begins(self, update: OpenUpdate, live: tuple[str, ...]) -> tuple[str, ...]:
        """What each replica holds as its session began (its begin's reply, or
        ``/model_info`` where the reply does not say, as SGLang's), and whether it is still
        the process this manager knew: a new one (a restart) has its server info fetched
        again. A replica that cannot say is dropped (and resumed) before any write; the
        others' are in ``update.sessions.begun``."""
        timeout = self.config.lifecycle_timeout_s
        begun = update.sessions.begun
        silent = [u for u in live if u not in begun]
        models = await self.call_all(silent, "get_model_info", timeout_s=timeout)
        for url, model in models.items():
            if not isinstance(model, BaseException):
                version = model.get("weight_version")
                begun[url] = HeldLabel(label=str(version) if version is not None else None)
        restarted = [u for u in live if u in update.sessions.restarted]
        if restarted:
            infos = await self.call_all(restarted, "get_server_info", timeout_s=timeout)
            for url, info in infos.items():
                reason = None if isinstance(info, BaseException) else refusal(info)
                if reason is not None:
                    infos[url] = RemoteReplicaError(
                        f"replica {url} restarted and cannot take point-to-point updates: {reason}",
                        replica=url,
                        route="/server_info",
                    )
                elif not isinstance(info, BaseException):
                    self.replicas.learn(url, info)
            models.update(infos)
        live = await self.drop_failed(update, live, models, "reading what it holds")
        if not live:
            raise_all_dropped(update.dropped, stage="begin")
        return live


class PlainLifecycle:
    """The eight calls (see the module docstring).

    Args:
        calls: the shared calls.
    """

    def __init__(self, calls: ReplicaCalls) -> None:
        self._calls = calls

    async def open(
        self, update: OpenUpdate, replicas: tuple[str, ...], *, must_remain: bool
    ) -> tuple[str, ...]:
        """See `Lifecycle.open`."""
        paused = await self._pause(update, replicas, must_remain=must_remain)
        return await self._begin(update, paused, must_remain=must_remain) if paused else ()

    async def _pause(
        self, update: OpenUpdate, replicas: tuple[str, ...], *, must_remain: bool
    ) -> tuple[str, ...]:
        calls, cfg = self._calls, self._calls.config
        if not cfg.manage_generation:
            return replicas
        timeout = cfg.lifecycle_timeout_s
        results = await calls.call_all(
            replicas, "pause_generation", mode=cfg.pause_mode, timeout_s=timeout
        )
        # A pause that timed out may still take effect: resume those too.
        update.sessions.paused.update(replicas)
        live = await calls.drop_failed(update, replicas, results, "pause_generation")
        if cfg.release_kv_cache and live:
            results = await calls.call_all(
                live, "release_memory_occupation", tags=["kv_cache"], timeout_s=timeout
            )
            # SGLang cannot resume what it did not release (it exits): only these resume.
            update.sessions.released.update(
                u for u, r in results.items() if not isinstance(r, BaseException)
            )
            live = await calls.drop_failed(update, live, results, "release_memory_occupation")
        if not live and must_remain:
            raise_all_dropped(update.dropped, stage="pause")
        return live

    async def _begin(
        self, update: OpenUpdate, replicas: tuple[str, ...], *, must_remain: bool
    ) -> tuple[str, ...]:
        calls, cfg = self._calls, self._calls.config
        known = calls.replicas

        async def begin(url: str) -> str | None:
            leased = known.protocols[url].serves(WEIGHT_UPDATE_LEASE)
            reply = await known.clients[url].begin_weight_update(
                cfg.selector,
                lease_s=cfg.lease_s if leased else None,
                timeout_s=cfg.lifecycle_timeout_s,
            )
            known.note_begin(url, reply, update.sessions)
            log_changed_outside(url, reply.changed_outside)
            return reply.session_token

        by_url = dict(zip(replicas, await settled(begin(u) for u in replicas), strict=True))
        update.sessions.tokens.update(
            {u: r for u, r in by_url.items() if not isinstance(r, BaseException)}
        )
        live = await calls.drop_failed(update, replicas, by_url, "begin_weight_update")
        if not live and must_remain:
            raise_all_dropped(update.dropped, stage="begin_weight_update")
        return live

    async def finish(
        self,
        update: OpenUpdate,
        replicas: tuple[str, ...],
        result: PushResult,
        *,
        events: Sequence[str] = (),
    ) -> Finished:
        """See `Lifecycle.finish` (the manager waits for copies in flight before it)."""
        calls = self._calls
        timeout = calls.config.lifecycle_timeout_s
        digests = result.digests_by_replica(update.targets) if replicas else {}
        tokens = update.sessions.tokens

        async def finish(url: str) -> bool:
            client, token = calls.replicas.clients[url], tokens.get(url)
            verify, unverified = calls.verification(url, digests, result)
            await client.update_weight_version(
                update.version, abort_all_requests=False, session_token=token, timeout_s=timeout
            )
            await client.end_weight_update(
                session_token=token,
                digests=digests.get(url) if verify else None,
                unverified=unverified,
                timeout_s=timeout,
            )
            tokens.pop(url, None)
            return verify

        results = dict(zip(replicas, await settled(finish(u) for u in replicas), strict=True))
        unfinished = await calls.unfinished(update, results)
        return Finished(tuple(u for u, ok in results.items() if ok is True), unfinished)

    async def resume(self, update: OpenUpdate, replicas: tuple[str, ...]) -> None:
        """See `Lifecycle.resume`."""
        await self._calls.resume(update, replicas)


class FusedLifecycle:
    """The two fused calls (see the module docstring).

    Args:
        calls: the shared calls.
    """

    def __init__(self, calls: ReplicaCalls) -> None:
        self._calls = calls

    async def open(
        self, update: OpenUpdate, replicas: tuple[str, ...], *, must_remain: bool
    ) -> tuple[str, ...]:
        """See `Lifecycle.open`: one ``begin_weight_sync`` per replica."""
        calls, cfg = self._calls, self._calls.config
        known, sessions = calls.replicas, update.sessions
        timeout = cfg.lifecycle_timeout_s
        releases = cfg.release_kv_cache and cfg.manage_generation

        async def begin(url: str) -> str | None:
            protocol = known.protocols[url]
            try:
                reply = await known.clients[url].begin_weight_sync(
                    pause_mode=cfg.pause_mode if cfg.manage_generation else None,
                    release_kv_cache=releases,
                    selector=cfg.selector,
                    lease_s=cfg.lease_s if protocol.serves(WEIGHT_UPDATE_LEASE) else None,
                    # One call's deadline for the three (a lease must not lapse meanwhile).
                    budget_s=timeout,
                    fence=sessions.fenced and protocol.serves(WEIGHT_SYNC_FENCE),
                    timeout_s=timeout + _REPLY_MARGIN_S,
                    poll_s=cfg.reply_poll_s,
                )
            except LifecycleStepError as exc:
                if "/release_memory_occupation" in exc.completed:
                    sessions.released.add(url)
                raise
            except BaseException:
                # Unknown how far it got; a server with the fused calls resumes memory it
                # did not release harmlessly, so take it back to be sure.
                if releases:
                    sessions.released.add(url)
                raise
            if releases:
                sessions.released.add(url)
            # Held from now, not once every replica answered: the renewals start at once.
            sessions.tokens[url] = reply.session_token
            known.note_begin(url, reply, sessions)
            log_changed_outside(url, reply.changed_outside)
            if reply.fences:
                sessions.fence_events[url] = tuple(reply.fences)
            return reply.session_token

        if cfg.manage_generation:
            sessions.paused.update(replicas)
        by_url = dict(zip(replicas, await settled(begin(u) for u in replicas), strict=True))
        live = await calls.drop_failed(update, replicas, by_url, "begin_weight_sync")
        if not live and must_remain:
            raise_all_dropped(update.dropped, stage="begin_weight_sync")
        return live

    async def finish(
        self,
        update: OpenUpdate,
        replicas: tuple[str, ...],
        result: PushResult,
        *,
        events: Sequence[str] = (),
    ) -> Finished:
        """See `Lifecycle.finish`: one ``end_weight_sync`` per replica, which resumes too
        (sent while the copies are in flight when `events` names the events they complete
        at: the replica waits for them before it verifies)."""
        calls, cfg = self._calls, self._calls.config
        timeout = cfg.lifecycle_timeout_s
        digests = result.digests_by_replica(update.targets) if replicas else {}
        sessions = update.sessions
        landing = result.landing if events else None

        async def finish(url: str) -> tuple[bool, BaseException | None]:
            verify, unverified = calls.verification(url, digests, result)
            try:
                reply = await calls.replicas.clients[url].end_weight_sync(
                    new_version=update.version,
                    session_token=sessions.tokens.get(url),
                    digests=digests.get(url) if verify else None,
                    unverified=unverified,
                    resume=cfg.manage_generation,
                    resume_kv_cache=url in sessions.released,
                    after_events=list(events) if events else None,
                    budget_s=timeout,
                    timeout_s=timeout + _REPLY_MARGIN_S,
                    poll_s=cfg.reply_poll_s,
                    # Sent while the copies run: no reply before they land.
                    poll_after=landing.seen if landing is not None else None,
                )
            except LifecycleStepError as exc:
                if "/end_weight_update" not in exc.completed:
                    raise
                # Verified and ended; serving again refused (as a plain resume would raise).
                sessions.tokens.pop(url, None)
                if "/resume_memory_occupation" in exc.completed:
                    sessions.released.discard(url)
                return verify, exc
            sessions.tokens.pop(url, None)
            sessions.released.discard(url)
            # A fenced begin's finding, known at the end.
            log_changed_outside(url, reply.changed_outside)
            return verify, None

        results = dict(zip(replicas, await settled(finish(u) for u in replicas), strict=True))
        unfinished = await calls.unfinished(update, results)
        done = {u: r for u, r in results.items() if not isinstance(r, BaseException)}
        return Finished(
            tuple(u for u, (ok, _) in done.items() if ok),
            unfinished,
            {u: exc for u, (_, exc) in done.items() if exc is not None},
        )

    async def resume(self, update: OpenUpdate, replicas: tuple[str, ...]) -> None:
        """Nothing: ``end_weight_sync`` resumed."""


def log_changed_outside(url: str, changed: Sequence[str]) -> None:
    """Log parameters a replica found changed outside any session."""
    if changed:
        logger.error(
            "replica %s: %d parameter(s) changed outside a weight-update session since "
            "its last update (bytes written into it without a session; it served them "
            "meanwhile): %s; this update overwrites them",
            url,
            len(changed),
            ", ".join(changed[:8]),
        )


def raise_all_dropped(dropped: Mapping[str, str], *, stage: str) -> None:
    """Raise that no replica is left in the update, naming the first and why.

    Raises:
        RemoteReplicaError: always.
    """
    url, why = next(iter(dropped.items()))
    others = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
    raise RemoteReplicaError(
        f"no replica could take the update: replica {url}{others} {why}; nothing was "
        "written and every replica serves its previous weights",
        replica=url,
        route=stage,
    )


async def settled(coroutines: Iterable[Awaitable[T]]) -> list[T | BaseException]:
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


def failures_of(results: Mapping[str, Any]) -> list[tuple[str, BaseException]]:
    """The failed calls of `results`, as ``(url, exception)``."""
    return [(u, r) for u, r in results.items() if isinstance(r, BaseException)]
