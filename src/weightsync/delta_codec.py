"""The bytes of a delta sync and the checksum both ends compute.

A delta sync writes, into each rollout rank, only the elements that changed since the bytes
the rank verifiably holds (its *base*). The sender encodes them once per source tensor and
lays them out per rank as one *payload*, written one-sidedly into a region the rank
registered for it (its *delta region*); the rank applies the payload in place and checks the
result. This module is what both ends share, and imports nothing but torch, so that an
engine's worker (e.g. SGLang's custom weight loader) can apply deltas without the rest of
the library.

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
base checksum matched and whose checksum after applying equals base + change holds exactly
the bytes the trainer meant, every byte of them.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

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
    blocks = [_blocks(s.elements)[0].numel() if s.elements is not None else 0 for s in sections]
    num_bytes = _layout(sections, blocks)[-1]
    return PayloadSize(num_bytes=num_bytes, num_elements=sum(s.values.numel() for s in sections))


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
    """`sections` laid out as one payload (uint8) on `device`.

    Raises:
        ValueError: a section whose values are not integer bits, or whose element count
            differs from its values'.
    """
    blocks = []
    for section in sections:
        if section.values.dtype not in _BITS_DTYPES.values():
            raise ValueError(
                f"section of parameter {section.param_index}: values must be raw bits "
                f"(int8/16/32/64), got {section.values.dtype}"
            )
        if section.elements is not None:
            if section.elements.numel() != section.values.numel():
                raise ValueError(
                    f"section of parameter {section.param_index}: "
                    f"{section.elements.numel()} elements but {section.values.numel()} values"
                )
            blocks.append(_blocks(section.elements))
        else:
            blocks.append(None)
    num_blocks = [b[0].numel() if b is not None else 0 for b in blocks]
    places = _layout(sections, num_blocks)
    total = places[-1]
    payload = torch.zeros(total, dtype=torch.uint8, device=device)
    table = torch.zeros(len(sections), SECTION_WORDS, dtype=torch.int64)
    block_rows = []
    first_block = 0
    for i, (section, block) in enumerate(zip(sections, blocks, strict=True)):
        offsets_at, values_at = places[2 + 2 * i], places[3 + 2 * i]
        count = section.values.numel()
        table[i] = torch.tensor(
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
        if block is not None:
            starts, counts = block
            block_rows.append(torch.stack([starts, counts], dim=1))
            first_block += num_blocks[i]
            offsets = (section.elements & 0xFFFF).to(torch.int32).to(torch.int16)
            payload[offsets_at : offsets_at + 2 * count].view(torch.int16).copy_(offsets)
        value_bytes = count * section.values.element_size()
        payload[values_at : values_at + value_bytes].copy_(
            section.values.reshape(-1).view(torch.uint8)
        )
    head = torch.tensor(
        [MAGIC, FORMAT_VERSION, len(sections), sum(num_blocks), places[0], places[1], total, 0],
        dtype=torch.int64,
    )
    payload[: HEAD_WORDS * 8].copy_(head.view(torch.uint8))
    payload[places[0] : places[1]].copy_(table.reshape(-1).view(torch.uint8))
    if block_rows:
        rows = torch.cat([r.to("cpu") for r in block_rows]).reshape(-1)
        payload[places[1] : places[1] + rows.numel() * 8].copy_(rows.view(torch.uint8))
    return payload


@dataclass(frozen=True, slots=True, kw_only=True)
class Applied:
    """What applying a payload did.

    Attributes:
        params: the indices of the parameters it wrote.
        num_elements: elements written.
    """

    params: tuple[int, ...]
    num_elements: int


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
    if payload.dtype != torch.uint8 or payload.numel() < HEAD_WORDS * 8:
        raise DeltaFormatError(f"a delta payload is uint8 of at least {HEAD_WORDS * 8} bytes")
    head = payload[: HEAD_WORDS * 8].cpu().view(torch.int64).tolist()
    magic, version, num_sections, num_blocks, sections_at, blocks_at, total, _ = head
    if magic != MAGIC or version != FORMAT_VERSION:
        raise DeltaFormatError(
            f"not a weightsync delta payload (magic {magic:#x}, version {version}); the sender "
            f"and this rank must run the same delta format ({FORMAT_VERSION})"
        )
    if total > payload.numel() or sections_at != HEAD_WORDS * 8:
        raise DeltaFormatError(
            f"the payload says {total} bytes but {payload.numel()} were given to apply"
        )
    tables_end = blocks_at + num_blocks * 16
    if not (sections_at + num_sections * SECTION_WORDS * 8 == blocks_at <= tables_end <= total):
        raise DeltaFormatError("the payload's tables do not fit inside it")
    tables = payload[sections_at:tables_end].cpu()
    sections = tables[: blocks_at - sections_at].view(torch.int64).view(-1, SECTION_WORDS)
    blocks = tables[blocks_at - sections_at :].view(torch.int64).view(-1, 2)
    writes: list[tuple[int, int, torch.Tensor | None, torch.Tensor]] = []
    highest: list[torch.Tensor] = []
    # The block table goes to the payload's device once, not once per section.
    blocks_on_device = blocks.to(payload.device) if num_blocks else blocks
    for row in sections.tolist():
        index, kind, count, values_at, offsets_at, first, nblocks, start = row
        _check_section(row, blocks, params, total)
        param = as_bits(params[index])
        values = payload[values_at : values_at + count * param.element_size()].view(param.dtype)
        if kind == SectionKind.DENSE:
            writes.append((index, start, None, values))
            continue
        starts = blocks_on_device[first : first + nblocks, 0]
        counts = blocks_on_device[first : first + nblocks, 1]
        offsets = payload[offsets_at : offsets_at + 2 * count].view(torch.int16)
        elements = torch.repeat_interleave(starts, counts, output_size=count)
        elements += offsets.to(torch.int64) & 0xFFFF
        writes.append((index, 0, elements.to(param.device), values.to(param.device)))
        if count:
            highest.append(elements.max() - params[index].numel())
    # Offsets are read on the device: one look at every section's largest element before the
    # first write (one host sync for all), so that a payload reaching past a parameter
    # changes nothing.
    if highest and int(torch.stack(highest).max()) >= 0:
        raise DeltaFormatError("a sparse section reaches past the end of its parameter")
    num_elements = 0
    for index, start, elements, values in writes:
        param = as_bits(params[index])
        if elements is None:
            param[start : start + values.numel()].copy_(values)
        else:
            param.index_copy_(0, elements, values)
        num_elements += values.numel()
    return Applied(params=tuple(sorted({w[0] for w in writes})), num_elements=num_elements)


def _check_section(
    row: list[int], blocks: torch.Tensor, params: Sequence[torch.Tensor], total: int
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
    if count < 0 or values_at % 8 or values_at + count * size > total:
        raise DeltaFormatError(f"{where}: its {count} values do not fit the payload")
    if kind == SectionKind.DENSE:
        if not 0 <= start <= start + count <= numel:
            raise DeltaFormatError(f"{where}: dense run {start}+{count} out of bounds")
    elif kind == SectionKind.SPARSE:
        if offsets_at % 8 or offsets_at + 2 * count > total or first < 0:
            raise DeltaFormatError(f"{where}: its offsets do not fit the payload")
        rows = blocks[first : first + nblocks]
        if rows.shape[0] != nblocks or int(rows[:, 1].sum()) != count:
            raise DeltaFormatError(f"{where}: its blocks do not add up to {count} elements")
        if nblocks and (int(rows[:, 0].min()) < 0 or int(rows[:, 0].max()) >= numel):
            raise DeltaFormatError(f"{where}: a block starts outside the parameter")
    else:
        raise DeltaFormatError(f"{where}: unknown kind {kind}")


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
    """

    num_elements: int
    refused: int | None
    error: str | None
    mismatched: tuple[str, ...]
    unexpected: tuple[str, ...]
    checksums: dict[str, int]


def apply_and_check(
    payloads: Sequence[torch.Tensor],
    params: Mapping[str, torch.Tensor],
    expected: Mapping[str, int],
) -> Checked:
    """Apply `payloads` in order to `params` (by name; numbered by their sorted names), stop
    at the first that is not a valid delta, then checksum every parameter and compare the
    changed ones with `expected` (every name in it must be one of `params`)."""
    names = sorted(params)
    ordered = [params[name] for name in names]
    written: set[int] = set()
    num_elements = 0
    refused, error = None, None
    for index, payload in enumerate(payloads):
        try:
            applied = apply_payload(payload, ordered)
        except DeltaFormatError as exc:
            refused, error = index, str(exc)
            break
        written.update(applied.params)
        num_elements += applied.num_elements
    after = checksums(params)
    return Checked(
        num_elements=num_elements,
        refused=refused,
        error=error,
        mismatched=tuple(name for name, value in expected.items() if after[name] != value),
        unexpected=tuple(names[i] for i in sorted(written) if names[i] not in expected),
        checksums=after,
    )


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
    rows, row_w, col_w, tail_w = _weights(words.numel(), words.device)
    grid = words[: rows * CHECK_ROW_WORDS].view(rows, CHECK_ROW_WORDS)
    total = (grid.sum(dim=1) * row_w).sum() + (grid.sum(dim=0) * col_w).sum()
    return total + (words[rows * CHECK_ROW_WORDS :] * tail_w).sum()


def checksums(params: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """``{name: checksum}`` of `params` (one host sync for all of them)."""
    if not params:
        return {}
    values = torch.stack([checksum_tensor(p).cpu() for p in params.values()])
    return dict(zip(params, values.tolist(), strict=True))


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
    """`checksum_change` on the host, with numpy (its int64 arithmetic wraps as torch's
    does, in fewer passes)."""
    size = new.element_size()
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    diff = new.numpy().view(unsigned).astype(np.int64)
    diff -= old.numpy().view(unsigned).astype(np.int64)
    byte = elements.numpy() * size
    word = byte >> 3
    if size < 8:
        diff <<= (byte & 7) << 3
    grid_words = rows * CHECK_ROW_WORDS
    if not len(word) or int(word.max()) < grid_words:
        weight = row_w.numpy()[word >> _ROW_SHIFT]
        weight += col_w.numpy()[word & (CHECK_ROW_WORDS - 1)]
    else:
        in_grid = word < grid_words
        weight = np.empty_like(word)
        grid = word[in_grid]
        weight[in_grid] = (
            row_w.numpy()[grid >> _ROW_SHIFT] + col_w.numpy()[grid & (CHECK_ROW_WORDS - 1)]
        )
        weight[~in_grid] = tail_w.numpy()[word[~in_grid] - grid_words]
    diff *= weight
    return int(diff.sum(dtype=np.int64))
