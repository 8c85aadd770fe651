"""Filling a staging slot: source boxes fused into few strided copies, run on worker threads.

A MoE layer yields hundreds of small per-expert tensors that are views of one fused
parameter. Copying them one by one costs a framework call each; instead, consecutive boxes
that share a storage, a shape and strides and whose source and slot offsets advance by
constant steps become one copy of a strided view with an extra leading dim (all of an
expert block's gate and up halves in one call, whatever the tensor-parallel split).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from weightsync.sender.buckets import Bucket, SourceBox
from weightsync.sender.chunks import Chunk

# Below this many bytes per slot, handing copies to threads costs more than it saves.
_MIN_PARALLEL_BYTES = 4 << 20


class CopyOp(NamedTuple):
    """One strided copy from a source storage into the typed staging buffer.

    ``base.as_strided(size, src_stride, src_offset)`` is copied (and cast) into
    ``staging.as_strided(size, dst_stride, dst_offset)``; offsets and strides are in elements.
    `whole` says that the source view is `base` itself. A named tuple: a push makes one per
    source box.
    """

    base: torch.Tensor
    size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_offset: int
    dst_stride: tuple[int, ...]
    dst_offset: int
    whole: bool = False  # the view is `base` itself: no view to make

    @property
    def numel(self) -> int:
        """Elements the copy moves."""
        return math.prod(self.size)

    def split(self, parts: int) -> list[CopyOp]:
        """This copy cut along its outermost dim into at most `parts` copies."""
        rows = self.size[0]
        bounds = [rows * i // parts for i in range(parts + 1)]
        return [
            CopyOp(
                self.base,
                (hi - lo, *self.size[1:]),
                self.src_stride,
                self.src_offset + lo * self.src_stride[0],
                self.dst_stride,
                self.dst_offset + lo * self.dst_stride[0],
            )
            for lo, hi in itertools.pairwise(bounds)
            if hi > lo
        ]

    def run(self, staging: torch.Tensor) -> None:
        """Copy into `staging` (the whole ring as a 1-D tensor of the plan dtype)."""
        src = (
            self.base
            if self.whole
            else self.base.as_strided(self.size, self.src_stride, self.src_offset)
        )
        dst = staging.as_strided(self.size, self.dst_stride, self.dst_offset)
        dst.copy_(src, non_blocking=dst.device != src.device)


def _contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


# A plan repeats a handful of boxes over thousands of tensors (every expert reads the same
# rows), so their geometry is computed once per box and stride.
@functools.lru_cache(maxsize=4096)
def _box_geometry(
    box: tuple[tuple[int, int], ...], stride: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(size, contiguous strides, element offset from the tensor's start)`` of a box."""
    size = tuple(hi - lo for lo, hi in box)
    offset = sum(lo * s for (lo, _), s in zip(box, stride, strict=True))
    return size, _contiguous_strides(size), offset


def _single_op(source: SourceBox, slot_base: int, element_size: int) -> CopyOp:
    tensor = source.tensor
    stride = tensor.stride()
    size, dst_stride, offset = _box_geometry(source.box, stride)
    return CopyOp(
        tensor,
        size,
        stride,
        tensor.storage_offset() + offset,
        dst_stride,
        slot_base + source.slot_offset // element_size,
        offset == 0 and size == tensor.shape,
    )


def fuse_copies(sources: Sequence[SourceBox], *, slot_base: int, element_size: int) -> list[CopyOp]:
    """The bucket's source boxes as few strided copies.

    Args:
        sources: the boxes, in slot order.
        slot_base: element offset of the slot in the typed staging buffer.
        element_size: bytes per staged element.

    Returns:
        Copies that together write exactly what copying every box would.
    """
    ops: list[CopyOp] = []
    run: list[CopyOp] = []

    def close() -> None:
        if len(run) == 1:
            ops.append(run[0])
        elif run:
            first = run[0]
            ops.append(
                CopyOp(
                    first.base,
                    (len(run), *first.size),
                    (run[1].src_offset - first.src_offset, *first.src_stride),
                    first.src_offset,
                    (run[1].dst_offset - first.dst_offset, *first.dst_stride),
                    first.dst_offset,
                )
            )
        run.clear()

    signature = None
    last_tensor, tensor_key = None, None
    for source in sources:
        op = _single_op(source, slot_base, element_size)
        if op.base is not last_tensor:
            # Consecutive boxes mostly read one tensor: its storage is looked up once.
            last_tensor = op.base
            tensor_key = (last_tensor.untyped_storage().data_ptr(), op.base.dtype, op.base.device)
        op_signature = (tensor_key, op.size, op.src_stride)
        if run and op_signature == signature:
            src_step = op.src_offset - run[-1].src_offset
            dst_step = op.dst_offset - run[-1].dst_offset
            if len(run) == 1:
                extends = src_step >= 0 and dst_step >= op.numel
            else:
                extends = (
                    src_step == run[1].src_offset - run[0].src_offset
                    and dst_step == run[1].dst_offset - run[0].dst_offset
                )
            if extends:
                run.append(op)
                continue
        close()
        run.append(op)
        signature = op_signature
    close()
    return ops


class SlotFiller:
    """Runs the copies and zero fills of a bucket, or of one chunk of it, into a slot."""

    def __init__(self, *, num_workers: int) -> None:
        """Create the filler; threads start on the first large host fill.

        Args:
            num_workers: threads that share a slot's copies (1 = the calling thread).
        """
        self._num_workers = num_workers
        self._pool: ThreadPoolExecutor | None = None

    def fill(
        self,
        contents: Bucket | Chunk,
        *,
        staging_bytes: torch.Tensor,
        staging_typed: torch.Tensor,
        slot_index: int,
        slot_bytes: int,
        ops_out: list[CopyOp] | None = None,
    ) -> int:
        """Write `contents` into slot `slot_index` and return the number of copies it took.

        On CUDA the copies are only enqueued; the caller synchronises before the slot is read.

        Args:
            contents: a bucket, or a chunk of one (its offsets are from the slot's start).
            staging_bytes: the ring as a 1-D uint8 tensor.
            staging_typed: the same memory as a 1-D tensor of the plan dtype.
            slot_index: which slot.
            slot_bytes: bytes per slot.
            ops_out: if given, receives the copies run (offsets into the whole ring).
        """
        element_size = staging_typed.element_size()
        slot_start = slot_index * slot_bytes
        ops = fuse_copies(
            contents.sources, slot_base=slot_start // element_size, element_size=element_size
        )
        if ops_out is not None:
            ops_out.extend(ops)
        zeros = [(slot_start + offset, num_bytes) for offset, num_bytes in contents.zeros]
        self.run(ops, zeros, staging_bytes=staging_bytes, staging_typed=staging_typed)
        return len(ops)

    def run(
        self,
        ops: Sequence[CopyOp],
        zeros: Sequence[tuple[int, int]],
        *,
        staging_bytes: torch.Tensor,
        staging_typed: torch.Tensor,
    ) -> None:
        """Run `ops` and zero the byte ranges `zeros` (offsets into the whole ring).

        Host copies run on up to `num_workers` threads when there are enough bytes; CUDA
        copies are only enqueued, on the current stream, as few launches as possible.
        """
        with torch.no_grad():
            for offset, num_bytes in zeros:
                staging_bytes[offset : offset + num_bytes].zero_()
            if not ops:
                return
            on_host = staging_typed.is_cpu and all(op.base.is_cpu for op in ops)
            if not on_host:
                _run_on_device(ops, staging_typed)
                return
            num_bytes = sum(op.numel for op in ops) * staging_typed.element_size()
            if self._num_workers == 1 or num_bytes < _MIN_PARALLEL_BYTES:
                _run_all(ops, staging_typed)
                return
            chunks = _balance(ops, self._num_workers)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._num_workers, thread_name_prefix="weightsync-fill"
                )
            futures = [self._pool.submit(_run_all, chunk, staging_typed) for chunk in chunks[1:]]
            _run_all(chunks[0], staging_typed)
            for future in futures:
                future.result()

    def close(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _run_all(ops: Sequence[CopyOp], staging_typed: torch.Tensor) -> None:
    """Host copies (blocking), `CopyOp.run` inlined: a push runs one per source box."""
    with torch.no_grad():
        view = staging_typed.as_strided
        for base, size, src_stride, src_offset, dst_stride, dst_offset, whole in ops:
            src = base if whole else base.as_strided(size, src_stride, src_offset)
            view(size, dst_stride, dst_offset).copy_(src)


def _run_on_device(ops: Sequence[CopyOp], staging_typed: torch.Tensor) -> None:
    """Enqueue copies into a GPU ring (or from GPU tensors into a host ring).

    Copies between tensors of one dtype on the ring's device go out as multi-tensor
    launches (``torch._foreach_copy_``): a MoE layer's thousands of per-expert tensors would
    otherwise cost one kernel launch, ~10 us of host time, each. The rest (casts, other
    devices, strided sources the fused kernel does not take) run one by one.
    """
    device, dtype = staging_typed.device, staging_typed.dtype
    view = staging_typed.as_strided
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for op in ops:
        base, size, src_stride, src_offset, dst_stride, dst_offset, whole = op
        src = base if whole else base.as_strided(size, src_stride, src_offset)
        dst = view(size, dst_stride, dst_offset)
        if base.device == device and base.dtype == dtype and src.is_contiguous():
            dsts.append(dst)
            srcs.append(src)
        else:
            dst.copy_(src, non_blocking=src.device != device)
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def record_events(devices: Sequence[torch.device]) -> list[torch.cuda.Event]:
    """An event after the copies queued so far on each device's current CUDA stream: a
    transport that cannot wait for them on the GPU may read the slot once they completed."""
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def _balance(ops: Sequence[CopyOp], parts: int) -> list[list[CopyOp]]:
    """Split `ops` into `parts` lists of about equal elements, cutting large copies."""
    total = sum(op.numel for op in ops)
    share = -(-total // parts)
    pieces: list[CopyOp] = []
    for op in ops:
        if op.numel > share and op.size[0] > 1:
            pieces.extend(op.split(min(op.size[0], -(-op.numel // share))))
        else:
            pieces.append(op)
    chunks: list[list[CopyOp]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for piece in pieces:
        index = loads.index(min(loads))
        chunks[index].append(piece)
        loads[index] += piece.numel
    return [chunk for chunk in chunks if chunk]
