"""`PushRun`: executing one push of a `SourcePlan`, bucket by bucket, through the ring."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from weightsync.layout.types import DTYPE_SIZES
from weightsync.plan.items import SourcePlan, StageWork
from weightsync.sender.buckets import Bucket, BucketPacker
from weightsync.sender.chunks import Chunk, split_bucket
from weightsync.sender.config import SenderConfig
from weightsync.sender.fill import CopyOp, SlotFiller, record_events
from weightsync.sender.replay import ScriptRecorder
from weightsync.sender.staging import StagingRing
from weightsync.sender.stats import PushStats
from weightsync.sender.writes import WriteQueue, coalesce


class PushRun:
    """One `WeightSender.push`: packs the stream into buckets, stages and writes them.

    Buckets are staged in the order they fill, each in chunks (`split_bucket`) whose writes
    start as soon as the chunk is filled, so a bucket's fill overlaps its own writes; slot
    ``k`` of the ring is reused only after every write that reads it finished, so filling one
    slot also overlaps the writes of the others.
    """

    def __init__(
        self,
        plan: SourcePlan,
        *,
        config: SenderConfig,
        ring_for: Callable[[torch.device], StagingRing],
        filler: SlotFiller,
        queue: WriteQueue,
        declared_shapes: Mapping[str, tuple[int, ...]],
        checked_shapes: dict[str, tuple[int, ...]] | None = None,
        recorder: ScriptRecorder | None = None,
    ) -> None:
        """Prepare one packer per layout of the plan.

        Args:
            plan: the rank's share of the sync.
            config: the sender's settings (slot and chunk sizes).
            ring_for: returns the allocated staging ring, given the first source tensor's
                device (which decides where a new ring lives).
            filler: runs the copies into a slot.
            queue: submits and waits for writes.
            declared_shapes: the shapes the rank declared for the plan (may be empty).
            checked_shapes: ``{hf_name: shape}`` already found to hold every box this plan
                reads of the tensor; filled as tensors pass, so that the caller can keep it
                for the next push of the same plan and skip checking the boxes again.
            recorder: records the push for replays (`weightsync.sender.replay`).

        Raises:
            ValueError: the plan's dtype is not one weightsync moves.
        """
        self._plan = plan
        self._ring_for = ring_for
        self._filler = filler
        self._queue = queue
        self._declared = declared_shapes
        self._checked = {} if checked_shapes is None else checked_shapes
        self._recorder = recorder
        self._dtype = getattr(torch, plan.dtype, None)
        if not isinstance(self._dtype, torch.dtype) or plan.dtype not in DTYPE_SIZES:
            raise ValueError(f"the plan's dtype {plan.dtype!r} is not one weightsync moves")
        self._element_size = DTYPE_SIZES[plan.dtype]
        slot_bytes = config.slot_bytes
        slot_bytes -= slot_bytes % self._element_size
        self._config = config
        self._packers = {
            layout_id: BucketPacker(
                layout_id=layout_id,
                slot_bytes=slot_bytes,
                element_size=self._element_size,
                dst_address=_address_on(targets[0].weights_info) if targets else _no_address,
            )
            for layout_id, targets in plan.targets.items()
        }
        self._next_slot = 0
        # Only the device is kept: a reference to the tensor would pin the memory of an
        # export that materialises its tensors for the whole push.
        self._source_device = torch.device("cpu")
        self._seen_source = False
        # Whether a CUDA tensor joined a bucket: only then may a host slot's copies be pending.
        self._cuda_sources = False
        self._bytes_staged = 0
        self._num_buckets = 0
        self._num_chunks = 0
        self._num_copies = 0
        self._num_regions = 0
        self._num_writes = 0
        self._fill_s = 0.0
        self._write_s = 0.0
        self._per_target: dict[str, int] = {}

    def execute(
        self, tensors: Iterable[tuple[str, torch.Tensor]], *, done: frozenset[str] = frozenset()
    ) -> PushStats:
        """Consume the stream, stage and write every bucket, wait for the last writes.

        Args:
            tensors: the ``(hf_name, tensor)`` stream.
            done: names already written in full by an earlier part of this push (a replay
                that stopped); they count as seen and must not come again.

        Raises:
            ValueError: as `WeightSender.push` says.
            TransferError: a write failed or timed out.
        """
        start = time.perf_counter()
        work = self._plan.work
        seen: set[str] = set(done)
        recorder = self._recorder
        for hf_name, tensor in tensors:
            works = work.get(hf_name)
            if works is None:
                continue
            if hf_name in seen:
                raise ValueError(f"the tensor stream yielded {hf_name!r} twice")
            seen.add(hf_name)
            self._check(hf_name, tensor, works)
            if not self._seen_source:
                self._source_device, self._seen_source = tensor.device, True
            if tensor.is_cuda:
                self._cuda_sources = True
            if recorder is not None:
                recorder.arrive(hf_name, tensor)
            for stage in works:
                for bucket in self._packers[stage.layout_id].add(tensor, stage.items):
                    self._stage_and_write(bucket)
        missing = [name for name in work if name not in seen]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(
                f"trainer rank {self._plan.rank}: the tensor stream ended without {shown}{more}, "
                "which the plan needs from this rank; check that the export yields what "
                "holding() declared"
            )
        for packer in self._packers.values():
            bucket = packer.flush()
            if bucket is not None:
                self._stage_and_write(bucket)
        t0 = time.perf_counter()
        self._queue.wait_all()
        self._write_s += time.perf_counter() - t0
        return PushStats(
            bytes_staged=self._bytes_staged,
            bytes_written=sum(self._per_target.values()),
            num_writes=self._num_writes,
            num_regions=self._num_regions,
            num_buckets=self._num_buckets,
            num_chunks=self._num_chunks,
            num_copies=self._num_copies,
            seconds=time.perf_counter() - start,
            fill_seconds=self._fill_s,
            write_seconds=self._write_s,
            bytes_per_target=dict(self._per_target),
        )

    def _check(self, hf_name: str, tensor: Any, works: tuple[StageWork, ...]) -> None:
        where = f"trainer rank {self._plan.rank}: tensor {hf_name!r}"
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{where} is a {type(tensor).__name__}, not a torch.Tensor")
        # Checked here, before the tensor joins a bucket: a bucket's first chunk is written
        # before its last one is copied, so a copy must not be the first to notice.
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            raise ValueError(
                f"{where} is a {tensor.layout} tensor on {tensor.device}; the sender copies "
                "dense (strided) tensors with data"
            )
        shape = tuple(tensor.shape)
        declared = self._declared.get(hf_name)
        if declared is not None and declared != shape:
            raise ValueError(
                f"{where} has shape {shape}, but the plan was built for shape {declared}"
            )
        # The boxes depend only on the plan: a shape that held them once holds them again.
        if self._checked.get(hf_name) == shape:
            return
        for stage in works:
            for item in stage.items:
                if item.hf_name is None:
                    continue
                box = item.src_box
                if len(box) != len(shape) or any(
                    stop > dim for (_, stop), dim in zip(box, shape, strict=False)
                ):
                    raise ValueError(
                        f"{where} has shape {shape}, but the plan reads box {box} of it for "
                        f"parameter {item.param_name!r}"
                    )
        self._checked[hf_name] = shape

    def _stage_and_write(self, bucket: Bucket) -> None:
        """Stage `bucket` in the next slot chunk by chunk, submitting each chunk's writes.

        On the host a chunk's copies are done when `fill` returns, so its writes go out at
        once, while the next chunk fills. Copies that run on a CUDA stream are only enqueued:
        with a stream-ordered transport (CUDA IPC) a chunk's writes are queued at once behind
        its copies on the GPU; otherwise they wait on the host for the chunk's events, after
        the next chunk's copies were enqueued. Either way the GPU copies one chunk while the
        transport reads the previous one.
        """
        ring = self._ring_for(self._source_device)
        slot = self._next_slot
        self._next_slot = (slot + 1) % ring.num_slots

        t0 = time.perf_counter()
        self._queue.wait_slot(slot)
        self._write_s += time.perf_counter() - t0
        staging_bytes, staging_typed = ring.as_bytes(), ring.as_dtype(self._dtype)
        slot_addr = ring.slot_addr(slot)
        chunks = split_bucket(
            bucket,
            chunk_bytes=self._config.slot_chunk_bytes(ring.device),
            element_size=self._element_size,
        )
        pending: tuple[Chunk, list[torch.cuda.Event]] | None = None
        recorder = self._recorder
        for number, chunk in enumerate(chunks):
            t1 = time.perf_counter()
            ops: list[CopyOp] | None = [] if recorder is not None else None
            self._num_copies += self._filler.fill(
                chunk,
                staging_bytes=staging_bytes,
                staging_typed=staging_typed,
                slot_index=slot,
                slot_bytes=ring.slot_bytes,
                ops_out=ops,
            )
            after_stream = self._producing_stream(ring.device, chunk)
            devices = [] if after_stream is not None else self._event_devices(ring.device, chunk)
            if recorder is not None and ops is not None:
                recorder.chunk(
                    chunk,
                    slot=slot,
                    new_bucket=number == 0,
                    ops=ops,
                    zeros=[(slot * ring.slot_bytes + o, n) for o, n in chunk.zeros],
                    stream_ordered=after_stream is not None,
                    event_devices=devices,
                    num_bytes=chunk.num_bytes,
                )
            if after_stream is not None:
                # The transport's copies wait for the fill on the GPU: nothing blocks here,
                # and the GPU fills the next chunk while it writes this one.
                self._fill_s += time.perf_counter() - t1
                self._write_chunk(
                    bucket.layout_id,
                    chunk,
                    [],
                    slot=slot,
                    slot_addr=slot_addr,
                    after_stream=after_stream,
                )
                continue
            events = record_events(devices)
            self._fill_s += time.perf_counter() - t1
            if pending is not None:
                self._write_chunk(bucket.layout_id, *pending, slot=slot, slot_addr=slot_addr)
                pending = None
            if events:
                pending = (chunk, events)
            else:
                self._write_chunk(bucket.layout_id, chunk, [], slot=slot, slot_addr=slot_addr)
        if pending is not None:
            self._write_chunk(bucket.layout_id, *pending, slot=slot, slot_addr=slot_addr)
        self._bytes_staged += bucket.num_bytes
        self._num_buckets += 1
        self._num_chunks += len(chunks)

    def _event_devices(self, staging_device: torch.device, chunk: Chunk) -> list[torch.device]:
        """The CUDA devices whose current streams run a chunk's copies (none on the host),
        for writes that wait for them on the host."""
        if not (self._cuda_sources or staging_device.type == "cuda"):
            return []
        devices = {s.tensor.device for s in chunk.sources if s.tensor.device.type == "cuda"}
        if staging_device.type == "cuda":
            devices.add(staging_device)
        return sorted(devices, key=str)

    def _producing_stream(self, staging_device: torch.device, chunk: Chunk) -> int | None:
        """The raw CUDA stream that fills `chunk` when the transport can order its writes
        after it: a GPU slot filled from the host or from that GPU only (every such copy is
        queued on the slot device's current stream). None: synchronize before writing."""
        if staging_device.type != "cuda" or not self._queue.stream_ordered:
            return None
        for source in chunk.sources:
            device = source.tensor.device
            if device.type != "cpu" and device != staging_device:
                return None
        return torch.cuda.current_stream(staging_device).cuda_stream

    def _write_chunk(
        self,
        layout_id: int,
        chunk: Chunk,
        events: list[torch.cuda.Event],
        *,
        slot: int,
        slot_addr: int,
        after_stream: int | None = None,
    ) -> None:
        """Submit `chunk`'s writes to every target of its layout, once its copies are done
        (on the host: `events`; on the GPU: the work queued on `after_stream`)."""
        t0 = time.perf_counter()
        for event in events:
            event.synchronize()
        t1 = time.perf_counter()
        for target in self._plan.targets[layout_id]:
            writes = coalesce(chunk.regions, slot_addr=slot_addr, weights_info=target.weights_info)
            self._queue.submit(target, writes, slot=slot, after_stream=after_stream)
            if self._recorder is not None:
                self._recorder.writes(chunk, target, writes, len(chunk.regions))
            self._num_writes += len(writes)
            self._num_regions += len(chunk.regions)
            self._per_target[target.session_id] = (
                self._per_target.get(target.session_id, 0) + chunk.num_bytes
            )
        self._fill_s += t1 - t0
        self._write_s += time.perf_counter() - t1


def _address_on(weights_info: Mapping[str, tuple[int, int, int]]):
    def address(param_name: str, offset: int) -> int:
        entry = weights_info.get(param_name)
        return (entry[0] if entry is not None else 0) + offset

    return address


def _no_address(param_name: str, offset: int) -> int:
    return offset
