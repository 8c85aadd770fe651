"""The plan against SGLang's DeepSeek layouts as a replica publishes them: fused shared
experts read off the published ``w13_weight``, attention DP and dense-TP from the derived
parallelism, and engine-owned parameters (FP8 KV-cache scales) left alone and reported."""

from __future__ import annotations

import dataclasses

import pytest

from weightsync.errors import LayoutMismatchError
from weightsync.layout import rank_layout
from weightsync.layout.quant import fp8_quantization_config
from weightsync.plan import (
    TargetRank,
    build_plan,
    served_targets,
    simulate_sources,
    simulate_targets,
)
from weightsync.testing.presets import preset_config

TINY = preset_config("tiny-deepseek")  # 8 routed experts, 1 shared, layers 1-2 MoE
TINY_FP8 = {**TINY, "quantization_config": fp8_quantization_config(128)}
W13 = "model.layers.1.mlp.experts.w13_weight"
W13_LAST = "model.layers.2.mlp.experts.w13_weight"


def _plan(config: dict, targets: list[TargetRank], **kwargs):
    return build_plan(
        hf_config=config,
        targets=targets,
        sources=simulate_sources(config, num_sources=2),
        **kwargs,
    )


def _with(target: TargetRank, **changes) -> TargetRank:
    info = dict(target.weights_info)
    for name, numel in changes.items():
        addr, _, size = info[name]
        info[name] = (addr, numel, size)
    return dataclasses.replace(target, weights_info=info)


# FP8 at tp 4 would cut the tiny model's 128x128 scale blocks, which SGLang refuses.
@pytest.mark.parametrize(
    ("config", "tp", "ep"),
    [
        *((TINY, tp, ep) for tp, ep in [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]),
        *((TINY_FP8, tp, ep) for tp, ep in [(1, 1), (2, 1), (2, 2)]),
    ],
)
def test_fused_shared_experts_are_read_off_the_published_w13(config, tp: int, ep: int) -> None:
    targets = simulate_targets(config, tp=tp, ep=ep, fused_shared_experts=True)
    # Like SGLang's, the published parallelism does not say it: the parameters do.
    assert all(t.parallelism.num_fused_shared_experts == 0 for t in targets)
    plan = _plan(config, targets)
    assert [t.parallelism.num_fused_shared_experts for t in plan.targets] == [1] * tp
    for target in plan.targets:
        layout = rank_layout(config, target.parallelism)
        assert layout[W13].shape[0] == 8 // ep + 1
        assert not any("shared_experts" in name for name in layout)
        # Every published parameter is written, the fused slot included, and nothing else.
        written = {p["name"] for t in plan.summary()["targets"] for p in t["params"]}
        assert written >= {W13, W13_LAST}
    # Unfused replicas keep their shared experts apart.
    plain = _plan(config, simulate_targets(config, tp=tp, ep=ep))
    assert [t.parallelism.num_fused_shared_experts for t in plain.targets] == [0] * tp


def test_fused_and_unfused_replicas_share_one_plan() -> None:
    fused = simulate_targets(TINY, tp=2, fused_shared_experts=True)
    plain = [
        dataclasses.replace(t, replica="replica1", session_id=f"replica1-rank{t.rank}:0")
        for t in simulate_targets(TINY, tp=2)
    ]
    plan = _plan(TINY, fused + plain)
    assert len(plan.groups) == 4
    assert plan.num_bytes_written == sum(g.num_bytes * len(g.targets) for g in plan.groups)


def test_a_w13_of_a_fractional_slot_count_is_refused_naming_the_sizes() -> None:
    targets = simulate_targets(TINY, tp=2)
    numel = targets[1].weights_info[W13][1]
    slot = numel // 8
    targets[1] = _with(targets[1], **{W13: numel + slot // 2})
    with pytest.raises(LayoutMismatchError) as caught:
        _plan(TINY, targets)
    message = str(caught.value)
    for part in (W13, "replica replica0 rank 1", f"expert slots of {slot}", "no SGLang layout"):
        assert part in message, message


def test_a_w13_with_more_fused_slots_than_shared_experts_is_refused() -> None:
    targets = simulate_targets(TINY, tp=2)
    numel = targets[0].weights_info[W13][1]
    targets[0] = _with(targets[0], **{W13: numel // 8 * 10})
    with pytest.raises(LayoutMismatchError, match="fuses none or all n_shared_experts=1"):
        _plan(TINY, targets)


def test_layers_that_disagree_on_fusion_are_refused() -> None:
    targets = simulate_targets(TINY, tp=2)
    numel = targets[0].weights_info[W13][1]
    targets[0] = _with(targets[0], **{W13: numel // 8 * 9})
    with pytest.raises(LayoutMismatchError, match="fuse different numbers of shared experts"):
        _plan(TINY, targets)


def test_a_parallelism_config_the_parameters_contradict_is_refused() -> None:
    # A server that publishes num_fused_shared_experts (the reference server) but unfused
    # parameters: the bytes would land in the wrong slots.
    targets = [
        dataclasses.replace(
            t, parallelism=dataclasses.replace(t.parallelism, num_fused_shared_experts=1)
        )
        for t in simulate_targets(TINY, tp=2)
    ]
    resolved, problems = served_targets(TINY, targets)
    assert len(problems) == 2 and "says 1 fused shared expert(s)" in problems[0]
    assert resolved == targets
    with pytest.raises(LayoutMismatchError, match="holds 0"):
        _plan(TINY, targets)


def test_models_without_deepseek_moe_are_left_as_published() -> None:
    config = preset_config("tiny-moe")
    targets = simulate_targets(config, tp=2)
    resolved, problems = served_targets(config, targets)
    assert (resolved, problems) == (targets, [])


@pytest.mark.parametrize(
    "settings",
    [
        {"attn_dp": 2},
        {"attn_dp": 4},
        {"attn_dp": 2, "dp_lm_head": True},
        {"moe_dense_tp_size": 1},
        {"attn_dp": 4, "moe_dense_tp_size": 1, "dp_lm_head": True, "fused_shared_experts": True},
    ],
)
def test_dp_attention_and_dense_tp_replicas_plan(settings: dict) -> None:
    targets = simulate_targets(TINY, tp=4, ep=4, **settings)
    plan = _plan(TINY, targets)
    for target, row in zip(plan.targets, plan.summary()["targets"], strict=True):
        parallelism = row["parallelism"]
        assert parallelism["attn_dp_size"] == settings.get("attn_dp", 1)
        assert parallelism["moe_dense_tp_size"] == settings.get("moe_dense_tp_size")
        assert parallelism["enable_dp_lm_head"] == settings.get("dp_lm_head", False)
        layout = rank_layout(TINY, target.parallelism)
        assert [p["name"] for p in row["params"]] == list(layout)


def test_fp8_kv_scales_are_engine_owned_left_alone_and_reported() -> None:
    targets = simulate_targets(TINY_FP8, tp=2)
    scales = [name for name in targets[0].weights_info if name.endswith(("k_scale", "v_scale"))]
    # MLA has two RadixAttention modules per layer, each with k_scale and v_scale.
    assert len(scales) == 3 * 2 * 2
    plan = _plan(TINY_FP8, targets)
    assert plan.engine_owned[("replica0", 1)] == dict.fromkeys(scales, "fp8_kv_scale")
    summary = plan.summary()
    assert summary["num_engine_owned"] == 2 * len(scales)
    assert list(summary["targets"][0]["engine_owned"]) == scales
    # No byte is planned into them.
    for part in plan.parts:
        for group in part.groups:
            assert not {p.name for p in group.params} & set(scales)


def test_only_declared_kinds_are_engine_owned() -> None:
    targets = simulate_targets(TINY_FP8, tp=1)
    name = "model.layers.0.self_attn.attn_mqa.k_scale"
    # A "scale" of more than one element is not the KV-cache scale SGLang registers.
    wide = [_with(targets[0], **{name: 2})]
    with pytest.raises(LayoutMismatchError, match="unexpected"):
        _plan(TINY_FP8, wide)
    extra = "model.layers.0.self_attn.rotary_emb.cos_sin_cache"
    info = {**targets[0].weights_info, extra: (1 << 50, 64, 4)}
    stray = [dataclasses.replace(targets[0], weights_info=info)]
    with pytest.raises(LayoutMismatchError, match="declare it engine-owned"):
        _plan(TINY_FP8, stray)
    plan = _plan(TINY_FP8, stray, engine_owned=["*.rotary_emb.*"])
    assert plan.engine_owned[("replica0", 0)][extra] == "declared"


def test_bf16_replicas_have_no_engine_owned_parameters() -> None:
    plan = _plan(TINY, simulate_targets(TINY, tp=2))
    assert plan.engine_owned == {} and plan.summary()["num_engine_owned"] == 0


@pytest.mark.parametrize(
    ("config", "fused"),
    [
        # Kimi-K2 runs fused only with --enforce-shared-experts-fusion; same rule.
        ({**TINY, "model_type": "kimi_k2"}, 1),
        # Every shared expert is a slot of its own (SGLang fuses all n_shared_experts).
        ({**TINY, "n_shared_experts": 2}, 2),
    ],
    ids=["kimi-k2", "two-shared-experts"],
)
def test_every_fused_shared_expert_is_counted(config: dict, fused: int) -> None:
    targets = simulate_targets(config, tp=2, ep=2, fused_shared_experts=True)
    plan = _plan(config, targets)
    assert [t.parallelism.num_fused_shared_experts for t in plan.targets] == [fused] * 2
    # One slot short of all of them is a layout SGLang never makes.
    if fused > 1:
        numel = targets[0].weights_info[W13][1]
        slot = numel // (8 // 2 + fused)
        short = [_with(targets[0], **{W13: numel - slot, W13_LAST: numel - slot}), targets[1]]
        with pytest.raises(LayoutMismatchError, match="fuses none or all n_shared_experts=2"):
            _plan(config, short)
