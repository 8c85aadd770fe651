"""The plan's pieces: copies, the staging work of one HF tensor, layout groups, per-source plans."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from weightsync.layout.types import ParamLayout
from weightsync.plan.types import TargetRank


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyItem:
    """A run of destination bytes of one parameter and where its elements come from.

    The source reads box ``src_box`` of HF tensor ``hf_name`` row-major, casts it to the plan's
    dtype and writes the bytes at ``dst_offset_bytes`` of parameter ``param_name`` of every
    target of the layout. ``hf_name is None`` means padding: write ``num_bytes`` zero bytes.

    Attributes:
        hf_name: the HF tensor the elements come from, or ``None`` for zeros.
        src_box: ``(start, stop)`` per dim of the HF tensor; in a `SourcePlan`, of the tensor
            the source yields (relative to the start of the box it holds, `SourcePlan.boxes`);
            empty for padding.
        param_name: the rollout parameter written.
        dst_offset_bytes: where the run starts, in bytes from the parameter's address.
        num_bytes: length of the run in bytes (elements times the plan dtype's element size).

    Raises:
        ValueError: a non-positive length, a negative offset, an empty box for data or a box
            for padding, or a box dim with ``stop <= start``.
    """

    hf_name: str | None
    src_box: tuple[tuple[int, int], ...]
    param_name: str
    dst_offset_bytes: int
    num_bytes: int

    def __post_init__(self) -> None:
        box = tuple((int(start), int(stop)) for start, stop in self.src_box)
        object.__setattr__(self, "src_box", box)
        where = f"CopyItem for {self.param_name!r} at byte {self.dst_offset_bytes}"
        if self.num_bytes <= 0 or self.dst_offset_bytes < 0:
            raise ValueError(f"{where}: num_bytes must be > 0 and the offset >= 0")
        if (self.hf_name is None) != (not box):
            raise ValueError(f"{where}: a box is required for data and forbidden for padding")
        if any(stop <= start or start < 0 for start, stop in box):
            raise ValueError(f"{where}: empty or negative box {box}")

    @property
    def is_padding(self) -> bool:
        """Whether the item writes zeros."""
        return self.hf_name is None

    @property
    def src_numel(self) -> int:
        """Number of HF elements the box covers (0 for padding)."""
        return math.prod(stop - start for start, stop in self.src_box) if self.src_box else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StageWork:
    """Everything one source stages from one HF tensor for one destination layout.

    Items are sorted by (parameter order, destination offset), so that items that are adjacent
    in the destination can be staged adjacently and written as one region.

    Attributes:
        layout_id: the `LayoutGroup` whose targets receive these bytes.
        items: the copies, including the padding of parameters whose first data comes from
            this HF tensor.
    """

    layout_id: int
    items: tuple[CopyItem, ...]

    @property
    def num_bytes(self) -> int:
        """Bytes staged for this work (written once to each target of the layout)."""
        return sum(item.num_bytes for item in self.items)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutGroup:
    """Rollout ranks with identical layouts; their bytes are computed and staged once.

    Attributes:
        layout_id: index of the group in `SyncPlan.groups`.
        layout_key: the shared `ParallelismConfig.layout_key()`.
        params: every parameter of such a rank, in the engine's order.
        targets: the ranks, in the order `build_plan` was given them.
    """

    layout_id: int
    layout_key: tuple[int, ...]
    params: tuple[ParamLayout, ...] = field(hash=False)
    targets: tuple[TargetRank, ...]

    @property
    def num_bytes(self) -> int:
        """Bytes of one rank of this layout."""
        return sum(param.num_bytes for param in self.params)


@dataclass(frozen=True, slots=True, kw_only=True)
class SourcePlan:
    """What one trainer source rank stages and writes.

    Call sequence for the sender: iterate its HF tensors; for each ``hf_name`` in `work`, for
    each `StageWork`, stage the items (cast to `dtype`) and write each item to every target in
    ``targets[work.layout_id]`` at ``weights_info[item.param_name][0] +
    item.dst_offset_bytes``. Tensors absent from `work` are not needed from this source.

    Attributes:
        rank: the trainer source rank.
        dtype: the rollout dtype to cast to (torch name without prefix).
        work: ``{hf_name: (StageWork, ...)}`` in the order the source yields its tensors, each
            tuple sorted by layout id.
        targets: ``{layout_id: targets}`` for every layout this source writes to.
        shapes: ``{hf_name: shape}`` of the tensors in `work` as the source's stream yields
            them (a held box's extents), as the source declared them when the plan was built.
        boxes: ``{hf_name: box}`` for the tensors of `work` the source holds a box of (a
            sharded trainer's slice); their items read relative to the box's start. Tensors
            held whole are absent.
        parts: for a layout of several dtypes (`weightsync.plan.parts`), the plan of each
            dtype, pushed in order; `work` is then empty and the counts are the parts'.
    """

    rank: int
    dtype: str
    work: Mapping[str, tuple[StageWork, ...]] = field(hash=False)
    targets: Mapping[int, tuple[TargetRank, ...]] = field(hash=False)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict, hash=False)
    boxes: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict, hash=False)
    parts: tuple[SourcePlan, ...] = field(default=(), hash=False)

    @property
    def num_bytes_staged(self) -> int:
        """Bytes the source stages (each layout's bytes once)."""
        if self.parts:
            return sum(part.num_bytes_staged for part in self.parts)
        return sum(w.num_bytes for works in self.work.values() for w in works)

    @property
    def num_bytes_written(self) -> int:
        """Bytes the source writes (each layout's bytes once per target of it)."""
        if self.parts:
            return sum(part.num_bytes_written for part in self.parts)
        return sum(
            w.num_bytes * len(self.targets[w.layout_id])
            for works in self.work.values()
            for w in works
        )

    @property
    def num_items(self) -> int:
        """Number of copy items (before the sender coalesces them)."""
        if self.parts:
            return sum(part.num_items for part in self.parts)
        return sum(len(w.items) for works in self.work.values() for w in works)

    @property
    def num_tensors(self) -> int:
        """Number of HF tensors the source stages from."""
        if self.parts:
            return len({name for part in self.parts for name in part.work})
        return len(self.work)

    def restricted(self, sessions: Collection[str]) -> SourcePlan:
        """This plan writing only to the targets whose session id is in `sessions`: the
        work of a layout none of them has is dropped (a delta sync writes the other
        targets' bytes its own way)."""
        targets = {
            layout_id: kept
            for layout_id, ranks in self.targets.items()
            if (kept := tuple(t for t in ranks if t.session_id in sessions))
        }
        if self.parts:
            return dataclasses.replace(
                self,
                targets=targets,
                parts=tuple(part.restricted(sessions) for part in self.parts),
            )
        work = {}
        for hf_name, works in self.work.items():
            kept_works = tuple(w for w in works if w.layout_id in targets)
            if kept_works:
                work[hf_name] = kept_works
        return dataclasses.replace(
            self,
            work=work,
            targets=targets,
            shapes={name: self.shapes[name] for name in work if name in self.shapes},
            boxes={name: self.boxes[name] for name in work if name in self.boxes},
        )
