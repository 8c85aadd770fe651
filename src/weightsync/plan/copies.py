"""Copy recipes: a slot's source boxes as few strided copies, computed from the geometry.

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
from typing import NamedTuple

from weightsync.plan.geometry import TensorGeometry
from weightsync.plan.packing import SourceBox


class CopyRecipe(NamedTuple):
    """One strided copy from a stream tensor's storage into the typed staging ring.

    ``tensor.as_strided(size, src_stride, src_offset)`` (offsets into the tensor's storage)
    is copied, and cast, into ``ring.as_strided(size, dst_stride, dst_offset)``; offsets and
    strides are in elements. `whole` says the source view is the tensor itself. A named
    tuple: a program holds one per fused run of boxes.

    Attributes:
        source: the index of the tensor among the stream tensors the plan reads.
        size: the copy's shape.
        src_stride: strides of the source view.
        src_offset: storage offset of the source view.
        dst_stride: strides of the destination view of the ring.
        dst_offset: element offset of the destination view in the ring.
        whole: the source view is the tensor itself.
    """

    source: int
    size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_offset: int
    dst_stride: tuple[int, ...]
    dst_offset: int
    whole: bool = False

    @property
    def numel(self) -> int:
        """Elements the copy moves."""
        return math.prod(self.size)

    def split(self, parts: int) -> list[CopyRecipe]:
        """This copy cut along its outermost dim into at most `parts` copies."""
        rows = self.size[0]
        bounds = [rows * i // parts for i in range(parts + 1)]
        return [
            CopyRecipe(
                self.source,
                (hi - lo, *self.size[1:]),
                self.src_stride,
                self.src_offset + lo * self.src_stride[0],
                self.dst_stride,
                self.dst_offset + lo * self.dst_stride[0],
            )
            for lo, hi in itertools.pairwise(bounds)
            if hi > lo
        ]


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


def _single(
    source: SourceBox, tensor: TensorGeometry, slot_base: int, element_size: int
) -> CopyRecipe:
    size, dst_stride, offset = _box_geometry(source.box, tensor.stride)
    return CopyRecipe(
        source.source,
        size,
        tensor.stride,
        tensor.storage_offset + offset,
        dst_stride,
        slot_base + source.slot_offset // element_size,
        offset == 0 and size == tensor.shape,
    )


def fuse_copies(
    sources: Sequence[SourceBox],
    tensors: Sequence[TensorGeometry],
    *,
    slot_base: int,
    element_size: int,
) -> list[CopyRecipe]:
    """A slot's source boxes as few strided copies.

    Args:
        sources: the boxes, in slot order.
        tensors: the geometry of every stream tensor the plan reads (``sources[i].source``
            indexes it; ``storage`` indexes it too).
        slot_base: element offset of the slot in the typed staging ring.
        element_size: bytes per staged element.

    Returns:
        Copies that together write exactly what copying every box would.
    """
    ops: list[CopyRecipe] = []
    run: list[CopyRecipe] = []

    def close() -> None:
        if len(run) == 1:
            ops.append(run[0])
        elif run:
            first = run[0]
            ops.append(
                CopyRecipe(
                    first.source,
                    (len(run), *first.size),
                    (run[1].src_offset - first.src_offset, *first.src_stride),
                    first.src_offset,
                    (run[1].dst_offset - first.dst_offset, *first.dst_stride),
                    first.dst_offset,
                )
            )
        run.clear()

    signature = None
    for source in sources:
        tensor = tensors[source.source]
        op = _single(source, tensor, slot_base, element_size)
        op_signature = (tensor.storage, tensor.dtype, tensor.device, op.size, op.src_stride)
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
