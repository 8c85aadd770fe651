"""`PushStats`: what one `WeightSender.push` moved and how long it took."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


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
        lower_seconds: wall time spent finding or lowering the push program (part of
            `seconds`).
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
