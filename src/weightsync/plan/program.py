"""Lowering a source plan into a push program: frozen data the sender executes as it is.

A `SourcePlan` says which bytes a trainer rank writes where; a `PushProgram` says how: the
staging ring, and per chunk of it which strided copies fill it from which stream tensors,
which runs stay zero, and which writes go to which target, in order. Lowering needs the
stream's geometry (`weightsync.plan.geometry`), so a program is valid for one plan and one
geometry, and the sender caches it per geometry: a push whose stream lies in memory the same
way runs the program again with no per-tensor planning left.

Lowering, step by step (each a module of this package):

1. keep the stream tensors the plan reads, in stream order, and check every box the plan
   reads against their shapes (`restrict`);
2. pack each layout's copy items into slot-sized buckets in stream order, pieces ordered by
   destination address inside a slot (`packing`);
3. cut each bucket into chunks where writes break anyway (`chunks`), so a chunk's writes go
   out while the next chunk fills;
4. per chunk, fuse the source boxes into few strided copies (`copies`) and coalesce the
   regions into writes per target (`writes`);
5. say after which stream tensor each chunk may be filled, and after which chunk a tensor is
   no longer read, so the sender holds each tensor only as long as it must.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from weightsync.layout.digest import sample_run
from weightsync.layout.dtypes import DTYPE_SIZES
from weightsync.plan.chunks import Chunk, split_bucket
from weightsync.plan.copies import CopyRecipe, fuse_copies
from weightsync.plan.direct import DirectCopy, DirectSpec, DirectStep, direct_copy, direct_samples
from weightsync.plan.geometry import StreamGeometry, StreamKey, TensorGeometry, restrict
from weightsync.plan.items import CopyItem, SourcePlan, StageWork
from weightsync.plan.packing import Bucket, BucketPacker
from weightsync.plan.types import TargetRank
from weightsync.plan.writes import PitchedRun, WriteRun, coalesce, direct_blocks, direct_writes


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingSpec:
    """The staging ring a program runs on: ``num_slots`` slots of ``slot_bytes`` on `device`.

    Attributes:
        device: ``"cpu"`` or a CUDA device (``"cuda:0"``).
        num_slots: slots of the ring; filling one overlaps the writes of the others.
        slot_bytes: bytes per slot, a multiple of 64.
        chunk_bytes: target bytes of one fill-then-write chunk, a multiple of 64.
        stream_ordered: the transport can make its writes wait on the GPU for the CUDA stream
            that fills a GPU slot (`weightsync.transport.base`), so no host wait is needed.
        direct: which tensors may be written from directly, unstaged (`weightsync.plan.direct`).

    Raises:
        ValueError: a size below 64 or not a multiple of 64, or ``num_slots < 1``.
    """

    device: str
    num_slots: int
    slot_bytes: int
    chunk_bytes: int
    stream_ordered: bool = False
    direct: DirectSpec = field(default_factory=DirectSpec)

    def __post_init__(self) -> None:
        for name in ("slot_bytes", "chunk_bytes"):
            value = getattr(self, name)
            if value < 64 or value % 64:
                raise ValueError(
                    f"StagingSpec.{name} must be a positive multiple of 64, got {value}"
                )
        if self.num_slots < 1:
            raise ValueError(f"StagingSpec.num_slots must be >= 1, got {self.num_slots}")

    @property
    def ring_bytes(self) -> int:
        """Bytes of the whole ring."""
        return self.num_slots * self.slot_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetWrites:
    """The writes of one chunk to one target.

    Attributes:
        target: the rollout rank written into.
        writes: the requests, in order (sources relative to the ring's start; a direct
            step's relative to its storage's first byte).
        num_regions: destination regions before coalescing.
        blocks: a direct step's copies as pitched copies, for a sender that copies into
            the target's mapped memory itself (`weightsync.plan.writes.direct_blocks`).
    """

    target: TargetRank
    writes: tuple[WriteRun, ...]
    num_regions: int
    blocks: tuple[PitchedRun, ...] = ()


class SampleSpan(NamedTuple):
    """The digest samples (`weightsync.layout.digest`) of one region of a chunk, in the ring.

    A named tuple, like `Region`: a program holds one per region.

    Attributes:
        ring_offset: byte of the first strided sample, from the ring's start.
        stride: bytes between two strided samples.
        count: strided samples.
        first_k: sample number of the first one.
        tail_offset: ring byte of the parameter's last byte when the region holds it (and it
            is not a strided sample), else -1.
        tail_k: its sample number.
        digest: the entry of `PushProgram.digests` the samples add to.
    """

    ring_offset: int
    stride: int
    count: int
    first_k: int
    tail_offset: int
    tail_k: int
    digest: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkStep:
    """One chunk of a program: fill it, then write it to every target of its layout.

    Attributes:
        slot: the ring slot the chunk lies in.
        new_bucket: the chunk starts a bucket: every earlier write that reads the slot must
            have finished before it is filled.
        after: how many of the program's stream tensors must have arrived before it fills.
        copies: the fill's copies (ring offsets from the ring's start).
        zeros: ``(ring byte offset, num_bytes)`` runs to zero.
        writes: per target of the chunk's layout.
        stream_ordered: the writes wait on the GPU for the filling stream, not on the host.
        event_devices: CUDA devices whose current streams run the copies, when the writes
            must wait on the host for them (empty: the copies are done when the fill returns).
        release: stream tensors (by program index) that no later step reads.
        num_bytes: bytes the chunk stages.
        samples: the digest samples of the chunk's regions, read once it is filled.
    """

    slot: int
    new_bucket: bool
    after: int
    copies: tuple[CopyRecipe, ...]
    zeros: tuple[tuple[int, int], ...]
    writes: tuple[TargetWrites, ...]
    stream_ordered: bool
    event_devices: tuple[str, ...]
    release: tuple[int, ...]
    num_bytes: int
    samples: tuple[SampleSpan, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PushCounters:
    """What a program stages and writes, counted once at lowering.

    Attributes:
        bytes_staged: bytes copied into the ring (each layout's bytes once).
        bytes_written: bytes written over all targets (staged and direct).
        num_writes: write requests over all targets, after coalescing (a pitched copy into
            mapped memory counts once).
        num_regions: destination regions over all targets, before coalescing.
        num_buckets: slots filled (one per bucket and layout).
        num_chunks: fill-then-write steps.
        num_copies: copies into the ring after fusing.
        bytes_per_target: bytes written to each target, by session id.
        bytes_direct: bytes written from the stream's tensors unstaged (each layout's once).
        num_direct: direct copies (items written unstaged, each layout's once).
        writes_per_target: write requests to each target, by session id (a pitched copy
            into mapped memory counts once, however many rows it has).
    """

    bytes_staged: int
    bytes_written: int
    num_writes: int
    num_regions: int
    num_buckets: int
    num_chunks: int
    num_copies: int
    bytes_per_target: Mapping[str, int] = field(default_factory=dict)
    bytes_direct: int = 0
    num_direct: int = 0
    writes_per_target: Mapping[str, int] = field(default_factory=dict)

    @property
    def copies_per_byte(self) -> float:
        """Copies each written byte took: 1 for a byte written straight from the trainer's
        tensor, 1 + 1 / (targets of its layout) for a staged one (the ring is filled once
        and written to every target); 0 for a program that writes nothing."""
        if not self.bytes_written:
            return 0.0
        return (self.bytes_written + self.bytes_staged) / self.bytes_written


@dataclass(frozen=True, slots=True, kw_only=True)
class PushProgram:
    """One source's push, lowered: run `steps` in order as the stream's tensors arrive.

    Attributes:
        plan: the source plan it was lowered from (compared by identity).
        geometry: the stream geometry it was lowered for.
        staging: the ring it runs on.
        dtype: the dtype the ring holds (the plan's rollout dtype).
        keys: the stream tensors the plan reads, in stream order; the program's indices
            (`CopyRecipe.source`, `ChunkStep.release`) index this.
        tensors: their geometry, each ``storage`` renumbered to index `keys`.
        steps: the chunks, in the order they are filled.
        direct: the direct copies, one step per run of consecutive tensors of one storage,
            in stream order; a step runs when its last tensor arrived, before the chunks
            that may fill then.
        counters: what the program stages and writes.
        digests: the ``(layout_id, param_name)`` of each digest the steps' samples sum
            into: the digest of what this source writes of that parameter to every target
            of that layout.
    """

    plan: SourcePlan = field(compare=False)
    geometry: StreamGeometry = field(compare=False)
    staging: StagingSpec
    dtype: str
    keys: tuple[StreamKey, ...]
    tensors: tuple[TensorGeometry, ...]
    steps: tuple[ChunkStep, ...]
    counters: PushCounters
    digests: tuple[tuple[int, str], ...] = ()
    direct: tuple[DirectStep, ...] = ()

    @property
    def all_direct(self) -> bool:
        """Whether every byte of the program is written directly (nothing is staged)."""
        return not self.steps and bool(self.direct)

    def matches(self, plan: SourcePlan, geometry: StreamGeometry, staging: StagingSpec) -> bool:
        """Whether this program is the one for `plan` (the same object), `geometry` and
        `staging`."""
        return self.plan is plan and self.staging == staging and self.geometry == geometry


def lower_push(plan: SourcePlan, geometry: StreamGeometry, staging: StagingSpec) -> PushProgram:
    """Lower `plan` for a stream of `geometry` onto a ring of `staging` (see the module).

    Args:
        plan: the source's share of a sync plan.
        geometry: how the source's stream lies in memory.
        staging: the ring and how its writes may be ordered.

    Returns:
        The program; pure data, no memory is touched.

    Raises:
        ValueError: the plan's dtype is not one weightsync moves; the stream lacks a tensor
            the plan needs; a tensor's shape differs from the one the plan was built for, or
            does not hold a box the plan reads of it; a tensor lies on a device that is
            neither the host nor a CUDA device.
    """
    element_size = DTYPE_SIZES.get(plan.dtype)
    if element_size is None:
        raise ValueError(f"the plan's dtype {plan.dtype!r} is not one weightsync moves")
    present = set(geometry.keys)
    missing = [key for key in plan.work if key not in present]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(
            f"trainer rank {plan.rank}: the tensor stream lacks {shown}{more}, which the plan "
            "needs from this rank; check that the export yields what its holding declared"
        )
    keys = tuple(key for key in geometry.keys if key in plan.work)
    tensors = restrict(geometry, keys)
    for key, tensor in zip(keys, tensors, strict=True):
        _check_tensor(plan, key, tensor)
    return _Lowering(plan, geometry, staging, keys, tensors, element_size).run()


def _check_tensor(plan: SourcePlan, key: StreamKey, tensor: TensorGeometry) -> None:
    where = f"trainer rank {plan.rank}: tensor {key!r}"
    if not (tensor.device == "cpu" or tensor.device.startswith("cuda")):
        raise ValueError(f"{where} is on {tensor.device}; the sender reads host or CUDA memory")
    shape = tensor.shape
    declared = plan.shapes.get(key)
    if declared is not None and tuple(declared) != shape:
        raise ValueError(f"{where} has shape {shape}, but the plan was built for shape {declared}")
    for work in plan.work[key]:
        for item in work.items:
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


class _Lowering:
    """The state of one `lower_push`: packers per layout, the steps so far."""

    def __init__(
        self,
        plan: SourcePlan,
        geometry: StreamGeometry,
        staging: StagingSpec,
        keys: tuple[StreamKey, ...],
        tensors: tuple[TensorGeometry, ...],
        element_size: int,
    ) -> None:
        self.plan, self.geometry, self.staging = plan, geometry, staging
        self.keys, self.tensors, self.element_size = keys, tensors, element_size
        slot_bytes = staging.slot_bytes - staging.slot_bytes % element_size
        self.packers = {
            layout_id: BucketPacker(
                layout_id=layout_id,
                slot_bytes=slot_bytes,
                element_size=element_size,
                dst_address=_address_on(targets[0].weights_info) if targets else _no_address,
            )
            for layout_id, targets in plan.targets.items()
        }
        self.steps: list[ChunkStep] = []
        self.direct: list[DirectStep] = []
        self.digests: dict[tuple[int, str], int] = {}
        self.param_bytes = {
            layout_id: {name: numel * size for name, (_, numel, size) in t[0].weights_info.items()}
            for layout_id, t in plan.targets.items()
            if t
        }
        self.num_buckets = 0
        self.bytes_staged = 0
        # Where each layout's items end, as (parameter, byte): an item that starts at one
        # continues another's destination, so staged it shares that item's write.
        self.ends: dict[int, set[tuple[str, int]]] = {}
        for works in plan.work.values():
            for work in works:
                ends = self.ends.setdefault(work.layout_id, set())
                ends.update((i.param_name, i.dst_offset_bytes + i.num_bytes) for i in work.items)

    def run(self) -> PushProgram:
        works: Mapping[StreamKey, tuple[StageWork, ...]] = self.plan.work
        group: list[DirectCopy] = []  # direct copies of consecutive tensors of one storage
        group_bytes = 0
        for index, key in enumerate(self.keys):
            storage = self.tensors[index].storage
            if group and (
                self.tensors[group[-1].source].storage != storage
                or group_bytes >= self.staging.chunk_bytes
            ):
                self._direct_step(group, after=index)
                group, group_bytes = [], 0
            for work in works[key]:
                before = len(group)
                staged = self._take_direct(index, work, group)
                group_bytes += sum(c.num_bytes for c in group[before:])
                for bucket in self.packers[work.layout_id].add(index, staged):
                    self._bucket(bucket, after=index + 1)
        if group:
            self._direct_step(group, after=len(self.keys))
        for layout_id in sorted(self.packers):
            bucket = self.packers[layout_id].flush()
            if bucket is not None:
                self._bucket(bucket, after=len(self.keys))
        return self._program()

    def _direct_step(self, copies: list[DirectCopy], *, after: int) -> None:
        """The direct copies of consecutive tensors of one storage, as one step that runs
        once the last of them arrived (so runs adjacent across tensors, an expert's gate and
        up halves of one fused parameter, go out as one write)."""
        self.direct.append(
            DirectStep(
                source=copies[-1].source,
                storage=self.tensors[copies[-1].source].storage,
                after=after,
                copies=tuple(copies),
                samples=direct_samples(copies, self.param_bytes, self.digests),
                num_bytes=sum(c.num_bytes for c in copies),
                writes=self._direct_writes(copies),
            )
        )

    def _take_direct(
        self, index: int, work: StageWork, direct: list[DirectCopy]
    ) -> tuple[CopyItem, ...]:
        """Add the items of `work` that go direct to `direct`; return the ones to stage."""
        spec = self.staging.direct
        if not spec.devices:
            return work.items
        tensor = self.tensors[index]
        ends = self.ends[work.layout_id]
        staged = []
        for item in work.items:
            copy = direct_copy(
                item,
                index,
                work.layout_id,
                tensor,
                dtype=self.plan.dtype,
                element_size=self.element_size,
                spec=spec,
                continues=(item.param_name, item.dst_offset_bytes) in ends,
            )
            if copy is None:
                staged.append(item)
            else:
                direct.append(copy)
        return tuple(staged)

    def _direct_writes(self, copies: Sequence[DirectCopy]) -> tuple[TargetWrites, ...]:
        """The direct copies of one tensor as writes per target (sources are offsets from
        the tensor's storage), adjacent runs of one parameter merged."""
        out = []
        for layout_id in sorted({c.layout_id for c in copies}):
            mine = [c for c in copies if c.layout_id == layout_id]
            for target in self.plan.targets[layout_id]:
                out.append(
                    TargetWrites(
                        target=target,
                        writes=tuple(direct_writes(mine, target.weights_info)),
                        num_regions=len(mine),
                        blocks=tuple(direct_blocks(mine, target.weights_info)),
                    )
                )
        return tuple(out)

    def _bucket(self, bucket: Bucket, *, after: int) -> None:
        staging, size = self.staging, self.element_size
        slot = self.num_buckets % staging.num_slots
        self.num_buckets += 1
        self.bytes_staged += bucket.num_bytes
        slot_start = slot * staging.slot_bytes
        chunks = split_bucket(bucket, chunk_bytes=staging.chunk_bytes, element_size=size)
        targets = self.plan.targets[bucket.layout_id]
        for number, chunk in enumerate(chunks):
            copies = fuse_copies(
                chunk.sources, self.tensors, slot_base=slot_start // size, element_size=size
            )
            devices = {self.tensors[s.source].device for s in chunk.sources}
            stream_ordered = (
                staging.stream_ordered
                and staging.device != "cpu"
                and devices <= {"cpu", staging.device}
            )
            event_devices: tuple[str, ...] = ()
            if not stream_ordered:
                cuda = {d for d in devices if d != "cpu"}
                if staging.device != "cpu":
                    cuda.add(staging.device)
                event_devices = tuple(sorted(cuda))
            writes = tuple(
                TargetWrites(
                    target=target,
                    writes=tuple(
                        coalesce(
                            chunk.regions, slot_offset=slot_start, weights_info=target.weights_info
                        )
                    ),
                    num_regions=len(chunk.regions),
                )
                for target in targets
            )
            self.steps.append(
                ChunkStep(
                    slot=slot,
                    new_bucket=number == 0,
                    after=after,
                    copies=tuple(copies),
                    zeros=tuple((slot_start + o, n) for o, n in chunk.zeros),
                    writes=writes,
                    stream_ordered=stream_ordered,
                    event_devices=event_devices,
                    release=(),
                    num_bytes=chunk.num_bytes,
                    samples=self._samples(bucket.layout_id, chunk, slot_start),
                )
            )

    def _samples(self, layout_id: int, chunk: Chunk, slot_start: int) -> tuple[SampleSpan, ...]:
        """Where the digest samples of `chunk`'s regions lie in the ring."""
        sizes = self.param_bytes.get(layout_id)
        if sizes is None:
            return ()
        spans = []
        for region in chunk.regions:
            num_bytes = sizes.get(region.param_name)
            if num_bytes is None:
                continue
            run = sample_run(num_bytes, region.dst_offset_bytes, region.num_bytes)
            if not run.count and run.tail_offset < 0:
                continue
            key = (layout_id, region.param_name)
            digest = self.digests.setdefault(key, len(self.digests))
            start = slot_start + region.slot_offset
            spans.append(
                SampleSpan(
                    ring_offset=start + run.first_offset,
                    stride=run.stride,
                    count=run.count,
                    first_k=run.first_k,
                    tail_offset=start + run.tail_offset if run.tail_offset >= 0 else -1,
                    tail_k=run.tail_k,
                    digest=digest,
                )
            )
        return tuple(spans)

    def _program(self) -> PushProgram:
        last_use: dict[int, int] = {}
        for position, step in enumerate(self.steps):
            for copy in step.copies:
                last_use[copy.source] = position
        releases: dict[int, list[int]] = {}
        for source, position in last_use.items():
            releases.setdefault(position, []).append(source)
        steps = tuple(
            dataclasses.replace(step, release=tuple(sorted(releases[position])))
            if position in releases
            else step
            for position, step in enumerate(self.steps)
        )
        return PushProgram(
            plan=self.plan,
            geometry=self.geometry,
            staging=self.staging,
            dtype=self.plan.dtype,
            keys=self.keys,
            tensors=self.tensors,
            steps=steps,
            counters=count(steps, self.direct, pitched=self.staging.direct.pitched),
            digests=tuple(self.digests),
            direct=tuple(self.direct),
        )


def count(
    steps: Sequence[ChunkStep], direct: Sequence[DirectStep] = (), *, pitched: bool = False
) -> PushCounters:
    """What `steps` stage and write, and what `direct` writes (as pitched copies where the
    sender copies into mapped memory, `pitched`, else as its runs)."""
    per_target: Counter[str] = Counter()
    writes: Counter[str] = Counter()
    num_regions = 0
    bytes_direct = num_direct = 0
    for direct_step in direct:
        bytes_direct += direct_step.num_bytes
        num_direct += len(direct_step.copies)
    for step in [*steps, *direct]:
        for target_writes in step.writes:
            session = target_writes.target.session_id
            requests = target_writes.writes
            if pitched and isinstance(step, DirectStep):
                writes[session] += len(target_writes.blocks)
            else:
                writes[session] += len(requests)
            num_regions += target_writes.num_regions
            per_target[session] += sum(w.num_bytes for w in requests)
    return PushCounters(
        bytes_staged=sum(step.num_bytes for step in steps),
        bytes_written=sum(per_target.values()),
        num_writes=sum(writes.values()),
        num_regions=num_regions,
        num_buckets=sum(step.new_bucket for step in steps),
        num_chunks=len(steps),
        num_copies=sum(len(step.copies) for step in steps),
        bytes_per_target=dict(per_target),
        bytes_direct=bytes_direct,
        num_direct=num_direct,
        writes_per_target=dict(writes),
    )


def _address_on(weights_info: Mapping[str, tuple[int, int, int]]):
    def address(param_name: str, offset: int) -> int:
        entry = weights_info.get(param_name)
        return (entry[0] if entry is not None else 0) + offset

    return address


def _no_address(param_name: str, offset: int) -> int:
    return offset
