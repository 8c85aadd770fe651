"""`PushStats`: what one `WeightSender.push` moved and how long it took, and how a push puts
them (and its partial failure) together."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from weightsync.errors import PartialPushError, TransferError
from weightsync.plan.program import PushProgram


@dataclass(frozen=True, slots=True, kw_only=True)
class PushStats:
    """Counters and timings of one push from one trainer rank.

    Attributes:
        rank: the trainer rank that pushed.
        bytes_staged: bytes copied into the staging ring (each layout's bytes once).
        bytes_written: bytes written over all targets.
        num_writes: transport write requests over all targets, after coalescing.
        num_regions: destination regions over all targets, before coalescing.
        num_buckets: staging slots filled (one per bucket and layout).
        num_chunks: fill-then-write steps over all buckets (a bucket is filled and written
            in chunks, so that its writes start before it is full).
        num_copies: copies into staging after fusing (many small expert tensors that are
            views of one fused parameter take one strided copy).
        seconds: wall time of the push.
        lower_seconds: wall time spent finding the program `WeightSender.preflight` checked
            (part of `seconds`; the lowering itself is the preflight's).
        fill_seconds: wall time spent filling staging slots.
        write_seconds: wall time spent submitting writes and waiting for them (what the
            fills did not hide).
        bytes_per_target: bytes written to each target, by session id.
        cached_program: the push ran the program an earlier push of the same plan lowered
            for the same stream geometry (no planning left); False when it was lowered now.
        digests: per target session id, ``{param_name: digest}`` of the bytes this rank
            wrote of each parameter (`weightsync.layout.digest`); the partial digests of all
            ranks add up to the parameter's. Empty when the sender computes none.
        digest_seconds: wall time spent on the digests (part of `seconds`).
        bytes_direct: bytes written straight from the trainer's tensors, unstaged (each
            layout's once; `bytes_staged` are the others).
        replayed: the push replayed a captured one (`weightsync.sender.replay`): the
            stream was not read.
        in_flight: the push returned with its copies still queued on the GPU (a replayed
            graph pushed with ``wait=False``): `WeightSender.wait_landed` waits for them.
        events: with `in_flight`, the IPC handles (hex) of the CUDA events the copies
            complete at: a receiver on the same host waits for them before it verifies.
        writes_per_target: write requests to each target, by session id (a pitched copy
            into mapped memory counts once).
    """

    rank: int

    bytes_staged: int
    bytes_written: int
    num_writes: int
    num_regions: int
    num_buckets: int
    num_chunks: int
    num_copies: int
    seconds: float
    lower_seconds: float
    fill_seconds: float
    write_seconds: float
    bytes_per_target: Mapping[str, int] = field(default_factory=dict)
    cached_program: bool = False
    digests: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    digest_seconds: float = 0.0
    bytes_direct: int = 0
    replayed: bool = False
    in_flight: bool = False
    events: tuple[str, ...] = ()
    writes_per_target: Mapping[str, int] = field(default_factory=dict)

    @property
    def write_gbps(self) -> float:
        """Bytes written per second of the push, in GB/s (10^9 bytes)."""
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else 0.0


def partial_error(
    failed: dict[str, TransferError], stats: PushStats, *, num_targets: int
) -> PartialPushError:
    """The error of a push whose writes to the `failed` targets failed (of `num_targets`),
    its message the first failure's and its result `stats`."""
    first = next(iter(failed.values()))
    others = f" ({len(failed)} of {num_targets} targets failed)" if num_targets > 1 else ""
    return PartialPushError(
        f"{first}{others}",
        failed={session: str(exc) for session, exc in failed.items()},
        result=stats,
        target_session=first.target_session,
        byte_ranges=first.byte_ranges,
        return_code=first.return_code,
        param_name=first.param_name,
    )


def program_stats(
    rank: int,
    program: PushProgram,
    *,
    seconds: float,
    lower_seconds: float,
    fill_seconds: float,
    write_seconds: float,
    cached: bool,
    digests: dict[str, dict[str, int]],
    digest_seconds: float,
    replayed: bool = False,
    in_flight: bool = False,
) -> PushStats:
    """The `PushStats` of one execution of `program`."""
    counters = program.counters
    return PushStats(
        rank=rank,
        bytes_staged=counters.bytes_staged,
        bytes_written=counters.bytes_written,
        num_writes=counters.num_writes,
        num_regions=counters.num_regions,
        num_buckets=counters.num_buckets,
        num_chunks=counters.num_chunks,
        num_copies=counters.num_copies,
        seconds=seconds,
        lower_seconds=lower_seconds,
        fill_seconds=fill_seconds,
        write_seconds=write_seconds,
        bytes_per_target=dict(counters.bytes_per_target),
        cached_program=cached,
        digests=digests,
        digest_seconds=digest_seconds,
        bytes_direct=counters.bytes_direct,
        replayed=replayed,
        in_flight=in_flight,
        writes_per_target=dict(counters.writes_per_target),
    )


def merge_stats(parts: list[PushStats]) -> PushStats:
    """The stats of a push of several parts (one per dtype) as one push's."""
    per_target: dict[str, int] = {}
    writes: dict[str, int] = {}
    digests: dict[str, dict[str, int]] = {}
    for stats in parts:
        for session, num_bytes in stats.bytes_per_target.items():
            per_target[session] = per_target.get(session, 0) + num_bytes
        for session, num_writes in stats.writes_per_target.items():
            writes[session] = writes.get(session, 0) + num_writes
        for session, values in stats.digests.items():
            digests.setdefault(session, {}).update(values)
    return PushStats(
        rank=parts[0].rank,
        bytes_staged=sum(s.bytes_staged for s in parts),
        bytes_written=sum(s.bytes_written for s in parts),
        num_writes=sum(s.num_writes for s in parts),
        num_regions=sum(s.num_regions for s in parts),
        num_buckets=sum(s.num_buckets for s in parts),
        num_chunks=sum(s.num_chunks for s in parts),
        num_copies=sum(s.num_copies for s in parts),
        seconds=sum(s.seconds for s in parts),
        lower_seconds=sum(s.lower_seconds for s in parts),
        fill_seconds=sum(s.fill_seconds for s in parts),
        write_seconds=sum(s.write_seconds for s in parts),
        bytes_per_target=per_target,
        cached_program=all(s.cached_program for s in parts),
        digests=digests,
        digest_seconds=sum(s.digest_seconds for s in parts),
        bytes_direct=sum(s.bytes_direct for s in parts),
        replayed=all(s.replayed for s in parts),
        in_flight=any(s.in_flight for s in parts),
        writes_per_target=writes,
    )


def partial_of_parts(exc: PartialPushError, done: list[PushStats]) -> PartialPushError:
    """`exc` of one part, its result what every part so far wrote."""
    return PartialPushError(
        str(exc),
        failed=exc.failed,
        result=merge_stats(done),
        target_session=exc.target_session,
        byte_ranges=exc.byte_ranges,
        return_code=exc.return_code,
        param_name=exc.param_name,
    )


def per_target(program: PushProgram, sums: dict[tuple[int, str], int]) -> dict[str, dict[str, int]]:
    """The digests of a push by target session id; the targets of one layout share one dict
    (it pickles once)."""
    per_layout: dict[int, dict[str, int]] = {}
    for (layout_id, param_name), value in sums.items():
        per_layout.setdefault(layout_id, {})[param_name] = value
    return {
        target.session_id: per_layout.get(layout_id, {})
        for layout_id, targets in program.plan.targets.items()
        for target in targets
    }
