"""Building a parameter's segments: contiguous destination runs, each one box of an HF tensor."""

from __future__ import annotations

import math

from weightsync.layout.types import ParamLayout, Segment


class SegmentBuilder:
    """Appends segments back to back, from destination element 0 of one parameter.

    Each ``add_*`` call places the next run right after the previous one, so the finished
    segments tile ``[0, numel)`` in order.
    """

    __slots__ = ("_offset", "_segments")

    def __init__(self) -> None:
        self._offset = 0
        self._segments: list[Segment] = []

    def add_box(self, hf_name: str, box: tuple[tuple[int, int], ...]) -> None:
        """Append the row-major box ``box`` of HF tensor ``hf_name`` (skipped when empty)."""
        numel = math.prod(stop - start for start, stop in box)
        if numel == 0:
            return
        self._segments.append(
            Segment(dst_offset=self._offset, numel=numel, hf_name=hf_name, src_box=box)
        )
        self._offset += numel

    def add_rows(self, hf_name: str, hf_shape: tuple[int, ...], rows: tuple[int, int]) -> None:
        """Append rows ``[rows[0], rows[1])`` of HF tensor ``hf_name`` (all other dims whole)."""
        self.add_box(hf_name, (rows, *((0, size) for size in hf_shape[1:])))

    def add_columns(self, hf_name: str, hf_shape: tuple[int, int], cols: tuple[int, int]) -> None:
        """Append columns ``[cols[0], cols[1])`` of 2-D HF tensor ``hf_name``, all rows."""
        self.add_box(hf_name, ((0, hf_shape[0]), cols))

    def add_whole(self, hf_name: str, hf_shape: tuple[int, ...]) -> None:
        """Append all of HF tensor ``hf_name``."""
        self.add_box(hf_name, tuple((0, size) for size in hf_shape))

    def add_padding(self, numel: int) -> None:
        """Append ``numel`` padding elements (kept zero by the engine)."""
        if numel <= 0:
            return
        self._segments.append(Segment(dst_offset=self._offset, numel=numel, hf_name=None))
        self._offset += numel

    def build(self, name: str, shape: tuple[int, ...], dtype: str) -> ParamLayout:
        """The finished parameter; its segments must cover exactly ``prod(shape)`` elements."""
        assert self._offset == math.prod(shape), (name, self._offset, shape)
        return ParamLayout(name=name, shape=shape, dtype=dtype, segments=tuple(self._segments))


def replicated_param(name: str, hf_name: str, shape: tuple[int, ...], dtype: str) -> ParamLayout:
    """A parameter every rank holds whole: one segment, all of ``hf_name``."""
    builder = SegmentBuilder()
    builder.add_whole(hf_name, shape)
    return builder.build(name, shape, dtype)
