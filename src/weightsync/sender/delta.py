"""`DeltaPush`: one trainer rank's delta sync, from its export to its targets' delta regions.

A delta push reads the export's stream once. Each tensor the plan reads is cast to the
rollout's dtype and compared with its reference (`weightsync.sender.delta_reference`): the
changed elements are found once per tensor, whatever the number of targets and layouts.
Each layout then takes the changed elements that land in its parameters, by the plan's run
tables (`weightsync.plan.delta`), as ``(parameter, element)`` pairs; at the end of the
stream each layout's changes are laid out as one payload (`weightsync.delta_codec`),
straight into this rank's registered buffer, and written to every delta target of that
layout into this rank's slot of the target's delta region (the region split evenly over the
trainer's ranks, so that sources never overlap) while the next layout's payload is laid out.
Beside each payload the push reports, per parameter, how the rank's writes move the
parameter's checksum (`weightsync.delta_codec.checksum_change`), which the driver adds to
the target's proven base to get the checksum the target must reach.

A target may instead *pull* its payloads (SGLang as released, through its custom weight
loader, `weightsync.delta_wire`): nothing is written to it; the payloads stay in this rank's
registered staging buffer until the next push, and the push reports where they lie
(`DeltaWrite.pulled`) for the driver to name in the target's call.

A push with no delta target still records every tensor as the new reference, so that the
next push can take deltas against it.

On CUDA, where the fused kernels run (`weightsync.delta_kernels.ready`), tensors of at least
`BUCKET_MIN_TENSOR_BYTES` are encoded a bucket at a time (`start_encode_bucket`: up to
`BUCKET_BYTES` of them, one fused pass and one host wait for all, the next bucket's first
pass queued before that wait), not one by one; a tensor
the bucket does not take (a smaller one, a cast the kernel does not make, another device, a
reference in host memory) is encoded alone, after
the bucket before it, so that the changes reach the layouts in the stream's order either
way. A bucket's changes stay in its shared outputs: a tensor that every layout takes whole
(a tp-1 layout, an expert whole on its rank) is filed as its span of them, and each
parameter gathers its spans of one bucket in a few launches when its payload is laid out,
so that a MoE's thousands of expert tensors cost no device op each.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from weightsync import delta_kernels
from weightsync.delta_codec import PayloadLayout, Section, checksum_changes, lay_out
from weightsync.export.base import WeightExport
from weightsync.layout.dtypes import DTYPE_SIZES
from weightsync.plan.delta import DeltaMap, DeltaTarget, delta_maps
from weightsync.plan.items import SourcePlan
from weightsync.plan.types import TargetRank
from weightsync.plan.writes import WriteRun
from weightsync.sender.delta_reference import Changes, DeltaReference
from weightsync.sender.pins import PushPins, pinned
from weightsync.sender.writes import WriteQueue
from weightsync.torch_dtypes import torch_dtype

if TYPE_CHECKING:
    from weightsync.transport import Transport

_WRAP = 1 << 64

BUCKET_BYTES = 1 << 30
"""Bytes of stream tensors (as the export yields them) a delta push encodes in one fused
pass on CUDA. The host waits once per bucket, for its first pass's sizes, while the next
bucket's first pass runs: two buckets are in flight, each with a scratch of 3/32 of its
bf16 bytes (kept between pushes), and each bucket's tensors are held until its second pass
is queued (an export that computes its tensors, such as `Fp8Export`, keeps up to twice this
much more alive).
On an H200 (bf16, 2 %, the bitmap pass of `weightsync.delta_kernels`), 256 MiB buckets
took 24.4 ms for 8.6 GB, 1 GiB 22.0, 4 GiB 21.8: past 1 GiB the syncs cost little."""

PAYLOAD_BUFFER_FRACTION = 1 / 16
"""The host payload buffer a push that only records the reference (the first of a sync
that keeps one) sets aside, as a fraction of the reference's bytes (and a quarter more
room), so that the first delta push finds its memory allocated, registered and touched:
faulting in fresh pages took a fifth of the first delta push's write phase on the CPU bench.
A bf16 delta takes a 16-bit offset and a value per change: 1/16 holds one at about 3 % of
elements changed (lr 1e-6 changes 2-4 %); a larger delta grows the buffer. A payload laid
out in GPU memory (no page faults) takes its buffer at the first delta push."""

BUCKET_MIN_TENSOR_BYTES = 1 << 20
"""The smallest tensor (as the export yields it) that joins a fused bucket; smaller ones are
encoded alone (`DeltaReference.encode`), where a bucket's per-tensor bookkeeping outgrows
the pass. Measured end to end on an H100 (`bench/delta.py --device cuda`, AdamW at lr 1e-6,
steps 2 and 3): the Qwen3-30B-A3B shape at 4 layers, whose 1,536 expert tensors are 6 MB
each, encodes in 0.085-0.087 s with a 1 MiB floor against 0.19-0.23 s with 32 MiB (each
small tensor alone waits for the device once); dense-8b at 8 layers, 0.014-0.015 s against
0.015-0.019."""


def _fused(device: torch.device) -> bool:
    """Whether tensors on `device` are encoded by buckets (the fused kernels run there)."""
    return delta_kernels.ready(device)


def fuses_bucket(
    reference: DeltaReference,
    dtype_name: str,
    hf_name: str,
    tensor: torch.Tensor,
    *,
    fused: dict[int, bool] | None = None,
) -> bool:
    """Whether `encode_bucket` takes `tensor` (``hf_name`` for a rollout of ``dtype_name``):
    its reference of the same length on the tensor's device, where the fused kernels run,
    and a dtype the kernel reads or casts from.

    Args:
        reference: the references.
        dtype_name: the rollout's dtype.
        hf_name: the tensor's name.
        tensor: the tensor as the export yields it.
        fused: whether the kernels run, per device index, kept by a caller that asks for
            many tensors (a push asks for each).
    """
    ref = reference.bits(dtype_name, hf_name)
    dtype = torch_dtype(dtype_name)
    if ref is None or ref.numel() != tensor.numel() or ref.element_size() != dtype.itemsize:
        return False
    # Device indices, not devices: building a torch.device per tensor costs more.
    index = ref.get_device()
    if tensor.get_device() != index or tensor.is_cuda != ref.is_cuda:
        return False
    if fused is None:
        fused = {}
    runs = fused.get(index)
    if runs is None:
        runs = fused[index] = _fused(ref.device)
    return runs and delta_kernels.finds_changes(tensor.dtype, dtype)


@dataclass(frozen=True, slots=True)
class EncodedBucket:
    """What `encode_bucket` found: each tensor's changes, left in the bucket's shared
    outputs until asked for (a view of each costs host time a MoE's thousands of small
    tensors add up).

    Attributes:
        found: the outputs, and where each tensor's changes lie in them.
        numels: each tensor's elements.
    """

    found: delta_kernels.BucketChanges
    numels: tuple[int, ...]

    def changes(self, index: int) -> Changes:
        """The changes of tensor `index` of the bucket (views of the outputs)."""
        elements, new, old = self.found.found(index)
        return Changes(elements=elements, old=old, new=new, numel=self.numels[index])


@dataclass(frozen=True, slots=True)
class StartedBucket:
    """A bucket whose first pass is queued (`start_encode_bucket`)."""

    counted: delta_kernels.CountedBucket
    numels: tuple[int, ...]

    def finish(self) -> EncodedBucket:
        """Wait for the first pass's sizes, queue the second: the bucket's changes, each
        reference then holding its tensor's bytes (once the device has run it)."""
        return EncodedBucket(found=self.counted.finish(), numels=self.numels)


def encode_bucket(
    reference: DeltaReference,
    entries: Sequence[tuple[str, str, torch.Tensor]],
    *,
    admitted: bool = False,
) -> EncodedBucket:
    """`DeltaReference.encode` of each ``(dtype_name, hf_name, tensor)`` of `entries`, in
    one fused pass (`weightsync.delta_kernels.find_changes_bucket_spans`): the same changes,
    bit for bit (``changes(i)`` of the result), and each reference then holds its tensor's
    bytes.

    Args:
        reference: the references to compare with and update.
        entries: the bucket's tensors.
        admitted: every entry already passed `fuses_bucket` (a caller that asked for each
            as it chose the bucket): they are not asked again.

    Raises:
        ValueError: an entry `fuses_bucket` refuses, or one named twice (its reference
            would be read and written by two tiles at once).
    """
    return start_encode_bucket(reference, entries, admitted=admitted).finish()


def start_encode_bucket(
    reference: DeltaReference,
    entries: Sequence[tuple[str, str, torch.Tensor]],
    *,
    admitted: bool = False,
    slot: int = 0,
) -> StartedBucket:
    """`encode_bucket` in two steps (`weightsync.delta_kernels.start_bucket`): this queues
    the first pass without waiting; ``finish()`` of the result waits for its sizes alone
    and queues the second. Starting the next bucket before finishing this one keeps the
    device busy while the host waits; the two then take different scratch `slot`s.

    Raises:
        ValueError: as `encode_bucket`, or a slot that is not 0 or 1.
    """
    news, refs, dtypes = [], [], []
    if len({(dtype_name, hf_name) for dtype_name, hf_name, _ in entries}) != len(entries):
        raise ValueError("a fused bucket names a tensor twice; encode it in separate buckets")
    for dtype_name, hf_name, tensor in entries:
        if not admitted and not fuses_bucket(reference, dtype_name, hf_name, tensor):
            raise ValueError(
                f"{hf_name!r} ({tensor.dtype} on {tensor.device}, for {dtype_name}) cannot be "
                "encoded in a fused bucket; encode it alone (DeltaReference.encode)"
            )
        news.append(tensor.reshape(-1).contiguous())
        refs.append(reference.bits(dtype_name, hf_name))
        dtypes.append(torch_dtype(dtype_name))
    counted = delta_kernels.start_bucket(news, refs, dtypes, slot=slot)
    return StartedBucket(counted=counted, numels=tuple(ref.numel() for ref in refs))


def wrap_int64(value: int) -> int:
    """`value` modulo 2**64 as a signed int64 (checksums and their changes add that way)."""
    value %= _WRAP
    return value - _WRAP if value >= 1 << 63 else value


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaWrite:
    """What one trainer rank wrote into one target's delta region.

    Attributes:
        payloads: ``(offset, num_bytes)`` of each payload in the target's delta region, in
            the order the target applies them.
        pulled: for a target that reads its payloads, ``(session_id, addr, num_bytes)`` of
            each in a trainer rank's registered memory, in the order it applies them.
        num_elements: elements the payloads change.
        full_bytes: bytes a full push of this rank's share would write to the target.
        full_elements: elements of that full push.
        changes: ``{param_name: change}`` of each parameter's checksum the payloads make
            (`weightsync.delta_codec.checksum_change`, wrapped to int64).
    """

    payloads: tuple[tuple[int, int], ...] = ()
    pulled: tuple[tuple[str, int, int], ...] = ()
    num_elements: int = 0
    full_bytes: int = 0
    full_elements: int = 0
    changes: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: DeltaWrite) -> DeltaWrite:
        """Both writes into the same target (another part, or another trainer rank's):
        payloads in order, counts and checksum changes added."""
        changes = dict(self.changes)
        for name, change in other.changes.items():
            changes[name] = wrap_int64(changes.get(name, 0) + change)
        return DeltaWrite(
            payloads=self.payloads + other.payloads,
            pulled=self.pulled + other.pulled,
            num_elements=self.num_elements + other.num_elements,
            full_bytes=self.full_bytes + other.full_bytes,
            full_elements=self.full_elements + other.full_elements,
            changes=changes,
        )

    @property
    def num_bytes(self) -> int:
        """Bytes put on the wire for the target (written, or read by it)."""
        written = sum(num_bytes for _, num_bytes in self.payloads)
        return written + sum(num_bytes for _, _, num_bytes in self.pulled)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaStats:
    """What one rank's delta push did.

    Attributes:
        rank: the trainer rank.
        written: per delta target session id, what was written there.
        failed: per target session id whose writes failed, why (its other targets'
            writes landed).
        token: the reference now holds the push labelled `token` (every tensor encoded);
            None when it does not.
        num_elements: elements of the tensors read (the bf16 elements a full push moves,
            once per layout aside).
        num_changed: elements that changed since the reference.
        reference_bytes: bytes the reference keeps.
        encode_seconds: reading, comparing and mapping the tensors.
        write_seconds: laying out the payloads and writing them.
        seconds: the whole push.
    """

    rank: int
    written: Mapping[str, DeltaWrite] = field(default_factory=dict)
    failed: Mapping[str, str] = field(default_factory=dict)
    token: int | None = None
    num_elements: int = 0
    num_changed: int = 0
    reference_bytes: int = 0
    encode_seconds: float = 0.0
    write_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def density(self) -> float:
        """Changed elements over elements read (0 for a push that read nothing)."""
        return self.num_changed / self.num_elements if self.num_elements else 0.0


class _Runs:
    """Maps changed source elements of one tensor to a `DeltaTarget`'s destination
    elements, family by family, by arithmetic: run ``i`` of a family starts at
    ``src_start + i * src_step``, so an element's run and its offset in it are a division
    away (no search over the runs)."""

    def __init__(self, target: DeltaTarget) -> None:
        self.families = tuple(
            (f.src_start, f.src_step or 1, f.dst_start, f.dst_step, f.count, f.length)
            for f in target.families
        )
        # Each family's first and end source element: what a search for its elements looks
        # for (the host's search takes them as an array).
        self._spans = tuple(
            (src, src + (count - 1) * step + length)
            for src, step, _, _, count, length in self.families
        )
        self._host_spans = tuple(np.array(span, dtype=np.int64) for span in self._spans)
        # One run from the tensor's first element: where it lands, and its length.
        self._one: tuple[int, int] | None = None
        if len(self.families) == 1:
            src, _, dst, _, count, length = self.families[0]
            if count == 1 and src == 0:
                self._one = (dst, length)

    def whole(self, numel: int) -> bool:
        """Whether these runs are one run over a whole tensor of `numel` (no split, as at
        tp 1, or an expert whole on its rank): mapping is then a shift, with no search."""
        return self._one is not None and self._one[1] >= numel

    @property
    def shift(self) -> int:
        """What a `whole` map adds to an element: where the tensor's first one lands."""
        if self._one is None:
            raise ValueError("these runs split the tensor: map its elements with map()")
        return self._one[0]

    def bounds(self, numel: int) -> list[int]:
        """The source elements `map` searches for in a tensor of `numel`: each family's
        first and end (none where the runs are `whole`)."""
        if self.whole(numel):
            return []
        return [bound for span in self._spans for bound in span]

    def map(
        self, elements: torch.Tensor, numel: int, found: Iterator[int] | None = None
    ) -> tuple[torch.Tensor | slice, torch.Tensor]:
        """``(positions in elements, destination elements)`` of the `elements` (ascending,
        of a tensor of `numel`) these runs cover; the positions may be a slice. `found`
        gives, in order, where each of `bounds` falls in `elements` (a search made for
        several runs at once); without it each family is searched here."""
        if self.whole(numel):
            # A GPU's search would wait for the device.
            return slice(None), elements + self.shift
        if elements.device.type == "cpu":
            return self._map_host(elements)
        return self._map_device(elements, found)

    def _map_device(
        self, elements: torch.Tensor, found: Iterator[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`map` with torch ops on the elements' device."""
        positions, destinations = [], []
        for (src, step, dst, dst_step, count, length), span in zip(
            self.families, self._spans, strict=True
        ):
            if found is not None:
                first, last = next(found), next(found)
            else:
                bounds = torch.tensor(span, device=elements.device)
                first, last = torch.searchsorted(elements, bounds).tolist()
            offset = elements[first:last] - src
            if count == 1:
                positions.append(torch.arange(first, last, device=elements.device))
                destinations.append(offset + dst)
                continue
            run, within = offset // step, offset % step
            inside = (within < length).nonzero().reshape(-1)
            positions.append(inside + first)
            destinations.append(dst + run[inside] * dst_step + within[inside])
        return _joined(positions, destinations, elements.device)

    def _map_host(self, elements: torch.Tensor) -> tuple[torch.Tensor | slice, torch.Tensor]:
        """`map` with numpy (faster than torch's CPU ops for these small passes); a single
        run's positions are a slice (its elements are contiguous in `elements`)."""
        found = elements.numpy()
        positions: list[np.ndarray | slice] = []
        destinations = []
        for (src, step, dst, dst_step, count, length), span in zip(
            self.families, self._host_spans, strict=True
        ):
            first, last = found.searchsorted(span).tolist()
            offset = found[first:last] - src
            if count == 1:
                positions.append(slice(first, last))
                destinations.append(offset + dst)
                continue
            run, within = np.divmod(offset, step)
            inside = np.flatnonzero(within < length)
            positions.append(inside + first)
            destinations.append(dst + run[inside] * dst_step + within[inside])
        if len(positions) == 1:
            only = positions[0]
            return (only if isinstance(only, slice) else torch.from_numpy(only)), torch.from_numpy(
                destinations[0]
            )
        arrays = [
            np.arange(p.start, p.stop, dtype=np.int64) if isinstance(p, slice) else p
            for p in positions
        ]
        empty = [np.zeros(0, dtype=np.int64)]
        return torch.from_numpy(np.concatenate(arrays or empty)), torch.from_numpy(
            np.concatenate(destinations or empty)
        )


def _joined(
    positions: list[torch.Tensor], destinations: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    if not positions:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty
    return _joined_pieces(positions), _joined_pieces(destinations)


@dataclass(frozen=True, slots=True)
class _Span:
    """One tensor's changes in a fused bucket (`EncodedBucket`), not yet cut out of it."""

    bucket: EncodedBucket
    index: int

    @property
    def where(self) -> tuple[delta_kernels.Found, int, int]:
        """``(output, begin, end)``: its changes are places ``begin .. end`` of the
        bucket's ``output``."""
        at, begin, end = self.bucket.found.spans[self.index]
        return self.bucket.found.outputs[at], begin, end

    @property
    def count(self) -> int:
        """Elements that changed."""
        _, begin, end = self.bucket.found.spans[self.index]
        return end - begin

    @property
    def numel(self) -> int:
        """The tensor's elements."""
        return self.bucket.numels[self.index]

    def changes(self) -> Changes:
        """Its changes, as views of the bucket's outputs."""
        return self.bucket.changes(self.index)


@dataclass(frozen=True, slots=True)
class _SpanPiece:
    """Changes of one tensor a parameter takes whole, left in a fused bucket's outputs:
    places ``begin .. end`` of ``output``, whose elements land ``shift`` further on."""

    output: delta_kernels.Found
    begin: int
    end: int
    shift: int


@dataclass(slots=True)
class _Pieces:
    """Changed elements one layout's parameter collects over the stream, in order: each
    part ``(destination elements, new bits, old bits)``, or a `_SpanPiece`."""

    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | _SpanPiece] = field(
        default_factory=list
    )

    @property
    def device(self) -> torch.device:
        """Where the changes lie."""
        first = self.parts[0]
        return (first.output if isinstance(first, _SpanPiece) else first)[0].device

    def joined(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(destination elements, new bits, old bits)`` of every part, in order; the
        spans of one bucket's output in a row gathered at once (`_gathered`)."""
        triples = []
        for _, run in itertools.groupby(self.parts, key=_source):
            first, *rest = run
            if isinstance(first, _SpanPiece):
                triples.append(_gathered([first, *rest]))  # type: ignore[list-item]
            else:
                triples.append(first)
        if len(triples) == 1:
            return triples[0]
        elements, new, old = zip(*triples, strict=True)
        return torch.cat(elements), torch.cat(new), torch.cat(old)


def _source(part: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | _SpanPiece) -> int:
    """What a part of `_Pieces` is gathered with: the parts that share it in a row (the
    spans of one bucket's output; a tensors part is alone)."""
    return id(part.output) if isinstance(part, _SpanPiece) else id(part)


def _gathered(spans: Sequence[_SpanPiece]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The changes `spans` (of one output) hold, in order, as destination elements, new and
    old bits: a few launches whatever the number of spans (a fused experts parameter takes
    hundreds from a bucket), the spans' table built on the host and copied without a wait."""
    elements, new, old = spans[0].output
    if len(spans) == 1:
        span = spans[0]
        where = slice(span.begin, span.end)
        return elements[where] + span.shift, new[where], old[where]
    table = np.array([(s.begin, s.shift, s.end - s.begin) for s in spans], dtype=np.int64).T
    lengths = table[2]
    total = int(lengths.sum())
    # A gathered place's source is its place plus its span's begin less the span's start.
    table[0] -= np.cumsum(lengths) - lengths
    host = torch.from_numpy(np.ascontiguousarray(table))
    device = elements.device
    on_device = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    per_place = torch.repeat_interleave(on_device[:2], on_device[2], dim=1, output_size=total)
    places = torch.arange(total, device=device) + per_place[0]
    return elements[places] + per_place[1], new[places], old[places]


@dataclass(frozen=True, slots=True)
class _Move:
    """What one parameter's checksum change is computed from: its changed elements, their
    old and new bits, and the parameter's element count."""

    param_name: str
    elements: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor
    numel: int


@dataclass(frozen=True, slots=True)
class _Job:
    """One layout's payload: its delta targets, their share of the push (without the
    checksum changes), what those are computed from, and the payload's layout (None: no
    element of the layout changed)."""

    targets: list[TargetRank]
    share: DeltaWrite
    moves: list[_Move]
    layout: PayloadLayout | None


def _moved(moves: Sequence[_Move]) -> dict[str, int]:
    """``{param_name: checksum change}`` of `moves`, one per parameter (a fused experts
    parameter takes hundreds of pieces: one change over all of them, not one each), with one
    host sync for all where they lie on one device."""
    values = checksum_changes([(m.elements, m.old, m.new, m.numel) for m in moves])
    return dict(zip((m.param_name for m in moves), values, strict=True))


class DeltaPush:
    """Runs delta pushes for one `WeightSender` (see the module).

    Args:
        transport: writes the payloads.
        rank: this rank in the trainer group.
        world_size: ranks of the trainer group (the delta region's slots).
        timeout_s: how long a batch of writes may take.
        reference: the reference the pushes compare against and update.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        reference: DeltaReference,
    ) -> None:
        self._transport = transport
        self.rank = rank
        self.world_size = world_size
        self.reference = reference
        self._queue = WriteQueue(transport, timeout_s=timeout_s, max_outstanding_per_peer=64)
        self._maps: tuple[SourcePlan | None, tuple[DeltaMap, ...]] = (None, ())
        self._runs: dict[int, _Runs] = {}
        self._buffer: torch.Tensor | None = None

    def maps(self, plan: SourcePlan) -> tuple[DeltaMap, ...]:
        """The delta maps of `plan` (one per part), kept while the plan is the same object."""
        if self._maps[0] is not plan:
            self._maps = (plan, delta_maps(plan))
            self._runs = {}
        return self._maps[1]

    def can_encode(self, plan: SourcePlan) -> bool:
        """Whether the reference holds every tensor `plan` reads (a delta can be encoded)."""
        keys = {(m.dtype, name) for m in self.maps(plan) for name in m.tensors}
        return self.reference.holds(keys)

    def push(
        self,
        plan: SourcePlan,
        export: WeightExport,
        targets: Sequence[TargetRank],
        *,
        token: int,
        pulls: Collection[str] = (),
    ) -> DeltaStats:
        """Encode `export` against the reference, write each delta target's share (or keep
        it for the target to read), and make the export the new reference (labelled
        `token` once every tensor is read).

        Args:
            plan: this rank's whole source plan (the delta targets are among its targets).
            export: the rank's export, as the full push reads it.
            targets: the targets that take a delta (may be empty: the push then only
                records the reference).
            token: what the reference is labelled once complete.
            pulls: session ids of the `targets` that read their payloads (they need no
                delta region).

        Raises:
            ValueError: a delta is asked for but the reference lacks a tensor (nothing is
                written), or a target that does not read its payloads offers no delta
                region.
            TensorChangedError: a tensor changed while the push read it.
        """
        start = time.perf_counter()
        maps = self.maps(plan)
        sessions = {t.session_id for t in targets}
        for target in targets:
            if target.delta_region is None and target.session_id not in pulls:
                raise ValueError(
                    f"{target.label} offers no delta region; it can only take a full sync"
                )
        if targets and not self.can_encode(plan):
            raise ValueError(
                f"trainer rank {self.rank} has no complete delta reference for this plan: "
                "its last push did not record every tensor; every target needs a full sync"
            )
        self.reference.invalidate()
        wanted = {
            (index, layout_id)
            for index, delta_map in enumerate(maps)
            for layout_id, ranks in _part(plan, index).targets.items()
            if any(t.session_id in sessions for t in ranks)
        }
        by_name = {name: index for index, m in enumerate(maps) for name in m.tensors}
        infos = _layout_ranks(plan, wanted)
        pieces: dict[tuple[int, int, str], _Pieces] = {}
        pins = PushPins(self.rank)
        names: list[str] = []
        taken, versions = pins.stream(names)
        num_elements = num_changed = 0
        device = None
        fused: dict[int, bool] = {}
        # Every tensor's changes, in the stream's order: a tensor the fused bucket takes has
        # None until its bucket is encoded. The layouts take them in that order (`_file`),
        # so that a parameter written from several tensors gets ascending elements, while
        # a tensor encoded alone does not cut the bucket before it short.
        pending: list[tuple[int, DeltaMap, str, Changes | _Span | None]] = []
        bucket: list[tuple[int, DeltaMap, str, torch.Tensor]] = []
        bucket_bytes = 0
        # The bucket whose first pass is queued, and the scratch slot the next one takes.
        started: StartedBucket | None = None
        slot = 0
        for hf_name, tensor in export:
            index = by_name.get(hf_name)
            if index is None:
                continue
            names.append(hf_name)
            kept, version = pinned(tensor)
            taken.append(kept)
            versions.append(version)
            delta_map = maps[index]
            num_elements += tensor.numel()
            device = tensor.device
            if not wanted:
                self.reference.record(
                    delta_map.dtype, hf_name, tensor.to(torch_dtype(delta_map.dtype))
                )
                continue
            if tensor.numel() * tensor.element_size() >= BUCKET_MIN_TENSOR_BYTES and fuses_bucket(
                self.reference, delta_map.dtype, hf_name, tensor, fused=fused
            ):
                bucket.append((index, delta_map, hf_name, tensor))
                pending.append((index, delta_map, hf_name, None))
                bucket_bytes += tensor.numel() * tensor.element_size()
                if bucket_bytes >= BUCKET_BYTES:
                    # This bucket's first pass is queued before the host waits for the
                    # sizes of the one before it: the device is not left idle meanwhile.
                    queued = self._start_bucket(bucket, slot)
                    num_changed += self._finish_bucket(started, pending)
                    started, slot = queued, 1 - slot
                    bucket, bucket_bytes = [], 0
                    self._file(pending, infos, pieces)
                continue
            changes = self.reference.encode(delta_map.dtype, hf_name, tensor)
            num_changed += changes.elements.numel()
            pending.append((index, delta_map, hf_name, changes))
            if not bucket:
                self._file(pending, infos, pieces)
        queued = self._start_bucket(bucket, slot)
        num_changed += self._finish_bucket(started, pending)
        num_changed += self._finish_bucket(queued, pending)
        self._file(pending, infos, pieces)
        encoded = time.perf_counter()
        missing = by_name.keys() - set(names)
        if missing:
            raise ValueError(
                f"trainer rank {self.rank}: the export yielded no {sorted(missing)[:3]} "
                f"({len(missing)} tensors the plan reads); nothing of the delta was written"
            )
        pins.check(until="the delta push encoding it")
        self.reference.complete(token)
        written: dict[str, DeltaWrite] = {}
        failed: dict[str, str] = {}
        if targets:
            written, failed = self._write(plan, maps, targets, infos, pieces, frozenset(pulls))
        elif self._buffer is None and device is not None:
            on = self._payload_device_of(device)
            if on.type == "cpu":
                self._buffer_for(int(self.reference.num_bytes * PAYLOAD_BUFFER_FRACTION), on)
        end = time.perf_counter()
        return DeltaStats(
            rank=self.rank,
            written=written,
            failed=failed,
            token=token,
            num_elements=num_elements,
            num_changed=num_changed,
            reference_bytes=self.reference.num_bytes,
            encode_seconds=encoded - start,
            write_seconds=end - encoded,
            seconds=end - start,
        )

    def _start_bucket(
        self, bucket: Sequence[tuple[int, DeltaMap, str, torch.Tensor]], slot: int
    ) -> StartedBucket | None:
        """Queue the first pass over `bucket`'s tensors in scratch `slot` (None: empty)."""
        if not bucket:
            return None
        entries = [(delta_map.dtype, hf_name, tensor) for _, delta_map, hf_name, tensor in bucket]
        return start_encode_bucket(self.reference, entries, admitted=True, slot=slot)

    @staticmethod
    def _finish_bucket(
        started: StartedBucket | None,
        pending: list[tuple[int, DeltaMap, str, Changes | _Span | None]],
    ) -> int:
        """Finish `started` and put its tensors' changes in their places in `pending` (its
        tensors are the first entries still without changes, in order); the elements that
        changed."""
        if started is None:
            return 0
        encoded = started.finish()
        changed, next_one = 0, 0
        for at, (index, delta_map, hf_name, changes) in enumerate(pending):
            if next_one == len(encoded.numels):
                break
            if changes is None:
                span = _Span(encoded, next_one)
                next_one += 1
                changed += span.count
                pending[at] = (index, delta_map, hf_name, span)
        return changed

    def _file(
        self,
        pending: list[tuple[int, DeltaMap, str, Changes | _Span | None]],
        infos: Mapping[tuple[int, int], TargetRank],
        pieces: dict[tuple[int, int, str], _Pieces],
    ) -> None:
        """File the changes of `pending`'s tensors under the wanted layouts (`infos`), in
        order, up to the first still in a bucket; those filed leave `pending`."""
        filed = 0
        for index, delta_map, hf_name, changes in pending:
            if changes is None:
                break
            self._collect(index, delta_map, hf_name, changes, infos, pieces)
            filed += 1
        del pending[:filed]

    def _collect(
        self,
        index: int,
        delta_map: DeltaMap,
        hf_name: str,
        changes: Changes | _Span,
        infos: Mapping[tuple[int, int], TargetRank],
        pieces: dict[tuple[int, int, str], _Pieces],
    ) -> None:
        """File `changes` of one tensor under each wanted layout's parameters (`infos`: a
        rank of each, whose parameters the layout publishes). A bucket's tensor that every
        layout takes whole is filed as its span of the bucket's outputs (no op on it here).

        Raises:
            ValueError: a layout's ranks do not publish a parameter the plan writes.
        """
        if not (changes.count if isinstance(changes, _Span) else changes.elements.numel()):
            return
        numel = changes.numel
        chosen = []
        for target in delta_map.tensors[hf_name]:
            if (index, target.layout_id) not in infos:
                continue
            runs = self._runs.get(id(target))
            if runs is None:
                runs = self._runs[id(target)] = _Runs(target)
            chosen.append((target, runs))
        if isinstance(changes, _Span):
            if all(runs.whole(numel) for _, runs in chosen):
                output, begin, end = changes.where
                for target, runs in chosen:
                    self._piece(index, target, infos, pieces).parts.append(
                        _SpanPiece(output, begin, end, runs.shift)
                    )
                return
            changes = changes.changes()
        found = None
        if changes.elements.device.type != "cpu" and len(chosen) > 1:
            # One search, and one wait for the device, for every target's runs (a fused
            # experts tensor feeds hundreds of parameters).
            bounds = [b for _, runs in chosen for b in runs.bounds(changes.numel)]
            if bounds:
                where = torch.tensor(bounds, device=changes.elements.device)
                found = iter(torch.searchsorted(changes.elements, where).tolist())
        for target, runs in chosen:
            positions, elements = runs.map(changes.elements, changes.numel, found)
            if not elements.numel():
                continue
            self._piece(index, target, infos, pieces).parts.append(
                (elements, _taken(changes.new, positions), _taken(changes.old, positions))
            )

    @staticmethod
    def _piece(
        index: int,
        target: DeltaTarget,
        infos: Mapping[tuple[int, int], TargetRank],
        pieces: dict[tuple[int, int, str], _Pieces],
    ) -> _Pieces:
        """What `target`'s parameter collects, under its layout (`infos`).

        Raises:
            ValueError: the layout's ranks do not publish the parameter.
        """
        key = (index, target.layout_id, target.param_name)
        piece = pieces.get(key)
        if piece is None:
            rank = infos[(index, target.layout_id)]
            if target.param_name not in rank.weights_info:
                raise ValueError(f"{rank.label} publishes no parameter {target.param_name!r}")
            piece = pieces[key] = _Pieces()
        return piece

    def _write(
        self,
        plan: SourcePlan,
        maps: tuple[DeltaMap, ...],
        targets: Sequence[TargetRank],
        infos: Mapping[tuple[int, int], TargetRank],
        pieces: dict[tuple[int, int, str], _Pieces],
        pulls: frozenset[str],
    ) -> tuple[dict[str, DeltaWrite], dict[str, str]]:
        """Lay out each wanted layout's payload in registered memory and write it to its
        delta targets (those in `pulls` get where it lies instead).

        Every payload's size is known before any is written (`lay_out`), so they are laid
        out straight into the registered buffer, one after another, each written as soon as
        it is there: laying out the next one overlaps the writes of those before it, and
        so does computing each parameter's checksum change, which only the reply needs."""
        sessions = {t.session_id: t for t in targets}
        jobs: list[_Job] = []
        per_target = dict.fromkeys(sessions, DeltaWrite())
        device = self._payload_device(pieces)
        for index in range(len(maps)):
            part = _part(plan, index)
            full = _full_bytes(part)
            element_size = DTYPE_SIZES[part.dtype]
            for layout_id, ranks in part.targets.items():
                mine = [t for t in ranks if t.session_id in sessions]
                if not mine:
                    continue
                rank = infos[(index, layout_id)]
                sections, moves = self._sections(index, layout_id, rank, pieces)
                share = DeltaWrite(
                    num_elements=sum(s.values.numel() for s in sections),
                    full_bytes=full.get(layout_id, 0),
                    full_elements=full.get(layout_id, 0) // element_size,
                )
                jobs.append(_Job(mine, share, moves, lay_out(sections) if sections else None))
        buffer = self._buffer_for(sum(j.layout.num_bytes for j in jobs if j.layout), device)
        failed: dict[str, str] = {}
        used: dict[str, int] = dict.fromkeys(sessions, 0)
        self._queue.start()
        session_id = self._transport.session_id
        place = 0
        for job in jobs:
            if job.layout is None:
                continue
            size = job.layout.num_bytes
            job.layout.write(buffer[place : place + size])
            if device.type == "cuda":
                # The transport reads the buffer from its own stream: the payload lands first.
                torch.cuda.current_stream(device).synchronize()
            for target in job.targets:
                if target.session_id in pulls:
                    where = (session_id, buffer.data_ptr() + place, size)
                    per_target[target.session_id] += DeltaWrite(pulled=(where,))
                    continue
                addr, region_bytes = target.delta_region  # type: ignore[misc]
                slot_bytes = region_bytes // self.world_size // 8 * 8
                offset = self.rank * slot_bytes + used[target.session_id]
                if used[target.session_id] + size > slot_bytes:
                    failed[target.session_id] = (
                        f"{target.label}: the delta ({used[target.session_id] + size}"
                        f" bytes from trainer rank {self.rank}) does not fit its slot of the "
                        f"delta region ({slot_bytes} bytes of {region_bytes}, split over "
                        f"{self.world_size} trainer ranks); it needs a full sync, or a larger "
                        "region (weightsync serve --delta-region-mb)"
                    )
                    continue
                used[target.session_id] += size
                per_target[target.session_id] += DeltaWrite(payloads=((offset, size),))
                run = WriteRun(place, addr + offset, size, "(delta payload)")
                self._queue.submit(target, [run], ring_base=buffer.data_ptr(), slot=0)
            place += size
        for job in jobs:
            share = dataclasses.replace(job.share, changes=_moved(job.moves))
            for target in job.targets:
                per_target[target.session_id] += share
        self._queue.wait_all()
        for session, error in self._queue.failed.items():
            failed.setdefault(session, str(error))
        written = {s: write for s, write in per_target.items() if s not in failed}
        return written, failed

    def _sections(
        self,
        index: int,
        layout_id: int,
        target: TargetRank,
        pieces: dict[tuple[int, int, str], _Pieces],
    ) -> tuple[list[Section], list[_Move]]:
        """One layout's sections, and what each parameter's checksum change is computed
        from (`_moved`)."""
        order = {name: i for i, name in enumerate(sorted(target.weights_info))}
        sections, moves = [], []
        for (part, layout, param_name), piece in sorted(pieces.items()):
            if (part, layout) != (index, layout_id):
                continue
            elements, new, old = piece.joined()
            sections.append(Section(param_index=order[param_name], elements=elements, values=new))
            numel = target.weights_info[param_name][1]
            moves.append(_Move(param_name, elements, old, new, numel))
        return sections, moves

    def _payload_device(self, pieces: Mapping[tuple[int, int, str], _Pieces]) -> torch.device:
        """Where the payloads are laid out, in registered memory: the GPU the changes lie on,
        where the transport reads that GPU's memory (no copy through the host), else the
        host."""
        for piece in pieces.values():
            return self._payload_device_of(piece.device)
        return torch.device("cpu")

    def _payload_device_of(self, device: torch.device) -> torch.device:
        """Where the payloads of changes found on `device` are laid out: there where the
        transport reads that GPU's memory, else on the host."""
        if device.type == "cuda" and self._transport.capabilities.reads("cuda", device.index):
            return device
        return torch.device("cpu")

    def _buffer_for(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        """Registered memory on `device` the transport reads, of at least `num_bytes`: the
        last push's buffer where it is large enough, else a new one with a quarter more
        room (a later push's delta is rarely much larger, and registering costs)."""
        buffer = self._buffer
        if buffer is not None and buffer.numel() >= num_bytes and buffer.device == device:
            return buffer
        if buffer is not None:
            self._queue.drain()
            self._transport.unregister(buffer.data_ptr())
            self._buffer = None
        size = max(num_bytes + num_bytes // 4, 1 << 20)
        if device.type == "cuda":
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            # Zeroed: its pages are faulted in here, not while a payload is laid out.
            buffer = torch.zeros(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._transport.register(buffer.data_ptr(), buffer.numel())
        self._buffer = buffer
        return buffer

    def release(self) -> None:
        """Unregister and free the payload buffer (the reference stays)."""
        if self._buffer is not None:
            self._queue.drain()
            self._transport.unregister(self._buffer.data_ptr())
            self._buffer = None


def _taken(values: torch.Tensor, positions: torch.Tensor | slice) -> torch.Tensor:
    """``values[positions]``; on the host through numpy, whose take costs a third of
    torch's indexing for the few thousand positions a tensor's run maps (a MoE makes that
    call thousands of times a push)."""
    if isinstance(positions, slice):
        return values if positions == slice(None) else values[positions]
    if values.device.type == "cpu" and positions.device.type == "cpu":
        return torch.from_numpy(values.numpy().take(positions.numpy()))
    return values[positions]


def _joined_pieces(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """`pieces` as one tensor (one piece: no copy of it)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces))


def _part(plan: SourcePlan, index: int) -> SourcePlan:
    return plan.parts[index] if plan.parts else plan


def _layout_ranks(
    plan: SourcePlan, layouts: Collection[tuple[int, int]]
) -> dict[tuple[int, int], TargetRank]:
    """A rank of each ``(part, layout_id)`` of `layouts`, as the whole plan's targets have it:
    a part's targets publish only that part's parameters, and a payload numbers the
    parameters among all the rank publishes (a layout's ranks publish the same names and
    sizes)."""
    published = {t.session_id: t for ranks in plan.targets.values() for t in ranks}
    found = {}
    for index, layout_id in layouts:
        first = _part(plan, index).targets[layout_id][0]
        found[(index, layout_id)] = published.get(first.session_id, first)
    return found


def _full_bytes(plan: SourcePlan) -> dict[int, int]:
    """Bytes a full push of `plan` writes to one target of each layout."""
    out: dict[int, int] = {}
    for works in plan.work.values():
        for work in works:
            out[work.layout_id] = out.get(work.layout_id, 0) + work.num_bytes
    return out
