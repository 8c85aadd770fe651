"""Pure copy planning: which trainer source writes which bytes of which rollout rank, and how.

`build_plan` takes what each rollout rank published (`TargetRank`) and what each trainer
source rank holds (`SourceHolding`), applies the layout rules of `weightsync.layout`, spreads
the work over every source that holds the data and validates the result before a byte moves.
`lower_push` turns one source's share, with the geometry of its tensor stream
(`StreamGeometry`), into the `PushProgram` the sender executes; `delta_maps` turns it into
the run tables of a delta sync (where each element of its tensors lands). `simulate_targets` /
`simulate_sources` make the inputs for a cluster that does not exist. `served_targets` reads
from a rank's published parameters what its server's arguments cannot say (fused shared
experts); parameters no HF tensor feeds (FP8 KV-cache scales) are `EngineOwned`, left alone
and named in the plan.
"""

from weightsync.plan.builder import build_plan
from weightsync.plan.delta import DeltaMap, DeltaTarget, RunFamily, delta_map, delta_maps
from weightsync.plan.engine_owned import ENGINE_OWNED_KINDS, EngineOwned, EngineOwnedKind
from weightsync.plan.geometry import StreamGeometry, TensorGeometry
from weightsync.plan.items import CopyItem, LayoutGroup, SourcePlan, StageWork
from weightsync.plan.program import PushProgram, StagingSpec, lower_push
from weightsync.plan.served import published_fused_shared_experts, served_targets
from weightsync.plan.simulate import simulate_sources, simulate_targets, stage_layers
from weightsync.plan.sync_plan import SyncPlan
from weightsync.plan.types import SourceHolding, TargetRank, TensorMeta

__all__ = [
    "ENGINE_OWNED_KINDS",
    "CopyItem",
    "DeltaMap",
    "DeltaTarget",
    "EngineOwned",
    "EngineOwnedKind",
    "LayoutGroup",
    "PushProgram",
    "RunFamily",
    "SourceHolding",
    "SourcePlan",
    "StageWork",
    "StagingSpec",
    "StreamGeometry",
    "SyncPlan",
    "TargetRank",
    "TensorGeometry",
    "TensorMeta",
    "build_plan",
    "delta_map",
    "delta_maps",
    "lower_push",
    "published_fused_shared_experts",
    "served_targets",
    "simulate_sources",
    "simulate_targets",
    "stage_layers",
]
