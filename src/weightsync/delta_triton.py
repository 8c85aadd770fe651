"""The Triton kernels of `weightsync.delta_kernels` (see there); importing this module
imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl

_SEED = tl.constexpr(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64
_MUL1 = tl.constexpr(-4658895280553007687)  # 0xBF58476D1CE4E5B9
_MUL2 = tl.constexpr(-7723592293110705685)  # 0x94D049BB133111EB


@triton.jit
def mix(x):
    """splitmix64 of uint64 `x`."""
    x = x + tl.full((), _SEED, tl.int64).to(tl.uint64, bitcast=True)
    x = (x ^ (x >> 30)) * tl.full((), _MUL1, tl.int64).to(tl.uint64, bitcast=True)
    x = (x ^ (x >> 27)) * tl.full((), _MUL2, tl.int64).to(tl.uint64, bitcast=True)
    return x ^ (x >> 31)


@triton.jit
def changes_kernel(
    new_ptr,
    ref_ptr,
    local_ptr,
    new_out_ptr,
    old_out_ptr,
    counts_ptr,
    n,
    CAST: tl.constexpr,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    value = tl.load(new_ptr + offsets, mask=inside, other=0)
    if CAST:  # noqa: SIM108 - a constexpr branch, resolved when the kernel compiles
        bits = value.to(FLOAT).to(BITS, bitcast=True)
    else:
        bits = value
    old = tl.load(ref_ptr + offsets, mask=inside, other=0)
    changed = (bits != old) & inside
    flags = changed.to(tl.int32)
    place = pid.to(tl.int64) * BLOCK + (tl.cumsum(flags, axis=0) - 1)
    tl.store(local_ptr + place, tl.arange(0, BLOCK).to(tl.int16), mask=changed)
    tl.store(new_out_ptr + place, bits, mask=changed)
    tl.store(old_out_ptr + place, old, mask=changed)
    tl.store(ref_ptr + offsets, bits, mask=changed)
    tl.store(counts_ptr + pid, tl.sum(flags, axis=0))


@triton.jit
def gather_kernel(
    local_ptr,
    new_in_ptr,
    old_in_ptr,
    counts_ptr,
    starts_ptr,
    elements_ptr,
    new_ptr,
    old_ptr,
    first,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    count = tl.load(counts_ptr + pid)
    start = tl.load(starts_ptr + pid)
    lanes = tl.arange(0, BLOCK)
    live = lanes < count
    source = pid.to(tl.int64) * BLOCK + lanes
    local = tl.load(local_ptr + source, mask=live, other=0).to(tl.int64)
    block_first = first + pid.to(tl.int64) * BLOCK
    tl.store(elements_ptr + start + lanes, block_first + local, mask=live)
    tl.store(new_ptr + start + lanes, tl.load(new_in_ptr + source, mask=live), mask=live)
    tl.store(old_ptr + start + lanes, tl.load(old_in_ptr + source, mask=live), mask=live)


@triton.jit
def checksum_kernel(
    addr_ptr,
    row0_ptr,
    rows_ptr,
    out_ptr,
    COLS: tl.constexpr,
    ROWS: tl.constexpr,
    STEP: tl.constexpr,
):
    tile = tl.program_id(0)
    base = tl.load(addr_ptr + tile).to(tl.pointer_type(tl.int64))
    row0 = tl.load(row0_ptr + tile)
    num_rows = tl.load(rows_ptr + tile)
    cols = tl.arange(0, COLS)
    steps = tl.arange(0, STEP)
    column_sums = tl.zeros([COLS], dtype=tl.int64)
    weighted_rows = tl.zeros([STEP], dtype=tl.int64)
    for r in range(0, ROWS, STEP):
        rows = r + steps
        live = rows < num_rows
        block = tl.load(
            base + rows.to(tl.int64)[:, None] * COLS + cols[None, :],
            mask=live[:, None],
            other=0,
        )
        column_sums += tl.sum(block, axis=0)
        weights = mix(((row0 + rows.to(tl.int64)) * 4).to(tl.uint64)).to(tl.int64, bitcast=True)
        weighted_rows += tl.sum(block, axis=1) * weights
    column_weights = mix((cols.to(tl.int64) * 4 + 1).to(tl.uint64)).to(tl.int64, bitcast=True)
    total = tl.sum(weighted_rows, axis=0) + tl.sum(column_sums * column_weights, axis=0)
    tl.store(out_ptr + tile, total)


@triton.jit
def scatter_kernel(
    dest_ptr,
    start_ptr,
    count_ptr,
    offsets_at_ptr,
    values_at_ptr,
    payload_ptr,
    BITS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One block of a sparse section: its values written at its start plus its 16-bit
    offsets, read from the payload's bytes."""
    block = tl.program_id(0)
    dest = tl.load(dest_ptr + block).to(tl.pointer_type(BITS))
    start = tl.load(start_ptr + block)
    count = tl.load(count_ptr + block)
    offsets = (payload_ptr + tl.load(offsets_at_ptr + block)).to(tl.pointer_type(tl.int16))
    values = (payload_ptr + tl.load(values_at_ptr + block)).to(tl.pointer_type(BITS))
    for first in range(0, count, CHUNK):
        lanes = first + tl.arange(0, CHUNK)
        live = lanes < count
        offset = tl.load(offsets + lanes, mask=live, other=0).to(tl.int64) & 0xFFFF
        value = tl.load(values + lanes, mask=live)
        tl.store(dest + start + offset, value, mask=live)
