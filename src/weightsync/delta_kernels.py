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
import os
from collections.abc import Sequence

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
    import triton.language as tl

    bits = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[element_size]
    if dest.numel():
        kernels[3][(dest.numel(),)](
            dest, start, count, offsets_at, values_at, payload, BITS=bits, CHUNK=SCATTER_CHUNK
        )
