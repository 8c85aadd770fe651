"""One weight update as data: what the driver opened (`OpenUpdate`) and what the trainer
ranks pushed into it (`PushResult`, with the `Landing` of copies left in flight).

The driver's `SyncManager.open_update` returns an `OpenUpdate`; the ranks write into its
``targets`` (after its ``fences``); `SyncManager.finish_update` takes the update and the
push's `PushResult` (or the error the push raised) and ends it. Everything one update
learns or holds (sessions begun, memory released, what each begin said) lives on its
`OpenUpdate`, so the long-lived manager keeps only what outlives an update.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightsync.manager.versions import HeldLabel
from weightsync.plan import TargetRank
from weightsync.sender import DeltaStats, Fence, PushStats, wrap_int64

if TYPE_CHECKING:
    from weightsync.manager.delta import DeltaChoice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Landing:
    """Copies a push left in flight, and when the driver saw them land.

    Attributes:
        events: the IPC handles (hex) of the CUDA events the copies complete at (every
            source rank's ``PushStats.events``); a replica that takes
            ``weight_sync_events`` waits for them itself before it verifies.
        seen: resolves to the `time.perf_counter` at which the driver saw its copies done,
            or raises `PartialPushError` (they did not finish in time) or
            `TensorChangedError` (a tensor changed before they landed). A future: awaited
            by every step that needs it.
    """

    events: tuple[str, ...]
    seen: asyncio.Future[float] = field(compare=False, repr=False)

    async def wait(self) -> float:
        """When the copies were seen done; now if the driver could not see them (the
        replicas verify what arrived either way)."""
        try:
            return await self.seen
        except Exception as exc:
            logger.warning("the trainer could not see its copies land: %s", exc)
            return time.perf_counter()


@dataclass(frozen=True, slots=True, kw_only=True)
class PushResult:
    """What every trainer source rank wrote in one update, added up.

    Attributes:
        bytes_written: bytes written to rollout memory, over all targets (a delta's
            payloads, for a target that took one).
        bytes_staged: bytes copied into staging memory, over all sources.
        num_writes: transport writes after coalescing (a delta payload counts one).
        num_regions: destination regions before coalescing.
        bytes_per_replica: bytes written into each replica (by replica URL).
        seconds_per_source: wall time of each source rank's push (by source rank).
        cached_program: every source ran a push program cached from an earlier push (see
            ``PushStats.cached_program``).
        per_source: every source rank's own `PushStats`, by rank.
        digests: per target session id, ``{param_name: digest}`` of what all sources wrote
            (`weightsync.layout.digest`); empty when the sources computed none.
        landing: the copies still in flight when the push returned, None when every write
            had landed.
        deltas: every source rank's delta push (`WeightSender.push_delta`), by rank; empty
            when the sync keeps no delta reference.
        delta_verified: the replicas whose every byte the update's checksums verified
            (`weightsync.manager.delta`): they applied their delta and checked it, or, run
            by SGLang's delta loader, hold after a full write what the trainers wrote.
        laid_out: per target session id, ``{param_name: checksum}`` of what all sources
            wrote there, for the full targets the sync asked them to checksum
            (`weightsync.sender.base_checksums.LaidOutChecksums`); empty otherwise.
    """

    bytes_written: int
    bytes_staged: int
    num_writes: int
    num_regions: int
    bytes_per_replica: Mapping[str, int] = field(default_factory=dict)
    seconds_per_source: Mapping[int, float] = field(default_factory=dict)
    cached_program: bool = False
    per_source: Mapping[int, PushStats] = field(default_factory=dict)
    digests: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    landing: Landing | None = field(default=None, compare=False)
    deltas: Mapping[int, DeltaStats] = field(default_factory=dict)
    delta_verified: frozenset[str] = frozenset()
    laid_out: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @classmethod
    def of_ranks(
        cls,
        stats: Mapping[int, PushStats],
        targets: Sequence[TargetRank],
        deltas: Mapping[int, DeltaStats] | None = None,
        laid_out: Sequence[Mapping[str, Mapping[str, int]]] = (),
    ) -> PushResult:
        """Every source rank's `PushStats` (by rank), delta pushes and checksums of what it
        wrote (`laid_out`, one mapping per rank) added up, bytes counted per replica."""
        replica_of = {t.session_id: t.replica for t in targets}
        deltas = dict(deltas or {})
        per_replica: dict[str, int] = {}
        delta_bytes = delta_writes = 0
        for delta in deltas.values():
            for session_id, write in delta.written.items():
                replica = replica_of.get(session_id, session_id)
                per_replica[replica] = per_replica.get(replica, 0) + write.num_bytes
                delta_bytes += write.num_bytes
                delta_writes += len(write.payloads)
        digests: dict[str, dict[str, int]] = {}
        for rank_stats in stats.values():
            for session_id, partial in rank_stats.digests.items():
                total = digests.setdefault(session_id, {})
                for name, value in partial.items():
                    total[name] = total.get(name, 0) + value
            for session_id, num_bytes in rank_stats.bytes_per_target.items():
                replica = replica_of.get(session_id, session_id)
                per_replica[replica] = per_replica.get(replica, 0) + num_bytes
        return cls(
            bytes_written=sum(s.bytes_written for s in stats.values()) + delta_bytes,
            bytes_staged=sum(s.bytes_staged for s in stats.values()),
            num_writes=sum(s.num_writes for s in stats.values()) + delta_writes,
            num_regions=sum(s.num_regions for s in stats.values()),
            bytes_per_replica=per_replica,
            seconds_per_source={rank: s.seconds for rank, s in stats.items()},
            cached_program=all(s.cached_program for s in stats.values()),
            per_source=dict(stats),
            digests=digests,
            deltas=deltas,
            laid_out=add_checksums(laid_out),
        )

    @property
    def delta_token(self) -> int | None:
        """The push every source rank's delta reference now holds, None unless all hold the
        same one."""
        tokens = {delta.token for delta in self.deltas.values()}
        if not self.deltas or len(tokens) != 1:
            return None
        return tokens.pop()

    @classmethod
    def empty(cls) -> PushResult:
        """A push that wrote nothing."""
        return cls(bytes_written=0, bytes_staged=0, num_writes=0, num_regions=0)

    def digests_by_replica(
        self, targets: Sequence[TargetRank]
    ) -> dict[str, dict[int, dict[str, int]]]:
        """The digests per replica and rank, for the replicas the push computed them for
        every rank of."""
        by_replica: dict[str, dict[int, dict[str, int]]] = {}
        incomplete: set[str] = set()
        for target in targets:
            digests = self.digests.get(target.session_id)
            if digests is None:
                incomplete.add(target.replica)
                continue
            by_replica.setdefault(target.replica, {})[target.rank] = dict(digests)
        return {url: ranks for url, ranks in by_replica.items() if url not in incomplete}


@dataclass(slots=True)
class Sessions:
    """The replica sessions one update holds, and what opening them did: the lifecycle
    calls (`weightsync.manager.lifecycle`) record here what the update must undo or
    finish.

    Attributes:
        tokens: the session token of every session begun (None where the replica gives none).
        released: replicas whose KV cache the update released (they must take it back).
        paused: replicas whose generation the update paused.
        begun: what each begin said the replica holds.
        restarted: replicas found to be a new process behind their URL.
        fence_events: a fenced begin's events, one per rank, by replica.
        fenced: the update asks replicas that can for a fenced begin.
    """

    tokens: dict[str, str | None] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)
    begun: dict[str, HeldLabel] = field(default_factory=dict)
    restarted: set[str] = field(default_factory=set)
    fence_events: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fenced: bool = False


@dataclass(slots=True, kw_only=True)
class OpenUpdate:
    """A weight update the driver opened: sessions begun on ``replicas``, ready to be
    written. Hand it to the push (its targets, epoch and fences are all a push needs) and
    then to `SyncManager.finish_update`, exactly once.

    Attributes:
        version: the label the new weights get.
        replicas: the replicas in the update, by URL.
        targets: every rank of those replicas, with their published metadata.
        epoch: identifies the targets (it changes whenever they do: a plan may be cached
            per epoch).
        fences: CUDA events writes into a target must follow (replicas that began fenced).
        dropped: replicas left out before any write, with why (they serve their previous
            weights).
        metadata_refreshed: whether rollout metadata was fetched for this update.
        sessions: the sessions the update holds (the manager's record).
        started: `time.perf_counter` when the update began; ``opened`` when it was ready.
        delta: which replicas take a delta and what they proved (`weightsync.manager.delta`),
            once chosen; None for an update that keeps no delta reference.
    """

    version: str = ""
    replicas: tuple[str, ...] = ()
    targets: tuple[TargetRank, ...] = ()
    epoch: int = 0
    fences: tuple[Fence, ...] = ()
    dropped: dict[str, str] = field(default_factory=dict)
    metadata_refreshed: bool = False
    sessions: Sessions = field(default_factory=Sessions, repr=False)
    started: float = field(default_factory=time.perf_counter, repr=False)
    paused_at: float = field(default=0.0, repr=False)
    opened: float = field(default=0.0, repr=False)
    finished: bool = field(default=False, repr=False)
    delta: DeltaChoice | None = field(default=None, repr=False)


def stay_paused(replicas: Sequence[str]) -> str:
    """What a failure after writing began leaves behind, for an error's note."""
    return (
        f"the update failed after writing began: replicas {', '.join(replicas)} stay paused "
        "(they may hold mixed weights) until a later update to them succeeds"
    )


def add_checksums(
    shares: Sequence[Mapping[str, Mapping[str, int]]],
) -> dict[str, dict[str, int]]:
    """Per session id and parameter, the checksums of the sources' shares added up (a
    checksum is linear in the bytes)."""
    out: dict[str, dict[str, int]] = {}
    for share in shares:
        for session_id, sums in share.items():
            total = out.setdefault(session_id, {})
            for name, value in sums.items():
                total[name] = wrap_int64(total.get(name, 0) + value)
    return out
