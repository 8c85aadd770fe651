"""Pure copy planning: which trainer source writes which bytes of which rollout rank.

`build_plan` takes what each rollout rank published (`TargetRank`) and what each trainer
source rank holds (`SourceHolding`), applies the layout rules of `weightsync.layout`, spreads
the work over every source that holds the data and validates the result before a byte moves.
`simulate_targets` / `simulate_sources` make those inputs for a cluster that does not exist.
"""

from weightsync.plan.builder import build_plan
from weightsync.plan.items import CopyItem, LayoutGroup, SourcePlan, StageWork
from weightsync.plan.simulate import simulate_sources, simulate_targets, stage_layers
from weightsync.plan.sync_plan import SyncPlan
from weightsync.plan.types import SourceHolding, TargetRank, TensorMeta

__all__ = [
    "CopyItem",
    "LayoutGroup",
    "SourceHolding",
    "SourcePlan",
    "StageWork",
    "SyncPlan",
    "TargetRank",
    "TensorMeta",
    "build_plan",
    "simulate_sources",
    "simulate_targets",
    "stage_layers",
]
