"""The bytes of a delta sync and the checksum both ends compute.

A delta sync writes, into each rollout rank, only the elements that changed since the bytes
the rank verifiably holds (its *base*). The sender encodes them once per source tensor and
lays them out per rank as one *payload*, written one-sidedly into a region the rank
registered for it (its *delta region*); the rank applies the payload in place and checks the
result. This module is what both ends share, and imports nothing but torch and numpy, so
that an engine's worker (e.g. SGLang's custom weight loader) can apply deltas without the
rest of the library.

A payload, every offset in bytes from its start and a multiple of 8::

    head      int64[8]    MAGIC, FORMAT_VERSION, num_sections, num_blocks,
                          sections_at, blocks_at, total_bytes, 0
    sections  int64[num_sections, 8]
                          param_index, kind, count, values_at, offsets_at,
                          first_block, num_blocks, start
    blocks    int64[num_blocks, 2]   start element, count
    offsets   int16[...]  per sparse section, its elements' offsets from their block's start
    values    per section, its elements' bytes (the parameter's element size each)

A section writes ``count`` elements of one parameter (``param_index``: its position in the
rank's parameter names, sorted). A ``SPARSE`` section's elements are the ``count`` of its
blocks added up: block ``b`` holds elements ``start_b + offset`` with offsets below 65,536,
so an element costs two bytes of position beside its value. A ``DENSE`` section writes the
elements ``start .. start + count`` from its values, for runs where most elements changed.

The checksum (`checksum`) covers every byte of a parameter at memory speed with two integer
reductions, and is linear in the bytes: the sender computes how a delta moves it
(`checksum_change`) from the old and new values of the elements it changes, so a rank whose
base checksum matched and whose checksum after applying, read over every byte, equals
base + change holds exactly the bytes the trainer meant, every byte of them. The rank can
also derive its checksum after from the base's and the elements it wrote, read before and
after writing (`apply_and_check`'s ``"changes"`` check): that proves every element written,
at a cost in the changed elements, and leaves bytes written since the base was read into
other elements to the next full read.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from weightsync import delta_kernels

MAGIC = 0x57534445_4C544131  # "WSDELTA1"
FORMAT_VERSION = 1
HEAD_WORDS = 8
SECTION_WORDS = 8
BLOCK_ELEMENTS = 1 << 16  # a sparse block spans 65,536 elements: 16-bit offsets
# Words (8 bytes) per row of the checksum's grid: rows and columns are both summed.
CHECK_ROW_WORDS = 512
_ROW_SHIFT = CHECK_ROW_WORDS.bit_length() - 1

_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SectionKind(enum.IntEnum):
    """How a section addresses its elements."""

    SPARSE = 0
    DENSE = 1


class DeltaFormatError(ValueError):
    """A payload that is not a delta this module wrote, or that does not fit the rank's
    parameters: nothing of it was applied."""


def bits_dtype(element_size: int) -> torch.dtype:
    """The integer dtype whose elements are `element_size` bytes (the raw bits of values).

    Raises:
        ValueError: an element size other than 1, 2, 4 or 8.
    """
    dtype = _BITS_DTYPES.get(element_size)
    if dtype is None:
        raise ValueError(f"delta values must be 1, 2, 4 or 8 bytes each, got {element_size}")
    return dtype


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s elements as raw integer bits, flat (a view of a contiguous tensor)."""
    return tensor.reshape(-1).view(bits_dtype(tensor.element_size()))


def _align(num_bytes: int) -> int:
    return (num_bytes + 7) // 8 * 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Section:
    """Changed elements of one parameter of one rank, before they are laid out.

    Attributes:
        param_index: the parameter's position in the rank's parameter names, sorted.
        elements: element indices into the flat parameter (int64, any order, no repeats);
            for a dense section, ``None`` and the elements are ``start .. start + len(values)``.
        values: their new bits (`bits_dtype` of the parameter's element size), one per element.
        start: a dense section's first element.
    """

    param_index: int
    elements: torch.Tensor | None
    values: torch.Tensor
    start: int = 0

    @property
    def kind(self) -> SectionKind:
        """Sparse with element indices, dense without."""
        return SectionKind.DENSE if self.elements is None else SectionKind.SPARSE


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadSize:
    """The bytes a payload takes, computed before it is built."""

    num_bytes: int
    num_elements: int


def payload_size(sections: Sequence[Section]) -> PayloadSize:
    """How many bytes `encode_payload` will produce for `sections` (one device sync per sparse
    section, to count its blocks)."""
    return PayloadSize(
        num_bytes=lay_out(sections).num_bytes,
        num_elements=sum(s.values.numel() for s in sections),
    )


def _blocks(elements: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block starts, counts)`` of runs of `elements` in the same 65,536-element block."""
    ids, counts = torch.unique_consecutive(elements >> 16, return_counts=True)
    return ids << 16, counts


def _layout(sections: Sequence[Section], num_blocks: Sequence[int]) -> list[int]:
    """Byte offsets: sections table, blocks table, each section's offsets and values, end."""
    at = HEAD_WORDS * 8
    places = [at]
    at += len(sections) * SECTION_WORDS * 8
    places.append(at)
    at += sum(num_blocks) * 16
    for section in sections:
        if section.elements is not None:
            places.append(at)
            at = _align(at + section.values.numel() * 2)
        else:
            places.append(at)
        places.append(at)
        at = _align(at + section.values.numel() * section.values.element_size())
    places.append(at)
    return places


def encode_payload(sections: Sequence[Section], device: torch.device | str) -> torch.Tensor:
    """`sections` laid out as one payload (uint8) on `device` (`lay_out`, then
    `PayloadLayout.write` into a new tensor).

    Raises:
        ValueError: a section whose values are not integer bits, or whose element count
            differs from its values'.
    """
    layout = lay_out(sections)
    payload = torch.empty(layout.num_bytes, dtype=torch.uint8, device=device)
    layout.write(payload)
    return payload


@dataclass(frozen=True, slots=True)
class PayloadLayout:
    """Where each part of one payload goes, known before any of it is written (`lay_out`),
    so that a sender can size the memory it writes the payload into first.

    Attributes:
        sections: the payload's sections, in order.
        blocks: per section, its blocks' ``(starts, counts)`` (None for a dense section).
        places: byte offsets: the section table, the block table, each section's offsets
            and values, and the end (`num_bytes`).
    """

    sections: tuple[Section, ...]
    blocks: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    places: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        """The payload's size."""
        return self.places[-1]

    def write(self, out: torch.Tensor) -> None:
        """Write the payload into the first `num_bytes` of `out` (uint8, contiguous, on any
        device; the sections' tensors are copied there). Every one of those bytes is
        written, the alignment padding as zeros, so that the payload does not depend on
        what `out` held.

        Raises:
            ValueError: `out` is not a contiguous uint8 tensor of at least `num_bytes`.
        """
        total = self.num_bytes
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < total:
            raise ValueError(
                f"a payload of {total} bytes needs a contiguous uint8 tensor at least that "
                f"large, got {out.dtype} of {out.numel()} elements"
            )
        places = self.places
        num_blocks = [b[0].numel() if b is not None else 0 for b in self.blocks]
        out[:total].zero_()
        rows, block_rows = [], []
        first_block = 0
        for i, (section, block) in enumerate(zip(self.sections, self.blocks, strict=True)):
            offsets_at, values_at = places[2 + 2 * i], places[3 + 2 * i]
            count = section.values.numel()
            rows.append(
                [
                    section.param_index,
                    int(section.kind),
                    count,
                    values_at,
                    offsets_at,
                    first_block,
                    num_blocks[i],
                    section.start,
                ]
            )
            if block is not None and section.elements is not None:
                starts, counts = block
                block_rows.append(torch.stack([starts, counts], dim=1))
                first_block += num_blocks[i]
                # An element's offset in its block is its low 16 bits: the int16 cast keeps
                # them (integer casts wrap), in one pass and no temporary.
                out[offsets_at : offsets_at + 2 * count].view(torch.int16).copy_(section.elements)
            value_bytes = count * section.values.element_size()
            out[values_at : values_at + value_bytes].copy_(
                section.values.reshape(-1).view(torch.uint8)
            )
        head = [
            MAGIC,
            FORMAT_VERSION,
            len(self.sections),
            sum(num_blocks),
            places[0],
            places[1],
            total,
            0,
        ]
        table = torch.tensor([head, *rows], dtype=torch.int64).reshape(-1)
        out[: places[1]].copy_(table.view(torch.uint8))
        if block_rows:
            # One copy of every block row, wherever the sections' elements lie.
            joined = torch.cat(block_rows).reshape(-1)
            out[places[1] : places[1] + joined.numel() * 8].copy_(joined.view(torch.uint8))


def lay_out(sections: Sequence[Section]) -> PayloadLayout:
    """Where each part of a payload of `sections` goes (one device sync per sparse section,
    to count its blocks); `PayloadLayout.write` then writes it.

    Raises:
        ValueError: a section whose values are not integer bits, or whose element count
            differs from its values'.
    """
    for section in sections:
        if section.values.dtype not in _BITS_DTYPES.values():
            raise ValueError(
                f"section of parameter {section.param_index}: values must be raw bits "
                f"(int8/16/32/64), got {section.values.dtype}"
            )
        if section.elements is not None and section.elements.numel() != section.values.numel():
            raise ValueError(
                f"section of parameter {section.param_index}: "
                f"{section.elements.numel()} elements but {section.values.numel()} values"
            )
    blocks = tuple(_blocks(s.elements) if s.elements is not None else None for s in sections)
    num_blocks = [b[0].numel() if b is not None else 0 for b in blocks]
    return PayloadLayout(
        sections=tuple(sections), blocks=blocks, places=tuple(_layout(sections, num_blocks))
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Applied:
    """What applying a payload did.

    Attributes:
        params: the indices of the parameters it wrote.
        num_elements: elements written.
    """

    params: tuple[int, ...]
    num_elements: int


@dataclass(frozen=True, slots=True)
class _Write:
    """One section of a checked payload, ready to write: ``elements`` (on the parameter's
    device) for a sparse section, None for a dense run from ``start``."""

    index: int
    start: int
    elements: torch.Tensor | None
    values: torch.Tensor


def apply_payload(payload: torch.Tensor, params: Sequence[torch.Tensor]) -> Applied:
    """Write the elements of `payload` into `params` (the rank's parameters, by sorted name).

    Every section is checked against its parameter (index, element count, bounds) before
    the first element is written, so a payload that does not fit changes nothing.

    Args:
        payload: the bytes the sender wrote (uint8, on any device; the tables are read to the
            host once).
        params: the rank's parameters in the order of their sorted names, each contiguous.

    Raises:
        DeltaFormatError: a bad magic, version or size, or a section that does not fit.
    """
    if _scatters(payload, params):
        scattered = _scatter_payload(payload, params)
        return Applied(params=tuple(sorted(scattered.written)), num_elements=scattered.num_elements)
    writes = _read_payload(payload, params)
    for write in writes:
        _write(as_bits(params[write.index]), write)
    return Applied(
        params=tuple(sorted({w.index for w in writes})),
        num_elements=sum(w.values.numel() for w in writes),
    )


def _payload_tables(
    payload: torch.Tensor, *, blocks: bool = True
) -> tuple[int, np.ndarray, np.ndarray]:
    """``(total bytes, section rows, block rows)`` of `payload`, read to the host (int64
    arrays of `SECTION_WORDS` and 2 columns; without `blocks`, the block rows are left on
    the payload's device and an empty array stands for them), its head and tables checked
    (each section is checked against its parameter by `_checked_tables`).

    Raises:
        DeltaFormatError: a bad magic, version or size, or tables that do not fit.
    """
    if payload.dtype != torch.uint8 or payload.numel() < HEAD_WORDS * 8:
        raise DeltaFormatError(f"a delta payload is uint8 of at least {HEAD_WORDS * 8} bytes")
    head = payload[: HEAD_WORDS * 8].cpu().view(torch.int64).tolist()
    magic, version, num_sections, num_blocks, sections_at, blocks_at, total, _ = head
    if magic != MAGIC or version != FORMAT_VERSION:
        raise DeltaFormatError(
            f"not a weightsync delta payload (magic {magic:#x}, version {version}); the sender "
            f"and this rank must run the same delta format ({FORMAT_VERSION})"
        )
    if total > payload.numel() or total % 8 or sections_at != HEAD_WORDS * 8:
        raise DeltaFormatError(
            f"the payload says {total} bytes but {payload.numel()} were given to apply"
        )
    if num_sections < 0 or num_blocks < 0:
        raise DeltaFormatError("the payload's tables do not fit inside it")
    tables_end = blocks_at + num_blocks * 16
    if not (sections_at + num_sections * SECTION_WORDS * 8 == blocks_at <= tables_end <= total):
        raise DeltaFormatError("the payload's tables do not fit inside it")
    tables = payload[sections_at : tables_end if blocks else blocks_at].cpu().numpy()
    sections = tables[: blocks_at - sections_at].view(np.int64).reshape(-1, SECTION_WORDS)
    if not blocks:
        return total, sections, np.zeros((num_blocks, 0), dtype=np.int64)
    rows = tables[blocks_at - sections_at :].view(np.int64).reshape(-1, 2)
    return total, sections, rows


def _checked_tables(
    payload: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[int, np.ndarray, np.ndarray]:
    """`_payload_tables` of `payload`, every section checked against its parameter (index,
    element count, bounds) at once; the first section that does not fit is named by
    `_check_section`.

    Raises:
        DeltaFormatError: a bad head or tables, or a section that does not fit.
    """
    total, sections, blocks = _payload_tables(payload)
    numels = np.array([p.numel() for p in params], dtype=np.int64)
    sizes = np.array([p.element_size() for p in params], dtype=np.int64)
    if not _sections_fit(sections, blocks, numels, sizes, total):
        for row in sections.tolist():
            _check_section(row, blocks, params, total)
        raise DeltaFormatError("the payload's sections do not fit its parameters")
    return total, sections, blocks


def _sections_fit(
    sections: np.ndarray, blocks: np.ndarray, numels: np.ndarray, sizes: np.ndarray, total: int
) -> bool:
    """Whether every section fits its parameter (of `numels` elements of `sizes` bytes) and
    the payload's `total` bytes, its blocks included, as `_check_section` checks one."""
    if not _section_fields_fit(sections, blocks.shape[0], numels, sizes, total):
        return False
    index, kind, count, _, _, first, nblocks, _ = sections.T
    sparse = kind == SectionKind.SPARSE
    spans = np.where(sparse, nblocks, 0)
    owner = np.repeat(np.arange(sections.shape[0]), spans)
    begins = np.cumsum(spans) - spans
    block_rows = np.arange(owner.size) - begins[owner] + first[owner]
    starts, counts = blocks[block_rows, 0], blocks[block_rows, 1]
    numel = numels[index[owner]]
    if ((counts < 0) | (counts > BLOCK_ELEMENTS) | (starts < 0) | (starts >= numel)).any():
        return False
    added = np.concatenate([[0], np.cumsum(counts)])
    return not (sparse & (added[begins + spans] - added[begins] != count)).any()


def _section_fields_fit(
    sections: np.ndarray, num_blocks: int, numels: np.ndarray, sizes: np.ndarray, total: int
) -> bool:
    """Whether every section's own fields fit its parameter and the payload (its blocks
    apart): `_sections_fit`'s checks of the section table. Every field is bounded before
    it takes part in a sum, so that no hostile value wraps int64 into range."""
    index, kind, count, values_at, offsets_at, first, nblocks, start = sections.T
    fits = (index >= 0) & (index < numels.size)
    param = np.where(fits, index, 0)
    numel = numels[param] if numels.size else np.zeros_like(index)
    size = sizes[param] if sizes.size else np.ones_like(index)
    fits &= (count >= 0) & (count <= total) & (values_at >= 0) & (values_at <= total)
    fits &= (values_at % 8 == 0) & (values_at + count * size <= total)
    dense, sparse = kind == SectionKind.DENSE, kind == SectionKind.SPARSE
    fits &= dense | sparse
    fits &= ~dense | ((start >= 0) & (start <= numel) & (count <= numel - start))
    fits &= ~sparse | (
        (offsets_at >= 0)
        & (offsets_at <= total)
        & (offsets_at % 8 == 0)
        & (offsets_at + 2 * count <= total)
        & (first >= 0)
        & (first <= num_blocks)
        & (nblocks >= 0)
        & (nblocks <= num_blocks - first)
        & ((nblocks > 0) | (count == 0))
    )
    return bool(fits.all())


def _read_payload(payload: torch.Tensor, params: Sequence[torch.Tensor]) -> list[_Write]:
    """`payload`'s sections as writes into `params`, every one checked; nothing written.

    Raises:
        DeltaFormatError: a bad magic, version or size, or a section that does not fit.
    """
    _, sections, block_rows = _checked_tables(payload, params)
    blocks = torch.from_numpy(block_rows)
    writes: list[_Write] = []
    highest: list[torch.Tensor] = []
    # The block table goes to the payload's device once, not once per section.
    blocks_on_device = blocks.to(payload.device) if blocks.shape[0] else blocks
    for row in sections.tolist():
        index, kind, count, values_at, offsets_at, first, nblocks, start = row
        param = as_bits(params[index])
        values = payload[values_at : values_at + count * param.element_size()].view(param.dtype)
        if kind == SectionKind.DENSE:
            writes.append(_Write(index, start, None, values))
            continue
        starts = blocks_on_device[first : first + nblocks, 0]
        counts = blocks_on_device[first : first + nblocks, 1]
        offsets = payload[offsets_at : offsets_at + 2 * count].view(torch.int16)
        elements = torch.repeat_interleave(starts, counts, output_size=count)
        elements += offsets.to(torch.int64) & 0xFFFF
        writes.append(_Write(index, 0, elements.to(param.device), values.to(param.device)))
        if count:
            highest.append(elements.max() - params[index].numel())
    # Offsets are read on the device: one look at every section's largest element before the
    # first write (one host sync for all), so that a payload reaching past a parameter
    # changes nothing.
    if highest and int(torch.stack(highest).max()) >= 0:
        raise DeltaFormatError("a sparse section reaches past the end of its parameter")
    return writes


def _scatters(payload: torch.Tensor, params: Sequence[torch.Tensor]) -> bool:
    """Whether `payload` is applied by the fused scatter: it and every parameter on one
    CUDA device that runs the kernels (`weightsync.delta_kernels.ready`)."""
    device = payload.device
    return delta_kernels.ready(device) and all(p.device == device for p in params)


@dataclass(slots=True)
class _Scattered:
    """What `_scatter_payload` wrote: the parameters (indices) and the elements; with its
    derive, each dense section's checksum change (0-d tensors, by parameter), the sparse
    sections' changes and repeated writes summed per parameter (`moved`, `repeats`: int64
    tensors with one value per parameter, for the parameters in `summed`), and the
    parameters whose elements could have been written twice (`unordered`)."""

    written: set[int]
    num_elements: int
    changes: dict[int, list[torch.Tensor | int]] = field(default_factory=dict)
    moved: torch.Tensor | None = None
    repeats: torch.Tensor | None = None
    summed: tuple[int, ...] = ()
    unordered: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Blocks:
    """The blocks of a payload's sparse sections of one element size, as device tables."""

    element_size: int
    param: torch.Tensor
    owner: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    offsets_at: torch.Tensor
    values_at: torch.Tensor


def _scatter_payload(
    payload: torch.Tensor, params: Sequence[torch.Tensor], *, derive: bool = False
) -> _Scattered:
    """Apply `payload` with the fused scatter (`weightsync.delta_kernels.scatter_blocks`).

    The host reads the head and the section table only, and checks every section; the
    blocks are checked where they lie, on the device (counts, starts, each section's total,
    and each block's largest offset against its parameter's end), and one host sync for
    all of them comes before the first write. A payload that fails there is checked again
    on the host (`_checked_tables`) to say which section does not fit. With `derive`, the
    scatter also sums how each parameter's checksum moves, from each element's bits read
    just before its write (`weightsync.delta_kernels.scatter_blocks_changes`): the check
    then costs about the scatter, not another read of every byte.

    Raises:
        DeltaFormatError: as `_read_payload` (nothing written).
    """
    total, sections, blocks = _payload_tables(payload, blocks=False)
    num_blocks = blocks.shape[0]
    numels = np.array([p.numel() for p in params], dtype=np.int64)
    sizes = np.array([p.element_size() for p in params], dtype=np.int64)
    if not _section_fields_fit(sections, num_blocks, numels, sizes, total):
        _checked_tables(payload, params)  # names the section
        raise DeltaFormatError("the payload's sections do not fit its parameters")
    device = payload.device
    index, kind, count, values_at, offsets_at, first, nblocks, start = sections.T
    dense = kind == SectionKind.DENSE
    spans = np.where(dense, 0, nblocks)
    size = sizes[index] if index.size else index
    kinds = sorted(set(size[~dense].tolist()))
    addresses = np.array([p.data_ptr() for p in params], dtype=np.int64)
    grids = (numels * sizes + 7) // 8 // CHECK_ROW_WORDS * CHECK_ROW_WORDS
    # One upload of every small table: the sections' columns, the parameters', and each
    # element size's blocks per section.
    spans_by_kind = [np.where(size == k, spans, 0) for k in kinds]
    columns = [index, count, offsets_at, values_at, first, numels, addresses, grids]
    columns += spans_by_kind
    upload = torch.from_numpy(np.concatenate(columns)).to(device)
    num_sections, num_params = len(index), len(params)
    cut = [num_sections] * 5 + [num_params] * 3 + [num_sections] * len(kinds)
    index_d, count_d, offsets_d, values_d, first_d, numels_d, addresses_d, grids_d, *spans_d = (
        upload.split(cut)
    )
    rows = payload[HEAD_WORDS * 8 + num_sections * SECTION_WORDS * 8 :][: num_blocks * 16]
    block_table = rows.view(torch.int64).view(-1, 2)
    groups: list[_Blocks] = []
    faults: list[torch.Tensor] = []
    sections_d = torch.arange(num_sections, device=device)
    for k, spans_k, on_host in zip(kinds, spans_d, spans_by_kind, strict=True):
        owner = torch.repeat_interleave(sections_d, spans_k, output_size=int(on_host.sum()))
        begins = torch.cumsum(spans_k, 0) - spans_k
        local = torch.arange(owner.numel(), device=device) - begins[owner]
        # Contiguous columns: a kernel indexes its tables by block.
        starts, counts = block_table[first_d[owner] + local].T.contiguous()
        param = index_d[owner]
        numel = numels_d[param]
        faults.append(
            ((counts < 0) | (counts > BLOCK_ELEMENTS) | (starts < 0) | (starts >= numel)).any()
        )
        added = torch.cumsum(counts, 0) - counts
        before = added - added[begins[owner]]
        totals = torch.zeros(num_sections, dtype=torch.int64, device=device)
        totals.index_add_(0, owner, counts)
        faults.append(((totals != count_d) & (spans_k > 0)).any())
        group = _Blocks(
            element_size=k,
            param=param,
            owner=owner,
            starts=starts,
            counts=counts,
            offsets_at=offsets_d[owner] + 2 * before,
            values_at=values_d[owner] + k * before,
        )
        largest = delta_kernels.largest_offsets(payload, group.offsets_at, counts)
        faults.append((starts + largest >= numel).any())
        groups.append(group)
    # The one host sync before the first write.
    if faults and bool(torch.stack(faults).any()):
        _checked_tables(payload, params)  # names a section whose blocks do not fit
        raise DeltaFormatError("a sparse section reaches past the end of its parameter")
    done = _Scattered(written=set(index.tolist()), num_elements=int(count.sum()))
    for i, begin, n, at in zip(
        index[dense].tolist(),
        start[dense].tolist(),
        count[dense].tolist(),
        values_at[dense].tolist(),
        strict=True,
    ):
        bits = as_bits(params[i])
        values = payload[at : at + n * bits.element_size()].view(bits.dtype)
        if derive:
            change, _ = _write_and_change(bits, _Write(i, begin, None, values))
            done.changes.setdefault(i, []).append(change)
        else:
            bits[begin : begin + n].copy_(values)
    moved = torch.zeros(num_params, dtype=torch.int64, device=device)
    repeats = torch.zeros(num_params, dtype=torch.int64, device=device)
    for g in groups:
        tables = (addresses_d[g.param], g.starts, g.counts, g.offsets_at, g.values_at)
        if not derive:
            delta_kernels.scatter_blocks(payload, g.element_size, *tables)
            continue
        change, strict = delta_kernels.scatter_blocks_changes(
            payload, g.element_size, *tables, grids_d[g.param]
        )
        moved.index_add_(0, g.param, change)
        repeats.index_add_(0, g.param, 1 - strict)
        # A block that starts at or before the one before it in its section may write an
        # element that one wrote (the kernel sees repeats within a block).
        later = g.owner[1:] == g.owner[:-1]
        back = (later & (g.starts[1:] <= g.starts[:-1])).to(torch.int64)
        repeats.index_add_(0, g.param[1:], back)
    if not derive:
        return done
    done.moved, done.repeats = moved, repeats
    done.summed = tuple(sorted(set(index[~dense].tolist())))
    # Two sections of one parameter scatter at once, not one after the other.
    unique, times = np.unique(index, return_counts=True)
    done.unordered = set(unique[times > 1].tolist())
    return done


def _write(bits: torch.Tensor, write: _Write) -> None:
    """Write one section's values into a parameter's flat `bits`."""
    if write.elements is None:
        bits[write.start : write.start + write.values.numel()].copy_(write.values)
    else:
        bits.index_copy_(0, write.elements, write.values)


def _check_section(
    row: list[int], blocks: np.ndarray, params: Sequence[torch.Tensor], total: int
) -> None:
    """Check one section's fields against its parameter and the payload's size.

    Raises:
        DeltaFormatError: the section does not fit.
    """
    index, kind, count, values_at, offsets_at, first, nblocks, start = row
    if not 0 <= index < len(params):
        raise DeltaFormatError(f"a section names parameter {index} of {len(params)}")
    numel = params[index].numel()
    size = params[index].element_size()
    where = f"section of parameter {index} ({numel} elements)"
    if count < 0 or values_at < 0 or values_at % 8 or values_at + count * size > total:
        raise DeltaFormatError(f"{where}: its {count} values do not fit the payload")
    if kind == SectionKind.DENSE:
        if not 0 <= start <= start + count <= numel:
            raise DeltaFormatError(f"{where}: dense run {start}+{count} out of bounds")
    elif kind == SectionKind.SPARSE:
        if offsets_at < 0 or offsets_at % 8 or offsets_at + 2 * count > total or first < 0:
            raise DeltaFormatError(f"{where}: its offsets do not fit the payload")
        rows = blocks[first : first + nblocks]
        if rows.shape[0] != nblocks or int(rows[:, 1].sum()) != count:
            raise DeltaFormatError(f"{where}: its blocks do not add up to {count} elements")
        if nblocks and (int(rows[:, 1].min()) < 0 or int(rows[:, 1].max()) > BLOCK_ELEMENTS):
            raise DeltaFormatError(
                f"{where}: a block holds fewer than 0 or more than {BLOCK_ELEMENTS} elements"
            )
        if nblocks and (int(rows[:, 0].min()) < 0 or int(rows[:, 0].max()) >= numel):
            raise DeltaFormatError(f"{where}: a block starts outside the parameter")
    else:
        raise DeltaFormatError(f"{where}: unknown kind {kind}")


Check = Literal["changes", "full"]
"""How `apply_and_check` finds each parameter's checksum after applying: ``"changes"``
derives it from the proven base's and the changed elements (O(changed elements)),
``"full"`` reads every byte of every parameter again."""

CHECKS: tuple[str, ...] = ("changes", "full")


@dataclass(frozen=True, slots=True, kw_only=True)
class Checked:
    """What applying one rank's payloads and checking its checksums found
    (`apply_and_check`).

    Attributes:
        num_elements: elements the applied payloads wrote.
        refused: the index of the payload that was not a valid delta (it and those after
            it were not applied), or None.
        error: why it was refused, or None.
        mismatched: parameters whose checksum after applying differs from the expected one.
        unexpected: parameters a payload wrote that had no expected checksum.
        checksums: ``{param_name: checksum}`` of every parameter after applying.
        check: the check that ran: ``"changes"`` (derived from the base) or ``"full"``
            (every byte read again; also what a call without a base gets).
        recomputed: under ``"changes"``, the parameters whose checksum after was computed
            over all their bytes instead (not in the base, or written by a section whose
            elements were not strictly ascending, where a repeated element would count
            twice); empty under ``"full"``.
    """

    num_elements: int
    refused: int | None
    error: str | None
    mismatched: tuple[str, ...]
    unexpected: tuple[str, ...]
    checksums: dict[str, int]
    check: str = "full"
    recomputed: tuple[str, ...] = ()


def apply_and_check(
    payloads: Sequence[torch.Tensor],
    params: Mapping[str, torch.Tensor],
    expected: Mapping[str, int],
    *,
    base: Mapping[str, int] | None = None,
    check: Check = "changes",
) -> Checked:
    """Apply `payloads` in order to `params` (by name; numbered by their sorted names), stop
    at the first that is not a valid delta, then compare the checksum of every changed
    parameter with `expected` (every name in it must be one of `params`).

    With ``check="changes"`` and a `base`, each parameter's checksum after applying is
    derived, not read: its base checksum plus the change (`checksum_change`) of the elements
    the payloads wrote, from their bits read just before each section was written and read
    back just after. It costs a few passes over the changed elements instead of one over
    every byte, and proves every element a payload wrote: wrong values, elements, a section
    written to the wrong place, or a write into a changed element since the base was read
    all move the derived checksum off the trainers'. What it cannot see is a byte written
    since the base was read into an element no payload touches: the derived checksum then
    still says the base's value, and only a full pass (``check="full"``, or the next
    proof of the base) reads it. Without a `base`, or with ``check="full"``, every
    parameter is read again after applying. Where the payload and every parameter lie on
    one CUDA device that runs the fused kernels (`weightsync.delta_kernels.ready`), the
    scatter derives the change in the same pass, from each element's bits read just before
    its write (on an H100, 5.6 GB of bf16 at 2 %: about the scatter's time, where reading
    every byte again takes longer than the scatter). The result's ``check`` says which ran.

    Args:
        payloads: the payloads' bytes (uint8), in the order to apply them.
        params: every parameter of the rank by name.
        expected: ``{param_name: checksum}`` the changed parameters must hold after.
        base: ``{param_name: checksum}`` the rank computed over `params`' bytes and proved
            to the trainers before any payload was applied, with nothing written into them
            since but these payloads; a parameter missing from it is checksummed in full.
        check: ``"changes"`` (derive from `base`) or ``"full"``.

    Raises:
        ValueError: `check` is not one of `CHECKS`.
    """
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    names = sorted(params)
    ordered = [params[name] for name in names]
    derive = check == "changes" and base is not None
    changes: dict[int, list[torch.Tensor | int]] = {}
    ascending: dict[int, list[torch.Tensor | bool]] = {}
    sums: list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = []
    written: set[int] = set()
    num_elements = 0
    refused, error = None, None
    for index, payload in enumerate(payloads):
        if _scatters(payload, ordered):
            try:
                scattered = _scatter_payload(payload, ordered, derive=derive)
            except DeltaFormatError as exc:
                refused, error = index, str(exc)
                break
            written.update(scattered.written)
            num_elements += scattered.num_elements
            for i, moved in scattered.changes.items():
                changes.setdefault(i, []).extend(moved)
                ascending.setdefault(i, []).extend([True] * len(moved))
            if scattered.moved is not None and scattered.repeats is not None:
                sums.append((scattered.moved, scattered.repeats, scattered.summed))
            for i in scattered.unordered:
                ascending.setdefault(i, []).append(False)
                changes.setdefault(i, [])
            continue
        try:
            writes = _read_payload(payload, ordered)
        except DeltaFormatError as exc:
            refused, error = index, str(exc)
            break
        for write in writes:
            bits = as_bits(ordered[write.index])
            if derive:
                change, strict = _write_and_change(bits, write)
                changes.setdefault(write.index, []).append(change)
                ascending.setdefault(write.index, []).append(strict)
            else:
                _write(bits, write)
            written.add(write.index)
            num_elements += write.values.numel()
    if derive and base is not None:
        after, recomputed = _derived(params, names, base, changes, ascending, sums)
    else:
        after, recomputed = checksums(params), ()
    return Checked(
        num_elements=num_elements,
        refused=refused,
        error=error,
        mismatched=tuple(name for name, value in expected.items() if after[name] != value),
        unexpected=tuple(names[i] for i in sorted(written) if names[i] not in expected),
        checksums=after,
        check="changes" if derive else "full",
        recomputed=recomputed,
    )


def _write_and_change(
    bits: torch.Tensor, write: _Write
) -> tuple[torch.Tensor | int, torch.Tensor | bool]:
    """Write one section into a parameter's flat `bits` and say how its checksum moved:
    ``(change, strictly ascending)``, the change from the elements' bits read just before
    the write and read back just after it. On a device both are 0-d tensors (no host
    sync); the second says that no element repeats, so that the change counts each once."""
    if bits.device.type == "cpu":
        return _host_write_and_change(bits, write)
    numel = bits.numel()
    if write.elements is None:
        span = slice(write.start, write.start + write.values.numel())
        old = bits[span].clone()
        bits[span].copy_(write.values)
        elements = torch.arange(span.start, span.stop, device=bits.device)
        return checksum_change(elements, old, bits[span], numel=numel), True
    elements = write.elements
    old = bits[elements]
    bits.index_copy_(0, elements, write.values)
    strict = (elements[1:] > elements[:-1]).all()
    return checksum_change(elements, old, bits[elements], numel=numel), strict


# Elements of a sparse section a host apply reads, writes and reads back at a time: the
# cache lines the first read brings stay in the cache for the write and the read back.
_APPLY_CHUNK = 1 << 14


def _host_write_and_change(bits: torch.Tensor, write: _Write) -> tuple[int, bool]:
    """`_write_and_change` on the host, with numpy (its take and put are several times
    faster than torch's CPU indexing), a chunk of elements at a time."""
    flat = bits.numpy()
    size = flat.itemsize
    weights = _host_weights(_align(flat.size * size) // 8)
    values = write.values.numpy()
    if write.elements is None:
        span = slice(write.start, write.start + values.size)
        old = flat[span].copy()
        flat[span] = values
        elements = np.arange(span.start, span.stop, dtype=np.int64)
        return _host_change_arrays(elements, old, flat[span], *weights), True
    where = write.elements.numpy()
    strict = where.size < 2 or bool((where[1:] > where[:-1]).all())
    change = 0
    for start in range(0, where.size, _APPLY_CHUNK):
        part = where[start : start + _APPLY_CHUNK]
        old = flat.take(part)
        flat[part] = values[start : start + _APPLY_CHUNK]
        change += _host_change_arrays(part, old, flat.take(part), *weights)
    return change, strict


def _derived(
    params: Mapping[str, torch.Tensor],
    names: Sequence[str],
    base: Mapping[str, int],
    changes: Mapping[int, Sequence[torch.Tensor | int]],
    ascending: Mapping[int, Sequence[torch.Tensor | bool]],
    sums: Sequence[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = (),
) -> tuple[dict[str, int], tuple[str, ...]]:
    """``({param_name: checksum after}, recomputed)``: each parameter's base checksum plus
    its sections' `changes` (by index into the sorted `names`) and its share of each fused
    scatter's `sums` (``(changes, repeats, indices)``, one value per parameter); computed
    over its bytes instead where it has no base, a section was not strictly `ascending`,
    or a scatter saw an element repeat. What a device computed reaches the host in one
    sync."""
    found = [x for index in changes for x in (*changes[index], *ascending[index])]
    pending = [x.to(torch.int64) for x in found if isinstance(x, torch.Tensor)]
    parts = [torch.stack(pending)] if pending else []
    parts += [vector for moved, repeats, _ in sums for vector in (moved, repeats)]
    synced = iter(torch.cat(parts).tolist() if parts else ())
    scalars = [next(synced) for _ in pending]
    single = iter(scalars)

    def value(x: torch.Tensor | int | bool) -> int:
        return int(next(single)) if isinstance(x, torch.Tensor) else int(x)

    total: dict[str, int] = {}
    recompute = {name for name in params if name not in base}
    for index in changes:
        moved = [value(x) for x in changes[index]]
        strict = [value(x) for x in ascending[index]]
        total[names[index]] = sum(moved)
        if not all(strict):
            recompute.add(names[index])
    for moved_d, _, indices in sums:
        moved = [next(synced) for _ in range(moved_d.numel())]
        repeats = [next(synced) for _ in range(moved_d.numel())]
        for index in indices:
            name = names[index]
            total[name] = total.get(name, 0) + moved[index]
            if repeats[index]:
                recompute.add(name)
    recomputed = tuple(name for name in params if name in recompute)
    full = checksums({name: params[name] for name in recomputed})
    after = {
        name: full[name] if name in recompute else _wrap_int64(base[name] + total.get(name, 0))
        for name in params
    }
    return after, recomputed


def _wrap_int64(value: int) -> int:
    """`value` modulo 2**64 as a signed 64-bit integer (a checksum's range)."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


# --- the checksum -------------------------------------------------------------------------


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of int64 `x` (wrapping arithmetic; logical shifts by masking)."""
    x = x + (-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * (-4658895280553007687)  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * (-7723592293110705685)  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & ((1 << 33) - 1))


@functools.lru_cache(maxsize=256)
def _weights(
    num_words: int, device: torch.device
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, row weights, column weights, tail weights)`` for a parameter of `num_words`."""
    rows = num_words // CHECK_ROW_WORDS
    tail = num_words - rows * CHECK_ROW_WORDS
    row_w = _mix(torch.arange(rows, dtype=torch.int64, device=device) * 4)
    col_w = _mix(torch.arange(CHECK_ROW_WORDS, dtype=torch.int64, device=device) * 4 + 1)
    tail_w = _mix(torch.arange(tail, dtype=torch.int64, device=device) * 4 + 2)
    return rows, row_w, col_w, tail_w


def _words(param: torch.Tensor) -> torch.Tensor:
    """`param`'s bytes as int64 words, the last one zero-padded (a copy only when unaligned)."""
    raw = param.reshape(-1).view(torch.uint8)
    num_bytes = raw.numel()
    full = num_bytes // 8 * 8
    if full == num_bytes and raw.data_ptr() % 8 == 0:
        return raw.view(torch.int64)
    padded = torch.zeros(_align(num_bytes), dtype=torch.uint8, device=raw.device)
    padded[:num_bytes].copy_(raw)
    return padded.view(torch.int64)


def checksum_tensor(param: torch.Tensor) -> torch.Tensor:
    """The checksum of `param`'s bytes as a 0-d int64 tensor on its device (no host sync).

    The bytes as int64 words form a grid of `CHECK_ROW_WORDS` columns (the last partial row
    apart); the checksum adds each row's sum, each column's sum and each word of the last
    row, each times a fixed pseudo-random weight of its position, modulo 2**64. It is linear
    in the words, so a change of some elements moves it by an amount computed from those
    elements alone (`checksum_change`); a difference it misses must cancel in every row
    and every column sum at once.
    """
    words = _words(param)
    if words.device.type == "cpu":
        return torch.tensor(_host_checksum(words))
    return _device_checksum(words)


def _device_checksum(words: torch.Tensor) -> torch.Tensor:
    """`checksum_tensor` of int64 `words` on their device, with torch's ops: for one tensor
    the fused kernel's launch and tables cost more than they save (`checksums` batches)."""
    return _torch_checksum(words)


def _device_checksums(words: Sequence[torch.Tensor]) -> torch.Tensor:
    """`checksum_tensor` of each int64 tensor of `words` (one device), as one int64
    tensor: one fused pass over all of them where the kernels run
    (`weightsync.delta_kernels`), torch ops otherwise."""
    if not delta_kernels.ready(words[0].device):
        return torch.stack([_torch_checksum(w) for w in words])
    totals = delta_kernels.checksum_words(words)
    for index, tensor in enumerate(words):
        rows, _, _, tail_w = _weights(tensor.numel(), tensor.device)
        if tail_w.numel():
            totals[index] += (tensor[rows * CHECK_ROW_WORDS :] * tail_w).sum()
    return totals


def _torch_checksum(words: torch.Tensor) -> torch.Tensor:
    """`checksum_tensor` of int64 `words` with torch ops, on their device."""
    rows, row_w, col_w, tail_w = _weights(words.numel(), words.device)
    grid = words[: rows * CHECK_ROW_WORDS].view(rows, CHECK_ROW_WORDS)
    total = (grid.sum(dim=1) * row_w).sum() + (grid.sum(dim=0) * col_w).sum()
    return total + (words[rows * CHECK_ROW_WORDS :] * tail_w).sum()


# Rows of the grid a host checksum sums at a time (1 MiB): its column sums and its row
# sums both come from the cache, so memory is read once.
_HOST_ROWS = 256


def _host_checksum(words: torch.Tensor) -> int:
    """`checksum_tensor` of int64 host `words` with numpy: one read of memory, where
    torch's column sum over a tall grid runs at half memory speed and its row sum reads the
    bytes a second time. numpy's int64 sums wrap as torch's do."""
    rows, row_w, col_w, tail_w = _weights(words.numel(), words.device)
    flat = words.numpy()
    grid = flat[: rows * CHECK_ROW_WORDS].reshape(rows, CHECK_ROW_WORDS)
    row_sums = np.empty(rows, dtype=np.int64)
    col_sums = np.zeros(CHECK_ROW_WORDS, dtype=np.int64)
    part = np.empty(CHECK_ROW_WORDS, dtype=np.int64)
    for start in range(0, rows, _HOST_ROWS):
        block = grid[start : start + _HOST_ROWS]
        np.add.reduce(block, axis=0, out=part)
        col_sums += part
        np.add.reduce(block, axis=1, out=row_sums[start : start + _HOST_ROWS])
    row_sums *= row_w.numpy()
    col_sums *= col_w.numpy()
    tail = flat[rows * CHECK_ROW_WORDS :] * tail_w.numpy()
    # Python ints from here: numpy warns where two int64 scalars wrap.
    parts = (row_sums.sum(dtype=np.int64), col_sums.sum(dtype=np.int64), tail.sum(dtype=np.int64))
    return _wrap_int64(sum(int(part) for part in parts))


def checksums(params: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """``{name: checksum}`` of `params` (one host sync per device for all of them)."""
    found: dict[str, int] = {}
    on_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, param in params.items():
        if param.device.type == "cpu":
            found[name] = _host_checksum(_words(param))
        else:
            on_device.setdefault(param.device, []).append((name, _words(param)))
    for pairs in on_device.values():
        values = _device_checksums([words for _, words in pairs]).tolist()
        found.update((name, value) for (name, _), value in zip(pairs, values, strict=True))
    return {name: found[name] for name in params}


def checksum_change(
    elements: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    numel: int,
) -> torch.Tensor:
    """How the checksum of a parameter of `numel` elements moves when `elements` go from
    `old` to `new` bits (a 0-d int64 tensor; add it to the base's checksum, wrapping).

    Args:
        elements: int64 element indices into the flat parameter.
        old: their bits before (`bits_dtype` of the element size).
        new: their bits after, same dtype.
        numel: the parameter's elements (its word grid depends on its size).
    """
    size = new.element_size()
    rows, row_w, col_w, tail_w = _weights(_align(numel * size) // 8, elements.device)
    if elements.device.type == "cpu":
        return torch.tensor(_host_change(elements, old, new, rows, row_w, col_w, tail_w))
    return _device_change(elements, old, new, rows, row_w, col_w, tail_w)


def checksum_changes(
    changes: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
) -> list[int]:
    """`checksum_change` of each ``(elements, old, new, numel)`` of `changes`, as ints: on
    a device where the fused kernels run (`weightsync.delta_kernels.ready`), one launch per
    element size for all of them (a few tables instead of a dozen torch ops each), and one
    host sync per device."""
    found: list[torch.Tensor | int | None] = [None] * len(changes)
    fused: dict[tuple[torch.device, int], list[int]] = {}
    for index, (elements, old, new, numel) in enumerate(changes):
        if delta_kernels.ready(elements.device):
            fused.setdefault((elements.device, new.element_size()), []).append(index)
        else:
            found[index] = checksum_change(elements, old, new, numel=numel)
    for (_, size), indices in fused.items():
        grids = []
        for index in indices:
            num_words = _align(changes[index][3] * size) // 8
            grids.append(num_words // CHECK_ROW_WORDS * CHECK_ROW_WORDS)
        moved = delta_kernels.checksum_changes([changes[i][:3] for i in indices], grids)
        for position, index in enumerate(indices):
            found[index] = moved[position]
    # One host sync per device (a rank's tensors may lie on more than one).
    by_device: dict[torch.device, list[int]] = {}
    for index, x in enumerate(found):
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            by_device.setdefault(x.device, []).append(index)
    values = [x if isinstance(x, int) else None for x in found]
    for indices in by_device.values():
        synced = torch.stack([found[i] for i in indices]).tolist()  # type: ignore[misc]
        for index, value in zip(indices, synced, strict=True):
            values[index] = value
    return [int(found[i]) if v is None else v for i, v in enumerate(values)]  # type: ignore[arg-type]


def _device_change(
    elements: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    rows: int,
    row_w: torch.Tensor,
    col_w: torch.Tensor,
    tail_w: torch.Tensor,
) -> torch.Tensor:
    """`checksum_change` with torch ops, on the elements' device (no host sync)."""
    size = new.element_size()
    mask = (1 << (8 * size)) - 1 if size < 8 else -1
    diff = (new.to(torch.int64) & mask) - (old.to(torch.int64) & mask)
    byte = elements * size
    word = byte >> 3
    diff = diff * (torch.ones_like(byte) << ((byte & 7) * 8))
    grid_words = rows * CHECK_ROW_WORDS
    # Without boolean indexing (a host sync each): indices clamped into both tables, the
    # right weight picked per word.
    if not tail_w.numel():
        weight = row_w[word >> _ROW_SHIFT] + col_w[word & (CHECK_ROW_WORDS - 1)]
    elif not rows:
        weight = tail_w[word]
    else:
        grid = torch.clamp(word, max=grid_words - 1)
        tail = torch.clamp(word - grid_words, min=0)
        weight = torch.where(
            word < grid_words,
            row_w[grid >> _ROW_SHIFT] + col_w[grid & (CHECK_ROW_WORDS - 1)],
            tail_w[tail],
        )
    return (diff * weight).sum()


def _host_change(
    elements: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    rows: int,
    row_w: torch.Tensor,
    col_w: torch.Tensor,
    tail_w: torch.Tensor,
) -> int:
    """`checksum_change` on the host (`_host_change_arrays` of the tensors' arrays)."""
    return _host_change_arrays(
        elements.numpy(),
        old.numpy(),
        new.numpy(),
        rows,
        row_w.numpy(),
        col_w.numpy(),
        tail_w.numpy(),
    )


def _host_weights(num_words: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """`_weights` of a host parameter of `num_words`, as numpy arrays."""
    rows, row_w, col_w, tail_w = _weights(num_words, torch.device("cpu"))
    return rows, row_w.numpy(), col_w.numpy(), tail_w.numpy()


# Elements a host checksum change takes per pass: its four int64 scratch arrays (1 MiB) stay
# in the cache, and no pass allocates. Arrays as large as a tensor's changes would be fresh
# memory each time (glibc hands large freed blocks back to the kernel): their page faults
# cost more than the arithmetic.
_CHANGE_CHUNK = 1 << 15

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}

_scratch = threading.local()


def _change_scratch() -> np.ndarray:
    """This thread's scratch of `_host_change_arrays`: 4 rows of `_CHANGE_CHUNK` int64."""
    arrays = getattr(_scratch, "arrays", None)
    if arrays is None:
        arrays = _scratch.arrays = np.empty((4, _CHANGE_CHUNK), dtype=np.int64)
    return arrays


def _host_change_arrays(
    elements: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    rows: int,
    row_w: np.ndarray,
    col_w: np.ndarray,
    tail_w: np.ndarray,
) -> int:
    """`checksum_change` with numpy (its int64 arithmetic wraps as torch's does), of
    `elements` (int64) going from `old` to `new` (raw bits, same dtype), a cache-sized
    chunk at a time in reused scratch."""
    size = new.itemsize
    # Unsigned below 8 bytes (an element's bits, zero-extended into its lane); 8-byte words
    # as int64, whose differences wrap (int64 and uint64 would meet in float64).
    bits = _UNSIGNED[size] if size < 8 else np.int64
    new_bits, old_bits = new.view(bits), old.view(bits)
    per_word = 8 // size
    # An element's word and its lane's bit offset in it, by shifts (sizes are powers of 2).
    word_shift = per_word.bit_length() - 1
    lane_shift = (8 * size).bit_length() - 1
    grid_words = rows * CHECK_ROW_WORDS
    scratch = _change_scratch()
    total = 0
    for start in range(0, elements.size, _CHANGE_CHUNK):
        stop = min(start + _CHANGE_CHUNK, elements.size)
        diff, other, word, weight = (row[: stop - start] for row in scratch)
        part = elements[start:stop]
        np.copyto(diff, new_bits[start:stop])
        np.subtract(diff, old_bits[start:stop], out=diff)
        if size < 8:
            np.bitwise_and(part, per_word - 1, out=other)
            np.left_shift(other, lane_shift, out=other)
            np.left_shift(diff, other, out=diff)
        np.right_shift(part, word_shift, out=word)
        if int(word.max()) < grid_words:
            np.right_shift(word, _ROW_SHIFT, out=other)
            np.take(row_w, other, out=weight, mode="clip")
            np.bitwise_and(word, CHECK_ROW_WORDS - 1, out=word)
            np.take(col_w, word, out=other, mode="clip")
            weight += other
        else:  # some in the grid's last, partial row: their own weights
            in_grid = word < grid_words
            grid = word[in_grid]
            weight[in_grid] = row_w[grid >> _ROW_SHIFT] + col_w[grid & (CHECK_ROW_WORDS - 1)]
            weight[~in_grid] = tail_w[word[~in_grid] - grid_words]
        diff *= weight
        total += int(diff.sum(dtype=np.int64))
    return _wrap_int64(total)
