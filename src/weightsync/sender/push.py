"""`PushRun`: executing one push of a `SourcePlan`, bucket by bucket, through the ring."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from weightsync.layout.types import DTYPE_SIZES
from weightsync.plan.items import SourcePlan, StageWork
from weightsync.sender.buckets import Bucket, BucketPacker
from weightsync.sender.config import SenderConfig
from weightsync.sender.fill import SlotFiller
from weightsync.sender.staging import StagingRing
from weightsync.sender.stats import PushStats
from weightsync.sender.writes import WriteQueue, coalesce


class PushRun:
    """One `WeightSender.push`: packs the stream into buckets, stages and writes them.

    Buckets are staged in the order they fill; slot ``k`` of the ring is reused only after
    every write that reads it finished, so filling one slot overlaps the writes of the others.
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
    ) -> None:
        """Prepare one packer per layout of the plan.

        Args:
            plan: the rank's share of the sync.
            config: the sender's settings (slot size).
            ring_for: returns the allocated staging ring, given the first source tensor's
                device (which decides where a new ring lives).
            filler: runs the copies into a slot.
            queue: submits and waits for writes.
            declared_shapes: the shapes the rank declared for the plan (may be empty).

        Raises:
            ValueError: the plan's dtype is not one weightsync moves.
        """
        self._plan = plan
        self._ring_for = ring_for
        self._filler = filler
        self._queue = queue
        self._declared = declared_shapes
        self._dtype = getattr(torch, plan.dtype, None)
        if not isinstance(self._dtype, torch.dtype) or plan.dtype not in DTYPE_SIZES:
            raise ValueError(f"the plan's dtype {plan.dtype!r} is not one weightsync moves")
        self._element_size = DTYPE_SIZES[plan.dtype]
        slot_bytes = config.slot_bytes
        slot_bytes -= slot_bytes % self._element_size
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
        self._bytes_staged = 0
        self._num_buckets = 0
        self._num_copies = 0
        self._num_regions = 0
        self._num_writes = 0
        self._fill_s = 0.0
        self._write_s = 0.0
        self._per_target: dict[str, int] = {}

    def execute(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> PushStats:
        """Consume the stream, stage and write every bucket, wait for the last writes.

        Raises:
            ValueError: as `WeightSender.push` says.
            TransferError: a write failed or timed out.
        """
        start = time.perf_counter()
        work = self._plan.work
        seen: set[str] = set()
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
        shape = tuple(tensor.shape)
        declared = self._declared.get(hf_name)
        if declared is not None and declared != shape:
            raise ValueError(
                f"{where} has shape {shape}, but the plan was built for shape {declared}"
            )
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

    def _stage_and_write(self, bucket: Bucket) -> None:
        ring = self._ring_for(self._source_device)
        slot = self._next_slot
        self._next_slot = (slot + 1) % ring.num_slots

        t0 = time.perf_counter()
        self._queue.wait_slot(slot)
        t1 = time.perf_counter()
        self._num_copies += self._filler.fill(
            bucket,
            staging_bytes=ring.as_bytes(),
            staging_typed=ring.as_dtype(self._dtype),
            slot_index=slot,
            slot_bytes=ring.slot_bytes,
        )
        _synchronize(ring.device, bucket)
        t2 = time.perf_counter()
        slot_addr = ring.slot_addr(slot)
        for target in self._plan.targets[bucket.layout_id]:
            writes = coalesce(bucket.regions, slot_addr=slot_addr, weights_info=target.weights_info)
            self._queue.submit(target, writes, slot=slot)
            self._num_writes += len(writes)
            self._num_regions += len(bucket.regions)
            self._per_target[target.session_id] = (
                self._per_target.get(target.session_id, 0) + bucket.num_bytes
            )
        t3 = time.perf_counter()
        self._fill_s += t2 - t1
        self._write_s += (t1 - t0) + (t3 - t2)
        self._bytes_staged += bucket.num_bytes
        self._num_buckets += 1


def _address_on(weights_info: Mapping[str, tuple[int, int, int]]):
    def address(param_name: str, offset: int) -> int:
        entry = weights_info.get(param_name)
        return (entry[0] if entry is not None else 0) + offset

    return address


def _no_address(param_name: str, offset: int) -> int:
    return offset


def _synchronize(staging_device: torch.device, bucket: Bucket) -> None:
    """Wait for enqueued GPU copies before the transport reads the slot."""
    devices = {s.tensor.device for s in bucket.sources if s.tensor.device.type == "cuda"}
    if staging_device.type == "cuda":
        devices.add(staging_device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
