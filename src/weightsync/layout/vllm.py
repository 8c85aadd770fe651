"""vLLM 0.32's view of weightsync's layout: parameter names and parallelism.

vLLM lays every parameter out byte for byte as weightsync's `rank_layout` (SGLang's layout)
does (tests/test_layout_vllm.py holds the tables), with one naming difference: a fused MoE
keeps its expert weights in a ``routed_experts`` submodule, so vLLM's
``model.layers.0.mlp.experts.routed_experts.w13_weight`` is weightsync's
``model.layers.0.mlp.experts.w13_weight`` (``w2_weight`` likewise). `weightsync_name` and
`vllm_name` map between the two; every other name is the same on both sides.

`vllm_parallelism` gives the `ParallelismConfig` of one vLLM rank from vLLM's own parallel
settings, deriving the MoE split the way vLLM's ``FusedMoEParallelConfig.make`` does: the MoE
spans the TP ranks of every DP rank (TP flattened across DP); with
``--enable-expert-parallel`` each rank holds whole experts (``ep_size`` = TP x DP, no MoE
tensor parallelism), without it every expert is split over TP x DP ranks.

Pure: no torch, no vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightsync.layout.parallelism import ParallelismConfig

# vLLM 0.32's FusedMoE holds its expert weights (and their quantisation scales, under any
# quantisation) in the `routed_experts` submodule.
_VLLM_EXPERTS = re.compile(r"\.mlp\.experts\.routed_experts\.(w13_|w2_)")
_WEIGHTSYNC_EXPERTS = re.compile(r"\.mlp\.experts\.(w13_|w2_)")


def weightsync_name(vllm_param_name: str) -> str:
    """weightsync's name of the vLLM parameter `vllm_param_name` (``named_parameters()``).

    ``...mlp.experts.routed_experts.w13_weight`` → ``...mlp.experts.w13_weight`` (and the
    same for ``w2_*`` and the experts' other tensors); every other name is unchanged.
    """
    return _VLLM_EXPERTS.sub(r".mlp.experts.\1", vllm_param_name)


def vllm_name(weightsync_param_name: str) -> str:
    """vLLM's name of the parameter weightsync calls `weightsync_param_name`; the inverse
    of `weightsync_name`."""
    return _WEIGHTSYNC_EXPERTS.sub(r".mlp.experts.routed_experts.\1", weightsync_param_name)


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmMoeParallelism:
    """How vLLM 0.32 splits a fused MoE over its ranks (``FusedMoEParallelConfig``).

    Attributes:
        ep_size: ranks the experts are spread over (whole experts per rank).
        ep_rank: this rank's place among them.
        moe_tp_size: ranks each expert is split over.
        moe_tp_rank: this rank's place among them.
    """

    ep_size: int
    ep_rank: int
    moe_tp_size: int
    moe_tp_rank: int


def vllm_moe_parallelism(
    *,
    tp_size: int,
    tp_rank: int,
    dp_size: int = 1,
    dp_rank: int = 0,
    enable_expert_parallel: bool = False,
) -> VllmMoeParallelism:
    """vLLM's MoE split for TP rank `tp_rank` of DP rank `dp_rank`.

    vLLM flattens TP across DP: the MoE group has ``tp_size * dp_size`` ranks, this one at
    ``dp_rank * tp_size + tp_rank``. Expert parallelism applies only when that group has more
    than one rank and `enable_expert_parallel` is set; it then holds whole experts
    (``ep_size`` = the group, MoE TP 1); otherwise every expert is split over the group
    (EP 1).

    Raises:
        ValueError: a size below 1 or a rank outside its size.
    """
    _check_rank("tp", tp_size, tp_rank)
    _check_rank("dp", dp_size, dp_rank)
    group_size = tp_size * dp_size
    group_rank = dp_rank * tp_size + tp_rank
    if enable_expert_parallel and group_size > 1:
        return VllmMoeParallelism(
            ep_size=group_size, ep_rank=group_rank, moe_tp_size=1, moe_tp_rank=0
        )
    return VllmMoeParallelism(ep_size=1, ep_rank=0, moe_tp_size=group_size, moe_tp_rank=group_rank)


def vllm_parallelism(
    *,
    tp_size: int,
    tp_rank: int,
    dp_size: int = 1,
    dp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    enable_expert_parallel: bool = False,
) -> ParallelismConfig:
    """The `ParallelismConfig` of one vLLM rank (vLLM's ``--tensor-parallel-size``,
    ``--data-parallel-size``, ``--pipeline-parallel-size``, ``--enable-expert-parallel``).

    Attention, dense MLPs, embeddings and ``lm_head`` are split over TP; the MoE as
    `vllm_moe_parallelism` derives it.

    Raises:
        ValueError: a size below 1 or a rank outside its size; or ``dp_size > 1``: vLLM's
            MoE then spans TP x DP ranks (several engines), which a `ParallelismConfig` (one
            replica's TP group) cannot express; EP across DP is not supported yet.
    """
    moe = vllm_moe_parallelism(
        tp_size=tp_size,
        tp_rank=tp_rank,
        dp_size=dp_size,
        dp_rank=dp_rank,
        enable_expert_parallel=enable_expert_parallel,
    )
    _check_rank("pp", pp_size, pp_rank)
    if dp_size > 1:
        raise ValueError(
            f"vLLM data parallelism (dp_size={dp_size}) is not supported: vLLM splits the MoE "
            f"over TP x DP = {tp_size * dp_size} ranks of {dp_size} engines (expert parallelism "
            "across DP), which one replica's ParallelismConfig cannot express; run each "
            "replica with --data-parallel-size 1"
        )
    return ParallelismConfig(
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        ep_size=moe.ep_size,
        ep_rank=moe.ep_rank,
        moe_tp_size=moe.moe_tp_size,
        moe_tp_rank=moe.moe_tp_rank,
    )


def _check_rank(axis: str, size: int, rank: int) -> None:
    """Raise ValueError unless `size` is an int >= 1 and `rank` an int in [0, size)."""
    for what, value in ((f"{axis}_size", size), (f"{axis}_rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{what} must be an int, got {value!r}")
    if size < 1:
        raise ValueError(f"{axis}_size must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"{axis}_rank={rank} is outside 0..{size - 1} ({axis}_size={size})")
