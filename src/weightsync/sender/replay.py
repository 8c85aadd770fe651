"""`PushScript`: a push of one plan recorded once, then replayed while the stream keeps its shape.

Every push of a plan packs the same items into the same slots, cuts the same chunks, fuses
the same copies and coalesces the same writes; only the tensors' bytes change. Packing costs
~15 us of Python per HF tensor, which for a MoE of ~19,000 tensors is longer than moving its
60 GB over NVLink. So the first push of a plan records, chunk by chunk, what it did
(`ScriptRecorder`): the copies by stream position, the zero runs, the writes per target, and
when each chunk could go (after how many stream tensors). Later pushes (`ScriptReplay`) only
check that the stream yields the same names in the same order with the same geometry (shape,
strides, storage offset, dtype, device, and which earlier tensor shares its storage), then
rebuild the copies from the fresh tensors and submit the recorded writes.

The script holds no tensor: a replay keeps each tensor only until the last chunk that reads
it was filled, like a push does. A stream that differs at some tensor (another order, a new
stride, a missing or extra tensor) stops the replay there with `ReplayMismatch`, before
anything of that tensor is staged; the caller finishes the push the normal way from that
point (the tensors still held, then the rest of the stream).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.plan.items import SourcePlan
from weightsync.plan.types import TargetRank
from weightsync.sender.fill import CopyOp, SlotFiller, record_events
from weightsync.sender.staging import StagingRing
from weightsync.sender.writes import Write, WriteQueue

# (stream index of the base tensor, size, src stride, src offset, dst stride, dst offset,
# whole): a `CopyOp` with its tensor named by stream position.
OpRecipe = tuple[int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...], int, bool]
TensorKey = tuple[Any, ...]


def tensor_key(tensor: torch.Tensor, storages: dict[int, int], index: int) -> TensorKey:
    """What a replay needs to be unchanged about a tensor (raises for a non-strided one).

    Args:
        tensor: the stream's tensor at position `index`.
        storages: ``{storage data_ptr: first stream index}`` of the tensors so far; updated.
        index: the tensor's stream position.
    """
    group = storages.setdefault(tensor.untyped_storage().data_ptr(), index)
    return (
        tensor.shape,
        tensor.stride(),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.device,
        tensor.layout,
        group,
    )


@dataclass(slots=True, kw_only=True)
class Step:
    """One chunk of a recorded push: fill it, then write it.

    Attributes:
        slot: the ring slot.
        new_bucket: the chunk starts a bucket: wait for the slot's previous writes first.
        after: stream tensors that must have arrived before the chunk is filled.
        ops: the copies, tensors by stream index; offsets into the whole ring.
        zeros: ``(ring byte offset, num_bytes)`` runs to zero.
        writes: ``(target, writes)`` per target of the chunk's layout.
        stream_ordered: the writes may wait for the fill on the GPU (`WriteQueue.submit`'s
            ``after_stream``) instead of the host.
        event_devices: CUDA devices whose current streams run the copies, when the writes
            wait for them on the host (empty: the copies are done when the fill returns).
        release: stream indices that no later step reads.
        num_bytes: bytes the chunk stages.
        num_regions: destination regions of its writes, over all targets, before coalescing.
    """

    slot: int
    new_bucket: bool
    after: int
    ops: list[OpRecipe] = field(default_factory=list)
    zeros: list[tuple[int, int]] = field(default_factory=list)
    writes: list[tuple[TargetRank, list[Write]]] = field(default_factory=list)
    stream_ordered: bool = False
    event_devices: tuple[torch.device, ...] = ()
    release: tuple[int, ...] = ()
    num_bytes: int = 0
    num_regions: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PushScript:
    """A recorded push of `plan` through a ring at `ring_addr`.

    Attributes:
        plan: the plan recorded (compared by identity).
        ring_addr: the ring's base address then (a ring allocated again elsewhere voids it).
        names: the HF names the plan needed, in stream order.
        keys: each one's `tensor_key`.
        steps: the chunks, in the order they were filled.
        counters: the push's byte and request counters (`PushStats` fields).
    """

    plan: SourcePlan
    ring_addr: int
    names: tuple[str, ...]
    keys: tuple[TensorKey, ...]
    steps: tuple[Step, ...]
    counters: dict[str, Any]


class ReplayMismatch(Exception):
    """The stream left the recorded script; nothing of `current` (or later) was staged.

    Attributes:
        pending: ``(name, tensor)`` pairs that arrived but whose copies were not all filled,
            in stream order.
        current: the pair that did not match, or None when the stream ended early.
        rest: the stream after `current`.
        done: names whose every copy was filled and written.
        counters: what the replayed chunks did (`PushStats` counter fields).
    """

    def __init__(
        self,
        *,
        pending: list[tuple[str, torch.Tensor]],
        current: tuple[str, Any] | None,
        rest: Iterator[tuple[str, Any]],
        done: frozenset[str],
        counters: dict[str, Any],
    ) -> None:
        super().__init__("the tensor stream differs from the recorded push")
        self.pending = pending
        self.current = current
        self.rest = rest
        self.done = done
        self.counters = counters


class ScriptRecorder:
    """Collects a `PushScript` while `PushRun` does a push the normal way."""

    def __init__(self, plan: SourcePlan) -> None:
        """Start an empty recording of a push of `plan`."""
        self._plan = plan
        self._names: list[str] = []
        self._keys: list[TensorKey] = []
        self._index: dict[int, int] = {}  # id(tensor) -> stream index
        self._storages: dict[int, int] = {}
        self._steps: list[Step] = []
        self._by_chunk: dict[int, Step] = {}
        self.broken = False

    def arrive(self, name: str, tensor: torch.Tensor) -> None:
        """Record the next tensor the plan needs (after `PushRun` checked it)."""
        index = len(self._names)
        self._names.append(name)
        self._keys.append(tensor_key(tensor, self._storages, index))
        self._index[id(tensor)] = index

    def chunk(
        self,
        chunk: object,
        *,
        slot: int,
        new_bucket: bool,
        ops: Sequence[CopyOp],
        zeros: Sequence[tuple[int, int]],
        stream_ordered: bool,
        event_devices: Sequence[torch.device],
        num_bytes: int,
    ) -> None:
        """Record a chunk that was just filled (`ops` and `zeros` with ring offsets)."""
        recipes = []
        for base, size, src_stride, src_offset, dst_stride, dst_offset, whole in ops:
            index = self._index.get(id(base))
            if index is None:  # a copy from a tensor that is not the stream's: not replayable
                self.broken = True
                return
            recipes.append((index, size, src_stride, src_offset, dst_stride, dst_offset, whole))
        step = Step(
            slot=slot,
            new_bucket=new_bucket,
            after=len(self._names),
            ops=recipes,
            zeros=list(zeros),
            stream_ordered=stream_ordered,
            event_devices=tuple(event_devices),
            num_bytes=num_bytes,
        )
        self._steps.append(step)
        self._by_chunk[id(chunk)] = step

    def writes(
        self, chunk: object, target: TargetRank, writes: list[Write], num_regions: int
    ) -> None:
        """Record the writes of a recorded chunk to one target (`num_regions` before
        coalescing)."""
        step = self._by_chunk.get(id(chunk))
        if step is None:
            self.broken = True
            return
        step.writes.append((target, writes))
        step.num_regions += num_regions

    def finish(self, *, ring_addr: int) -> PushScript | None:
        """The script, or None if the push could not be recorded."""
        if self.broken:
            return None
        last_use: dict[int, int] = {}
        for position, step in enumerate(self._steps):
            for recipe in step.ops:
                last_use[recipe[0]] = position
        releases: dict[int, list[int]] = {}
        for index, position in last_use.items():
            releases.setdefault(position, []).append(index)
        for position, step in enumerate(self._steps):
            step.release = tuple(releases.get(position, ()))
        return PushScript(
            plan=self._plan,
            ring_addr=ring_addr,
            names=tuple(self._names),
            keys=tuple(self._keys),
            steps=tuple(self._steps),
            counters=step_counters(self._steps),
        )


class ScriptReplay:
    """Runs a `PushScript` against a new stream of the same tensors."""

    def __init__(
        self,
        script: PushScript,
        *,
        ring: StagingRing,
        filler: SlotFiller,
        queue: WriteQueue,
        dtype: torch.dtype,
    ) -> None:
        """Bind the script to the sender's ring, filler and write queue."""
        self._script = script
        self._ring = ring
        self._filler = filler
        self._queue = queue
        self._dtype = dtype
        self.fill_seconds = 0.0
        self.write_seconds = 0.0

    def execute(self, tensors: Iterable[tuple[str, Any]]) -> None:
        """Consume the stream and do every recorded step.

        Args:
            tensors: the ``(hf_name, tensor)`` stream of this push.

        Raises:
            ReplayMismatch: the stream differs from the recording (see the module docstring).
            TransferError: a write failed or timed out.
        """
        script = self._script
        work = script.plan.work
        names, keys, steps = script.names, script.keys, script.steps
        held: list[tuple[str, torch.Tensor] | None] = []
        storages: dict[int, int] = {}
        next_step = 0
        pending: tuple[Step, list[torch.cuda.Event]] | None = None
        stream = iter(tensors)
        for name, tensor in stream:
            if name not in work:
                continue
            index = len(held)
            try:
                matches = (
                    index < len(names)
                    and name == names[index]
                    and tensor_key(tensor, storages, index) == keys[index]
                )
            except (AttributeError, RuntimeError, TypeError):
                matches = False
            if not matches:
                raise self._mismatch(held, (name, tensor), stream, next_step, pending)
            held.append((name, tensor))
            while next_step < len(steps) and steps[next_step].after == index + 1:
                pending = self._step(steps[next_step], held, pending)
                next_step += 1
        if len(held) != len(names):
            raise self._mismatch(held, None, stream, next_step, pending)
        while next_step < len(steps):
            pending = self._step(steps[next_step], held, pending)
            next_step += 1
        if pending is not None:
            self._write(*pending)
        t0 = time.perf_counter()
        self._queue.wait_all()
        self.write_seconds += time.perf_counter() - t0

    def _step(
        self,
        step: Step,
        held: list[tuple[str, torch.Tensor] | None],
        pending: tuple[Step, list[torch.cuda.Event]] | None,
    ) -> tuple[Step, list[torch.cuda.Event]] | None:
        """Fill one chunk and write it (or the previous one, when writes wait on the host)."""
        ring = self._ring
        if step.new_bucket:
            if pending is not None:
                self._write(*pending)
                pending = None
            t0 = time.perf_counter()
            self._queue.wait_slot(step.slot)
            self.write_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        # Every tensor a step reads is still held: it is released after its last step.
        ops = [
            CopyOp(_tensor(held, i), size, src_stride, src_offset, dst_stride, dst_offset, whole)
            for i, size, src_stride, src_offset, dst_stride, dst_offset, whole in step.ops
        ]
        self._filler.run(
            ops,
            step.zeros,
            staging_bytes=ring.as_bytes(),
            staging_typed=ring.as_dtype(self._dtype),
        )
        del ops
        for index in step.release:
            held[index] = None
        events = record_events(step.event_devices)
        self.fill_seconds += time.perf_counter() - t0
        if step.stream_ordered:
            self._write(step, [])
            return pending
        if pending is not None:
            self._write(*pending)
        if events:
            return (step, events)
        self._write(step, [])
        return None

    def _write(self, step: Step, events: list[torch.cuda.Event]) -> None:
        t0 = time.perf_counter()
        for event in events:
            event.synchronize()
        t1 = time.perf_counter()
        after_stream = None
        if step.stream_ordered:
            after_stream = torch.cuda.current_stream(self._ring.device).cuda_stream
        for target, writes in step.writes:
            self._queue.submit(target, writes, slot=step.slot, after_stream=after_stream)
        self.fill_seconds += t1 - t0
        self.write_seconds += time.perf_counter() - t1

    def _mismatch(
        self,
        held: list[tuple[str, torch.Tensor] | None],
        current: tuple[str, Any] | None,
        rest: Iterator[tuple[str, Any]],
        next_step: int,
        pending: tuple[Step, list[torch.cuda.Event]] | None,
    ) -> ReplayMismatch:
        if pending is not None:
            self._write(*pending)
        done_steps = self._script.steps[:next_step]
        done = frozenset(self._script.names[i] for i, entry in enumerate(held) if entry is None)
        counters = step_counters(done_steps)
        return ReplayMismatch(
            pending=[entry for entry in held if entry is not None],
            current=current,
            rest=rest,
            done=done,
            counters=counters,
        )


def _tensor(held: list[tuple[str, torch.Tensor] | None], index: int) -> torch.Tensor:
    entry = held[index]
    if entry is None:  # an internal invariant: releases come after a tensor's last step
        raise RuntimeError(f"stream tensor {index} was released before a step that reads it")
    return entry[1]


def step_counters(steps: Sequence[Step]) -> dict[str, Any]:
    """`PushStats` counter fields of `steps`."""
    per_target: dict[str, int] = {}
    num_writes = 0
    for step in steps:
        for target, writes in step.writes:
            num_writes += len(writes)
            per_target[target.session_id] = per_target.get(target.session_id, 0) + sum(
                w.num_bytes for w in writes
            )
    return {
        "bytes_staged": sum(step.num_bytes for step in steps),
        "bytes_written": sum(per_target.values()),
        "num_writes": num_writes,
        "num_regions": sum(step.num_regions for step in steps),
        "num_buckets": sum(step.new_bucket for step in steps),
        "num_chunks": len(steps),
        "num_copies": sum(len(step.ops) for step in steps),
        "bytes_per_target": per_target,
    }
