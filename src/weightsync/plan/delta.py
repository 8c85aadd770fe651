"""Delta maps: where each element of a source's tensors lands, as compact run tables.

A delta sync finds the changed elements of each tensor a source streams once, as flat
row-major indices into the local tensor (the box it holds), and then needs, per layout, the
destination of each: a parameter and an element offset in it. `delta_map` turns a
`SourcePlan`'s copy items into that table. A copy item reads a box row-major into one
destination run, so its elements form contiguous source runs at a regular stride (a column
slice of a ``[R, C]`` tensor is ``R`` runs, ``C`` apart); a `RunFamily` holds such a
progression, and the families of every item of one tensor, layout and parameter are chained
into as few as possible: a sharded trainer's per-row items of a column slice become one
family again. A plan of an 8B model then keeps a handful of families per parameter, not one
entry per row.

Pure: the tables are plain ints; the sender turns them into index tensors.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.plan.boxes import Box
from weightsync.plan.items import CopyItem, SourcePlan

# How far past a lone run, in source order, its chain partner is looked for: enough for a
# few interleaved column blocks per row, and it bounds the work per run.
_PARTNER_WINDOW = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFamily:
    """`count` runs of `length` elements at regular steps.

    Run ``i`` reads local flat elements ``[src_start + i * src_step, + length)`` and writes
    parameter elements ``[dst_start + i * dst_step, + length)``. The steps are 0 when `count`
    is 1.

    Raises:
        ValueError: a count or length below 1, a negative start, or a step of a family of
            several runs that lets its source runs overlap.
    """

    src_start: int
    src_step: int
    dst_start: int
    dst_step: int
    count: int
    length: int

    def __post_init__(self) -> None:
        if self.count < 1 or self.length < 1 or self.src_start < 0 or self.dst_start < 0:
            raise ValueError(f"{self}: count and length must be >= 1 and the starts >= 0")
        if self.count > 1 and self.src_step < self.length:
            raise ValueError(f"{self}: source runs overlap (src_step below length)")

    @property
    def num_elements(self) -> int:
        """Elements the runs cover."""
        return self.count * self.length

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """The runs as ``(src_start, dst_start, length)``, in source order."""
        for i in range(self.count):
            yield (
                self.src_start + i * self.src_step,
                self.dst_start + i * self.dst_step,
                self.length,
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaTarget:
    """Where one stream tensor's elements land in one parameter of one layout.

    Attributes:
        layout_id: the layout group written (`SourcePlan.targets`).
        param_name: the parameter written.
        element_size: bytes per element of the plan's dtype (element offsets times it are the
            byte offsets of the copy items).
        families: the runs; their source runs are disjoint, and the families are ordered by
            the source start of their first run.
    """

    layout_id: int
    param_name: str
    element_size: int
    families: tuple[RunFamily, ...]

    @property
    def num_elements(self) -> int:
        """Elements of the tensor that land in the parameter."""
        return sum(family.num_elements for family in self.families)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaMap:
    """The run tables of one `SourcePlan` of one dtype.

    Attributes:
        dtype: the plan's dtype (the changed elements are found after the cast to it).
        tensors: ``{hf_name: (DeltaTarget, ...)}`` for every tensor of the plan's work, in
            the order the source streams them; the targets of a tensor follow its work's
            layout order, then the order its items first write each parameter. A tensor
            whose items are all padding maps to ``()``.
        shapes: ``{hf_name: local shape}`` of the same tensors (the flat indices are into
            these).
    """

    dtype: str
    tensors: Mapping[str, tuple[DeltaTarget, ...]] = field(hash=False)
    shapes: Mapping[str, tuple[int, ...]] = field(hash=False)

    @property
    def num_families(self) -> int:
        """Families over every tensor and target (the size of the tables)."""
        return sum(len(t.families) for targets in self.tensors.values() for t in targets)


def delta_map(plan: SourcePlan) -> DeltaMap:
    """The run tables of `plan`, a plan of one dtype.

    Raises:
        ValueError: `plan` has parts (map each part, or use `delta_maps`); a tensor of its
            work has no shape; an item's box does not fit the local shape, its byte length
            is not a whole number of elements, its byte offset is not a whole number of
            elements, or its element size differs from the other items of its parameter; or
            two items write the same source element into one parameter of one layout.
    """
    if plan.parts:
        raise ValueError(
            f"source rank {plan.rank}: a plan of {len(plan.parts)} dtype parts has no run "
            "table of its own; map each part (delta_maps)"
        )
    tensors: dict[str, tuple[DeltaTarget, ...]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for hf_name, works in plan.work.items():
        shape = plan.shapes.get(hf_name)
        if shape is None:
            raise ValueError(
                f"source rank {plan.rank}: HF tensor {hf_name!r} is in the plan's work but not "
                "in its shapes; rebuild the plan with build_plan"
            )
        shapes[hf_name] = tuple(shape)
        grouped: dict[tuple[int, str], list[CopyItem]] = {}
        for work in works:
            for item in work.items:
                if not item.is_padding:
                    grouped.setdefault((work.layout_id, item.param_name), []).append(item)
        tensors[hf_name] = tuple(
            _target(hf_name, shapes[hf_name], layout_id, param_name, items)
            for (layout_id, param_name), items in grouped.items()
        )
    return DeltaMap(dtype=plan.dtype, tensors=tensors, shapes=shapes)


def delta_maps(plan: SourcePlan) -> tuple[DeltaMap, ...]:
    """One `DeltaMap` per part of `plan`, in push order (``(delta_map(plan),)`` for a plan of
    one dtype).

    Raises:
        ValueError: as `delta_map`, for any part.
    """
    return tuple(delta_map(part) for part in plan.parts) if plan.parts else (delta_map(plan),)


# A family while a table is built: (src_start, dst_start, length, count, src_step, dst_step).
# Plain tuples, since a sharded trainer's plan can hold a million per-row items to fold.
_Runs = tuple[int, int, int, int, int, int]


def _target(
    hf_name: str,
    shape: tuple[int, ...],
    layout_id: int,
    param_name: str,
    items: Sequence[CopyItem],
) -> DeltaTarget:
    """The `DeltaTarget` of the data items of one (tensor, layout, parameter)."""
    where = f"HF tensor {hf_name!r} (local shape {shape}) into {param_name!r} of layout {layout_id}"
    strides = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    element_size = 0
    runs: list[_Runs] = []
    for item in items:
        box = item.src_box
        numel = src = 0
        if len(box) == len(shape):
            numel = 1
            for (start, stop), extent, stride in zip(box, shape, strides, strict=True):
                numel *= (stop - start) if stop <= extent else 0
                src += start * stride
        if not numel:
            raise ValueError(f"{where}: box {box} does not fit the local shape")
        size, remainder = divmod(item.num_bytes, numel)
        if remainder or (element_size and size != element_size):
            raise ValueError(
                f"{where}: the item at byte {item.dst_offset_bytes} has {item.num_bytes} bytes "
                f"for {numel} elements; expected {element_size or 'whole'} bytes each"
            )
        element_size = size
        dst, misaligned = divmod(item.dst_offset_bytes, size)
        if misaligned:
            raise ValueError(
                f"{where}: byte offset {item.dst_offset_bytes} is not a whole number of "
                f"{size}-byte elements"
            )
        runs += _box_runs(box, shape, strides, src, dst)
    runs.sort()
    chains = _chain(_fuse(runs))
    shared = _first_shared(chains)
    if shared is not None:
        index = tuple(
            shared // stride % extent for stride, extent in zip(strides, shape, strict=True)
        )
        raise ValueError(
            f"{where}: local element {index} is written twice; each element may land in a "
            "parameter once, so the plan's items overlap (rebuild it with build_plan)"
        )
    families = tuple(
        RunFamily(
            src_start=src,
            src_step=src_step,
            dst_start=dst,
            dst_step=dst_step,
            count=count,
            length=length,
        )
        for src, dst, length, count, src_step, dst_step in chains
    )
    return DeltaTarget(
        layout_id=layout_id, param_name=param_name, element_size=element_size, families=families
    )


def _box_runs(
    box: Box, shape: tuple[int, ...], strides: tuple[int, ...], src: int, dst: int
) -> list[_Runs]:
    """The families of reading `box` (its first element at local flat index `src`) of a
    local tensor of `shape` row-major into parameter elements from `dst` on.

    The box's elements are contiguous in the local tensor over the trailing dims it spans
    fully plus the last partial dim; the dims before that index the runs. Index dims of
    extent 1 drop out, and a dim folds into the one inside it when stepping it steps the
    inner one past its end; the longest remaining dim becomes the progression of the
    families, one family per index of the others.
    """
    last = len(box) - 1
    while last >= 0 and box[last] == (0, shape[last]):
        last -= 1
    if last < 0:
        return [(0, dst, math.prod(shape), 1, 0, 0)]
    length = (box[last][1] - box[last][0]) * strides[last]
    dims: list[tuple[int, int, int]] = []  # (extent, src stride, dst stride), outer first
    dst_stride = length
    for k in range(last - 1, -1, -1):
        extent = box[k][1] - box[k][0]
        if extent > 1:
            # Only the source needs checking: the destination is the box read row-major,
            # where an outer dim always steps the inner one past its end.
            if dims and strides[k] == dims[0][0] * dims[0][1]:
                dims[0] = (extent * dims[0][0], dims[0][1], dims[0][2])
            else:
                dims.insert(0, (extent, strides[k], dst_stride))
        dst_stride *= extent
    if not dims:
        return [(src, dst, length, 1, 0, 0)]
    along = max(range(len(dims)), key=lambda d: dims[d][0])
    count, src_step, dst_step = dims[along]
    others = dims[:along] + dims[along + 1 :]
    families = []
    for index in itertools.product(*(range(extent) for extent, _, _ in others)):
        src_start = src + sum(i * s for i, (_, s, _) in zip(index, others, strict=True))
        dst_start = dst + sum(i * d for i, (_, _, d) in zip(index, others, strict=True))
        families.append((src_start, dst_start, length, count, src_step, dst_step))
    return families


def _fuse(families: Sequence[_Runs]) -> list[_Runs]:
    """`families` (sorted) with neighbouring lone runs that continue each other in both
    source and destination joined into one run (row blocks read in turn)."""
    fused: list[_Runs] = []
    for family in families:
        if fused:
            src, dst, length, count, _, _ = fused[-1]
            if (
                count == 1
                and family[3] == 1
                and family[0] == src + length
                and family[1] == dst + length
            ):
                fused[-1] = (src, dst, length + family[2], 1, 0, 0)
                continue
        fused.append(family)
    return fused


def _chain(families: Sequence[_Runs]) -> list[_Runs]:
    """`families` (sorted) joined where their runs continue one progression; sorted by
    source start. A join never lets a family's own runs overlap (a step is at least the
    length), so overlaps between items are left for `_first_shared` to find.

    Each family not yet taken starts a chain, which takes the family whose first run is the
    chain's next one (same length, and the same steps or a lone run) until there is none. A
    chain of one run has no step yet: it takes the nearby later family whose gap to it sets a
    step the table continues (the column block of the next row, not the next block of this
    row), else the first one that fits.
    """
    starts = {family[:3]: i for i, family in enumerate(families)}
    taken = [False] * len(families)
    chains = []
    for first, chain in enumerate(families):
        if taken[first]:
            continue
        taken[first] = True
        while True:
            src, dst, length, count, src_step, dst_step = chain
            if count == 1:
                following = _partner(families, first, taken, starts)
            else:
                following = starts.get((src + count * src_step, dst + count * dst_step, length))
                if following is not None and (
                    taken[following]
                    or (families[following][3] > 1 and families[following][4:] != chain[4:])
                ):
                    following = None
            if following is None:
                break
            taken[following] = True
            after = families[following]
            if count == 1:
                src_step, dst_step = after[0] - src, after[1] - dst
            chain = (src, dst, length, count + after[3], src_step, dst_step)
        chains.append(chain)
    return chains


def _partner(
    families: Sequence[_Runs],
    first: int,
    taken: list[bool],
    starts: Mapping[tuple[int, int, int], int],
) -> int | None:
    """The index of the family that the lone run ``families[first]`` best chains with (see
    `_chain`), or None."""
    src, dst, length = families[first][:3]
    fallback = None
    for index in range(first + 1, min(first + 1 + _PARTNER_WINDOW, len(families))):
        candidate = families[index]
        src_gap, dst_gap = candidate[0] - src, candidate[1] - dst
        if taken[index] or candidate[2] != length or src_gap < length:
            continue
        if candidate[3] > 1:
            if candidate[4:] == (src_gap, dst_gap):
                return index
            continue
        following = starts.get((candidate[0] + src_gap, candidate[1] + dst_gap, length))
        if following is not None and not taken[following]:
            after = families[following]
            if after[3] == 1 or after[4:] == (src_gap, dst_gap):
                return index
        if fallback is None:
            fallback = index
    return fallback


def _first_shared(families: Sequence[_Runs]) -> int | None:
    """A source element two runs of `families` (sorted by source start, each with disjoint
    runs) share, or None.

    Families whose source spans do not interleave are disjoint; only the runs of a cluster of
    interleaving families are walked.
    """
    cluster: list[_Runs] = []
    stop = 0
    for family in [*families, None]:
        if family is None or family[0] >= stop:
            if len(cluster) > 1:
                end = 0
                for run_src, run_length in heapq.merge(*(_sources(f) for f in cluster)):
                    if run_src < end:
                        return run_src
                    end = run_src + run_length
            cluster = []
        if family is not None:
            cluster.append(family)
            src, _, length, count, src_step, _ = family
            stop = max(stop, src + (count - 1) * src_step + length)
    return None


def _sources(family: _Runs) -> Iterator[tuple[int, int]]:
    """``(src_start, length)`` of each run of `family`, in order."""
    src, _, length, count, src_step, _ = family
    for i in range(count):
        yield src + i * src_step, length
