"""Packing a layout's copy items into staging slots: buckets, regions and source boxes.

Part of lowering a source plan into a push program (`weightsync.plan.program`): pure, sources
are named by their index in the stream, not held.

A `Bucket` is what one staging slot holds for one destination layout: a list of `Region`s
(runs of slot bytes and where they land), the source boxes that fill them and the runs that
stay zero. Items are packed in the order the stream yields them; an item larger than the room
left in a slot is split by rows of its box (down to single elements if need be) and continues
in the next slot. When a slot is closed its pieces are ordered by destination address, so
runs that are adjacent in the destination (an expert's gate and up halves, neighbouring
experts) sit next to each other in the slot and go out as one write.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from weightsync.plan.items import CopyItem

Box = tuple[tuple[int, int], ...]


class Region(NamedTuple):
    """A run of staged bytes and the destination bytes it becomes.

    An immutable named tuple rather than a dataclass: a push makes one per item piece, and
    a tuple is built several times faster.

    Attributes:
        slot_offset: first byte of the run, from the slot's start.
        num_bytes: length of the run.
        param_name: the rollout parameter written.
        dst_offset_bytes: where the run lands, from the parameter's address.
        hf_name: the HF tensor the bytes come from, or ``None`` for zeros.
    """

    slot_offset: int
    num_bytes: int
    param_name: str
    dst_offset_bytes: int
    hf_name: str | None


class SourceBox(NamedTuple):
    """One box of a stream tensor, read row-major into a run of slot elements.

    A named tuple, like `Region`, for the same reason.

    Attributes:
        source: the tensor's index among the stream tensors the plan reads.
        box: ``(start, stop)`` per dim of the tensor.
        slot_offset: first byte of the run in the slot.
    """

    source: int
    box: Box
    slot_offset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """The contents of one staging slot for one layout.

    Attributes:
        layout_id: the destination layout (`StageWork.layout_id`).
        regions: the slot's runs and destinations, by slot offset; they tile
            ``[0, num_bytes)``.
        sources: the boxes that fill the data runs.
        zeros: ``(slot_offset, num_bytes)`` of the padding runs.
        num_bytes: bytes of the slot in use.
    """

    layout_id: int
    regions: tuple[Region, ...]
    sources: tuple[SourceBox, ...]
    zeros: tuple[tuple[int, int], ...]
    num_bytes: int


def box_range(box: Box, start: int, stop: int) -> list[Box]:
    """Boxes that cover elements ``[start, stop)`` of `box` read row-major, in that order.

    Returns at most ``2 * len(box) - 1`` boxes; the whole box when the range covers it.
    """
    if start >= stop:
        return []
    extents = [hi - lo for lo, hi in box]
    if start == 0 and stop == math.prod(extents):
        return [box]
    lo0 = box[0][0]
    if len(box) == 1:
        return [((lo0 + start, lo0 + stop),)]
    inner = box[1:]
    row = math.prod(extents[1:])
    row_start, start_in_row = divmod(start, row)
    row_stop, stop_in_row = divmod(stop, row)

    def rows(first: int, last: int) -> tuple[tuple[int, int], ...]:
        return ((lo0 + first, lo0 + last),)

    if row_start == row_stop:
        return [
            rows(row_start, row_start + 1) + sub
            for sub in box_range(inner, start_in_row, stop_in_row)
        ]
    out: list[Box] = []
    if start_in_row:
        out += [rows(row_start, row_start + 1) + sub for sub in box_range(inner, start_in_row, row)]
        row_start += 1
    if row_stop > row_start:
        out.append(rows(row_start, row_stop) + inner)
    if stop_in_row:
        out += [rows(row_stop, row_stop + 1) + sub for sub in box_range(inner, 0, stop_in_row)]
    return out


# A piece of an item in the open bucket: (dst_key, item, source, first, numel), where `first`
# is the item's first element in the piece. A plain tuple: thousands are made per lowering.
_Piece = tuple[int, CopyItem, int, int, int]


_dst_key = operator.itemgetter(0)


class BucketPacker:
    """Packs one layout's items into slot-sized buckets, in stream order.

    Call `add` for each stream tensor's items, in stream order; it returns the buckets that
    became full. Call `flush` after the last tensor for the partly filled one.
    """

    def __init__(
        self,
        *,
        layout_id: int,
        slot_bytes: int,
        element_size: int,
        dst_address: Callable[[str, int], int],
    ) -> None:
        """Start an empty bucket.

        Args:
            layout_id: the layout the buckets are for.
            slot_bytes: capacity of a slot (a multiple of `element_size`).
            element_size: bytes per staged element (the plan dtype's).
            dst_address: ``(param_name, dst_offset_bytes) -> address`` on the layout's first
                target; pieces are ordered by it inside a slot.
        """
        self._layout_id = layout_id
        self._slot_elements = slot_bytes // element_size
        self._element_size = element_size
        self._dst_address = dst_address
        self._pieces: list[_Piece] = []
        self._used = 0  # elements of the open bucket

    def add(self, source: int, items: Sequence[CopyItem]) -> list[Bucket]:
        """Append `items` of stream tensor `source` (its padding items read nothing).

        Returns:
            The buckets that this filled, in order.
        """
        full: list[Bucket] = []
        size = self._element_size
        address = self._dst_address
        for item in items:
            numel = item.num_bytes // size
            if 0 < numel <= self._slot_elements - self._used:
                # The common case, an item that fits in the open bucket whole.
                key = address(item.param_name, item.dst_offset_bytes)
                self._pieces.append((key, item, source, 0, numel))
                self._used += numel
                continue
            first = 0
            while first < numel:
                if self._used == self._slot_elements:
                    full.append(self._close())
                take = min(numel - first, self._slot_elements - self._used)
                key = address(item.param_name, item.dst_offset_bytes + first * size)
                self._pieces.append((key, item, source, first, take))
                self._used += take
                first += take
        return full

    def flush(self) -> Bucket | None:
        """The open bucket, if it holds anything."""
        return self._close() if self._pieces else None

    def _close(self) -> Bucket:
        size = self._element_size
        regions: list[Region] = []
        sources: list[SourceBox] = []
        zeros: list[tuple[int, int]] = []
        offset = 0
        self._pieces.sort(key=_dst_key)
        for _, item, source, first, numel in self._pieces:
            num_bytes = numel * size
            regions.append(
                Region(
                    slot_offset=offset,
                    num_bytes=num_bytes,
                    param_name=item.param_name,
                    dst_offset_bytes=item.dst_offset_bytes + first * size,
                    hf_name=item.hf_name,
                )
            )
            if item.hf_name is None:
                if zeros and zeros[-1][0] + zeros[-1][1] == offset:
                    zeros[-1] = (zeros[-1][0], zeros[-1][1] + num_bytes)
                else:
                    zeros.append((offset, num_bytes))
            elif num_bytes == item.num_bytes:
                sources.append(SourceBox(source=source, box=item.src_box, slot_offset=offset))
            else:
                run = offset
                for box in box_range(item.src_box, first, first + numel):
                    sources.append(SourceBox(source=source, box=box, slot_offset=run))
                    run += math.prod(hi - lo for lo, hi in box) * size
            offset += num_bytes
        self._pieces = []
        self._used = 0
        return Bucket(
            layout_id=self._layout_id,
            regions=tuple(regions),
            sources=tuple(sources),
            zeros=tuple(zeros),
            num_bytes=offset,
        )
