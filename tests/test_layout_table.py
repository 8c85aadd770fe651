"""Worked examples of the parameter table: names, order, shapes, segments, padding, speed."""

from __future__ import annotations

import time

import pytest
import torch

from weightsync.layout import (
    ParallelismConfig,
    hf_tensor_shapes,
    layer_index,
    padded_vocab_size,
    rank_layout,
)
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import preset_config
from weightsync.torch_dtypes import dtype_name, torch_dtype


def _rank(tp_size: int, tp_rank: int = 0, **extra: int) -> ParallelismConfig:
    return ParallelismConfig(tp_size=tp_size, tp_rank=tp_rank, **extra)


def _boxes(layout) -> list[tuple[str | None, tuple]]:
    return [(s.hf_name, s.src_box) for s in layout.segments]


@pytest.mark.parametrize(
    ("vocab", "tp_size", "padded"),
    [(1000, 1, 1024), (1000, 2, 1024), (1000, 8, 1024), (1000, 3, 1152), (1024, 3, 1152),
     (64, 3, 192), (1, 1, 64), (151936, 8, 151936), (32000, 6, 32256)],
)  # fmt: skip
def test_padded_vocab_size(vocab: int, tp_size: int, padded: int) -> None:
    assert padded_vocab_size(vocab, tp_size) == padded


def test_qwen3_rank_table_names_order_and_shapes() -> None:
    config = preset_config("tiny")  # 4 heads, 2 kv heads, head_dim 16, hidden 64
    layout = rank_layout(config, _rank(2, 1))
    names = list(layout)
    assert names[:9] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ]
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert len(names) == 1 + 4 * 8 + 2
    shapes = {name: p.shape for name, p in layout.items()}
    assert shapes["model.embed_tokens.weight"] == (512, 64)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 2 * 1) * 16, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (128, 64)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)

    prefix = "model.layers.3."
    assert _boxes(layout[prefix + "self_attn.qkv_proj.weight"]) == [
        (prefix + "self_attn.q_proj.weight", ((32, 64), (0, 64))),
        (prefix + "self_attn.k_proj.weight", ((16, 32), (0, 64))),
        (prefix + "self_attn.v_proj.weight", ((16, 32), (0, 64))),
    ]
    assert _boxes(layout[prefix + "self_attn.o_proj.weight"]) == [
        (prefix + "self_attn.o_proj.weight", ((0, 64), (32, 64)))
    ]
    assert _boxes(layout[prefix + "mlp.gate_up_proj.weight"]) == [
        (prefix + "mlp.gate_proj.weight", ((64, 128), (0, 64))),
        (prefix + "mlp.up_proj.weight", ((64, 128), (0, 64))),
    ]
    assert _boxes(layout[prefix + "mlp.down_proj.weight"]) == [
        (prefix + "mlp.down_proj.weight", ((0, 64), (64, 128)))
    ]
    # Rank 1 of 2 holds padded rows [512, 1024): real rows 512..999, then 24 zero rows.
    embed = layout["model.embed_tokens.weight"]
    assert _boxes(embed) == [("model.embed_tokens.weight", ((512, 1000), (0, 64))), (None, ())]
    assert embed.segments[1].dst_offset == 488 * 64 and embed.segments[1].numel == 24 * 64


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    config = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    head_dim = 4
    for tp_rank in range(8):
        qkv = rank_layout(config, _rank(8, tp_rank))["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape == (3 * head_dim, 32)
        kv_head = tp_rank // 4
        k_rows = (kv_head * head_dim, (kv_head + 1) * head_dim)
        assert [s.src_box[0] for s in qkv.segments] == [
            (tp_rank * head_dim, (tp_rank + 1) * head_dim),
            k_rows,
            k_rows,
        ]


def test_qwen2_has_fused_qkv_bias() -> None:
    config = {**preset_config("tiny"), "model_type": "qwen2"}
    layout = rank_layout(config, _rank(2, 0))
    bias = layout["model.layers.0.self_attn.qkv_proj.bias"]
    assert bias.shape == (64,)
    assert _boxes(bias) == [
        ("model.layers.0.self_attn.q_proj.bias", ((0, 32),)),
        ("model.layers.0.self_attn.k_proj.bias", ((0, 16),)),
        ("model.layers.0.self_attn.v_proj.bias", ((0, 16),)),
    ]
    assert not any("norm.weight" in n and "self_attn" in n for n in layout)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_tied_dense_models_have_no_lm_head(model_type: str) -> None:
    config = {**preset_config("tiny", tie_word_embeddings=True), "model_type": model_type}
    assert "lm_head.weight" not in rank_layout(config, _rank(2, 1))
    assert "lm_head.weight" not in hf_tensor_shapes(config)


def test_moe_rank_table() -> None:
    config = preset_config("tiny-moe")  # 8 experts, moe_intermediate 32, layer 0 dense
    layout = rank_layout(config, _rank(4, 3, ep_size=2))  # ep_rank 1, moe_tp 2, moe_tp_rank 1
    prefix = "model.layers.2.mlp."
    names = [n for n in layout if n.startswith("model.layers.2.")]
    assert names == [
        "model.layers.2.self_attn.qkv_proj.weight",
        "model.layers.2.self_attn.o_proj.weight",
        "model.layers.2.self_attn.q_norm.weight",
        "model.layers.2.self_attn.k_norm.weight",
        prefix + "experts.w13_weight",
        prefix + "experts.w2_weight",
        prefix + "gate.weight",
        "model.layers.2.input_layernorm.weight",
        "model.layers.2.post_attention_layernorm.weight",
    ]
    assert "model.layers.0.mlp.gate_up_proj.weight" in layout
    w13, w2 = layout[prefix + "experts.w13_weight"], layout[prefix + "experts.w2_weight"]
    assert w13.shape == (4, 32, 64) and w2.shape == (4, 64, 16)
    assert layout[prefix + "gate.weight"].shape == (8, 64)
    assert len(w13.segments) == 8 and len(w2.segments) == 4
    assert _boxes(w13)[:2] == [
        ("model.layers.2.mlp.experts.4.gate_proj.weight", ((16, 32), (0, 64))),
        ("model.layers.2.mlp.experts.4.up_proj.weight", ((16, 32), (0, 64))),
    ]
    assert _boxes(w2)[-1] == ("model.layers.2.mlp.experts.7.down_proj.weight", ((0, 64), (16, 32)))
    # ep_size == tp_size: whole experts, no tensor split.
    whole = rank_layout(config, _rank(4, 2, ep_size=4))
    assert whole[prefix + "experts.w13_weight"].shape == (2, 64, 64)
    assert whole[prefix + "experts.w2_weight"].shape == (2, 64, 32)


def test_decoder_sparse_step_picks_moe_layers() -> None:
    config = preset_config("tiny-moe", decoder_sparse_step=2, mlp_only_layers=[3])
    layout = rank_layout(config, _rank(1))
    moe_layers = sorted({layer_index(n) for n in layout if "experts" in n})
    assert moe_layers == [1]


def test_dtype_override_and_aliases() -> None:
    config = preset_config("tiny")
    for dtype in (torch.bfloat16, "bfloat16", "bf16", "torch.bfloat16"):
        layout = rank_layout(config, _rank(1), dtype)
        assert {p.dtype for p in layout.values()} == {"bfloat16"}
        assert all(p.element_size == 2 and p.num_bytes == 2 * p.numel for p in layout.values())
    assert {p.dtype for p in rank_layout(config, _rank(1), "auto").values()} == {"float32"}
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("float32") is torch.float32
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float16) == "float16"


def test_layer_index() -> None:
    assert layer_index("model.layers.7.self_attn.q_proj.weight") == 7
    assert layer_index("model.layers.12.mlp.experts.3.down_proj.weight") == 12
    assert layer_index("model.layers.0.mlp.experts.w13_weight") == 0
    assert layer_index("model.embed_tokens.weight") is None
    assert layer_index("model.norm.weight") is None
    assert layer_index("lm_head.weight") is None


def test_returned_tables_are_independent_copies() -> None:
    config = preset_config("tiny")
    first = rank_layout(config, _rank(2, 0))
    first.pop("model.norm.weight")
    assert "model.norm.weight" in rank_layout(config, _rank(2, 0))
    shapes = hf_tensor_shapes(config)
    shapes.clear()
    assert hf_tensor_shapes(config)


@pytest.mark.serial  # wall-clock bounds: not beside another test
def test_large_moe_table_builds_fast() -> None:
    # A Qwen3-30B-A3B-sized model with 48 layers of 128 experts, at tp=8 without ep (every
    # rank holds a slice of every expert: the most segments per rank).
    config = preset_config("qwen3-30b-a3b", dtype="bfloat16", tie_word_embeddings=False)
    # A vocabulary no other test uses, so nothing is cached yet.
    config["vocab_size"] += 7
    start = time.perf_counter()
    layout = rank_layout(config, _rank(8, 5))
    first_s = time.perf_counter() - start
    assert first_s < 1.0, f"building one rank's table took {first_s:.2f} s"
    assert sum(len(p.segments) for p in layout.values()) > 48 * 128 * 3
    start = time.perf_counter()
    for _ in range(100):
        rank_layout(config, _rank(8, 5))
    assert (time.perf_counter() - start) / 100 < 0.01


def test_shard_state_dict_casts_and_places_on_device() -> None:
    config = preset_config("tiny")
    hf = {name: torch.randn(shape) for name, shape in hf_tensor_shapes(config).items()}
    shards = shard_state_dict(hf, config, {"tp_size": 2, "tp_rank": 0}, torch.bfloat16)
    assert {t.dtype for t in shards.values()} == {torch.bfloat16}
    assert {t.device.type for t in shards.values()} == {"cpu"}
    assert torch.equal(shards["model.norm.weight"], hf["model.norm.weight"].to(torch.bfloat16))
    meta = shard_state_dict(hf, config, {"tp_size": 2, "tp_rank": 0}, device="meta")
    assert {t.device.type for t in meta.values()} == {"meta"}
