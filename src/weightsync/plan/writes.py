"""A slot's regions as writes to one target: adjacent runs of one parameter merged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from weightsync.plan.direct import DirectCopy
from weightsync.plan.packing import Region


class WriteRun(NamedTuple):
    """One transport write request of a push program and the parameter its bytes belong to.

    Attributes:
        src_offset: first byte of the source, from the start of the staging ring.
        dst_addr: the target address.
        num_bytes: length.
        param_name: the parameter written.
    """

    src_offset: int
    dst_addr: int
    num_bytes: int
    param_name: str


def coalesce(
    regions: Sequence[Region],
    *,
    slot_offset: int,
    weights_info: Mapping[str, tuple[int, int, int]],
) -> list[WriteRun]:
    """The regions of one slot as writes to one target, adjacent runs merged.

    Two consecutive regions merge when they belong to the same parameter and are contiguous
    in the slot and in the target's memory (``dst = weights_info[param][0] +
    dst_offset_bytes``). Runs of different parameters are never merged, even when the
    parameters happen to sit next to each other: the target registered each parameter as
    its own region, and a write may not cross registrations (an RDMA key or a CUDA IPC
    mapping covers one region).

    Args:
        regions: the slot's regions (slot offsets from the slot's start).
        slot_offset: where the slot starts in the ring, in bytes.
        weights_info: the target's ``{param_name: (addr, numel, element_size)}``.

    Raises:
        ValueError: a region's parameter is not in the target's ``weights_info``.
    """
    runs = []
    for region in regions:
        entry = _entry(weights_info, region.param_name)
        runs.append(
            (
                slot_offset + region.slot_offset,
                entry[0] + region.dst_offset_bytes,
                region.num_bytes,
                region.param_name,
            )
        )
    return _merged(runs)


def direct_writes(
    copies: Sequence[DirectCopy], weights_info: Mapping[str, tuple[int, int, int]]
) -> list[WriteRun]:
    """Direct copies (`weightsync.plan.direct`) as writes to one target: each copy's runs,
    sources as byte offsets from their storage's first byte, adjacent runs of one parameter
    merged (an expert's gate and up halves of one fused tensor land side by side). The rows
    of `direct_blocks`, one write each.

    Raises:
        ValueError: a copy's parameter is not in the target's ``weights_info``.
    """
    return _merged(
        [
            (
                b.src_offset + r * b.src_pitch,
                b.dst_addr + r * b.row_bytes,
                b.row_bytes,
                b.param_name,
            )
            for b in direct_blocks(copies, weights_info)
            for r in range(b.rows)
        ]
    )


class PitchedRun(NamedTuple):
    """Rows of equal length, evenly spaced in the source and back to back in one target
    parameter: a row-parallel slice of a trainer tensor as one 2-D (pitched) copy.

    Attributes:
        src_offset: first byte of the first row, from the source storage's first byte.
        dst_addr: the target address of the first row.
        rows: how many rows.
        row_bytes: bytes per row.
        src_pitch: bytes from one row's start to the next in the source.
        param_name: the parameter written.
    """

    src_offset: int
    dst_addr: int
    rows: int
    row_bytes: int
    src_pitch: int
    param_name: str

    @property
    def num_bytes(self) -> int:
        """Bytes the copy moves."""
        return self.rows * self.row_bytes


def direct_blocks(
    copies: Sequence[DirectCopy], weights_info: Mapping[str, tuple[int, int, int]]
) -> list[PitchedRun]:
    """Direct copies as copies into memory the sender addresses itself: a copy whose runs
    are evenly spaced rows becomes one pitched copy; the other runs are merged as in
    `direct_writes` and become copies of one row.

    Raises:
        ValueError: a copy's parameter is not in the target's ``weights_info``.
    """
    blocks: list[PitchedRun] = []
    runs: list[tuple[int, int, int, str]] = []

    def flush() -> None:
        blocks.extend(
            PitchedRun(w.src_offset, w.dst_addr, 1, w.num_bytes, w.num_bytes, w.param_name)
            for w in _merged(runs)
        )
        runs.clear()

    for copy in copies:
        entry = _entry(weights_info, copy.param_name)
        pitch = copy.runs[1][0] - copy.runs[0][0] if len(copy.runs) > 1 else 0
        if pitch > 0 and all(
            b[0] - a[0] == pitch for a, b in zip(copy.runs, copy.runs[1:], strict=False)
        ):
            flush()
            src, dst, row_bytes = copy.runs[0]
            blocks.append(
                PitchedRun(src, entry[0] + dst, len(copy.runs), row_bytes, pitch, copy.param_name)
            )
            continue
        runs += [(src, entry[0] + dst, n, copy.param_name) for src, dst, n in copy.runs]
    flush()
    return blocks


def _entry(weights_info: Mapping[str, tuple[int, int, int]], name: str) -> tuple[int, int, int]:
    entry = weights_info.get(name)
    if entry is None:
        raise ValueError(
            f"parameter {name!r} is not in the target's weights_info; the plan does not match "
            "the target it was built for"
        )
    return entry


def _merged(runs: Sequence[tuple[int, int, int, str]]) -> list[WriteRun]:
    """``(src, dst, num_bytes, param_name)`` runs as writes, a run merged into the one before
    when both belong to one parameter and are contiguous in the source and the target."""
    merged: list[list] = []
    for src, dst, num_bytes, param in runs:
        if merged:
            last = merged[-1]
            if last[3] == param and last[0] + last[2] == src and last[1] + last[2] == dst:
                last[2] += num_bytes
                continue
        merged.append([src, dst, num_bytes, param])
    return [WriteRun(src, dst, n, param) for src, dst, n, param in merged]
