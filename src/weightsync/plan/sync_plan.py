"""The whole copy plan of one sync: layout groups, who writes what, and its summary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.plan.items import LayoutGroup, SourcePlan
from weightsync.plan.types import TargetRank


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncPlan:
    """A validated plan: every byte of every target parameter is written by exactly one source.

    Built by `build_plan`; each trainer source rank executes ``for_source(rank)``.

    Attributes:
        dtype: the rollout dtype (torch name without prefix).
        targets: the rollout ranks, in the order they were given.
        groups: one `LayoutGroup` per distinct layout, sorted by layout key.
        assignments: ``{(hf_name, layout_id, box): source_rank}``: who stages and writes each
            HF tensor for each layout; ``box`` is ``()`` for a tensor its holders hold whole,
            else the box of it the unit's holders hold.
        source_plans: ``{source_rank: SourcePlan}`` for every source given, sorted by rank
            (a source with nothing to do has an empty plan).
        num_write_regions: writes over all sources and targets after coalescing items that are
            adjacent in the destination (an estimate: the sender's buckets may split a run).
        parts: for a layout of several parameter dtypes, the plan of each dtype
            (`weightsync.plan.parts`); `dtype` is then the dtype of the part writing most.
        engine_owned: ``{(replica, rank): {param_name: kind}}``: the parameters each target
            published that no HF tensor feeds (FP8 KV-cache scales, and those the caller
            declared, `weightsync.plan.engine_owned`), which the plan leaves alone; targets
            with none are left out.
    """

    dtype: str
    targets: tuple[TargetRank, ...]
    groups: tuple[LayoutGroup, ...]
    assignments: Mapping[tuple[str, int, tuple[tuple[int, int], ...]], int] = field(hash=False)
    source_plans: Mapping[int, SourcePlan] = field(hash=False)
    num_write_regions: int
    parts: tuple[SyncPlan, ...] = field(default=(), hash=False)
    engine_owned: Mapping[tuple[str, int], Mapping[str, str]] = field(
        default_factory=dict, hash=False
    )

    def for_source(self, rank: int) -> SourcePlan:
        """The part of the plan that trainer source `rank` executes.

        Raises:
            ValueError: `rank` was not one of the plan's sources.
        """
        if rank not in self.source_plans:
            known = ", ".join(str(r) for r in self.source_plans)
            raise ValueError(f"source rank {rank} is not in this plan; its sources are {known}")
        return self.source_plans[rank]

    @property
    def bytes_written_per_source(self) -> dict[int, int]:
        """``{source_rank: bytes it writes over all targets}``."""
        return {rank: sp.num_bytes_written for rank, sp in self.source_plans.items()}

    @property
    def bytes_staged_per_source(self) -> dict[int, int]:
        """``{source_rank: bytes it stages}`` (each layout once)."""
        return {rank: sp.num_bytes_staged for rank, sp in self.source_plans.items()}

    @property
    def num_bytes_written(self) -> int:
        """Bytes written over all sources (the sum of every target's parameter bytes)."""
        return sum(self.bytes_written_per_source.values())

    @property
    def imbalance(self) -> float:
        """Max over mean of the bytes written per source; 1.0 is perfect balance."""
        loads = list(self.bytes_written_per_source.values())
        mean = sum(loads) / len(loads) if loads else 0.0
        return max(loads) / mean if mean > 0 else 1.0

    def summary(self) -> dict[str, Any]:
        """A JSON-able description: targets with their parameters, sources with their loads.

        Returns:
            ``{"dtype", "num_layout_groups", "num_units", "num_copy_items",
            "num_write_regions", "bytes_written", "imbalance", "targets": [{"replica",
            "rank", "session_id", "layout_id", "parallelism", "num_params", "bytes",
            "params": [{"name", "shape", "dtype"}], "engine_owned": {name: kind}}],
            "num_engine_owned", "sources": [{"rank", "bytes", "bytes_staged", "num_tensors",
            "num_items", "targets": [{"replica", "rank"}]}]}``; ``parallelism`` is the
            target's layout (`ParallelismConfig.to_dict`: attention DP, fused shared experts,
            dense-MLP TP, DP lm_head among it).
        """
        layout_of = {(t.replica, t.rank): group for group in self.groups for t in group.targets}
        targets = []
        for target in self.targets:
            group = layout_of[(target.replica, target.rank)]
            targets.append(
                {
                    "replica": target.replica,
                    "rank": target.rank,
                    "session_id": target.session_id,
                    "layout_id": group.layout_id,
                    "parallelism": target.parallelism.to_dict(),
                    "num_params": len(group.params),
                    "bytes": group.num_bytes,
                    "params": [
                        {"name": p.name, "shape": list(p.shape), "dtype": p.dtype}
                        for p in group.params
                    ],
                    "engine_owned": dict(self.engine_owned.get((target.replica, target.rank), {})),
                }
            )
        sources = []
        for rank, sp in self.source_plans.items():
            written_to = [t for layout_id in sorted(sp.targets) for t in sp.targets[layout_id]]
            sources.append(
                {
                    "rank": rank,
                    "bytes": sp.num_bytes_written,
                    "bytes_staged": sp.num_bytes_staged,
                    "num_tensors": sp.num_tensors,
                    "num_items": sp.num_items,
                    "targets": [{"replica": t.replica, "rank": t.rank} for t in written_to],
                }
            )
        return {
            "dtype": self.dtype,
            "num_layout_groups": len(self.groups),
            "num_units": len(self.assignments),
            "num_copy_items": sum(s["num_items"] for s in sources),
            "num_write_regions": self.num_write_regions,
            "bytes_written": self.num_bytes_written,
            "imbalance": self.imbalance,
            "num_engine_owned": sum(len(owned) for owned in self.engine_owned.values()),
            "targets": targets,
            "sources": sources,
        }
