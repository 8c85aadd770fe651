"""Fused GPU kernels of a delta sync (Triton), each one pass over memory.

- `find_changes`: the elements of a tensor (cast to the rollout's dtype inside the kernel)
  whose bits differ from the reference, their old and new bits, ascending, and the
  reference updated where they differ. Each block of `CHANGE_BLOCK` elements reads the new
  bytes and the reference once and writes its changed elements, in order, to its own run of
  a scratch buffer (a prefix sum over the block's compare mask places them); a second, small
  kernel gathers the runs, placed by a prefix sum over the blocks' counts. Memory sees one
  read of the tensor and of the reference, and writes proportional to the changes, where
  torch's cast, ``!=``, ``nonzero`` and gathers read and write the whole tensor several times.
- `scatter_blocks`: a payload's sparse sections written into their parameters, one program
  per block of the payload's block table: its 16-bit offsets and values read once from the
  payload and stored, where torch builds every element's int64 index first.
- `find_changes_bucket`: `find_changes` of every tensor of a bucket at once, in two
  launches per kind of tensor (source and rollout dtype) whatever the number of tensors, and
  one host sync. The bucket's tensors are cut into tiles, numbered across the bucket; a
  program finds its tile's tensor in a table of one entry a tensor. The first pass reads
  each tile's new bytes and reference once (vectorised loads) and stores how many elements
  changed, which (one bit an element) and, per 32-bit word of those bits, how many changed
  in the tile before it. One prefix sum over the tiles' counts places every tile's changes
  in the bucket's outputs; the host reads back only each tensor's total, to size them
  (`start_bucket` queues the first pass and that copy; `CountedBucket.finish` waits for the
  copy alone, so a caller that starts the next bucket first keeps the device busy). The
  second pass works in the changes, not the elements: lane ``j`` of a tile's program takes
  the tile's ``j``-th change (a binary search over the word prefixes, a select in the
  word), reads that element's new and old bits, writes them in order, and updates the
  reference. Memory sees one read of the bucket and its reference, three thirty-seconds of
  the bf16 bytes written as scratch, and reads and writes in the changes' sectors. On an
  H200 (8.6 GB of bf16 in 128 MB tensors, one run): 14.7 ms at 5 % against torch's 27.4
  (59 % of a same-device copy's rate against 32 %), and at 2 % as one bucket 13.9 ms
  (first pass 6.4, second 5.3; a plain Triton compare-and-count reads the same bytes in
  4.0 ms, so the first pass has room left). Those were timed with the second pass's rounds
  unrolled; they are a loop now (an unrolled round a compile took minutes), not yet timed.
- `checksum_words`: `weightsync.delta_codec`'s checksum of many parameters at once. The
  parameters' full rows of words are cut into tiles of rows (the tables built on the device);
  one program reads a tile once
  and adds up its rows' sums and its column sums, each times its position's weight
  (computed in the kernel), into one number; the tiles' numbers add up per parameter. The
  last, partial row of a parameter is left to the caller.

Triton is imported only when a kernel runs: the host path and SGLang's workers never need
it. `ready(device)` says whether the kernels run on a device (CUDA with Triton importable,
and ``WEIGHTSYNC_DELTA_KERNELS`` not ``0``); every caller keeps a torch path for the rest.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

CHANGE_BLOCK = 1024
"""Elements per block of `find_changes` (a block's positions fit int16)."""
CHANGE_CHUNK = 1 << 26
"""Elements per launch of `find_changes` (its scratch: 2 bytes plus twice the element size
per element, reused)."""
CHECK_COLUMNS = 512
"""Words per row of the checksum's grid (`weightsync.delta_codec.CHECK_ROW_WORDS`)."""
TILE_ROWS = 64
"""Rows of the grid one checksum program reads."""
_TILE_BLOCK = 4
"""Rows a checksum program loads at a time."""


def ready(device: torch.device) -> bool:
    """Whether the kernels run on `device`: CUDA, Triton importable, and the environment
    variable ``WEIGHTSYNC_DELTA_KERNELS`` not ``"0"``."""
    if device.type != "cuda" or os.environ.get("WEIGHTSYNC_DELTA_KERNELS", "1") == "0":
        return False
    return _kernels() is not None


@functools.cache
def _kernels():
    """The kernels (`weightsync.delta_triton`), or None when Triton cannot be imported."""
    try:
        from weightsync import delta_triton
    except ImportError:
        return None
    return (
        delta_triton.changes_kernel,
        delta_triton.gather_kernel,
        delta_triton.checksum_kernel,
        delta_triton.scatter_kernel,
        delta_triton.bucket_count_kernel,
        delta_triton.bucket_write_kernel,
        delta_triton.bucket_select_kernel,
        delta_triton.scatter_change_kernel,
        delta_triton.largest_offset_kernel,
        delta_triton.change_kernel,
    )


_FLOATS = {torch.float32, torch.float16, torch.bfloat16}


def finds_changes(source: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether `find_changes` takes a tensor of `source` for a rollout of `dtype` (the same
    dtype, or a cast between float32, float16 and bfloat16)."""
    return source == dtype or (source in _FLOATS and dtype in _FLOATS)


FUSED_CAST_ELEMENTS = 1 << 25
"""The fewest elements of a tensor whose changes `find_changes` finds faster than torch's
ops. Measured on an H200 (`bench/delta_kernels.py`, 8.6 GB in 128 MB tensors, 2 %): with a
float32 tensor cast to bf16 in the kernel, 26.2 ms against torch's 29.5; with bf16 already,
27.0 against 23.5, and with 16 MB tensors 162 against 73 (two launches and a host sync a
tensor cost more than the passes they save). So it runs for large tensors that need a cast."""


def fuses(source: torch.dtype, dtype: torch.dtype, numel: int) -> bool:
    """Whether finding the changes of `numel` elements of `source` for a rollout of `dtype`
    goes through `find_changes` (see `FUSED_CAST_ELEMENTS`)."""
    return source != dtype and numel >= FUSED_CAST_ELEMENTS and finds_changes(source, dtype)


def find_changes(
    new: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(elements, new bits, old bits)`` of the elements of flat `new` whose bits, in
    `dtype`, differ from the reference bits `ref` (same device and length), ascending; `ref`
    then holds `new`'s bits.

    Args:
        new: the tensor, flat and contiguous, in `dtype` or in a float dtype cast to it in the
            kernel (a float `dtype` only).
        ref: the reference bits (`weightsync.delta_codec.bits_dtype` of `dtype`'s size).
        dtype: the rollout's dtype.

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
        ValueError: a cast the kernel does not make.
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("find_changes needs Triton")
    changes_kernel, gather_kernel = kernels[0], kernels[1]
    import triton.language as tl

    cast = new.dtype != dtype
    if not finds_changes(new.dtype, dtype):
        raise ValueError(
            f"find_changes casts between float dtypes only, not {new.dtype} to {dtype}"
        )
    if not cast:
        new = new.view(ref.dtype)
    bits_type = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[ref.element_size()]
    float_type = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    numel = ref.numel()
    chunk = min(numel, CHANGE_CHUNK)
    local = torch.empty(chunk, dtype=torch.int16, device=ref.device)
    new_scratch = torch.empty(chunk, dtype=ref.dtype, device=ref.device)
    old_scratch = torch.empty(chunk, dtype=ref.dtype, device=ref.device)
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for first in range(0, numel, CHANGE_CHUNK):
        size = min(CHANGE_CHUNK, numel - first)
        blocks = -(-size // CHANGE_BLOCK)
        counts = torch.empty(blocks, dtype=torch.int64, device=ref.device)
        changes_kernel[(blocks,)](
            new[first : first + size],
            ref[first : first + size],
            local,
            new_scratch,
            old_scratch,
            counts,
            size,
            CAST=cast,
            FLOAT=float_type.get(dtype, tl.float32),
            BITS=bits_type,
            BLOCK=CHANGE_BLOCK,
        )
        starts = torch.cumsum(counts, 0) - counts
        total = int(counts.sum())  # the one host sync of a chunk: the outputs' size
        elements = torch.empty(total, dtype=torch.int64, device=ref.device)
        new_bits = torch.empty(total, dtype=ref.dtype, device=ref.device)
        old_bits = torch.empty(total, dtype=ref.dtype, device=ref.device)
        if total:
            gather_kernel[(blocks,)](
                local,
                new_scratch,
                old_scratch,
                counts,
                starts,
                elements,
                new_bits,
                old_bits,
                first,
                BLOCK=CHANGE_BLOCK,
            )
        pieces.append((elements, new_bits, old_bits))
    if len(pieces) == 1:
        return pieces[0]
    return tuple(torch.cat([p[i] for p in pieces]) for i in range(3))  # type: ignore[return-value]


BUCKET_ROWS = 32
"""Rows of 32 elements a program of `find_changes_bucket` compares at a time. The tile
settings here are the ones measured on an H200 (`bench/delta_kernels.py` times others
beside them, as variants)."""
BUCKET_STEPS = 8
"""Steps of `BUCKET_ROWS` rows in one tile of `find_changes_bucket`."""
BUCKET_WARPS = 4
"""Warps of a program of `find_changes_bucket`."""
BUCKET_TILE = BUCKET_ROWS * 32 * BUCKET_STEPS
"""Elements of one tile of `find_changes_bucket` (one program of each pass), as the
settings above are imported (`_bucket_tile` reads them as a call finds them)."""
BUCKET_SECOND_PASS = "select"
"""How the second pass of `find_changes_bucket` finds a tile's changes: ``"select"``, lane
``j`` of a program takes the tile's ``j``-th change, found in the first pass's bitmap by
its per-word prefix (work in the changes); ``"bitmap"``, every element's bit is read from
the bitmap (work in the elements, reads in the changes); ``"full"``, every element is
compared again (no bitmap)."""
BUCKET_SLOTS = 256
"""Changes a program of the ``"select"`` second pass takes at a time."""

_scratches: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}

Found = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(elements, new bits, old bits)`` of one tensor's changes (see `find_changes`)."""


@dataclass(frozen=True, slots=True)
class BucketChanges:
    """The changes `find_changes_bucket_spans` found in a bucket, in shared outputs.

    Attributes:
        outputs: ``(elements, new bits, old bits)`` of each kind of tensor of the bucket
            (and one of each empty tensor), on the bucket's device.
        spans: per tensor of the bucket, in order, ``(output, begin, end)``: its changes are
            places ``begin .. end`` of ``outputs[output]``, ascending.
    """

    outputs: tuple[Found, ...]
    spans: tuple[tuple[int, int, int], ...]

    def found(self, index: int) -> Found:
        """The changes of the bucket's tensor `index`, as views of the outputs."""
        output, begin, end = self.spans[index]
        elements, new, old = self.outputs[output]
        return elements[begin:end], new[begin:end], old[begin:end]


def find_changes_bucket(
    news: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]
) -> list[Found]:
    """`find_changes` of each ``(new, ref, dtype)`` of a bucket, in one pass over all of them
    (two launches per kind of tensor, one host sync; see the module): equal, bit for bit,
    to `find_changes` of each in turn, and each `ref` then holds its new bits.

    The results of a bucket are views of shared outputs (one per kind of tensor);
    `find_changes_bucket_spans` gives the outputs and where each tensor's changes lie in
    them, without a view per tensor.

    Args:
        news: the tensors, each flat and contiguous, in its `dtypes` entry or in a float
            dtype cast to it in the kernel (a float dtype only).
        refs: their reference bits (`weightsync.delta_codec.bits_dtype` of each dtype's
            size), on one device, each as long as its tensor.
        dtypes: each tensor's rollout dtype.

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
        ValueError: a cast the kernel does not make, or a tensor that does not match its
            reference (length, device).
    """
    found = find_changes_bucket_spans(news, refs, dtypes)
    return [found.found(i) for i in range(len(news))]


def find_changes_bucket_spans(
    news: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]
) -> BucketChanges:
    """`find_changes_bucket`, its results left in the bucket's shared outputs: what a
    caller that maps many tensors' changes at once (`weightsync.sender.delta`) takes, where
    a view of each tensor's would cost more host time than its pass.

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
        ValueError: a cast the kernel does not make, or a tensor that does not match its
            reference (length, device).
    """
    return start_bucket(news, refs, dtypes).finish()


def start_bucket(
    news: Sequence[torch.Tensor],
    refs: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    *,
    slot: int = 0,
) -> CountedBucket:
    """The first pass of `find_changes_bucket_spans` over a bucket, queued on the device,
    and the copy of what the second pass needs to size its outputs, without waiting for
    either: `CountedBucket.finish` waits for that copy alone, then queues the second pass.
    A caller that starts the next bucket before finishing this one keeps the device busy
    while the host waits (the references are updated at `finish`).

    Args:
        news: the tensors, as `find_changes_bucket` takes them.
        refs: their reference bits, as there.
        dtypes: each tensor's rollout dtype.
        slot: the scratch the pass keeps its bitmap in until `finish` (0 or 1): a bucket
            started before another one finished takes the other slot.

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
        ValueError: a cast the kernel does not make, a tensor that does not match its
            reference (length, device), or a slot that is not 0 or 1.
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("find_changes_bucket needs Triton")
    if not len(news) == len(refs) == len(dtypes):
        raise ValueError(
            f"find_changes_bucket: {len(news)} tensors, {len(refs)} references, "
            f"{len(dtypes)} dtypes"
        )
    if slot not in (0, 1):
        raise ValueError(f"a bucket's scratch slot is 0 or 1, not {slot!r}")
    if not news:
        return CountedBucket(kernels=kernels, outputs=[], spans=[])
    device = refs[0].device
    outputs: list[Found] = []
    spans: list[tuple[int, int, int] | None] = [None] * len(news)
    members: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (new, ref, dtype) in enumerate(zip(news, refs, dtypes, strict=True)):
        if not finds_changes(new.dtype, dtype):
            raise ValueError(
                f"find_changes_bucket casts between float dtypes only, not {new.dtype} to {dtype}"
            )
        if new.numel() != ref.numel() or new.device != device or ref.device != device:
            raise ValueError(
                f"find_changes_bucket: tensor {i} ({new.numel()} elements on {new.device}) "
                f"does not match its reference ({ref.numel()} on {ref.device}) on {device}"
            )
        if new.numel():
            members.setdefault((new.dtype, dtype), []).append(i)
        else:
            spans[i] = (len(outputs), 0, 0)
            outputs.append((torch.zeros(0, dtype=torch.int64, device=device), ref[:0], ref[:0]))
    kinds = []
    table: list[int] = []
    first_tile = 0
    for (source, dtype), indices in members.items():
        kind = _BucketKind.build(news, refs, indices, source, dtype, first_tile, len(table))
        table += kind.table
        kinds.append(kind)
        first_tile = kind.tile0 + kind.num_tiles
    if not kinds:
        return CountedBucket(kernels=kernels, outputs=outputs, spans=spans)
    # Each tensor's last tile, in the kinds' order: where its place ends.
    last_tiles = [tile - 1 for kind in kinds for tile in kind.table[-len(kind.indices) :]]
    last_at = len(table)
    host = torch.tensor(table + last_tiles, dtype=torch.int64)
    on_gpu = device.type == "cuda"
    tables = host.pin_memory().to(device, non_blocking=True) if on_gpu else host
    counts = torch.empty(first_tile, dtype=torch.int32, device=device)
    mode = BUCKET_SECOND_PASS
    if mode not in ("select", "bitmap", "full"):
        raise ValueError(f"BUCKET_SECOND_PASS must be select, bitmap or full, not {mode!r}")
    if mode == "select" and _bucket_tile() > 1 << 15:
        # The select pass's per-word prefix is int16: a tile's changes must fit it.
        raise ValueError(f"a tile of {_bucket_tile()} elements is over 32,768 (BUCKET_ROWS, STEPS)")
    num_words = first_tile * _bucket_tile() // 32
    bitmap = _scratch(device, num_words if mode != "full" else 1, torch.int32, slot)
    prefix = _scratch(device, num_words if mode == "select" else 1, torch.int16, slot)
    for kind in kinds:
        kind.count(kernels[4], tables, counts, bitmap, prefix, mode)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    # Each tensor's last place, to size the outputs: copied to the host behind the pass,
    # waited for at `finish` alone.
    tensor_ends = ends[tables[last_at:]]
    ready_at = None
    if on_gpu:
        tensor_ends = tensor_ends.to("cpu", non_blocking=True)
        ready_at = torch.cuda.Event()
        ready_at.record()
    return CountedBucket(
        kernels=kernels,
        outputs=outputs,
        spans=spans,
        news=tuple(news),
        kinds=kinds,
        tables=tables,
        counts=counts,
        ends=ends,
        bitmap=bitmap,
        prefix=prefix,
        mode=mode,
        tensor_ends=tensor_ends,
        ready_at=ready_at,
    )


@dataclass(slots=True, kw_only=True)
class CountedBucket:
    """A bucket whose first pass is queued (`start_bucket`); `finish` gives its changes.

    Attributes:
        kernels: the kernels.
        outputs, spans: the outputs and spans known so far (empty tensors'), completed by
            `finish`.
        news: the bucket's tensors, held until the second pass that reads them again is
            queued (a tensor freed earlier could be overwritten first).
        kinds: the bucket's kinds of tensor (none: nothing to compare).
        tables, counts, ends, bitmap, prefix, mode: what the second pass reads.
        tensor_ends: each tensor's last place, on the host once `ready_at` has passed.
        ready_at: the event after which `tensor_ends` holds them (None: already does).
    """

    kernels: tuple
    outputs: list[Found]
    spans: list[tuple[int, int, int] | None]
    news: tuple[torch.Tensor, ...] = ()
    kinds: list[_BucketKind] = field(default_factory=list)
    tables: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    ends: torch.Tensor | None = None
    bitmap: torch.Tensor | None = None
    prefix: torch.Tensor | None = None
    mode: str = "select"
    tensor_ends: torch.Tensor | None = None
    ready_at: torch.cuda.Event | None = None

    def finish(self) -> BucketChanges:
        """Wait for the first pass's sizes (one host sync), queue the second pass (which
        writes the changes and updates the references) and return the changes."""
        if not self.kinds:
            return BucketChanges(outputs=tuple(self.outputs), spans=tuple(self.spans))  # type: ignore[arg-type]
        if self.ready_at is not None:
            self.ready_at.synchronize()
        assert self.tensor_ends is not None and self.ends is not None and self.counts is not None
        ends_iter = iter(self.tensor_ends.tolist())
        starts = self.ends - self.counts
        begin = 0
        outputs, spans = self.outputs, self.spans
        for kind in self.kinds:
            ends_of_kind = [next(ends_iter) for _ in kind.indices]
            new_out, old_out = kind.write(
                self.kernels[5] if self.mode != "select" else self.kernels[6],
                self.tables, self.counts, starts, self.bitmap, self.prefix, self.mode,
                begin, ends_of_kind[-1],
            )  # fmt: skip
            output, base = len(outputs), begin
            outputs.append((kind.elements, new_out, old_out))  # type: ignore[arg-type]
            for i, end in zip(kind.indices, ends_of_kind, strict=True):
                spans[i] = (output, begin - base, end - base)
                begin = end
        self.news = ()
        return BucketChanges(outputs=tuple(outputs), spans=tuple(spans))  # type: ignore[arg-type]


def _bucket_tile() -> int:
    """Elements of one tile of `find_changes_bucket` under the settings as they are now."""
    return BUCKET_ROWS * 32 * BUCKET_STEPS


def _scratch(device: torch.device, numel: int, dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
    """A scratch of at least `numel` of `dtype` on `device` in `slot`, kept between
    buckets (two slots: one bucket's bitmap waits for its second pass while the next
    bucket's first pass fills the other)."""
    key = (device, dtype, slot)
    scratch = _scratches.get(key)
    if scratch is None or scratch.numel() < numel:
        _scratches.pop(key, None)  # free the smaller one before taking the larger
        scratch = _scratches[key] = torch.empty(numel, dtype=dtype, device=device)
    return scratch


@dataclass(slots=True)
class _BucketKind:
    """The tensors of a bucket with one source and rollout dtype: one launch of each pass.

    Attributes:
        indices: their positions in the bucket.
        new_low, ref_low: the tensor and the reference lowest in memory (every other is
            addressed by its offset from them, in elements).
        table: the kind's part of the bucket's table: new offsets, reference offsets,
            lengths, first tiles (and the end), from `at`.
        at: where the kind's part starts in the bucket's table.
        tile0, num_tiles: the kind's first tile in the bucket, and its tiles.
        cast: whether the kernel casts (the source is not the rollout's dtype).
        dtype: the rollout's dtype.
        new_align, ref_align: elements every offset is a multiple of (hints for the loads).
        elements: the elements' output, set by `write`.
    """

    indices: list[int]
    new_low: torch.Tensor
    ref_low: torch.Tensor
    table: list[int]
    at: int
    tile0: int
    num_tiles: int
    cast: bool
    dtype: torch.dtype
    new_align: int
    ref_align: int
    elements: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        news: Sequence[torch.Tensor],
        refs: Sequence[torch.Tensor],
        indices: list[int],
        source: torch.dtype,
        dtype: torch.dtype,
        tile0: int,
        at: int,
    ) -> _BucketKind:
        """The kind of `indices`, its tiles from `tile0`, its table from `at`."""
        cast = source != dtype
        new_views = [news[i] if cast else news[i].view(refs[i].dtype) for i in indices]
        ref_views = [refs[i] for i in indices]
        new_low = min(new_views, key=lambda t: t.data_ptr())
        ref_low = min(ref_views, key=lambda t: t.data_ptr())
        new_offs = _offsets(new_views, new_low)
        ref_offs = _offsets(ref_views, ref_low)
        firsts = [tile0]
        for i in indices:
            firsts.append(firsts[-1] + -(-news[i].numel() // _bucket_tile()))
        return cls(
            indices=indices,
            new_low=new_low,
            ref_low=ref_low,
            table=new_offs + ref_offs + [news[i].numel() for i in indices] + firsts,
            at=at,
            tile0=tile0,
            num_tiles=firsts[-1] - tile0,
            cast=cast,
            dtype=dtype,
            new_align=_alignment(new_offs, new_low),
            ref_align=_alignment(ref_offs, ref_low),
        )

    def _args(self, tables: torch.Tensor) -> list:
        count = len(self.indices)
        at = self.at
        return [
            self.new_low,
            self.ref_low,
            tables[at:],
            tables[at + count :],
            tables[at + 2 * count :],
            tables[at + 3 * count :],
            count,
            self.tile0,
        ]

    def _constants(self) -> dict:
        import triton.language as tl

        floats = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
        bits = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
        return {
            "CAST": self.cast,
            "FLOAT": floats.get(self.dtype, tl.float32),
            "BITS": bits[self.ref_low.element_size()],
            "ROWS": BUCKET_ROWS,
            "STEPS": BUCKET_STEPS,
            "SEARCH": (len(self.indices) - 1).bit_length(),
            "NEW_ALIGN": self.new_align,
            "REF_ALIGN": self.ref_align,
        }

    def count(
        self,
        kernel,
        tables: torch.Tensor,
        counts: torch.Tensor,
        bitmap: torch.Tensor,
        prefix: torch.Tensor,
        mode: str,
    ) -> None:
        """Pass 1: the kind's tiles' counts (and bitmap, and its per-word prefix)."""
        kernel[(self.num_tiles,)](
            *self._args(tables),
            counts,
            bitmap,
            prefix,
            WRITE_BITMAP=mode != "full",
            WRITE_PREFIX=mode == "select",
            num_warps=BUCKET_WARPS,
            **self._constants(),
        )

    def write(
        self,
        kernel,
        tables: torch.Tensor,
        counts: torch.Tensor,
        starts: torch.Tensor,
        bitmap: torch.Tensor,
        prefix: torch.Tensor,
        mode: str,
        begin: int,
        end: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass 2: the kind's changes, places ``begin .. end`` of the bucket's, written into
        new outputs ``(new bits, old bits)`` (and `elements`); the references updated."""
        device = self.ref_low.device
        self.elements = torch.empty(end - begin, dtype=torch.int64, device=device)
        new_out = torch.empty(end - begin, dtype=self.ref_low.dtype, device=device)
        old_out = torch.empty(end - begin, dtype=self.ref_low.dtype, device=device)
        if end == begin:
            return new_out, old_out
        if mode == "select":
            constants = self._constants()
            words = constants.pop("ROWS") * constants.pop("STEPS")
            kernel[(self.num_tiles,)](
                *self._args(tables),
                counts,
                starts,
                begin,
                bitmap,
                prefix,
                self.elements,
                new_out,
                old_out,
                WORDS=words,
                WORD_SEARCH=(words - 1).bit_length(),
                SLOTS=BUCKET_SLOTS,
                num_warps=BUCKET_WARPS,
                **constants,
            )
        else:
            kernel[(self.num_tiles,)](
                *self._args(tables),
                counts,
                starts,
                begin,
                bitmap,
                self.elements,
                new_out,
                old_out,
                FROM_BITMAP=mode == "bitmap",
                num_warps=BUCKET_WARPS,
                **self._constants(),
            )
        return new_out, old_out


def _offsets(tensors: Sequence[torch.Tensor], low: torch.Tensor) -> list[int]:
    """Each tensor's address less `low`'s, in elements (one dtype: exact)."""
    size = low.element_size()
    return [(t.data_ptr() - low.data_ptr()) // size for t in tensors]


def _alignment(offsets: Sequence[int], low: torch.Tensor) -> int:
    """The most elements (up to 16 bytes' worth) that every offset of `offsets` is a
    multiple of, with `low`'s address 16-byte aligned (1 where it is not): the kernels'
    loads then stay vectorised."""
    size = low.element_size()
    if low.data_ptr() % 16:
        return 1
    align = 16 // size
    for offset in offsets:
        align = math.gcd(align, offset)
    return max(align, 1)


def checksum_words(words: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each int64 tensor of `words` (one device, each contiguous) contributes its full rows
    of `CHECK_COLUMNS` words to its checksum: an int64 tensor with one value per tensor, on
    their device, without a host sync. The words after the last full row are the caller's.

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("checksum_words needs Triton")
    checksum_kernel = kernels[2]
    device = words[0].device
    out = torch.zeros(len(words), dtype=torch.int64, device=device)
    table = _tiles(words, device)
    if table is None:
        return out
    addrs, row0, rows, owner = table
    partial = torch.empty(addrs.numel(), dtype=torch.int64, device=device)
    checksum_kernel[(addrs.numel(),)](
        addrs, row0, rows, partial, COLS=CHECK_COLUMNS, ROWS=TILE_ROWS, STEP=_TILE_BLOCK
    )
    return out.index_add_(0, owner, partial)


def _tiles(
    words: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The tiles of `words` as device tables (address, first row, rows, owning tensor),
    built with a few device ops from one small upload of each tensor's address, rows and
    tile count (counted here: no host sync)."""
    shapes = [(w.data_ptr(), w.numel() // CHECK_COLUMNS) for w in words]
    tiles = [-(-rows // TILE_ROWS) for _, rows in shapes]
    total = sum(tiles)
    if not total:
        return None
    table = torch.tensor(
        [(addr, rows, count) for (addr, rows), count in zip(shapes, tiles, strict=True)],
        dtype=torch.int64,
    ).to(device)
    addrs, num_rows, counts = table[:, 0], table[:, 1], table[:, 2]
    owner = torch.repeat_interleave(
        torch.arange(len(words), device=device), counts, output_size=total
    )
    first_tile = torch.cumsum(counts, 0) - counts
    row0 = (torch.arange(total, device=device) - first_tile[owner]) * TILE_ROWS
    rows = torch.clamp(num_rows[owner] - row0, max=TILE_ROWS).to(torch.int32)
    return addrs[owner] + row0 * (CHECK_COLUMNS * 8), row0, rows, owner


SCATTER_CHUNK = 1024
"""Elements a `scatter_blocks` program writes at a time."""


def _bits(element_size: int):
    """Triton's integer type of `element_size` bytes (the raw bits a scatter moves)."""
    import triton.language as tl

    return {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[element_size]


def scatter_blocks(
    payload: torch.Tensor,
    element_size: int,
    dest: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    offsets_at: torch.Tensor,
    values_at: torch.Tensor,
) -> None:
    """Write blocks of sparse sections from `payload` (uint8, on the parameters' device):
    block ``i`` writes ``count[i]`` values of `element_size` bytes, read at byte
    ``values_at[i]`` of the payload, to elements ``start[i] + offset`` of the parameter at
    address ``dest[i]``, the offsets read as 16-bit words at byte ``offsets_at[i]``. Every
    table is an int64 tensor on the payload's device; the caller has checked every block.

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("scatter_blocks needs Triton")
    bits = _bits(element_size)
    if dest.numel():
        tables = [t.contiguous() for t in (dest, start, count, offsets_at, values_at)]
        kernels[3][(dest.numel(),)](*tables, payload, BITS=bits, CHUNK=SCATTER_CHUNK)


def scatter_blocks_changes(
    payload: torch.Tensor,
    element_size: int,
    dest: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    offsets_at: torch.Tensor,
    values_at: torch.Tensor,
    grid_words: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scatter_blocks`, and how each block moves its parameter's checksum
    (`weightsync.delta_codec.checksum_change` of the elements it writes, from their bits
    read just before the write): ``(change, strict)``, int64 tensors with one value per
    block, on the payload's device, without a host sync. ``grid_words[i]`` is the words
    of block ``i``'s parameter in full rows of the checksum's grid; ``strict[i]`` is 1 where
    the block's offsets ascend strictly (no element written twice and counted twice).

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("scatter_blocks_changes needs Triton")
    bits = _bits(element_size)
    change = torch.zeros(dest.numel(), dtype=torch.int64, device=payload.device)
    strict = torch.ones(dest.numel(), dtype=torch.int64, device=payload.device)
    if dest.numel():
        tables = [t.contiguous() for t in (dest, start, count, offsets_at, values_at, grid_words)]
        kernels[7][(dest.numel(),)](
            *tables,
            payload,
            change,
            strict,
            BITS=bits,
            SIZE=element_size,
            COLS=CHECK_COLUMNS,
            CHUNK=SCATTER_CHUNK,
        )
    return change, strict


def largest_offsets(
    payload: torch.Tensor, offsets_at: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """The largest of each block's ``count[i]`` 16-bit offsets read at byte
    ``offsets_at[i]`` of `payload` (0 for a block of none), as an int64 tensor on the
    payload's device, without a host sync. Reads stay inside the payload and within
    `weightsync.delta_codec.BLOCK_ELEMENTS` offsets a block whatever the tables say (they
    are checked afterwards).

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("largest_offsets needs Triton")
    out = torch.zeros(count.numel(), dtype=torch.int64, device=payload.device)
    if count.numel():
        kernels[8][(count.numel(),)](
            offsets_at.contiguous(),
            count.contiguous(),
            payload,
            out,
            payload.numel(),
            LIMIT=1 << 16,
            CHUNK=SCATTER_CHUNK,
        )
    return out


CHANGE_TILE = 1024
"""Changed elements a `checksum_changes` program takes."""


def checksum_changes(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    grid_words: Sequence[int],
) -> torch.Tensor:
    """`weightsync.delta_codec.checksum_change` of each ``(elements, old, new)`` of
    `parts` (int64 element indices and their bits before and after, of one element size,
    all on one device), whose parameter has ``grid_words[i]`` words in full
    rows of the checksum's grid: an int64 tensor with one value per part, on their device,
    in one launch and without a host sync.

    Raises:
        RuntimeError: Triton is not available (check `ready` first).
        ValueError: parts of several element sizes, or a part whose lengths differ.
    """
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("checksum_changes needs Triton")
    if not parts:
        raise ValueError("checksum_changes needs at least one part")
    device = parts[0][0].device
    bits = parts[0][2].dtype
    size = parts[0][2].element_size()
    # Held until the launch: a contiguous copy freed earlier could be overwritten first.
    parts = [tuple(t.contiguous() for t in part) for part in parts]
    columns = []
    for index, (elements, old, new) in enumerate(parts):
        count = elements.numel()
        if old.dtype != bits or new.dtype != bits or old.numel() != count or new.numel() != count:
            raise ValueError(
                f"checksum_changes: part {index} has {count} elements, {old.numel()} old and "
                f"{new.numel()} new {new.dtype} bits (every part {bits}, one of each)"
            )
        # Its tiles: each one's addresses, count, grid and part, built in a few numpy ops
        # (a dense model's parameters hold tens of thousands of tiles).
        firsts = np.arange(0, count, CHANGE_TILE, dtype=np.int64)
        columns.append(
            np.stack(
                [
                    elements.data_ptr() + 8 * firsts,
                    old.data_ptr() + size * firsts,
                    new.data_ptr() + size * firsts,
                    np.minimum(CHANGE_TILE, count - firsts),
                    np.full_like(firsts, grid_words[index]),
                    np.full_like(firsts, index),
                ]
            )
        )
    out = torch.zeros(len(parts), dtype=torch.int64, device=device)
    tiles = np.concatenate(columns, axis=1)
    if not tiles.shape[1]:
        return out
    host = torch.from_numpy(tiles)
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    partial = torch.empty(tiles.shape[1], dtype=torch.int64, device=device)
    kernels[9][(tiles.shape[1],)](
        table[0], table[1], table[2], table[3], table[4], partial,
        BITS=_bits(size), SIZE=size, COLS=CHECK_COLUMNS, CHUNK=CHANGE_TILE,
    )  # fmt: skip
    return out.index_add_(0, table[5], partial)
