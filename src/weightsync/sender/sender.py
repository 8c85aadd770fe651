"""`WeightSender`: one trainer rank's side of a sync, from its HF tensors to the targets."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from weightsync.plan.items import SourcePlan
from weightsync.plan.types import SourceHolding, TensorMeta
from weightsync.sender.config import SenderConfig
from weightsync.sender.fill import SlotFiller
from weightsync.sender.push import PushRun
from weightsync.sender.replay import PushScript, ReplayMismatch, ScriptRecorder, ScriptReplay
from weightsync.sender.staging import StagingRing, transport_reads
from weightsync.sender.stats import PushStats
from weightsync.sender.writes import WriteQueue

if TYPE_CHECKING:
    from weightsync.transport import Transport


class WeightSender:
    """Executes one trainer rank's share of a sync plan.

    Call protocol, on every rank of the trainer group:

    1. ``holdings = sender.gather_holdings(export)`` (collective) and hand them, with the
       rollout's targets, to `weightsync.plan.build_plan`;
    2. ``sender.push(plan.for_source(sender.rank), export)`` after every optimizer step (the
       plan is reused until the targets change);
    3. ``release()`` before a trainer checkpoint save and ``restore()`` after it, if host
       memory is tight;
    4. ``close()`` at the end.

    A push streams the tensors once. Each tensor the plan needs is packed, per destination
    layout, into buckets of at most ``bucket_bytes``; each bucket is copied (and cast) into a
    slot of a staging ring registered with the transport once, then written to every target
    of its layout, adjacent runs coalesced. A slot is filled in chunks of about
    ``chunk_bytes`` and each chunk's writes start as soon as it is filled, so the fill overlaps
    the writes even when a push has a single bucket; filling the next slot overlaps the
    writes of the previous one too. Staging memory is ``num_slots * bucket_bytes``, on the
    host (pinned when CUDA is available) or, for CUDA tensors and a transport that reads GPU
    memory, on the GPU. With a stream-ordered transport (CUDA IPC) a chunk's writes wait for
    its copies on the GPU, so the host never blocks on them.

    The first push of a plan is recorded; a later push of the same plan whose stream yields
    the same names in the same order with the same geometry replays the recording instead of
    packing again (`weightsync.sender.replay`; ``PushStats.replayed``). A stream that differs
    falls back to a normal push from that tensor on, and the next push records again.
    The sender does not own the transport: closing it is the caller's job.
    """

    def __init__(self, config: SenderConfig, *, transport: Transport, group: Any = None) -> None:
        """Create the sender; staging memory is allocated at the first push.

        Args:
            config: bucket size, workers, timeouts, staging placement.
            transport: writes the bytes (a `weightsync.transport.Transport`).
            group: the trainer's torch.distributed process group, or None for a single
                process.
        """
        self.config = config
        self.group = group
        self._transport = transport
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            import torch.distributed as dist

            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        self._ring: StagingRing | None = None
        self._filler = SlotFiller(num_workers=config.num_workers)
        self._queue = WriteQueue(
            transport,
            timeout_s=config.timeout_s,
            max_outstanding_per_peer=config.max_outstanding_per_peer,
        )
        self._declared: dict[str, tuple[int, ...]] = {}
        # Per-plan facts kept between pushes of the same plan (compared by identity).
        self._cached_plan: SourcePlan | None = None
        self._checked_shapes: dict[str, tuple[int, ...]] = {}
        self._script: PushScript | None = None
        self._closed = False

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory currently allocated (0 before the first push)."""
        return self._ring.num_bytes if self._ring is not None and self._ring.allocated else 0

    @property
    def staging_device(self) -> torch.device | None:
        """Where the staging ring lives, once the first push chose it."""
        return self._ring.device if self._ring is not None else None

    def holding(self, export: Any) -> SourceHolding:
        """What this rank can produce, for the plan.

        Args:
            export: a `ModelExport` (anything with ``metas() -> {hf_name: TensorMeta}``), or
                a mapping ``{hf_name: TensorMeta | torch.Tensor}``.

        Returns:
            ``SourceHolding(rank=self.rank, tensors=...)``; `push` later checks each tensor
            against the shapes declared here.

        Raises:
            ValueError: `export` is none of the accepted kinds.
        """
        if hasattr(export, "metas"):
            metas = dict(export.metas())
        elif isinstance(export, Mapping):
            metas = {
                name: value
                if isinstance(value, TensorMeta)
                else TensorMeta(shape=tuple(value.shape), dtype=str(value.dtype))
                for name, value in export.items()
            }
        else:
            raise ValueError(
                "holding() takes a ModelExport or a mapping {hf_name: TensorMeta | Tensor}, "
                f"got {type(export).__name__}"
            )
        declared = {name: meta.shape for name, meta in metas.items()}
        if declared != self._declared:
            self._declared, self._script = declared, None
        return SourceHolding(rank=self.rank, tensors=metas)

    def gather_holdings(self, export: Any) -> list[SourceHolding]:
        """Every rank's `holding`, by rank; collective over the group (every rank calls it)."""
        mine = self.holding(export)
        if self.world_size == 1:
            return [mine]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        return sorted(gathered, key=lambda h: h.rank)

    def push(self, plan: SourcePlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> PushStats:
        """Write this rank's share of a sync into the plan's targets.

        Args:
            plan: ``sync_plan.for_source(self.rank)``.
            tensors: this rank's PP-local ``(hf_name, tensor)`` stream (a `ModelExport`
                works); any dtype, cast to ``plan.dtype``. Tensors the plan does not need
                from this rank are skipped without a copy.

        Returns:
            What was staged and written, and how long it took.

        Raises:
            ValueError: a tensor the plan needs has a shape other than the one declared in
                `holding` or too small for the plan's boxes, is yielded twice, or never comes
                (raised when the stream ends, before the remaining buckets are written); a
                bad tensor is reported before anything of its bucket is written.
            TransferError: a write failed or timed out; names the target and parameters.
        """
        if self._closed:
            raise ValueError("push() on a closed WeightSender")
        if plan is not self._cached_plan:
            self._cached_plan, self._checked_shapes, self._script = plan, {}, None
        try:
            return self._push(plan, tensors)
        except BaseException:
            self._script = None
            self._queue.drain()
            raise

    def _push(self, plan: SourcePlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> PushStats:
        """Replay the recorded push of `plan` if there is one, else push (and record)."""
        start = time.perf_counter()
        script = self._script
        ring = self._ring
        # A ring freed and allocated again elsewhere voids the recorded write addresses.
        if (
            script is not None
            and ring is not None
            and ring.allocated
            and ring.base_addr == script.ring_addr
        ):
            return self._replay(script, ring, tensors, start)
        recorder = ScriptRecorder(plan)
        stats = self._run(plan, recorder).execute(tensors)
        ring = self._ring
        if ring is not None and ring.allocated:
            self._script = recorder.finish(ring_addr=ring.base_addr)
        return stats

    def _replay(
        self,
        script: PushScript,
        ring: StagingRing,
        tensors: Iterable[tuple[str, torch.Tensor]],
        start: float,
    ) -> PushStats:
        dtype = getattr(torch, script.plan.dtype)
        replay = ScriptReplay(
            script, ring=ring, filler=self._filler, queue=self._queue, dtype=dtype
        )
        try:
            replay.execute(tensors)
        except ReplayMismatch as stop:
            # The stream changed: finish the normal way from where the replay stopped, and
            # record again at the next push.
            self._script = None
            rest = itertools.chain(
                stop.pending, [stop.current] if stop.current is not None else [], stop.rest
            )
            tail = self._run(script.plan, None).execute(rest, done=stop.done)
            return _merged(stop.counters, tail, replay, start)
        return PushStats(
            **script.counters,
            seconds=time.perf_counter() - start,
            fill_seconds=replay.fill_seconds,
            write_seconds=replay.write_seconds,
            replayed=True,
        )

    def _run(self, plan: SourcePlan, recorder: ScriptRecorder | None) -> PushRun:
        return PushRun(
            plan,
            config=self.config,
            ring_for=self._ring_for,
            filler=self._filler,
            queue=self._queue,
            declared_shapes=self._declared,
            checked_shapes=self._checked_shapes,
            recorder=recorder,
        )

    def release(self) -> None:
        """Unregister and free the staging memory (e.g. before a trainer checkpoint save)."""
        self._queue.drain()
        self._script = None
        if self._ring is not None:
            self._ring.free()

    def restore(self) -> None:
        """Allocate and register the staging memory again after `release` (no-op if unused)."""
        if self._closed:
            raise ValueError("restore() on a closed WeightSender")
        if self._ring is not None:
            self._ring.allocate()

    def close(self) -> None:
        """Free the staging memory and stop the worker threads; the sender is done."""
        if self._closed:
            return
        self.release()
        self._filler.close()
        self._closed = True

    def _ring_for(self, source_device: torch.device) -> StagingRing:
        """The staging ring, allocated on first use where `config.staging` says."""
        if self._ring is None:
            self._ring = StagingRing(
                transport=self._transport,
                num_slots=self.config.num_slots,
                slot_bytes=self.config.slot_bytes,
                device=self._staging_device(source_device),
                pin_memory=self.config.pin_memory,
            )
        self._ring.allocate()
        return self._ring

    def _staging_device(self, device: torch.device) -> torch.device:
        staging = self.config.staging
        if staging == "host":
            return torch.device("cpu")
        on_gpu = device.type == "cuda"
        readable = on_gpu and transport_reads(self._transport, device)
        if staging == "cuda" and not readable:
            raise ValueError(
                f"SenderConfig.staging='cuda' needs CUDA tensors and a transport that reads GPU "
                f"memory; the tensors are on {device} and the transport "
                f"{'does not' if on_gpu else 'was not asked'}; use staging='auto' or 'host'"
            )
        return device if readable else torch.device("cpu")


def _merged(
    counters: dict[str, Any], tail: PushStats, replay: ScriptReplay, start: float
) -> PushStats:
    """The stats of a push that a replay began and a normal push finished: the counters of
    both parts added up."""
    per_target = Counter(counters["bytes_per_target"])
    per_target.update(tail.bytes_per_target)
    summed = {k: v + getattr(tail, k) for k, v in counters.items() if k != "bytes_per_target"}
    return PushStats(
        **summed,
        seconds=time.perf_counter() - start,
        fill_seconds=replay.fill_seconds + tail.fill_seconds,
        write_seconds=replay.write_seconds + tail.write_seconds,
        bytes_per_target=dict(per_target),
    )
