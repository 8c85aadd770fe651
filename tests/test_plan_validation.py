"""Each way a plan can fail validation, and what its message says."""

from __future__ import annotations

import re

import pytest

from weightsync.errors import LayoutMismatchError, WeightSyncError
from weightsync.layout import hf_tensor_shapes, rank_layout
from weightsync.plan import (
    CopyItem,
    SourceHolding,
    TargetRank,
    TensorMeta,
    build_plan,
    simulate_sources,
    simulate_targets,
)
from weightsync.plan.validate import check_coverage
from weightsync.testing.presets import preset_config

CONFIG = preset_config("tiny")  # qwen3, 4 layers, float32
QKV = "model.layers.1.self_attn.qkv_proj.weight"
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


def _with_info(target: TargetRank, weights_info: dict) -> TargetRank:
    return TargetRank(
        replica=target.replica,
        rank=target.rank,
        session_id=target.session_id,
        parallelism=target.parallelism,
        weights_info=weights_info,
    )


def _plan_with_target(change) -> None:
    """Build a plan for 2 replicas x tp 2 where replica1 rank 1's weights_info is changed."""
    targets = simulate_targets(CONFIG, tp=2, replicas=2)
    info = dict(targets[3].weights_info)
    change(info)
    targets[3] = _with_info(targets[3], info)
    build_plan(hf_config=CONFIG, targets=targets, sources=simulate_sources(CONFIG, num_sources=2))


def _assert_names(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in message:\n{message}"


def test_missing_parameter_names_parameter_rank_expected_and_actual() -> None:
    with pytest.raises(LayoutMismatchError) as caught:
        _plan_with_target(lambda info: info.pop(QKV))
    expected_numel = rank_layout(CONFIG, {"tp_size": 2, "tp_rank": 1})[QKV].numel
    _assert_names(
        str(caught.value),
        QKV,
        "replica replica1 rank 1",
        "session replica1-rank1:0",
        "missing",
        f"numel {expected_numel}",
        "actual: not published",
    )


def test_unexpected_parameter_names_it_and_its_size() -> None:
    extra = "model.layers.1.self_attn.rotary_emb.inv_freq"
    with pytest.raises(LayoutMismatchError) as caught:
        _plan_with_target(lambda info: info.__setitem__(extra, (1 << 50, 8, 4)))
    _assert_names(
        str(caught.value),
        extra,
        "replica replica1 rank 1",
        "unexpected",
        "expected no such parameter",
        "actual numel 8, element size 4",
    )


def test_numel_mismatch_names_expected_and_actual() -> None:
    def shrink(info: dict) -> None:
        addr, numel, element_size = info[QKV]
        info[QKV] = (addr, numel - 64, element_size)

    numel = rank_layout(CONFIG, {"tp_size": 2, "tp_rank": 1})[QKV].numel
    with pytest.raises(LayoutMismatchError) as caught:
        _plan_with_target(shrink)
    _assert_names(
        str(caught.value),
        QKV,
        "replica replica1 rank 1",
        f"expected {numel}",
        f"actual {numel - 64}",
    )


def test_element_size_mismatch_of_one_parameter() -> None:
    def halve(info: dict) -> None:
        addr, numel, _ = info[QKV]
        info[QKV] = (addr, numel, 2)

    with pytest.raises(LayoutMismatchError) as caught:
        _plan_with_target(halve)
    _assert_names(
        str(caught.value),
        QKV,
        "replica replica1 rank 1",
        "element size",
        "expected 4 bytes (float32)",
        "actual 2 bytes",
    )


def test_rollout_in_another_dtype_is_reported_once_per_rank() -> None:
    targets = simulate_targets(CONFIG, tp=2, replicas=1, dtype="bfloat16")
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(
            hf_config=CONFIG,
            targets=targets,
            sources=simulate_sources(CONFIG, num_sources=1),
            dtype="float32",
        )
    message = str(caught.value)
    assert message.startswith("2 layout mismatches:")
    _assert_names(
        message,
        "replica replica0 rank 0",
        "replica replica0 rank 1",
        "'model.embed_tokens.weight' and all 34 others",
        "expected 4 bytes (float32)",
        "actual 2 bytes",
        "another dtype",
    )


def test_tensor_no_source_holds_names_it_and_the_layers_held() -> None:
    sources = simulate_sources(CONFIG, num_sources=2, pp=2)
    # Stage 1 (ranks 1 of 0..1) lost layer 3's up_proj.
    lost = "model.layers.3.mlp.up_proj.weight"
    stage1 = sources[1]
    sources[1] = SourceHolding(
        rank=stage1.rank, tensors={n: m for n, m in stage1.tensors.items() if n != lost}
    )
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(hf_config=CONFIG, targets=simulate_targets(CONFIG, tp=2), sources=sources)
    _assert_names(
        str(caught.value),
        f"no trainer source holds HF tensor {lost!r}",
        "model.layers.3.mlp.gate_up_proj.weight",
        "replica replica0 rank 0",
        "expected a source holding it with shape (128, 64)",
        "the sources hold layers 0-3",
        "model.embed_tokens.weight",
    )


def test_a_missing_pipeline_stage_is_one_problem_per_tensor() -> None:
    sources = simulate_sources(CONFIG, num_sources=2, pp=2)[:1]  # only stage 0
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(hf_config=CONFIG, targets=simulate_targets(CONFIG, tp=1), sources=sources)
    message = str(caught.value)
    assert re.match(r"\d+ layout mismatches:", message)
    _assert_names(message, "the sources hold layers 0-1", "... and ")


def test_misnamed_source_tensors_are_pointed_out() -> None:
    source = simulate_sources(CONFIG, num_sources=1)[0]
    renamed = {f"module.{name}": meta for name, meta in source.tensors.items()}
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(
            hf_config=CONFIG,
            targets=simulate_targets(CONFIG, tp=1),
            sources=[SourceHolding(rank=0, tensors=renamed)],
        )
    _assert_names(
        str(caught.value),
        "the sources hold 47 tensors the model does not have",
        "'module.lm_head.weight'",
    )


def test_source_with_wrong_shape_names_source_rank_expected_and_actual() -> None:
    sources = simulate_sources(CONFIG, num_sources=4)
    tensors = dict(sources[2].tensors)
    tensors[Q_PROJ] = TensorMeta(shape=(32, 64), dtype="float32")
    sources[2] = SourceHolding(rank=2, tensors=tensors)
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(hf_config=CONFIG, targets=simulate_targets(CONFIG, tp=2), sources=sources)
    _assert_names(
        str(caught.value),
        "source rank 2",
        Q_PROJ,
        QKV,
        "replica replica0 rank 0",
        "expected (64, 64)",
        "actual (32, 64)",
    )


def _coverage_problems(items: list[CopyItem]) -> list[str]:
    targets = simulate_targets(CONFIG, tp=1)
    plan = build_plan(
        hf_config=CONFIG, targets=targets, sources=simulate_sources(CONFIG, num_sources=1)
    )
    group = plan.groups[0]
    by_param: dict[str, list[CopyItem]] = {}
    for works in plan.for_source(0).work.values():
        for work in works:
            for item in work.items:
                by_param.setdefault(item.param_name, []).append(item)
    by_param["model.norm.weight"] = items
    return check_coverage(group, by_param, hf_tensor_shapes(CONFIG))


def _norm_item(start: int, stop: int, offset: int | None = None) -> CopyItem:
    return CopyItem(
        hf_name="model.norm.weight",
        src_box=((start, stop),),
        param_name="model.norm.weight",
        dst_offset_bytes=4 * start if offset is None else offset,
        num_bytes=4 * (stop - start),
    )


def test_coverage_check_accepts_the_real_items() -> None:
    assert _coverage_problems([_norm_item(0, 32), _norm_item(32, 64)]) == []


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([_norm_item(0, 32)], "items cover 128 bytes: expected 256"),
        ([_norm_item(0, 32), _norm_item(16, 64, offset=120)], "has an overlap at byte 128"),
        ([_norm_item(0, 16), _norm_item(32, 64)], "has a gap at byte 64"),
        ([_norm_item(0, 64), _norm_item(64, 65)], "outside its shape (64,)"),
        ([_norm_item(0, 64), _norm_item(0, 1, offset=256)], "cover 260 bytes: expected 256"),
    ],
)
def test_coverage_check_reports_gaps_overlaps_and_bounds(items, expected) -> None:
    problems = _coverage_problems(items)
    assert problems, "the coverage check accepted broken items"
    _assert_names(" | ".join(problems), "'model.norm.weight'", expected)


def test_coverage_check_reports_box_size_disagreeing_with_bytes() -> None:
    item = CopyItem(
        hf_name="model.norm.weight",
        src_box=((0, 32),),
        param_name="model.norm.weight",
        dst_offset_bytes=0,
        num_bytes=256,
    )
    problems = _coverage_problems([item])
    _assert_names(" | ".join(problems), "expected 128 bytes from its box, actual 256")


def test_coverage_check_reports_items_for_unknown_parameters() -> None:
    stray = CopyItem(
        hf_name=None, src_box=(), param_name="model.ghost.weight", dst_offset_bytes=0, num_bytes=4
    )
    targets = simulate_targets(CONFIG, tp=1)
    plan = build_plan(
        hf_config=CONFIG, targets=targets, sources=simulate_sources(CONFIG, num_sources=1)
    )
    problems = check_coverage(
        plan.groups[0], {"model.ghost.weight": [stray]}, hf_tensor_shapes(CONFIG)
    )
    _assert_names(" | ".join(problems), "'model.ghost.weight', which the layout lacks")


def test_layout_mismatch_is_a_value_error_and_a_weightsync_error() -> None:
    with pytest.raises(ValueError, match="missing"):
        _plan_with_target(lambda info: info.pop(QKV))
    with pytest.raises(WeightSyncError):
        _plan_with_target(lambda info: info.pop(QKV))


def test_many_problems_are_listed_then_counted() -> None:
    def drop_all_but_one(info: dict) -> None:
        for name in list(info)[1:]:
            info.pop(name)

    with pytest.raises(LayoutMismatchError) as caught:
        _plan_with_target(drop_all_but_one)
    message = str(caught.value)
    assert message.startswith("34 layout mismatches:")
    assert message.count("\n  - ") == 8
    assert message.endswith("... and 26 more")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t: t.append(t[0]), "target replica replica0 rank 0 given twice"),
        (lambda t: t.clear(), "at least one target"),
    ],
)
def test_bad_target_lists_are_value_errors(change, expected) -> None:
    targets = simulate_targets(CONFIG, tp=1)
    change(targets)
    with pytest.raises(ValueError, match=expected):
        build_plan(
            hf_config=CONFIG, targets=targets, sources=simulate_sources(CONFIG, num_sources=1)
        )


def test_duplicate_or_no_sources_are_value_errors() -> None:
    targets = simulate_targets(CONFIG, tp=1)
    source = simulate_sources(CONFIG, num_sources=1)[0]
    with pytest.raises(ValueError, match=r"source ranks must be unique, got \[0, 0\]"):
        build_plan(hf_config=CONFIG, targets=targets, sources=[source, source])
    with pytest.raises(ValueError, match="at least one trainer source"):
        build_plan(hf_config=CONFIG, targets=targets, sources=[])


def test_unknown_source_rank_in_for_source() -> None:
    plan = build_plan(
        hf_config=CONFIG,
        targets=simulate_targets(CONFIG, tp=1),
        sources=simulate_sources(CONFIG, num_sources=2),
    )
    with pytest.raises(ValueError, match="source rank 7 is not in this plan; its sources are 0, 1"):
        plan.for_source(7)


def _sources_with(name: str, meta: TensorMeta) -> list[SourceHolding]:
    (source,) = simulate_sources(CONFIG, num_sources=1)
    return [SourceHolding(rank=0, tensors={**source.tensors, name: meta})]


def test_an_extra_or_misspelled_tensor_is_refused_unless_skipped() -> None:
    targets = simulate_targets(CONFIG, tp=2)
    extra = _sources_with(
        "model.layers.0.mlp.gate_projj.weight", TensorMeta(shape=(4,), dtype="float32")
    )
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(hf_config=CONFIG, targets=targets, sources=extra)
    _assert_names(
        str(caught.value),
        "source rank 0 holds 1 tensor(s) the model's checkpoint does not have",
        "'model.layers.0.mlp.gate_projj.weight'",
        "skip_tensors",
    )
    plan = build_plan(
        hf_config=CONFIG, targets=targets, sources=extra, skip_tensors=["*.gate_projj.*"]
    )
    assert "model.layers.0.mlp.gate_projj.weight" not in plan.for_source(0).work


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8"])
def test_a_tensor_that_does_not_cast_to_the_rollout_dtype_is_refused(dtype: str) -> None:
    shape = hf_tensor_shapes(CONFIG)[Q_PROJ]
    sources = _sources_with(Q_PROJ, TensorMeta(shape=shape, dtype=dtype))
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(hf_config=CONFIG, targets=simulate_targets(CONFIG, tp=2), sources=sources)
    _assert_names(str(caught.value), Q_PROJ, f"is {dtype}", "does not cast to the rollout's")
    # Any floating-point dtype casts.
    ok = _sources_with(Q_PROJ, TensorMeta(shape=shape, dtype="bfloat16"))
    build_plan(hf_config=CONFIG, targets=simulate_targets(CONFIG, tp=2), sources=ok)


def test_aliased_destination_addresses_are_refused_before_any_write() -> None:
    norm = "model.layers.0.input_layernorm.weight"

    def alias(info: dict) -> None:
        # A parameter published at an address inside another one.
        info[norm] = (info[QKV][0] + 64, info[norm][1], info[norm][2])

    with pytest.raises(LayoutMismatchError) as caught:
        _plan_with_target(alias)
    _assert_names(
        str(caught.value),
        "replica replica1 rank 1",
        f"parameter {norm!r}",
        f"overlaps parameter {QKV!r}",
    )


def test_parameters_outside_the_registered_regions_are_refused_before_any_write() -> None:
    import dataclasses

    targets = simulate_targets(CONFIG, tp=2, replicas=2)
    spans = [(addr, numel * size) for addr, numel, size in targets[3].weights_info.values()]
    start = min(a for a, _ in spans)
    end = max(a + n for a, n in spans)
    sources = simulate_sources(CONFIG, num_sources=2)
    # The whole span registered: accepted.
    targets[3] = dataclasses.replace(targets[3], regions=((start, end - start),))
    build_plan(hf_config=CONFIG, targets=targets, sources=sources)
    # The last 64 bytes not registered: the parameter ending there is refused, by name.
    last = max(targets[3].weights_info, key=lambda n: targets[3].weights_info[n][0])
    targets[3] = dataclasses.replace(targets[3], regions=((start, end - start - 64),))
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(hf_config=CONFIG, targets=targets, sources=sources)
    _assert_names(
        str(caught.value),
        "replica replica1 rank 1",
        repr(last),
        "outside every memory region",
    )
    # A rank that publishes no regions is not checked.
    targets[3] = dataclasses.replace(targets[3], regions=None)
    build_plan(hf_config=CONFIG, targets=targets, sources=sources)


def test_a_mismatch_under_dp_attention_names_the_ranks_attention_place() -> None:
    config = preset_config("tiny-deepseek")
    targets = simulate_targets(config, tp=4, ep=4, attn_dp=2, moe_dense_tp_size=1)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    addr, numel, size = targets[3].weights_info[name]
    targets[3] = _with_info(targets[3], {**targets[3].weights_info, name: (addr, numel * 2, size)})
    with pytest.raises(LayoutMismatchError) as caught:
        build_plan(
            hf_config=config, targets=targets, sources=simulate_sources(config, num_sources=1)
        )
    # Attention splits over the 2 ranks of its attention-DP group: the message says where.
    _assert_names(
        str(caught.value),
        name,
        "replica replica0 rank 3",
        "tp 3/4, ep 3/4, attn tp 1/2 dp 1/2, dense tp 1",
        f"expected {numel}",
        f"actual {numel * 2}",
    )
