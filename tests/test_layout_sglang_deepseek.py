"""DeepSeek-V3 / Kimi-K2 layouts, bit for bit against SGLang 0.5.23's own weight loader.

`sglang_cpu/deepseek_layouts.json` holds, for every case of `sglang_cpu.deepseek_cases.CASES`
(fused shared experts at TP and EP, DP attention with and without ``--enable-dp-lm-head``,
``--moe-dense-tp-size 1``, bf16 and block FP8, DeepSeek-V3 with and without q_lora and a
Kimi-K2-shaped model) and every rank, each parameter SGLang's ``load_weights`` left: its name
in SGLang's order, shape, dtype and a digest of its bytes. ``scripts/sglang-deepseek-layouts``
rebuilds the tables by running SGLang's loader on the CPU. Here `shard_state_dict` shards the
same deterministic checkpoint and must give the same table; the ``sglang`` test runs SGLang's
loader live on a few cases.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from sglang_cpu.deepseek_cases import (
    CASES,
    MODELS,
    SGLANG_VERSION,
    TABLES_PATH,
    case_config,
    layout_rows,
    make_state,
    rank_parallelism,
    run_sglang_loader,
    table_row,
    write_checkpoint,
)
from weightsync.layout import ParallelismConfig, hf_tensor_shapes, rank_layout
from weightsync.receiver.loader import shard_state_dict


@functools.cache
def _stored() -> dict[str, Any]:
    return json.loads(TABLES_PATH.read_text())


@functools.cache
def _state(model: str) -> dict[str, Any]:
    config = MODELS[model]
    return make_state(hf_tensor_shapes(config), config)


def _weightsync_table(case: dict[str, Any], tp_rank: int) -> list[list[Any]]:
    config = case_config(case)
    params = shard_state_dict(_state(case["model"]), config, rank_parallelism(case, tp_rank))
    return [table_row(name, tensor) for name, tensor in params.items()]


def _differences(expected: list[list[Any]], actual: list[list[Any]]) -> str:
    """The first few rows that differ, by parameter, for the failure message."""
    want = {row[0]: row for row in expected}
    got = {row[0]: row for row in actual}
    lines = [f"only SGLang has {name}" for name in want if name not in got]
    lines += [f"only weightsync has {name}" for name in got if name not in want]
    lines += [
        f"{name}: SGLang {want[name][1:]} weightsync {got[name][1:]}"
        for name in want
        if name in got and want[name] != got[name]
    ]
    if not lines:
        lines = ["same rows in another order"]
    return "\n".join(lines[:12])


def test_tables_cover_every_case_of_this_sglang() -> None:
    stored = _stored()
    assert stored["sglang"] == SGLANG_VERSION
    assert list(stored["cases"]) == list(CASES)
    for name, entry in stored["cases"].items():
        assert entry["case"] == CASES[name], f"{name}: rebuild the tables"
        assert len(entry["ranks"]) == CASES[name]["tp_size"]


@pytest.mark.parametrize("case_name", list(CASES))
def test_shard_state_dict_matches_sglang_loader(case_name: str) -> None:
    case = CASES[case_name]
    ranks = _stored()["cases"][case_name]["ranks"]
    for tp_rank, rows in enumerate(ranks):
        expected = layout_rows(rows)
        actual = _weightsync_table(case, tp_rank)
        assert actual == expected, f"{case_name} rank {tp_rank}:\n" + _differences(expected, actual)
        # The layout itself names the same parameters, shapes and dtypes.
        layout = rank_layout(case_config(case), rank_parallelism(case, tp_rank))
        assert [[p.name, list(p.shape), p.dtype] for p in layout.values()] == [
            row[:3] for row in expected
        ]


def test_only_fp8_kv_scales_are_left_out() -> None:
    # The rows the comparison drops are the FP8 attention's scalar k_scale / v_scale, and only
    # those: every other parameter SGLang loads has an HF source in the layout.
    for name, entry in _stored()["cases"].items():
        for rows in entry["ranks"]:
            dropped = [row for row in rows if row not in layout_rows(rows)]
            fp8 = "quantization_config" in case_config(CASES[name])
            assert all(row[1] == [] and row[2] == "float32" for row in dropped), name
            assert bool(dropped) == fp8, name


def test_fused_slot_and_dp_attention_in_the_tables() -> None:
    # Spot checks that the tables are what the cases say: the fused shared expert is one
    # extra slot on every EP rank, and DP attention halves the heads' groups, not the experts.
    ranks = _stored()["cases"]["deepseek-v3-tp4-ep4-dp2-fused"]["ranks"]
    for rows in ranks:
        shapes = {row[0]: row[1] for row in rows}
        assert shapes["model.layers.1.mlp.experts.w13_weight"] == [8 // 4 + 1, 512, 256]
        assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" not in shapes
        # 4 heads over attention TP 2, and embed_tokens' 1024 padded rows likewise.
        assert shapes["model.layers.1.self_attn.q_b_proj.weight"] == [2 * 192, 128]
        assert shapes["model.embed_tokens.weight"] == [512, 256]
        # lm_head stays over the whole TP group without --enable-dp-lm-head.
        assert shapes["lm_head.weight"] == [256, 256]
    # Attention is replicated across the two attention-DP groups: rank 0 and rank 2 agree.
    first = {row[0]: row for row in ranks[0]}
    third = {row[0]: row for row in ranks[2]}
    assert (
        first["model.layers.1.self_attn.o_proj.weight"]
        == third["model.layers.1.self_attn.o_proj.weight"]
    )
    assert (
        first["model.layers.1.mlp.experts.w2_weight"]
        != third["model.layers.1.mlp.experts.w2_weight"]
    )


def test_parallelism_config_derives_attention_ranks_as_sglang_does() -> None:
    config = ParallelismConfig(tp_size=4, tp_rank=3, ep_size=2, attn_dp_size=2)
    assert (config.attn_tp_size, config.attn_tp_rank, config.attn_dp_rank) == (2, 1, 1)
    assert (config.ep_rank, config.moe_tp_rank) == (1, 1)
    assert ParallelismConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="attn_tp_size=2 \\* attn_dp_size=1"):
        ParallelismConfig(tp_size=4, tp_rank=0, attn_tp_size=2)
    with pytest.raises(ValueError, match="must be attn_dp_rank=0"):
        ParallelismConfig(tp_size=4, tp_rank=3, attn_dp_size=2, attn_dp_rank=0, attn_tp_rank=1)
    with pytest.raises(ValueError, match="--moe-dense-tp-size"):
        ParallelismConfig(tp_size=4, tp_rank=0, moe_dense_tp_size=2)
    # None and tp_size lay the dense MLP out alike, and share a layout key.
    assert (
        ParallelismConfig(tp_size=4, tp_rank=0, moe_dense_tp_size=4).layout_key()
        == ParallelismConfig(tp_size=4, tp_rank=0).layout_key()
    )


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.parametrize(
    "case_name",
    # The case with every layout at once; scripts/sglang-deepseek-layouts --check runs them all.
    ["deepseek-v3-fp8-tp4-ep2-dp2-fused-dplmhead-densetp1"],
)
def test_live_sglang_loader_matches(case_name: str, tmp_path) -> None:
    from sglang_cpu.launch import venv_if_built

    venv = venv_if_built()
    if venv is None:
        pytest.skip("real SGLang's venv is not built here: run scripts/setup --tests")
    case = CASES[case_name]
    config = case_config(case)
    checkpoint = write_checkpoint(tmp_path / case["model"], hf_tensor_shapes(config), config)
    ranks = run_sglang_loader(venv, checkpoint, case_name)
    assert len(ranks) == case["tp_size"]
    for tp_rank, rows in enumerate(ranks):
        expected = layout_rows(rows)
        actual = _weightsync_table(case, tp_rank)
        assert actual == expected, f"{case_name} rank {tp_rank}:\n" + _differences(expected, actual)
