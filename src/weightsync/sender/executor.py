"""Running a `PushProgram`: the sender's one execution path.

The program says what to do; this module does it as the stream's tensors arrive. Each
arriving tensor is checked against the geometry the program was lowered for (a tensor that
lies in memory another way would be read wrong by the precomputed copies), held until the
last step that reads it, and every step whose tensors have all arrived is filled and
written:

- a step that starts a bucket first waits for the writes still reading its slot;
- its copies and zero runs fill its part of the ring (`SlotFiller`);
- with a stream-ordered transport and a GPU ring its writes are queued at once behind the
  copies on the GPU; otherwise, when the copies run on CUDA streams, the writes wait on the
  host for events recorded after them, and are submitted after the next step's copies were
  enqueued, so the GPU fills one chunk while the transport reads the previous one;
- host copies are done when the fill returns, so their writes go out at once;
- a direct step (`weightsync.plan.direct`) runs once its last tensor arrived: its writes go
  out from the trainer's own memory (`weightsync.sender.direct`), no slot involved.

Each tensor is pinned as it arrives (`weightsync.sender.pins`): its version counter is read
before anything reads its bytes, for the caller to check once the writes landed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

from weightsync.export.geometry import tensor_geometry
from weightsync.plan.direct import DirectStep
from weightsync.plan.geometry import TensorGeometry
from weightsync.plan.program import ChunkStep, PushProgram
from weightsync.sender.digest import DigestSums
from weightsync.sender.direct import MappedDirect, TransportDirect
from weightsync.sender.fill import SlotFiller, record_events
from weightsync.sender.pins import PushPins, pinned
from weightsync.sender.staging import StagingRing
from weightsync.sender.writes import WriteQueue
from weightsync.torch_dtypes import storage_bytes, torch_dtype


@dataclass(slots=True)
class ExecutionTimes:
    """Where one execution's time went.

    Attributes:
        fill_s: filling the ring (and waiting on the host for GPU copies to finish).
        write_s: submitting writes and waiting for them (what the fills did not hide).
        digest_s: copying the digest samples out of the ring (part of `fill_s`).
    """

    fill_s: float = 0.0
    write_s: float = 0.0
    digest_s: float = 0.0


class ProgramRun:
    """One execution of a program over one stream (see the module docstring).

    Args:
        program: what to run.
        ring: the allocated staging ring the program's offsets refer to (None for a program
            that stages nothing).
        filler: runs the copies.
        queue: submits and waits for the writes.
        digests: sums the digest samples of each chunk once it is filled (None: no digest).
        direct: runs the program's direct steps (`weightsync.sender.direct`); needed when
            the program has any.
        table: the program's `arrival_table`, when the caller keeps it between pushes
            (computed here otherwise).
        pins: where each tensor the program reads is pinned as it arrives (None: nowhere);
            the caller checks it after `execute`.
    """

    def __init__(
        self,
        program: PushProgram,
        *,
        ring: StagingRing | None,
        filler: SlotFiller,
        queue: WriteQueue,
        digests: DigestSums | None = None,
        direct: TransportDirect | MappedDirect | None = None,
        table: ArrivalTable | None = None,
        pins: PushPins | None = None,
    ) -> None:
        if program.direct and direct is None:
            raise ValueError("the program writes directly from its tensors: pass direct=")
        self._program = program
        self._table = table if table is not None else arrival_table(program)
        self._direct = direct
        self._digests = digests
        self._ring = ring
        self._filler = filler
        self._queue = queue
        self._pins = pins
        if ring is None and program.steps:
            raise ValueError("the program stages its tensors: pass the staging ring")
        self._ring_base = ring.base_addr if ring is not None else 0
        self._typed = ring.as_dtype(getattr(torch, program.dtype)) if ring is not None else None
        self._bytes = ring.as_bytes() if ring is not None else None
        self._stream: int | None = None
        if ring is not None and any(step.stream_ordered for step in program.steps):
            self._stream = torch.cuda.current_stream(ring.device).cuda_stream
        self.times = ExecutionTimes()

    def execute(self, tensors: Iterable[tuple[str, Any]]) -> None:
        """Consume the stream and run every step; return once every write landed or failed
        (a failed target is recorded in the queue's `WriteQueue.failed`, not raised). Each
        tensor the program reads is pinned in `pins` (kept, its version counter read) as it
        arrives.

        Raises:
            ValueError: the stream differs from the geometry the program was lowered for (a
                tensor arrives out of order, twice, laid out otherwise, or not at all); raised
                before anything of that tensor is staged.
        """
        program = self._program
        index, expected, direct, direct_sources = self._table
        steps = program.steps
        arrived_direct: dict[int, Any] = {}
        held: list[Any] = [None] * len(expected)
        storages: dict[int, int] = {}
        arrived = 0
        next_step = 0
        pending: tuple[ChunkStep, list[torch.cuda.Event]] | None = None
        # Tensors arrive in program order, so the i-th taken is ``program.keys[i]``.
        pins = self._pins if self._pins is not None else PushPins(program.plan.rank)
        taken, versions = pins.stream(program.keys)
        for key, tensor in tensors:
            position = index.get(key)
            if position is None:
                continue
            try:
                offset = tensor.storage_offset()
                # The storage is known by its base address: cheaper than untyped_storage(),
                # and the same partition of the stream's tensors.
                storage = storages.setdefault(
                    tensor.data_ptr() - offset * tensor.element_size(), position
                )
                arrival = (
                    tensor.shape,
                    tensor.stride(),
                    offset,
                    tensor.dtype,
                    tensor.get_device(),
                    storage,
                )
            except (AttributeError, RuntimeError, TypeError):
                arrival = None
            if position != arrived or arrival != expected[position]:
                if pending is not None:
                    self._write(*pending)
                raise self._mismatch(key, tensor, position, arrived)
            held[position] = tensor
            kept, version = pinned(tensor)
            taken.append(kept)
            versions.append(version)
            arrived += 1
            if position in direct_sources:
                arrived_direct[position] = tensor
            direct_step = direct.get(arrived)
            if direct_step is not None:
                self._run_direct(direct_step, arrived_direct)
                arrived_direct = {}
            while next_step < len(steps) and steps[next_step].after == arrived:
                pending = self._step(steps[next_step], held, pending)
                next_step += 1
        if arrived != len(expected):
            if pending is not None:
                self._write(*pending)
            missing = program.keys[arrived]
            raise ValueError(
                f"trainer rank {program.plan.rank}: the tensor stream ended without "
                f"{missing!r} ({len(expected) - arrived} of the {len(expected)} tensors the "
                "plan needs from this rank are missing); the export must yield what its "
                "geometry() declared"
            )
        while next_step < len(steps):
            pending = self._step(steps[next_step], held, pending)
            next_step += 1
        if pending is not None:
            self._write(*pending)
        self._flush_digests()
        t0 = time.perf_counter()
        self._queue.wait_all()
        self.times.write_s += time.perf_counter() - t0

    def _step(
        self,
        step: ChunkStep,
        held: list[Any],
        pending: tuple[ChunkStep, list[torch.cuda.Event]] | None,
    ) -> tuple[ChunkStep, list[torch.cuda.Event]] | None:
        """Fill one chunk and write it (or the previous one, when writes wait on the host)."""
        if step.new_bucket:
            if pending is not None:
                self._write(*pending)
                pending = None
            self._flush_digests()  # before a slot is refilled
            t0 = time.perf_counter()
            self._queue.wait_slot(step.slot)
            self.times.write_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        self._filler.run(
            step.copies, held, step.zeros, staging_bytes=self._bytes, staging_typed=self._typed
        )
        for source in step.release:
            held[source] = None
        events = record_events(step.event_devices)
        self.times.fill_s += time.perf_counter() - t0
        if step.stream_ordered:
            self._write(step, [])
            return pending
        if pending is not None:
            self._write(*pending)
        if events:
            return (step, events)
        self._write(step, [])
        return None

    def _run_direct(self, step: DirectStep, tensors: dict[int, Any]) -> None:
        """Write one step's direct copies from `tensors` (by program index; the writer keeps
        them until the end)."""
        t0 = time.perf_counter()
        storage = storage_bytes(tensors[step.source])
        cast("TransportDirect | MappedDirect", self._direct).run(step, tensors, storage)
        if self._digests is not None:
            self._digests.add_direct(step, storage)
        self.times.write_s += time.perf_counter() - t0

    def _write(self, step: ChunkStep, events: list[torch.cuda.Event]) -> None:
        t0 = time.perf_counter()
        for event in events:
            event.synchronize()
        t1 = time.perf_counter()
        if self._digests is not None:
            # The chunk is filled (its events waited for, or its copies ahead on the stream
            # the samples are gathered on) and stays so until its slot is refilled.
            self._digests.add_step(step)
        after_stream = self._stream if step.stream_ordered else None
        base = self._ring_base
        for target_writes in step.writes:
            self._queue.submit(
                target_writes.target,
                target_writes.writes,
                ring_base=base,
                slot=step.slot,
                after_stream=after_stream,
            )
        self.times.fill_s += t1 - t0
        self.times.write_s += time.perf_counter() - t1

    def _flush_digests(self) -> None:
        if self._digests is not None and self._bytes is not None:
            t0 = time.perf_counter()
            self._digests.flush(self._bytes)
            self.times.digest_s += time.perf_counter() - t0

    def _mismatch(self, key: str, tensor: Any, position: int, arrived: int) -> ValueError:
        program = self._program
        where = f"trainer rank {program.plan.rank}: tensor {key!r}"
        if position < arrived:
            return ValueError(f"{where}: the tensor stream yielded it twice")
        if position > arrived:
            return ValueError(
                f"{where} arrived before {program.keys[arrived]!r}: the tensor stream's order "
                "differs from the geometry() the push was planned for"
            )
        if not isinstance(tensor, torch.Tensor):
            return ValueError(f"{where} is a {type(tensor).__name__}, not a torch.Tensor")
        try:
            actual: TensorGeometry | str = tensor_geometry(tensor, {}, position)
        except ValueError as exc:
            actual = str(exc)
        return ValueError(
            f"{where} lies in memory as {actual}, but the push was planned for "
            f"{program.tensors[position]}; the export's stream must match its geometry()"
        )


class ArrivalTable(NamedTuple):
    """What `ProgramRun.execute` looks each arriving tensor up in: fixed per program.

    Attributes:
        index: ``{stream key: program index}``.
        expected: each tensor's geometry as the tensor answers it (`_arrival_keys`).
        direct: the direct steps by how many tensors must have arrived before each runs.
        direct_sources: the program indices of the tensors direct steps read.
    """

    index: dict[str, int]
    expected: list[tuple]
    direct: dict[int, DirectStep]
    direct_sources: frozenset[int]


def arrival_table(program: PushProgram) -> ArrivalTable:
    """`program`'s `ArrivalTable` (a pass over its tensors: a caller that pushes the same
    program again keeps it)."""
    return ArrivalTable(
        index={key: i for i, key in enumerate(program.keys)},
        expected=_arrival_keys(program.tensors),
        direct={step.after: step for step in program.direct},
        direct_sources=frozenset(c.source for step in program.direct for c in step.copies),
    )


def _arrival_keys(tensors: Sequence[TensorGeometry]) -> list[tuple]:
    """What `ProgramRun.execute` compares each arriving tensor with: its geometry in the
    torch values a tensor answers with (dtype object, device index, -1 for the host)."""
    dtypes: dict[str, torch.dtype] = {}
    keys = []
    for tensor in tensors:
        dtype = dtypes.get(tensor.dtype)
        if dtype is None:
            dtype = dtypes[tensor.dtype] = torch_dtype(tensor.dtype)
        device = -1 if tensor.device == "cpu" else torch.device(tensor.device).index or 0
        keys.append(
            (tensor.shape, tensor.stride, tensor.storage_offset, dtype, device, tensor.storage)
        )
    return keys
