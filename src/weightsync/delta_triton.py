"""The Triton kernels of `weightsync.delta_kernels` (see there); importing this module
imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl

_SEED = tl.constexpr(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64
_MUL1 = tl.constexpr(-4658895280553007687)  # 0xBF58476D1CE4E5B9
_MUL2 = tl.constexpr(-7723592293110705685)  # 0x94D049BB133111EB

# Triton compiles a kernel again for each new combination of its integer arguments' value
# classes (1, a multiple of 16, other) and its pointers' 16-byte alignment. Sizes, counts
# and the addresses of tables sliced out of a larger one change from sync to sync, so a
# sync could stop for a compile (hundreds of milliseconds) long after the first: these
# arguments are not specialised on. Each is read once per program, so nothing is lost; the
# bulk data's pointers stay specialised, which keeps their loads vectorised.
_SCATTER_TABLES = ["dest_ptr", "start_ptr", "count_ptr", "offsets_at_ptr", "values_at_ptr"]
# The payload is read at byte offsets taken from the tables: its own alignment tells nothing.
_SCATTER_TABLES += ["payload_ptr"]
_BUCKET_SCALARS = ["num_tensors", "tile0"]
_BUCKET_TABLES = ["new_off_ptr", "ref_off_ptr", "numel_ptr", "first_tile_ptr"]


@triton.jit
def mix(x):
    """splitmix64 of uint64 `x`."""
    x = x + tl.full((), _SEED, tl.int64).to(tl.uint64, bitcast=True)
    x = (x ^ (x >> 30)) * tl.full((), _MUL1, tl.int64).to(tl.uint64, bitcast=True)
    x = (x ^ (x >> 27)) * tl.full((), _MUL2, tl.int64).to(tl.uint64, bitcast=True)
    return x ^ (x >> 31)


@triton.jit(do_not_specialize=["n"])
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


@triton.jit(do_not_specialize=["first"])
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


@triton.jit(do_not_specialize_on_alignment=_SCATTER_TABLES)
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


@triton.jit
def _weighted_change(element, old, value, grid, SIZE: tl.constexpr, COLS: tl.constexpr):
    """How `element` (int64 index) going from bits `old` to `value` (`SIZE` bytes each)
    moves its parameter's checksum: ``(new - old)`` at the element's place in its word,
    times the word's weight (its row's plus its column's in the grid of `COLS` words a row,
    or its tail weight past the grid's `grid` words)."""
    if SIZE < 8:
        diff = (value.to(tl.int64) & ((1 << (8 * SIZE)) - 1)) - (
            old.to(tl.int64) & ((1 << (8 * SIZE)) - 1)
        )
    else:
        diff = value.to(tl.int64) - old.to(tl.int64)
    byte = element * SIZE
    word = byte >> 3
    diff = diff << ((byte & 7) * 8)
    inside = mix(((word // COLS) * 4).to(tl.uint64)) + mix(((word % COLS) * 4 + 1).to(tl.uint64))
    tail = mix(((word - grid) * 4 + 2).to(tl.uint64))
    weight = tl.where(word < grid, inside, tail).to(tl.int64, bitcast=True)
    return diff * weight


@triton.jit(do_not_specialize_on_alignment=[*_SCATTER_TABLES, "grid_ptr"])
def scatter_change_kernel(
    dest_ptr,
    start_ptr,
    count_ptr,
    offsets_at_ptr,
    values_at_ptr,
    grid_ptr,
    payload_ptr,
    change_ptr,
    strict_ptr,
    BITS: tl.constexpr,
    SIZE: tl.constexpr,
    COLS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`scatter_kernel`, and how the block moves its parameter's checksum: each element's
    bits are read just before its value is written, and its `_weighted_change` (the grid's
    full rows holding ``grid_ptr[block]`` words) is summed into ``change_ptr[block]``.
    ``strict_ptr[block]`` is 1 where the block's offsets ascend strictly (no element is
    written twice, so each counts once)."""
    block = tl.program_id(0)
    dest = tl.load(dest_ptr + block).to(tl.pointer_type(BITS))
    start = tl.load(start_ptr + block)
    count = tl.load(count_ptr + block)
    grid = tl.load(grid_ptr + block)
    offsets = (payload_ptr + tl.load(offsets_at_ptr + block)).to(tl.pointer_type(tl.int16))
    values = (payload_ptr + tl.load(values_at_ptr + block)).to(tl.pointer_type(BITS))
    total = tl.zeros([CHUNK], dtype=tl.int64)
    repeats = tl.zeros([CHUNK], dtype=tl.int32)
    for first in range(0, count, CHUNK):
        lanes = first + tl.arange(0, CHUNK)
        live = lanes < count
        offset = tl.load(offsets + lanes, mask=live, other=0).to(tl.int64) & 0xFFFF
        before = tl.load(offsets + lanes - 1, mask=live & (lanes > 0), other=0).to(tl.int64)
        repeats += (live & (lanes > 0) & (offset <= (before & 0xFFFF))).to(tl.int32)
        value = tl.load(values + lanes, mask=live)
        element = start + offset
        old = tl.load(dest + element, mask=live, other=0)
        tl.store(dest + element, value, mask=live)
        total += tl.where(live, _weighted_change(element, old, value, grid, SIZE, COLS), 0)
    tl.store(change_ptr + block, tl.sum(total, axis=0))
    tl.store(strict_ptr + block, (tl.sum(repeats, axis=0) == 0).to(tl.int64))


@triton.jit(do_not_specialize_on_alignment=["elements_ptr", "old_ptr", "new_ptr", "count_ptr"])
def change_kernel(
    elements_ptr,
    old_ptr,
    new_ptr,
    count_ptr,
    grid_ptr,
    out_ptr,
    BITS: tl.constexpr,
    SIZE: tl.constexpr,
    COLS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """How one tile of a parameter's changes moves its checksum: ``count_ptr[tile]``
    elements (int64 indices read at address ``elements_ptr[tile]``) going from the bits at
    ``old_ptr[tile]`` to those at ``new_ptr[tile]``, their `_weighted_change` summed into
    ``out_ptr[tile]``."""
    tile = tl.program_id(0)
    elements = tl.load(elements_ptr + tile).to(tl.pointer_type(tl.int64))
    olds = tl.load(old_ptr + tile).to(tl.pointer_type(BITS))
    news = tl.load(new_ptr + tile).to(tl.pointer_type(BITS))
    count = tl.load(count_ptr + tile)
    grid = tl.load(grid_ptr + tile)
    lanes = tl.arange(0, CHUNK)
    live = lanes < count
    element = tl.load(elements + lanes, mask=live, other=0)
    old = tl.load(olds + lanes, mask=live, other=0)
    value = tl.load(news + lanes, mask=live, other=0)
    change = _weighted_change(element, old, value, grid, SIZE, COLS)
    tl.store(out_ptr + tile, tl.sum(tl.where(live, change, 0), axis=0))


@triton.jit(
    do_not_specialize=["total"],
    do_not_specialize_on_alignment=["offsets_at_ptr", "count_ptr", "payload_ptr"],
)
def largest_offset_kernel(
    offsets_at_ptr, count_ptr, payload_ptr, out_ptr, total, LIMIT: tl.constexpr, CHUNK: tl.constexpr
):
    """The largest 16-bit offset of each block (0 for none), read only inside the payload's
    ``total`` bytes and for at most ``LIMIT`` offsets a block, whatever its table says: the
    tables are checked after this pass, before anything is written."""
    block = tl.program_id(0)
    at = tl.load(offsets_at_ptr + block)
    count = tl.minimum(tl.maximum(tl.load(count_ptr + block), 0), LIMIT)
    largest = tl.zeros([CHUNK], dtype=tl.int64)
    for first in range(0, count, CHUNK):
        lanes = first + tl.arange(0, CHUNK)
        place = at + 2 * lanes.to(tl.int64)
        live = (lanes < count) & (place >= 0) & (place + 2 <= total)
        offset = tl.load((payload_ptr + place).to(tl.pointer_type(tl.int16)), mask=live, other=0)
        largest = tl.maximum(largest, offset.to(tl.int64) & 0xFFFF)
    tl.store(out_ptr + block, tl.max(largest, axis=0))


# --- one fused pass per bucket ------------------------------------------------------------
# A bucket's tensors of one kind (source dtype, rollout dtype) are cut into tiles of
# ``ROWS * 32 * STEPS`` elements, numbered across the bucket. A program finds its tile's
# tensor by a binary search over the tensors' first tiles (a table of one entry a tensor),
# and addresses the tensor as ``base + offset``: the offsets are multiples of 16 bytes, so
# the loads stay vectorised (a pointer read from a table would lose its alignment).


@triton.jit
def _bucket_tensor(tile, first_tile_ptr, num_tensors, SEARCH: tl.constexpr):
    """The index of the tensor holding global `tile`: the last whose first tile is at most
    `tile` (`first_tile_ptr` ascending, `num_tensors` + 1 entries)."""
    lo = tl.zeros((), dtype=tl.int32)
    hi = tl.zeros((), dtype=tl.int32) + num_tensors
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        below = tl.load(first_tile_ptr + mid) <= tile
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _count_step(
    new_base,
    ref_base,
    bitmap_ptr,
    prefix_ptr,
    word0,
    index,
    rows,
    cols,
    numel,
    before,
    MASKED: tl.constexpr,
    CAST: tl.constexpr,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    WRITE_BITMAP: tl.constexpr,
    WRITE_PREFIX: tl.constexpr,
):
    """Compare one step's ``[rows, 32]`` elements at `index`; store each row's changes as a
    32-bit word of the bitmap (and the changes of the tile before the row, `before` being
    those before the step); return the changes."""
    if MASKED:
        inside = index < numel
        value = tl.load(new_base + index, mask=inside, other=0)
        old = tl.load(ref_base + index, mask=inside, other=0)
    else:
        value = tl.load(new_base + index)
        old = tl.load(ref_base + index)
    if CAST:  # noqa: SIM108 - a constexpr branch, resolved when the kernel compiles
        bits = value.to(FLOAT).to(BITS, bitcast=True)
    else:
        bits = value
    # Lanes past the tensor load 0 on both sides: equal, so never counted.
    flags = (bits != old).to(tl.int32)
    if WRITE_BITMAP:
        # Distinct powers of two: their sum is their bitwise or (bit 31 wraps into the sign).
        tl.store(bitmap_ptr + word0 + rows, tl.sum(flags << cols[None, :], axis=1))
    row_counts = tl.sum(flags, axis=1)
    if WRITE_PREFIX:
        first = before + tl.cumsum(row_counts, axis=0) - row_counts
        tl.store(prefix_ptr + word0 + rows, first.to(tl.int16))
    return tl.sum(row_counts, axis=0)


@triton.jit(do_not_specialize=_BUCKET_SCALARS, do_not_specialize_on_alignment=_BUCKET_TABLES)
def bucket_count_kernel(
    new_ptr,
    ref_ptr,
    new_off_ptr,
    ref_off_ptr,
    numel_ptr,
    first_tile_ptr,
    num_tensors,
    tile0,
    counts_ptr,
    bitmap_ptr,
    prefix_ptr,
    CAST: tl.constexpr,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    STEPS: tl.constexpr,
    SEARCH: tl.constexpr,
    NEW_ALIGN: tl.constexpr,
    REF_ALIGN: tl.constexpr,
    WRITE_BITMAP: tl.constexpr,
    WRITE_PREFIX: tl.constexpr,
):
    """Pass 1 of a bucket: per tile, how many elements differ from the reference (and, with
    `WRITE_BITMAP`, which: one bit each; with `WRITE_PREFIX`, per 32-bit word of the bitmap
    the changes in its tile before it, as int16). Reads each tile's new bytes and reference
    once."""
    tile = tile0 + tl.program_id(0)
    t = _bucket_tensor(tile, first_tile_ptr, num_tensors, SEARCH)
    numel = tl.load(numel_ptr + t)
    start = (tile - tl.load(first_tile_ptr + t)).to(tl.int64) * (ROWS * 32 * STEPS)
    new_base = new_ptr + tl.multiple_of(tl.load(new_off_ptr + t), NEW_ALIGN)
    ref_base = ref_ptr + tl.multiple_of(tl.load(ref_off_ptr + t), REF_ALIGN)
    cols = tl.arange(0, 32)
    word0 = tile.to(tl.int64) * (ROWS * STEPS)
    count = tl.zeros((), dtype=tl.int32)
    if start + ROWS * 32 * STEPS <= numel:
        for s in tl.static_range(STEPS):
            rows = s * ROWS + tl.arange(0, ROWS)
            index = start + (rows * 32)[:, None] + cols[None, :]
            count += _count_step(
                new_base, ref_base, bitmap_ptr, prefix_ptr, word0, index, rows, cols, numel,
                count, False, CAST, FLOAT, BITS, WRITE_BITMAP, WRITE_PREFIX,
            )  # fmt: skip
    else:
        for s in tl.static_range(STEPS):
            rows = s * ROWS + tl.arange(0, ROWS)
            index = start + (rows * 32)[:, None] + cols[None, :]
            count += _count_step(
                new_base, ref_base, bitmap_ptr, prefix_ptr, word0, index, rows, cols, numel,
                count, True, CAST, FLOAT, BITS, WRITE_BITMAP, WRITE_PREFIX,
            )  # fmt: skip
    tl.store(counts_ptr + tile, count)


@triton.jit
def _write_step(
    new_base,
    ref_base,
    bitmap_ptr,
    word0,
    index,
    rows,
    cols,
    numel,
    place0,
    elements_ptr,
    new_out_ptr,
    old_out_ptr,
    MASKED: tl.constexpr,
    CAST: tl.constexpr,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    FROM_BITMAP: tl.constexpr,
):
    """Write one step's changed elements (index, new bits, old bits) from output position
    `place0` on, in order, and their new bits into the reference; return how many."""
    if FROM_BITMAP:
        words = tl.load(bitmap_ptr + word0 + rows)
        flags = (words[:, None] >> cols[None, :]) & 1
        changed = flags != 0
        # Only the changed lanes are read: the sectors holding no change are not fetched.
        value = tl.load(new_base + index, mask=changed, other=0)
        old = tl.load(ref_base + index, mask=changed, other=0)
        if CAST:  # noqa: SIM108 - a constexpr branch, resolved when the kernel compiles
            bits = value.to(FLOAT).to(BITS, bitcast=True)
        else:
            bits = value
    else:
        if MASKED:
            inside = index < numel
            value = tl.load(new_base + index, mask=inside, other=0)
            old = tl.load(ref_base + index, mask=inside, other=0)
        else:
            value = tl.load(new_base + index)
            old = tl.load(ref_base + index)
        if CAST:  # noqa: SIM108 - a constexpr branch, resolved when the kernel compiles
            bits = value.to(FLOAT).to(BITS, bitcast=True)
        else:
            bits = value
        changed = bits != old
        flags = changed.to(tl.int32)
    row_counts = tl.sum(flags, axis=1)
    row_first = tl.cumsum(row_counts, axis=0) - row_counts
    place = place0 + (row_first[:, None] + tl.cumsum(flags, axis=1) - flags).to(tl.int64)
    tl.store(elements_ptr + place, index, mask=changed)
    tl.store(new_out_ptr + place, bits, mask=changed)
    tl.store(old_out_ptr + place, old, mask=changed)
    tl.store(ref_base + index, bits, mask=changed)
    return tl.sum(row_counts, axis=0)


@triton.jit(
    do_not_specialize=[*_BUCKET_SCALARS, "base"], do_not_specialize_on_alignment=_BUCKET_TABLES
)
def bucket_write_kernel(
    new_ptr,
    ref_ptr,
    new_off_ptr,
    ref_off_ptr,
    numel_ptr,
    first_tile_ptr,
    num_tensors,
    tile0,
    counts_ptr,
    starts_ptr,
    base,
    bitmap_ptr,
    elements_ptr,
    new_out_ptr,
    old_out_ptr,
    CAST: tl.constexpr,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    STEPS: tl.constexpr,
    SEARCH: tl.constexpr,
    NEW_ALIGN: tl.constexpr,
    REF_ALIGN: tl.constexpr,
    FROM_BITMAP: tl.constexpr,
):
    """Pass 2 of a bucket: each tile with changes writes them (its tensor's element index,
    new bits, old bits) at its place, the exclusive prefix sum of the counts less `base`
    (this kind's first: its outputs are its own), and updates the reference."""
    tile = tile0 + tl.program_id(0)
    if tl.load(counts_ptr + tile) > 0:
        t = _bucket_tensor(tile, first_tile_ptr, num_tensors, SEARCH)
        numel = tl.load(numel_ptr + t)
        start = (tile - tl.load(first_tile_ptr + t)).to(tl.int64) * (ROWS * 32 * STEPS)
        new_base = new_ptr + tl.multiple_of(tl.load(new_off_ptr + t), NEW_ALIGN)
        ref_base = ref_ptr + tl.multiple_of(tl.load(ref_off_ptr + t), REF_ALIGN)
        cols = tl.arange(0, 32)
        word0 = tile.to(tl.int64) * (ROWS * STEPS)
        # The elements' output is the bucket's, shifted by the caller to this kind's first.
        place = tl.load(starts_ptr + tile) - base
        if start + ROWS * 32 * STEPS <= numel:
            for s in tl.static_range(STEPS):
                rows = s * ROWS + tl.arange(0, ROWS)
                index = start + (rows * 32)[:, None] + cols[None, :]
                place += _write_step(
                    new_base, ref_base, bitmap_ptr, word0, index, rows, cols, numel,
                    place, elements_ptr, new_out_ptr,
                    old_out_ptr, False, CAST, FLOAT, BITS, FROM_BITMAP,
                )  # fmt: skip
        else:
            for s in tl.static_range(STEPS):
                rows = s * ROWS + tl.arange(0, ROWS)
                index = start + (rows * 32)[:, None] + cols[None, :]
                place += _write_step(
                    new_base, ref_base, bitmap_ptr, word0, index, rows, cols, numel,
                    place, elements_ptr, new_out_ptr,
                    old_out_ptr, True, CAST, FLOAT, BITS, FROM_BITMAP,
                )  # fmt: skip


@triton.jit
def _popcount(x):
    """Set bits of each 32-bit value in int64 `x` (SWAR: no intrinsic, so that Triton's
    interpreter runs it too)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0xFF


@triton.jit(
    do_not_specialize=[*_BUCKET_SCALARS, "base"], do_not_specialize_on_alignment=_BUCKET_TABLES
)
def bucket_select_kernel(
    new_ptr,
    ref_ptr,
    new_off_ptr,
    ref_off_ptr,
    numel_ptr,
    first_tile_ptr,
    num_tensors,
    tile0,
    counts_ptr,
    starts_ptr,
    base,
    bitmap_ptr,
    prefix_ptr,
    elements_ptr,
    new_out_ptr,
    old_out_ptr,
    CAST: tl.constexpr,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    WORDS: tl.constexpr,
    WORD_SEARCH: tl.constexpr,
    SEARCH: tl.constexpr,
    NEW_ALIGN: tl.constexpr,
    REF_ALIGN: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """Pass 2 of a bucket by its changes rather than its elements: each tile with changes
    takes them `SLOTS` at a time, lane ``j`` its ``j``-th change, found by a binary search
    over the first pass's per-word prefix and a select in the word; then reads those
    elements' new and old bits, writes them in order at the tile's place (as
    `bucket_write_kernel`) and updates the reference. Its work is in the changes, not in
    the tile's elements."""
    tile = tile0 + tl.program_id(0)
    count = tl.load(counts_ptr + tile)
    if count > 0:
        t = _bucket_tensor(tile, first_tile_ptr, num_tensors, SEARCH)
        start = (tile - tl.load(first_tile_ptr + t)).to(tl.int64) * (WORDS * 32)
        new_base = new_ptr + tl.multiple_of(tl.load(new_off_ptr + t), NEW_ALIGN)
        ref_base = ref_ptr + tl.multiple_of(tl.load(ref_off_ptr + t), REF_ALIGN)
        place0 = tl.load(starts_ptr + tile) - base
        word0 = tile.to(tl.int64) * WORDS
        # A loop, not unrolled: its body is large, and a tile has only a few rounds of
        # changes at a delta's density (an unrolled body per round took minutes to compile).
        for first in range(0, WORDS * 32, SLOTS):
            if first < count:
                slot = first + tl.arange(0, SLOTS)
                live = slot < count
                # The last word whose changes before it are at most the slot's rank: the
                # word holding it (a word without changes shares its next one's prefix).
                lo = tl.zeros([SLOTS], dtype=tl.int32)
                hi = tl.zeros([SLOTS], dtype=tl.int32) + WORDS
                for _ in tl.static_range(WORD_SEARCH):
                    mid = (lo + hi) // 2
                    below = tl.load(prefix_ptr + word0 + mid).to(tl.int32) <= slot
                    lo = tl.where(below, mid, lo)
                    hi = tl.where(below, hi, mid)
                word = tl.load(bitmap_ptr + word0 + lo).to(tl.int64) & 0xFFFFFFFF
                rank = (slot - tl.load(prefix_ptr + word0 + lo).to(tl.int32)).to(tl.int64)
                # The rank-th set bit of the word, by halving: 16, 8, 4, 2, 1 bits.
                bit = tl.zeros([SLOTS], dtype=tl.int64)
                for half in tl.static_range(5):
                    width = 16 >> half
                    low = _popcount((word >> bit) & ((1 << width) - 1))
                    up = rank >= low
                    bit += tl.where(up, width, 0)
                    rank -= tl.where(up, low, 0)
                index = start + lo.to(tl.int64) * 32 + bit
                value = tl.load(new_base + index, mask=live, other=0)
                old = tl.load(ref_base + index, mask=live, other=0)
                if CAST:  # noqa: SIM108 - a constexpr branch, resolved when the kernel compiles
                    bits = value.to(FLOAT).to(BITS, bitcast=True)
                else:
                    bits = value
                place = place0 + slot
                tl.store(elements_ptr + place, index, mask=live)
                tl.store(new_out_ptr + place, bits, mask=live)
                tl.store(old_out_ptr + place, old, mask=live)
                tl.store(ref_base + index, bits, mask=live)
