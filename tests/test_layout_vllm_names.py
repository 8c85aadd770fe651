"""`weightsync.layout.vllm`: vLLM 0.32's parameter names and parallelism, as pure functions
(no vLLM needed). The byte layouts themselves are checked against vLLM in
tests/test_layout_vllm.py."""

from __future__ import annotations

import itertools

import pytest

from vllm_cpu.layout_cases import MODELS
from weightsync.layout import rank_layout
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.vllm import (
    VllmMoeParallelism,
    vllm_moe_parallelism,
    vllm_name,
    vllm_parallelism,
    weightsync_name,
)

# The layout cases' Qwen3-MoE with every layer's MLP sparse (the names below are layer 0's).
QWEN3_MOE = {**MODELS["qwen3_moe"], "mlp_only_layers": []}

RENAMED = [
    (
        "model.layers.0.mlp.experts.routed_experts.w13_weight",
        "model.layers.0.mlp.experts.w13_weight",
    ),
    (
        "model.layers.17.mlp.experts.routed_experts.w2_weight",
        "model.layers.17.mlp.experts.w2_weight",
    ),
    (
        "model.layers.3.mlp.experts.routed_experts.w13_weight_scale_inv",
        "model.layers.3.mlp.experts.w13_weight_scale_inv",
    ),
    (
        "model.language_model.layers.1.mlp.experts.routed_experts.w2_weight",
        "model.language_model.layers.1.mlp.experts.w2_weight",
    ),
]
UNCHANGED = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.qkv_proj.bias",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.self_attn.q_norm.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.mlp.gate.weight",
    "model.layers.0.mlp.gate.e_score_correction_bias",
    "model.layers.0.mlp.shared_experts.gate_up_proj.weight",
    "model.layers.0.mlp.shared_expert.down_proj.weight",
    "model.layers.0.mlp.shared_expert_gate.weight",
    "model.layers.0.input_layernorm.weight",
    # Only a fused MoE's expert tensors are renamed, not anything that mentions experts.
    "model.layers.0.mlp.experts.routed_experts_extra.w13_weight",
    "model.layers.0.experts.routed_experts.w13_weight",
]


@pytest.mark.parametrize(("vllm", "ours"), RENAMED)
def test_expert_names_map_both_ways(vllm: str, ours: str) -> None:
    """vLLM's ``routed_experts`` submodule is dropped from the name, and put back."""
    assert weightsync_name(vllm) == ours
    assert vllm_name(ours) == vllm


@pytest.mark.parametrize("name", UNCHANGED)
def test_other_names_are_the_same_on_both_sides(name: str) -> None:
    """Every name but a fused MoE's experts' is unchanged both ways."""
    assert weightsync_name(name) == name
    if ".routed_experts." not in name:
        assert vllm_name(name) == name


@pytest.mark.parametrize(("tp", "ep"), [(1, False), (2, False), (2, True), (4, True)])
def test_every_layout_name_round_trips(tp: int, ep: bool) -> None:
    """For every parameter of a Qwen3-MoE rank's layout, the vLLM name maps back to it, and
    exactly the experts' names differ."""
    for rank in range(tp):
        par = vllm_parallelism(tp_size=tp, tp_rank=rank, enable_expert_parallel=ep)
        for name in rank_layout(QWEN3_MOE, par, "bfloat16"):
            theirs = vllm_name(name)
            assert weightsync_name(theirs) == name
            is_expert = name.endswith((".mlp.experts.w13_weight", ".mlp.experts.w2_weight"))
            assert (theirs != name) == is_expert, name


def _moe(ep_size: int, ep_rank: int, moe_tp_size: int, moe_tp_rank: int) -> VllmMoeParallelism:
    return VllmMoeParallelism(
        ep_size=ep_size, ep_rank=ep_rank, moe_tp_size=moe_tp_size, moe_tp_rank=moe_tp_rank
    )


# vLLM's own examples (FusedMoEParallelConfig.make's docstring): (tp, dp, ep) -> per device,
# in device order (dp major).
VLLM_EXAMPLES = [
    (1, 1, False, [_moe(1, 0, 1, 0)]),
    (1, 1, True, [_moe(1, 0, 1, 0)]),  # EP needs more than one rank
    (2, 1, False, [_moe(1, 0, 2, 0), _moe(1, 0, 2, 1)]),
    (1, 2, False, [_moe(1, 0, 2, 0), _moe(1, 0, 2, 1)]),
    (2, 2, False, [_moe(1, 0, 4, r) for r in range(4)]),
    (2, 1, True, [_moe(2, 0, 1, 0), _moe(2, 1, 1, 0)]),
    (1, 2, True, [_moe(2, 0, 1, 0), _moe(2, 1, 1, 0)]),
    (2, 2, True, [_moe(4, r, 1, 0) for r in range(4)]),
]


@pytest.mark.parametrize(("tp", "dp", "ep", "devices"), VLLM_EXAMPLES)
def test_moe_split_follows_vllm(tp: int, dp: int, ep: bool, devices: list) -> None:
    """The MoE split per device is the one vLLM documents for each TP x DP x EP setting."""
    found = [
        vllm_moe_parallelism(
            tp_size=tp, tp_rank=t, dp_size=dp, dp_rank=d, enable_expert_parallel=ep
        )
        for d, t in itertools.product(range(dp), range(tp))
    ]
    assert found == devices


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("ep", [False, True])
def test_parallelism_without_dp(tp: int, ep: bool) -> None:
    """Without DP, vLLM's rank is SGLang's with ``ep_size`` = TP under EP (whole experts per
    rank) or 1 without (experts split over TP): the `ParallelismConfig` defaults agree."""
    for rank in range(tp):
        par = vllm_parallelism(tp_size=tp, tp_rank=rank, enable_expert_parallel=ep)
        ep_size = tp if ep else 1
        assert par == ParallelismConfig(tp_size=tp, tp_rank=rank, ep_size=ep_size)
        assert par.ep_size * par.moe_tp_size == tp
        assert (par.ep_rank, par.moe_tp_rank) == ((rank, 0) if ep else (0, rank))
        assert par.pp_size == 1 and par.attn_tp_size == tp


def test_parallelism_keeps_pipeline_stage() -> None:
    """Pipeline settings pass through (the extension refuses PP > 1 itself)."""
    par = vllm_parallelism(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1)
    assert (par.pp_size, par.pp_rank, par.tp_rank) == (2, 1, 1)


@pytest.mark.parametrize("ep", [False, True])
def test_data_parallel_is_refused(ep: bool) -> None:
    """DP > 1 spreads vLLM's MoE over several engines: no `ParallelismConfig` of one replica
    says that, so it is refused with the reason and the flag."""
    with pytest.raises(ValueError, match="--data-parallel-size 1"):
        vllm_parallelism(tp_size=2, tp_rank=0, dp_size=2, dp_rank=1, enable_expert_parallel=ep)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp_size": 0, "tp_rank": 0},
        {"tp_size": 2, "tp_rank": 2},
        {"tp_size": 2, "tp_rank": -1},
        {"tp_size": 2, "tp_rank": 0, "dp_size": 0},
        {"tp_size": 2, "tp_rank": 0, "dp_size": 2, "dp_rank": 2},
        {"tp_size": 2, "tp_rank": 0, "pp_size": 2, "pp_rank": 2},
        {"tp_size": 2.0, "tp_rank": 0},
        {"tp_size": True, "tp_rank": 0},
        {"tp_size": 2, "tp_rank": "1"},
    ],
)
def test_bad_sizes_and_ranks_are_refused(kwargs: dict) -> None:
    """A size below 1, a rank outside its size or a value that is not an int is a
    ValueError naming the axis."""
    with pytest.raises(ValueError, match=r"(tp|dp|pp)_(size|rank)"):
        vllm_parallelism(**kwargs)
