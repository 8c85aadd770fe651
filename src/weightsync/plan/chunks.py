"""Cutting a bucket into chunks that are filled, then written, one after another.

A slot's writes must not wait for the whole slot to fill: when a push has a single bucket,
nothing else would overlap its fill. A bucket is therefore staged in `Chunk`s, contiguous
byte ranges of its slot, each with its own regions, source boxes and zero runs: the writes of
one chunk go out while the next one fills. Chunks end where `coalesce` breaks the writes
anyway (a change of parameter, a gap in the destination), so cutting there costs no write;
only a run of one parameter longer than twice the chunk size is cut inside, which costs one
more write per cut and target.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.plan.packing import Bucket, Region, SourceBox, box_range


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """A contiguous part of one bucket's slot, filled and then written as one step.

    Attributes:
        start: first byte of the chunk, from the slot's start.
        num_bytes: length of the chunk.
        regions: the chunk's runs and destinations, by slot offset (from the slot's start);
            they tile ``[start, start + num_bytes)``.
        sources: the boxes that fill the chunk's data runs.
        zeros: ``(slot_offset, num_bytes)`` of the chunk's padding runs.
    """

    start: int
    num_bytes: int
    regions: tuple[Region, ...]
    sources: tuple[SourceBox, ...]
    zeros: tuple[tuple[int, int], ...]


def chunk_bounds(regions: Sequence[Region], *, chunk_bytes: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` byte ranges of the chunks of a slot holding `regions`.

    Runs that `coalesce` would merge (one parameter, contiguous in the destination) are kept
    whole and gathered until a chunk holds at least `chunk_bytes`; a chunk that would grow
    past ``2 * chunk_bytes`` is closed before the run that would overflow it, and a run longer
    than that on its own is cut every `chunk_bytes`.

    Args:
        regions: a bucket's regions, tiling ``[0, num_bytes)`` by slot offset.
        chunk_bytes: target chunk size, a multiple of the element size.

    Returns:
        Ranges that tile ``[0, num_bytes)`` in order; empty when `regions` hold no bytes.
    """
    limit = 2 * chunk_bytes
    bounds: list[tuple[int, int]] = []
    start = stop = 0
    for _, run_stop in _runs(regions):
        if run_stop - start > limit and stop > start:
            bounds.append((start, stop))
            start = stop
        while run_stop - start > limit:
            bounds.append((start, start + chunk_bytes))
            start += chunk_bytes
        stop = run_stop
        if stop - start >= chunk_bytes:
            bounds.append((start, stop))
            start = stop
    if stop > start:
        bounds.append((start, stop))
    return bounds


def split_bucket(bucket: Bucket, *, chunk_bytes: int, element_size: int) -> list[Chunk]:
    """`bucket` as chunks of about `chunk_bytes` (see `chunk_bounds`), in slot order.

    A region, zero run or source box that straddles a cut is split at it; a source box is
    split into the boxes that read its elements on either side (`box_range`). Together the
    chunks fill and write exactly what the bucket does.

    Args:
        bucket: a closed bucket.
        chunk_bytes: target chunk size, a multiple of `element_size`.
        element_size: bytes per staged element.
    """
    bounds = chunk_bounds(bucket.regions, chunk_bytes=chunk_bytes)
    if len(bounds) == 1:
        return [
            Chunk(
                start=0,
                num_bytes=bucket.num_bytes,
                regions=bucket.regions,
                sources=bucket.sources,
                zeros=bucket.zeros,
            )
        ]
    cuts = [stop for _, stop in bounds[:-1]]
    regions: list[list[Region]] = [[] for _ in bounds]
    sources: list[list[SourceBox]] = [[] for _ in bounds]
    zeros: list[list[tuple[int, int]]] = [[] for _ in bounds]
    for region in bucket.regions:
        for lo, hi in _cut(region.slot_offset, region.num_bytes, cuts):
            regions[bisect.bisect_right(cuts, lo)].append(
                Region(
                    slot_offset=lo,
                    num_bytes=hi - lo,
                    param_name=region.param_name,
                    dst_offset_bytes=region.dst_offset_bytes + lo - region.slot_offset,
                    hf_name=region.hf_name,
                )
            )
    for source in bucket.sources:
        numel = math.prod(hi - lo for lo, hi in source.box)
        for lo, hi in _cut(source.slot_offset, numel * element_size, cuts):
            first = (lo - source.slot_offset) // element_size
            last = (hi - source.slot_offset) // element_size
            index = bisect.bisect_right(cuts, lo)
            offset = lo
            for box in box_range(source.box, first, last):
                sources[index].append(SourceBox(source=source.source, box=box, slot_offset=offset))
                offset += math.prod(b - a for a, b in box) * element_size
    for start, num_bytes in bucket.zeros:
        for lo, hi in _cut(start, num_bytes, cuts):
            zeros[bisect.bisect_right(cuts, lo)].append((lo, hi - lo))
    return [
        Chunk(
            start=lo,
            num_bytes=hi - lo,
            regions=tuple(regions[i]),
            sources=tuple(sources[i]),
            zeros=tuple(zeros[i]),
        )
        for i, (lo, hi) in enumerate(bounds)
    ]


def _runs(regions: Sequence[Region]) -> list[tuple[int, int]]:
    """Slot ranges of the runs `coalesce` merges into one write, whatever the target.

    Within one parameter, destination contiguity is a matter of ``dst_offset_bytes`` alone,
    so every target of a layout breaks its writes at the same places.
    """
    runs: list[tuple[int, int]] = []
    last: Region | None = None
    for region in regions:
        stop = region.slot_offset + region.num_bytes
        if (
            last is not None
            and last.param_name == region.param_name
            and last.dst_offset_bytes + last.num_bytes == region.dst_offset_bytes
            and runs[-1][1] == region.slot_offset
        ):
            runs[-1] = (runs[-1][0], stop)
        else:
            runs.append((region.slot_offset, stop))
        last = region
    return runs


def _cut(start: int, num_bytes: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, start + num_bytes)`` split at the `cuts` that fall strictly inside it."""
    stop = start + num_bytes
    inner = cuts[bisect.bisect_right(cuts, start) : bisect.bisect_left(cuts, stop)]
    edges = [start, *inner, stop]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]
