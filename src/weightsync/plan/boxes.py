"""Boxes of HF tensors held by sharded sources, and copy items cut along them.

A trainer rank of a sharded trainer holds a box of an HF tensor (`TensorMeta.box`): rows of
a column-parallel weight, columns of a row-parallel one, an FSDP shard's rows. A copy item
reads a box of the HF tensor row-major into one run of destination bytes; when that box
straddles holders, the item is cut into the runs each holder's box can serve. A run is the
part of the item whose elements are contiguous in its row-major order: cutting rows off a
box keeps one run per holder, cutting columns leaves one run per row.

All of it is pure; boxes are tuples of ``(start, stop)`` per dim.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from weightsync.plan.items import CopyItem

Box = tuple[tuple[int, int], ...]


def intersect(a: Box, b: Box) -> Box | None:
    """The box both `a` and `b` cover, or None when they share no element."""
    if len(a) != len(b):
        return None
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return box if all(start < stop for start, stop in box) else None


def numel(box: Box) -> int:
    """Elements of `box`."""
    return math.prod(stop - start for start, stop in box)


def disjoint_or_equal(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """A pair of `boxes` that overlap without being equal, or None when there is none.

    Sources of one trainer hold each element of a tensor either in one box or in copies of
    the same box (data-parallel replicas, replicated norms); a partial overlap has no single
    holder set, so it is refused.
    """
    distinct = sorted(set(boxes))
    for a, b in itertools.combinations(distinct, 2):
        if intersect(a, b) is not None:
            return a, b
    return None


def runs_within(item: CopyItem, sub: Box) -> list[CopyItem]:
    """The contiguous runs of `item` whose elements lie in `sub` (a box inside the item's).

    The item's bytes are its box read row-major; the elements of `sub` are contiguous in that
    order over the trailing dims `sub` spans fully, so each run fixes the dims before the last
    partial one and spans that one.
    """
    whole = item.src_box
    if sub == whole:
        return [item]
    dims = len(whole)
    extents = [stop - start for start, stop in whole]
    strides = [math.prod(extents[k + 1 :]) for k in range(dims)]
    element_size = item.num_bytes // item.src_numel
    last_partial = max(k for k in range(dims) if sub[k] != whole[k])
    run_elements = (sub[last_partial][1] - sub[last_partial][0]) * strides[last_partial]
    runs = []
    for index in itertools.product(*(range(start, stop) for start, stop in sub[:last_partial])):
        position = sum((i - whole[k][0]) * strides[k] for k, i in enumerate(index))
        position += (sub[last_partial][0] - whole[last_partial][0]) * strides[last_partial]
        box = (
            *((i, i + 1) for i in index),
            sub[last_partial],
            *whole[last_partial + 1 :],
        )
        runs.append(
            dataclasses.replace(
                item,
                src_box=box,
                dst_offset_bytes=item.dst_offset_bytes + position * element_size,
                num_bytes=run_elements * element_size,
            )
        )
    return runs


def cut(item: CopyItem, boxes: Sequence[Box]) -> tuple[dict[Box, list[CopyItem]], int]:
    """`item` cut along the held `boxes` (pairwise disjoint or equal).

    Returns:
        ``{box: runs}`` for every box the item reads from (in destination order within each
        box), and how many of the item's elements no box holds.
    """
    pieces: dict[Box, list[CopyItem]] = {}
    covered = 0
    for box in sorted(set(boxes)):
        inside = intersect(item.src_box, box)
        if inside is None:
            continue
        pieces[box] = runs_within(item, inside)
        covered += numel(inside)
    return pieces, item.src_numel - covered


def shift(item: CopyItem, origin: Sequence[int]) -> CopyItem:
    """`item` reading the same elements from a tensor that starts at `origin` of the HF
    tensor (the holder's local tensor)."""
    box = tuple(
        (start - o, stop - o) for (start, stop), o in zip(item.src_box, origin, strict=True)
    )
    return dataclasses.replace(item, src_box=box)
