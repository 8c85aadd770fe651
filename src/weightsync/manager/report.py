"""What one sync did: bytes, writes and seconds, per phase and per replica."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.manager.delta import ReplicaWrite
from weightsync.manager.update import PushResult


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseTimes:
    """Seconds spent in each phase of the update lifecycle (docs/protocol.md).

    Attributes:
        pause: pause generation, release the KV cache, begin the sessions.
        metadata: fetch rollout metadata and build the plan (zero when cached).
        push: every source rank's writes, until they landed (a push that left its copies
            in flight ends when the driver saw them done).
        finalize: bump the weight version, end the sessions, run the bit-exact check (what
            of it did not overlap the push: an end sent while the copies were in flight
            counts from their landing).
        resume: resume the KV cache, flush, continue generation.
    """

    pause: float
    metadata: float
    push: float
    finalize: float
    resume: float

    @property
    def total(self) -> float:
        """Seconds from the first pause call to the last resume call."""
        return self.pause + self.metadata + self.push + self.finalize + self.resume


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncReport:
    """The outcome of one successful sync.

    Attributes:
        version: the weight version the replicas now serve.
        replicas: the replicas updated, by URL.
        phases: seconds per phase.
        push: what the sources wrote.
        metadata_refreshed: whether rollout metadata was fetched (first sync, or membership
            changed) rather than taken from the cache.
        bit_exact: the result of the bit-exact check, or None when it did not run.
        verified: the replicas whose ranks verified the sync's digests against what arrived.
        unverified: the updated replicas nothing verified: they cannot (SGLang as released),
            or the trainers computed no digests (``SenderConfig(digest=False)``).
        dropped: replicas left out of this sync because they failed before any write, with
            why; they serve their previous weights (and are tried again next sync).
        writes: in a sync that keeps a delta reference (``SyncConfig(delta=True)``), how each
            updated replica was written: delta or full, its bytes and density.
    """

    version: str
    replicas: tuple[str, ...]
    phases: PhaseTimes
    push: PushResult
    metadata_refreshed: bool
    bit_exact: bool | None = None
    verified: tuple[str, ...] = ()
    dropped: Mapping[str, str] = field(default_factory=dict)
    writes: Mapping[str, ReplicaWrite] = field(default_factory=dict)

    @property
    def unverified(self) -> tuple[str, ...]:
        """The updated replicas that did not verify the sync (see the class)."""
        return tuple(url for url in self.replicas if url not in self.verified)

    @property
    def bytes_written(self) -> int:
        """Bytes written into rollout memory by this sync."""
        return self.push.bytes_written

    @property
    def seconds(self) -> float:
        """Seconds from pause to resume."""
        return self.phases.total

    @property
    def gbps(self) -> float:
        """Bytes written per second of the push phase, in GB/s (10^9 bytes)."""
        return self.push.bytes_written / self.phases.push / 1e9 if self.phases.push > 0 else 0.0

    @property
    def num_writes(self) -> int:
        """Transport writes issued by this sync, after coalescing."""
        return self.push.num_writes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary."""
        return {
            "version": self.version,
            "replicas": list(self.replicas),
            "bytes": self.bytes_written,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "num_writes": self.num_writes,
            "num_regions": self.push.num_regions,
            "metadata_refreshed": self.metadata_refreshed,
            "cached_program": self.push.cached_program,
            "bit_exact": self.bit_exact,
            "verified": list(self.verified),
            "unverified": list(self.unverified),
            "dropped": dict(self.dropped),
            "phases": {
                "pause": self.phases.pause,
                "metadata": self.phases.metadata,
                "push": self.phases.push,
                "finalize": self.phases.finalize,
                "resume": self.phases.resume,
            },
            "bytes_per_replica": dict(self.push.bytes_per_replica),
            "writes": {url: write.to_dict() for url, write in self.writes.items()},
            "deltas": {
                str(rank): {
                    "num_changed": delta.num_changed,
                    "num_elements": delta.num_elements,
                    "density": delta.density,
                    "encode_seconds": delta.encode_seconds,
                    "write_seconds": delta.write_seconds,
                    "reference_bytes": delta.reference_bytes,
                    "failed": dict(delta.failed),
                }
                for rank, delta in self.push.deltas.items()
            },
            "sources": {
                str(rank): {
                    "bytes_written": stats.bytes_written,
                    "num_writes": stats.num_writes,
                    "seconds": stats.seconds,
                    "lower_seconds": stats.lower_seconds,
                    "fill_seconds": stats.fill_seconds,
                    "write_seconds": stats.write_seconds,
                    "digest_seconds": stats.digest_seconds,
                    "cached_program": stats.cached_program,
                    "bytes_staged": stats.bytes_staged,
                    "bytes_direct": stats.bytes_direct,
                    "writes_per_target": dict(stats.writes_per_target),
                    "replayed": stats.replayed,
                    "in_flight": stats.in_flight,
                }
                for rank, stats in self.push.per_source.items()
            },
        }
