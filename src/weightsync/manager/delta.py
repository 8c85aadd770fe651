"""Delta syncs on the driver: which replicas take a delta, applying it, and the bases kept.

A replica takes a delta only against bytes it is proven to hold. The driver keeps, per
replica, the checksums (`weightsync.delta_codec`) of every parameter of every rank as they
stood after the replica's last verified sync, and which push of the trainers' delta
reference that was (`DeltaBase`). At the next update the replica reports its checksums
after its session began; it takes a delta when they all equal the kept ones and the kept
push is the one the trainers' reference holds, and full bytes otherwise (a new replica, one
that missed or failed a sync, a restart, a checker reset, bytes written outside a session,
post-load processing that rewrote a published parameter). The first sync is always full.

After the push, a delta replica applies its payloads and checks that each changed
parameter's checksum became base + change; a full replica reports its checksums. Both are
taken before the session ends, that is before post-load processing, so that a base always
means "the bytes the trainers pushed". The replicas verified at the end keep their new
checksums as their base; every other replica of the update loses its base.

SGLang as released takes the same syncs through its custom weight loader
(`weightsync.manager.delta_loader`): the proof, the apply and the read after are delta calls,
the payloads stay in the trainers' memory for the ranks to read, and the session's last call
runs the post-load processing SGLang then skips at the end. SGLang has no digests to verify a
full write with, so the trainers checksum every parameter of such a replica's layout as
they wrote it (`PushResult.laid_out`) and its checksums after the push must equal them:
every byte is checked, and its base is those checksums.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from weightsync.control.protocol import WEIGHT_SYNC_DELTA
from weightsync.delta_wire import DeltaReply, Remote, ReplyStatus, serves_delta_loader
from weightsync.errors import RemoteReplicaError
from weightsync.manager.delta_loader import LoaderCalls, RankCall
from weightsync.manager.lifecycle import settled
from weightsync.manager.replicas import ReplicaSet
from weightsync.manager.update import OpenUpdate, PushResult
from weightsync.plan import TargetRank
from weightsync.sender import DeltaWrite, wrap_int64

logger = logging.getLogger(__name__)

T = TypeVar("T")

RankChecksums = Mapping[int, Mapping[str, int]]


RETRY_DELTA_AFTER = 8
"""Full writes a replica takes under ``when="faster"`` (its deltas measured slower) before it
takes a delta again: the density falls as the optimizer settles, and a link's load
changes, so a choice made once is measured again."""


@dataclass(slots=True)
class _Timing:
    """One replica's measured writes: the push phase of its last full write (and whether it
    was steady: no plan built within it) and of its last delta (None until seen), and the
    full writes it took since because deltas were slower."""

    full_s: float | None = None
    steady: bool = False
    delta_s: float | None = None
    held: int = 0


@dataclass(frozen=True, slots=True)
class DeltaBase:
    """What a replica verifiably holds: the push it got, and its checksums after it.

    Attributes:
        token: the trainers' reference push the bytes are.
        checksums: per rank, ``{param_name: checksum}`` of every parameter.
    """

    token: int
    checksums: RankChecksums


@dataclass(slots=True, kw_only=True)
class DeltaChoice:
    """How one update writes each replica that can take deltas.

    Attributes:
        token: the label the trainers' reference gets from this update's push.
        delta: replicas that take a delta, with the checksums they proved at begin.
        full: replicas that can take deltas but take full bytes this time, with why.
        after: per replica, its checksums after the push (before its session ended).
        loaders: the replicas among them that take delta calls through SGLang's custom
            weight loader (they read their payloads; their full writes are checked against
            the trainers' checksums).
        proved_s: per replica that was asked to prove its base, the seconds its checksums
            took (the driver's wall time of the call).
        applied_s: per delta replica that applied its delta, the seconds applying and
            checking took on it (its slowest rank's own time).
    """

    token: int
    delta: dict[str, RankChecksums] = field(default_factory=dict)
    full: dict[str, str] = field(default_factory=dict)
    after: dict[str, RankChecksums] = field(default_factory=dict)
    loaders: frozenset[str] = frozenset()
    proved_s: dict[str, float] = field(default_factory=dict)
    applied_s: dict[str, float] = field(default_factory=dict)

    def sessions(self, targets: Sequence[TargetRank]) -> frozenset[str]:
        """The session ids of the targets that take a delta."""
        return frozenset(t.session_id for t in targets if t.replica in self.delta)

    def pulls(self, targets: Sequence[TargetRank]) -> frozenset[str]:
        """The session ids of the delta targets that read their payloads."""
        return frozenset(
            t.session_id for t in targets if t.replica in self.delta and t.replica in self.loaders
        )

    def laid_out(self, targets: Sequence[TargetRank]) -> frozenset[str]:
        """The session ids of the full targets whose checksums the trainers compute."""
        return frozenset(
            t.session_id for t in targets if t.replica in self.full and t.replica in self.loaders
        )

    def mode(self, url: str) -> str:
        """``"delta"`` or ``"full"`` for replica `url`."""
        return "delta" if url in self.delta else "full"


def target_deltas(result: PushResult) -> dict[str, DeltaWrite]:
    """Per target session id, what every source rank's delta push wrote there, in rank
    order (`DeltaWrite` adds up)."""
    out: dict[str, DeltaWrite] = {}
    for rank in sorted(result.deltas):
        for session, write in result.deltas[rank].written.items():
            out[session] = out[session] + write if session in out else write
    return out


class DeltaSyncs:
    """The driver's delta bases, and the calls that prove, apply and record them.

    Call protocol, per update: `choose` once the sessions began (sets ``update.delta``),
    push, `apply` once the bytes landed and before the sessions end, then `record` with
    the replicas the update verified.

    Args:
        replicas: the manager's replicas (their clients and protocols).
        timeout_s: the deadline of each call.
        check: how replicas check after applying (``"changes"`` or ``"full"``,
            `ControlConfig.delta_check`).
        when: ``"always"`` or ``"faster"`` (`ControlConfig.delta_when`): with ``"faster"``,
            a replica whose last delta's push phase took at least as long as its last full
            write's takes full bytes, without proving its base, until `RETRY_DELTA_AFTER`
            such full writes have passed.
        loader: the calls into SGLang replicas started with the delta loader (None: such
            replicas take full bytes).
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        *,
        timeout_s: float,
        check: str = "changes",
        when: str = "always",
        loader: LoaderCalls | None = None,
    ) -> None:
        self._replicas = replicas
        self._timeout_s = timeout_s
        self._check = check
        self._when = when
        self._loader = loader
        self._bases: dict[str, DeltaBase] = {}
        self._timings: dict[str, _Timing] = {}

    def base(self, url: str) -> DeltaBase | None:
        """What replica `url` is known to hold, if anything."""
        return self._bases.get(url)

    def forget(self, urls: Collection[str]) -> None:
        """Drop the bases of `urls` (removed, or no longer known to hold them)."""
        for url in urls:
            self._bases.pop(url, None)
            self._timings.pop(url, None)
            if self._loader is not None:
                self._loader.forget(url)

    def close(self) -> None:
        """Free the delta calls' reply memory."""
        if self._loader is not None:
            self._loader.close()

    def loads(self, url: str) -> bool:
        """Whether replica `url` takes delta calls through SGLang's custom weight loader
        (and this driver can make them)."""
        protocol = self._replicas.protocols.get(url)
        return (
            self._loader is not None
            and protocol is not None
            and protocol.kind == "sglang"
            and serves_delta_loader(self._replicas.server_infos.get(url, {}))
        )

    def capable(self, url: str, targets: Sequence[TargetRank]) -> bool:
        """Whether replica `url` can take deltas: it serves them and every rank offers a
        delta region, or it runs the delta loader."""
        ranks = [t for t in targets if t.replica == url]
        if not ranks:
            return False
        if self.loads(url):
            return True
        protocol = self._replicas.protocols.get(url)
        return (
            protocol is not None
            and protocol.serves(WEIGHT_SYNC_DELTA)
            and all(t.delta_region is not None for t in ranks)
        )

    async def choose(self, update: OpenUpdate, *, token: int, reference: int | None) -> DeltaChoice:
        """Decide, per replica of `update`, delta or full (see the module); sets and returns
        ``update.delta``.

        Args:
            update: the open update.
            token: the label this update's push gives the trainers' reference.
            reference: the label of the push the trainers' reference holds now (None: it
                holds none, so every replica takes full bytes).
        """
        capable = [u for u in update.replicas if self.capable(u, update.targets)]
        choice = DeltaChoice(token=token, loaders=frozenset(u for u in capable if self.loads(u)))
        update.delta = choice
        provable = []
        for url in capable:
            base = self._bases.get(url)
            if reference is None:
                choice.full[url] = "the trainers keep no delta reference yet (first sync)"
            elif base is None:
                choice.full[url] = "no verified base (new, or its last sync did not verify)"
            elif base.token != reference:
                choice.full[url] = "it missed the sync the trainers' reference holds"
            elif (slower := self._slower(url)) is not None:
                choice.full[url] = slower
            else:
                provable.append(url)
        replies = await settled(
            _timed(self._checksums(update, url), choice.proved_s, url) for url in provable
        )
        for url, reply in zip(provable, replies, strict=True):
            if isinstance(reply, BaseException):
                choice.full[url] = f"its checksums could not be read ({reply})"
                continue
            differs = _first_difference(self._bases[url].checksums, reply)
            if differs is None:
                choice.delta[url] = reply
            else:
                choice.full[url] = f"its weights are not its verified base ({differs})"
        for url, why in choice.full.items():
            logger.info("replica %s takes full bytes: %s", url, why)
        return choice

    async def _checksums(
        self, update: OpenUpdate, url: str, *, finish: bool = False
    ) -> RankChecksums:
        """Every rank's checksums now (`finish`: the loader's last call of the session)."""
        client = self._replicas.clients[url]
        if update.delta is not None and url in update.delta.loaders:
            ranks = [t for t in update.targets if t.replica == url]
            replies = await self._loader_call(url, ranks, {}, finish=finish)
            return {rank: reply.checksums for rank, reply in replies.items()}
        return await client.delta_checksums(
            session_token=update.sessions.tokens.get(url), timeout_s=self._timeout_s
        )

    async def _loader_call(
        self,
        url: str,
        targets: Sequence[TargetRank],
        ranks: Mapping[int, RankCall],
        *,
        finish: bool,
    ) -> dict[int, DeltaReply]:
        """A delta call through the loader whose every rank verified, else raise with the
        first rank's reason."""
        if self._loader is None:
            raise RemoteReplicaError(
                f"replica {url}: this driver makes no delta calls (it has no Mooncake transport)",
                replica=url,
                route="/update_weights_from_tensor",
            )
        replies = await self._loader.call(
            self._replicas.clients[url], targets, ranks, finish=finish
        )
        for _, reply in sorted(replies.items()):
            if reply.status is not ReplyStatus.APPLIED:
                # The message says whether anything was written.
                raise RemoteReplicaError(
                    f"replica {url}: {reply.message}",
                    replica=url,
                    route="/update_weights_from_tensor",
                )
        return replies

    async def apply(
        self, update: OpenUpdate, result: PushResult, live: Collection[str]
    ) -> tuple[PushResult, dict[str, str]]:
        """Apply the deltas on the `live` delta replicas (those whose writes all landed)
        and read the `live` full replicas' checksums (a loader replica's must equal the
        trainers', ``result.laid_out``).

        Returns:
            `result` with ``delta_verified`` naming the replicas whose every byte the
            checksums verified (their delta, or a loader replica's full write), and
            ``{url: why}`` of the replicas that did not verify (their weights are not what
            the trainers meant: they stay paused and dirty).
        """
        choice = update.delta
        if choice is None:
            return result, {}
        deltas = target_deltas(result)
        by_replica: dict[str, list[TargetRank]] = {}
        for target in update.targets:
            by_replica.setdefault(target.replica, []).append(target)
        delta_urls = [u for u in choice.delta if u in by_replica and u in live]
        full_urls = [u for u in choice.full if u in by_replica and u in live]

        async def apply_one(url: str) -> RankChecksums:
            ranks = {}
            base = choice.delta[url]
            for target in by_replica[url]:
                written = deltas.get(target.session_id, DeltaWrite())
                expected = {
                    name: wrap_int64(base[target.rank][name] + change)
                    for name, change in written.changes.items()
                }
                ranks[target.rank] = (written, expected)
            if url in choice.loaders:
                calls = {
                    rank: RankCall(
                        payloads=tuple(
                            Remote(session_id=s, addr=a, num_bytes=n) for s, a, n in w.pulled
                        ),
                        # Proven again just before the writes: nothing moved since `choose`.
                        base={name: base[rank][name] for name in expected},
                        expected=expected,
                    )
                    for rank, (w, expected) in ranks.items()
                }
                replies = await self._loader_call(url, by_replica[url], calls, finish=True)
                choice.applied_s[url] = max((r.seconds for r in replies.values()), default=0.0)
                return {rank: reply.checksums for rank, reply in replies.items()}
            client = self._replicas.clients[url]
            answers = await client.apply_delta(
                session_token=update.sessions.tokens.get(url),
                ranks={rank: (w.payloads, e) for rank, (w, e) in ranks.items()},
                check=self._check,
                timeout_s=self._timeout_s,
            )
            choice.applied_s[url] = max((r.seconds for r in answers.values()), default=0.0)
            return {rank: reply.checksums for rank, reply in answers.items()}

        async def read_full(url: str) -> RankChecksums:
            # The loader's last call of the session runs the post-load processing.
            return await self._checksums(update, url, finish=url in choice.loaders)

        applied, read = await asyncio.gather(
            settled(apply_one(u) for u in delta_urls),
            settled(read_full(u) for u in full_urls),
        )
        failed: dict[str, str] = {}
        verified = []
        for url, reply in zip(delta_urls, applied, strict=True):
            if isinstance(reply, BaseException):
                failed[url] = f"its delta did not verify: {reply}"
            else:
                choice.after[url] = reply
                verified.append(url)
        for url, reply in zip(full_urls, read, strict=True):
            if url in choice.loaders:
                # No digests: every byte is checked against the trainers' checksums.
                if isinstance(reply, BaseException):
                    failed[url] = f"its checksums after the full write could not be read: {reply}"
                    continue
                if not all(result.laid_out.get(t.session_id) for t in by_replica[url]):
                    failed[url] = (
                        "the trainers computed no checksums of what they wrote to it, so its "
                        "full write cannot be verified"
                    )
                    continue
                written = replica_checksums(by_replica[url], result.laid_out)[url]
                differs = _first_difference(written, reply)
                if differs is not None:
                    failed[url] = (
                        f"its weights after the full write are not what the trainers wrote "
                        f"({differs})"
                    )
                    continue
                choice.after[url] = reply
                verified.append(url)
            elif isinstance(reply, BaseException):
                logger.warning("replica %s: no checksums after its full sync (%s)", url, reply)
            else:
                choice.after[url] = reply
        return dataclasses.replace(result, delta_verified=frozenset(verified)), failed

    def record(
        self,
        update: OpenUpdate,
        verified: Collection[str],
        reference: int | None,
        *,
        push_s: float | None = None,
    ) -> None:
        """Keep the checksums of the replicas `verified` as their bases, labelled with the
        push the trainers' reference now holds (`reference`, None: it holds none); every
        other replica of `update` loses its base. `push_s`, the update's push phase, is
        what a verified replica's write took (its delta, or its full bytes), for
        ``when="faster"``; a full write in an update that fetched metadata (its plan built
        within the phase) is not steady."""
        choice = update.delta
        for url in update.replicas:
            after = choice.after.get(url) if choice is not None else None
            if after is not None and url in verified and reference is not None:
                self._bases[url] = DeltaBase(token=reference, checksums=after)
            else:
                self._bases.pop(url, None)
        if choice is None or push_s is None:
            return
        for url in verified:
            timing = self._timings.setdefault(url, _Timing())
            if url in choice.delta:
                timing.delta_s, timing.held = push_s, 0
            elif url in choice.full:
                timing.full_s, timing.steady = push_s, not update.metadata_refreshed

    def _slower(self, url: str) -> str | None:
        """Why replica `url` takes full bytes though it could prove its base, under
        ``when="faster"``: its last delta was no faster than its last full write, or no
        full write of it was timed in a steady sync yet (the first also builds the plan:
        one more full write times it); None when it takes a delta."""
        timing = self._timings.get(url)
        if self._when != "faster" or timing is None or timing.delta_s is None:
            return None
        if timing.full_s is None or not timing.steady:
            return (
                "a full write of it is timed once in a steady sync, to compare with its "
                f"deltas ({timing.delta_s:.4f} s) (delta_when='faster')"
            )
        if timing.delta_s < timing.full_s or timing.held >= RETRY_DELTA_AFTER:
            timing.held = 0
            return None
        timing.held += 1
        return (
            f"its last full write took {timing.full_s:.4f} s and its last delta "
            f"{timing.delta_s:.4f} s (push phases, measured): over its link full bytes cost "
            f"less (delta_when='faster'; a delta is tried again after {RETRY_DELTA_AFTER} "
            "such full writes)"
        )

    def adopt(self, url: str, base: DeltaBase) -> None:
        """Take `base` as what replica `url` must hold to take its next update as a delta:
        bytes this driver never pushed there (a checkpoint the replica loaded, or one an
        earlier process pushed), which the trainers' reference holds as push ``base.token``.

        Nothing is taken on trust: ``base.checksums`` are what the trainers computed from
        those bytes as the replica lays them out (`TrainerSync.adopt_base`), and `choose`
        gives the replica a delta only if the checksums it reports once its session began
        equal them. The base replaces any the replica had; `record` replaces it in turn.
        """
        self._bases[url] = base


def replica_checksums(
    targets: Sequence[TargetRank], sums: Mapping[str, Mapping[str, int]]
) -> dict[str, dict[int, dict[str, int]]]:
    """Per replica and rank of `targets`, the checksum of every parameter the trainers write
    there, from `sums` (per target session id, added up over the trainer ranks,
    `weightsync.manager.update.add_checksums`). A parameter no trainer rank writes is the
    engine's own (FP8 KV scales, `weightsync.plan.engine_owned`): no delta touches it, and
    it is not part of a base."""
    out: dict[str, dict[int, dict[str, int]]] = {}
    for target in targets:
        out.setdefault(target.replica, {})[target.rank] = dict(sums.get(target.session_id, {}))
    return out


async def _timed(call: Awaitable[T], seconds: dict[str, float], url: str) -> T:
    """`call`'s result; its wall time is kept in ``seconds[url]`` (also when it raises)."""
    start = time.perf_counter()
    try:
        return await call
    finally:
        seconds[url] = time.perf_counter() - start


def _first_difference(kept: RankChecksums, now: RankChecksums) -> str | None:
    """Where `now` differs from `kept` (a rank, or a parameter `kept` names), or None when
    equal. Parameters only `now` names are not compared: the trainers never write them (the
    engine's own, such as FP8 KV scales), so no delta depends on their bytes."""
    if set(kept) != set(now):
        return f"ranks {sorted(now)} against {sorted(kept)}"
    for rank in sorted(kept):
        for name, value in kept[rank].items():
            if now[rank].get(name) != value:
                return f"rank {rank} parameter {name!r}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaWrite:
    """How one sync wrote one replica, in a sync that keeps a delta reference.

    Attributes:
        mode: ``"delta"`` (only what changed) or ``"full"`` (every byte).
        num_bytes: bytes put on the wire for it.
        full_bytes: bytes a full write of it takes.
        density: changed elements over all its elements (a delta's; None for a full write).
        why_full: why it took full bytes (None for a delta).
        prove_seconds: what proving its base took (its checksums of every parameter, read
            before the push); None when it was not asked.
        apply_seconds: what applying its delta and checking its checksums after took on
            its slowest rank (None for a full write).
    """

    mode: str
    num_bytes: int
    full_bytes: int
    density: float | None = None
    why_full: str | None = None
    prove_seconds: float | None = None
    apply_seconds: float | None = None

    def to_dict(self) -> dict[str, object]:
        """A JSON-able form."""
        return {
            "mode": self.mode,
            "bytes": self.num_bytes,
            "full_bytes": self.full_bytes,
            "density": self.density,
            "why_full": self.why_full,
            "prove_seconds": self.prove_seconds,
            "apply_seconds": self.apply_seconds,
        }


def replica_writes(
    update: OpenUpdate, result: PushResult, replicas: Collection[str]
) -> dict[str, ReplicaWrite]:
    """Per replica of `replicas`, how `update`'s push wrote it (empty without deltas)."""
    choice = update.delta
    if choice is None:
        return {}
    deltas = target_deltas(result)
    full_per_replica: dict[str, int] = {}
    for target in update.targets:
        for stats in result.per_source.values():
            full_per_replica[target.replica] = full_per_replica.get(
                target.replica, 0
            ) + stats.bytes_per_target.get(target.session_id, 0)
    out = {}
    for url in replicas:
        sent = result.bytes_per_replica.get(url, 0)
        if url in choice.delta:
            mine = [
                deltas[t.session_id]
                for t in update.targets
                if t.replica == url and t.session_id in deltas
            ]
            changed = sum(d.num_elements for d in mine)
            elements = sum(d.full_elements for d in mine)
            out[url] = ReplicaWrite(
                mode="delta",
                num_bytes=sent,
                full_bytes=sum(d.full_bytes for d in mine),
                density=changed / elements if elements else 0.0,
                prove_seconds=choice.proved_s.get(url),
                apply_seconds=choice.applied_s.get(url),
            )
        else:
            why = choice.full.get(url, "it serves no delta syncs (or offers no delta region)")
            out[url] = ReplicaWrite(
                mode="full",
                num_bytes=sent,
                full_bytes=full_per_replica.get(url, sent),
                why_full=why,
                prove_seconds=choice.proved_s.get(url),
            )
    return out
