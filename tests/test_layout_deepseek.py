"""The DeepSeek-V3 / Kimi-K2 layout rule: MLA with and without q_lora, DeepSeek MoE (router
with its float32 bias, routed experts by EP then MoE-TP, shared experts over TP), dense first
layers, tied and untied heads.

Random configs are checked against the independent reference loader (`reference_loader`,
written after SGLang's DeepseekV2 weight loader): every rank's `shard_state_dict` equals it,
segments tile each parameter once, padding is zero, and all ranks' segments rebuild every HF
tensor. Worked tables, real transformers checkpoints and the refusals follow.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from reference_loader import reference_hf_shapes, reference_shard
from weightsync.checkpoint import load_config_dict
from weightsync.layout import (
    ParallelismConfig,
    hf_tensor_shapes,
    normalize_hf_config,
    rank_layout,
    sglang_fuses_shared_experts,
)
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import (
    build_hf_config,
    preset_config,
    random_model,
    write_random_checkpoint,
)
from weightsync.torch_dtypes import dtype_name, torch_dtype

BIAS = "mlp.gate.e_score_correction_bias"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def cases(draw: st.DrawFn) -> dict:
    """A random small DeepSeek-V3 config plus a rollout tp_size / ep_size it splits over."""
    tp_size = draw(st.sampled_from([1, 2, 4]))
    ep_size = draw(st.sampled_from(_divisors(tp_size)))
    moe_tp_size = tp_size // ep_size
    num_layers = draw(st.integers(1, 3))
    # SGLang refuses tp_size > n_routed_experts.
    fewest = -(-tp_size // ep_size)
    num_experts = ep_size * draw(st.integers(fewest, fewest + 2))
    cfg = {
        "model_type": draw(st.sampled_from(["deepseek_v3", "kimi_k2"])),
        "vocab_size": draw(st.integers(1, 200)),
        "hidden_size": draw(st.sampled_from([4, 8, 12])),
        "intermediate_size": tp_size * draw(st.integers(1, 3)),
        "moe_intermediate_size": tp_size * draw(st.integers(1, 2)),
        "num_hidden_layers": num_layers,
        "num_attention_heads": tp_size * draw(st.integers(1, 2)),
        "q_lora_rank": draw(st.sampled_from([None, 3, 6])),
        "kv_lora_rank": draw(st.sampled_from([2, 5])),
        "qk_nope_head_dim": draw(st.sampled_from([2, 3])),
        "qk_rope_head_dim": draw(st.sampled_from([2, 4])),
        "v_head_dim": draw(st.sampled_from([2, 5])),
        "n_routed_experts": num_experts,
        "n_shared_experts": draw(st.integers(1, 2)),
        "first_k_dense_replace": draw(st.integers(0, num_layers)),
        "tie_word_embeddings": draw(st.booleans()),
        "dtype": draw(st.sampled_from(["float32", "bfloat16"])),
    }
    assert cfg["moe_intermediate_size"] % moe_tp_size == 0
    return {
        "cfg": cfg,
        "tp_size": tp_size,
        "ep_size": ep_size,
        "dtype": draw(st.sampled_from([None, torch.float32, torch.bfloat16])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _random_hf(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _check_and_rebuild(cfg: dict, tp_size: int, ep_size: int, dtype, hf: dict) -> None:
    """Every rank against the reference loader; then all ranks' segments rebuild ``hf``."""
    shapes = {name: tuple(t.shape) for name, t in hf.items()}
    model_dtype = dtype if dtype is not None else torch_dtype(cfg["dtype"])
    rebuilt = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
    covered = {name: torch.zeros(shape, dtype=torch.bool) for name, shape in shapes.items()}
    for tp_rank in range(tp_size):
        parallelism = ParallelismConfig(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size)
        layouts = rank_layout(cfg, parallelism, dtype)
        shards = shard_state_dict(hf, cfg, parallelism, dtype)
        reference = reference_shard(
            hf, cfg, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, dtype=model_dtype
        )
        assert list(shards) == list(reference) == list(layouts)
        assert not any("w_kc" in name or "w_vc" in name for name in layouts)
        for name, layout in layouts.items():
            shard = shards[name]
            # The router bias is float32 in SGLang whatever the model dtype.
            expected = torch.float32 if name.endswith(BIAS) else model_dtype
            assert shard.dtype == expected == reference[name].dtype, name
            assert layout.dtype == dtype_name(expected)
            assert tuple(shard.shape) == layout.shape == tuple(reference[name].shape)
            assert torch.equal(shard, reference[name]), (name, tp_rank)
            flat = shard.view(-1)
            offset = 0
            for segment in layout.segments:
                assert segment.dst_offset == offset and segment.numel > 0
                offset += segment.numel
                piece = flat[segment.dst_offset : segment.dst_offset + segment.numel]
                if segment.is_padding:
                    assert torch.count_nonzero(piece) == 0
                    continue
                box_shape = tuple(b - a for a, b in segment.src_box)
                assert math.prod(box_shape) == segment.numel
                assert all(
                    0 <= a < b <= n
                    for (a, b), n in zip(segment.src_box, shapes[segment.hf_name], strict=True)
                )
                slices = tuple(slice(a, b) for a, b in segment.src_box)
                piece = piece.view(box_shape).to(torch.float32)
                seen = covered[segment.hf_name][slices]
                # Replicated elements (router, norms, q_a / kv_a) agree on every rank.
                assert torch.equal(rebuilt[segment.hf_name][slices][seen], piece[seen])
                rebuilt[segment.hf_name][slices] = piece
                covered[segment.hf_name][slices] = True
            assert offset == layout.numel
    for name, tensor in hf.items():
        assert bool(covered[name].all()), f"{name} not fully covered"
        cast = torch.float32 if name.endswith(BIAS) else model_dtype
        assert torch.equal(rebuilt[name], tensor.to(cast).to(torch.float32)), name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_shards_match_reference_and_reassemble(case: dict) -> None:
    cfg = case["cfg"]
    shapes = reference_hf_shapes(cfg)
    assert hf_tensor_shapes(cfg) == shapes
    hf = _random_hf(shapes, case["seed"])
    _check_and_rebuild(cfg, case["tp_size"], case["ep_size"], case["dtype"], hf)


@pytest.mark.parametrize("preset", ["tiny-deepseek", "tiny-deepseek-nolora"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("tp_size", "ep_size"), [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_presets_match_reference_at_every_parallelism(
    preset: str, tied: bool, tp_size: int, ep_size: int
) -> None:
    cfg = preset_config(preset, tie_word_embeddings=tied)
    hf = _random_hf(reference_hf_shapes(cfg), seed=tp_size * 10 + ep_size)
    _check_and_rebuild(cfg, tp_size, ep_size, torch.bfloat16, hf)


def _boxes(layout) -> list[tuple[str | None, tuple]]:
    return [(s.hf_name, s.src_box) for s in layout.segments]


def test_rank_table_with_q_lora() -> None:
    config = preset_config("tiny-deepseek")  # 4 heads of 128+64 (q/k) and 128 (v), D 256
    # tp 2, ep 2: ep_rank 1 (experts 4..7 whole, moe_tp 1), heads 2..3, shared rows 128..255.
    layout = rank_layout(config, ParallelismConfig(tp_size=2, tp_rank=1, ep_size=2), "bf16")
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    names = [n for n in layout if n.startswith("model.layers.1.")]
    assert names == [
        a + "fused_qkv_a_proj_with_mqa.weight",
        a + "q_a_layernorm.weight",
        a + "q_b_proj.weight",
        a + "kv_b_proj.weight",
        a + "o_proj.weight",
        a + "kv_a_layernorm.weight",
        m + "gate.weight",
        m + "gate.e_score_correction_bias",
        m + "experts.w13_weight",
        m + "experts.w2_weight",
        m + "shared_experts.gate_up_proj.weight",
        m + "shared_experts.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ]
    shapes = {n: (p.shape, p.dtype) for n, p in layout.items() if n in names}
    assert shapes[a + "fused_qkv_a_proj_with_mqa.weight"] == ((128 + 128 + 64, 256), "bfloat16")
    assert shapes[a + "q_b_proj.weight"] == ((2 * 192, 128), "bfloat16")
    assert shapes[a + "kv_b_proj.weight"] == ((2 * 256, 128), "bfloat16")
    assert shapes[a + "o_proj.weight"] == ((256, 2 * 128), "bfloat16")
    assert shapes[m + "gate.weight"] == ((8, 256), "bfloat16")
    assert shapes[m + "gate.e_score_correction_bias"] == ((8,), "float32")
    assert shapes[m + "experts.w13_weight"] == ((4, 512, 256), "bfloat16")
    assert shapes[m + "experts.w2_weight"] == ((4, 256, 256), "bfloat16")
    assert shapes[m + "shared_experts.gate_up_proj.weight"] == ((256, 256), "bfloat16")
    assert shapes[m + "shared_experts.down_proj.weight"] == ((256, 128), "bfloat16")

    assert _boxes(layout[a + "fused_qkv_a_proj_with_mqa.weight"]) == [
        (a + "q_a_proj.weight", ((0, 128), (0, 256))),
        (a + "kv_a_proj_with_mqa.weight", ((0, 192), (0, 256))),
    ]
    assert _boxes(layout[a + "q_b_proj.weight"]) == [
        (a + "q_b_proj.weight", ((384, 768), (0, 128)))
    ]
    assert _boxes(layout[a + "kv_b_proj.weight"]) == [
        (a + "kv_b_proj.weight", ((512, 1024), (0, 128)))
    ]
    assert _boxes(layout[a + "o_proj.weight"]) == [(a + "o_proj.weight", ((0, 256), (256, 512)))]
    assert _boxes(layout[m + "experts.w13_weight"])[:2] == [
        (m + "experts.4.gate_proj.weight", ((0, 256), (0, 256))),
        (m + "experts.4.up_proj.weight", ((0, 256), (0, 256))),
    ]
    assert _boxes(layout[m + "shared_experts.gate_up_proj.weight"]) == [
        (m + "shared_experts.gate_proj.weight", ((128, 256), (0, 256))),
        (m + "shared_experts.up_proj.weight", ((128, 256), (0, 256))),
    ]
    assert _boxes(layout[m + "shared_experts.down_proj.weight"]) == [
        (m + "shared_experts.down_proj.weight", ((0, 256), (128, 256)))
    ]
    # Layer 0 is dense (first_k_dense_replace 1); the head is untied, vocab padded to 1024.
    assert "model.layers.0.mlp.gate_up_proj.weight" in layout
    assert not any(n.startswith("model.layers.0.mlp.gate.") for n in layout)
    assert list(layout)[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert layout["lm_head.weight"].shape == (512, 256)
    # w_kc / w_vc are derived state: not parameters SGLang publishes.
    assert not any("w_kc" in n or "w_vc" in n for n in layout)


def test_rank_table_without_q_lora_and_tied() -> None:
    config = preset_config("tiny-deepseek-nolora", tie_word_embeddings=True)
    layout = rank_layout(config, ParallelismConfig(tp_size=4, tp_rank=2))
    a = "model.layers.0.self_attn."
    assert [n for n in layout if n.startswith(a)] == [
        a + "q_proj.weight",
        a + "kv_a_proj_with_mqa.weight",
        a + "kv_b_proj.weight",
        a + "o_proj.weight",
        a + "kv_a_layernorm.weight",
    ]
    assert _boxes(layout[a + "q_proj.weight"]) == [(a + "q_proj.weight", ((384, 576), (0, 256)))]
    assert _boxes(layout[a + "kv_a_proj_with_mqa.weight"]) == [
        (a + "kv_a_proj_with_mqa.weight", ((0, 192), (0, 256)))
    ]
    # Tied: SGLang's lm_head is embed_tokens itself, so no parameter of its own.
    assert "lm_head.weight" not in layout and "lm_head.weight" not in hf_tensor_shapes(config)
    # tp 4 without ep: every rank a quarter of every expert (moe_intermediate 256 / 4).
    w13 = layout["model.layers.2.mlp.experts.w13_weight"]
    assert w13.shape == (8, 128, 256)
    assert _boxes(w13)[:2] == [
        ("model.layers.2.mlp.experts.0.gate_proj.weight", ((128, 192), (0, 256))),
        ("model.layers.2.mlp.experts.0.up_proj.weight", ((128, 192), (0, 256))),
    ]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("deepseek-ckpt")
    return {
        (preset, tied): write_random_checkpoint(
            root / f"{preset}-{tied}", preset_config(preset, tie_word_embeddings=tied), seed=3
        )
        for preset, tied in [("tiny-deepseek", False), ("tiny-deepseek-nolora", True)]
    }


def test_hf_tensor_shapes_match_saved_checkpoints(checkpoints) -> None:
    for (_preset, tied), path in checkpoints.items():
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            on_disk = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
        config = load_config_dict(path)
        assert hf_tensor_shapes(config) == on_disk
        assert hf_tensor_shapes(build_hf_config(config)) == on_disk
        assert ("lm_head.weight" in on_disk) is not tied
        # The router bias is a buffer, saved with the checkpoint.
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in on_disk


def test_in_memory_state_dict_loads_like_the_saved_one(checkpoints) -> None:
    # transformers keeps experts stacked (gate_up_proj / down_proj) and the router bias as a
    # buffer: a model's own state_dict() (not named_parameters()) shards like its checkpoint.
    path = checkpoints[("tiny-deepseek", False)]
    config = load_config_dict(path)
    memory_sd = random_model(preset_config("tiny-deepseek"), seed=3).state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in memory_sd
    saved_sd = load_file(str(path / "model.safetensors"))
    for tp_rank in range(2):
        parallelism = ParallelismConfig(tp_size=2, tp_rank=tp_rank, ep_size=2)
        from_memory = shard_state_dict(memory_sd, config, parallelism, torch.bfloat16)
        from_file = shard_state_dict(saved_sd, config, parallelism, torch.bfloat16)
        assert list(from_memory) == list(from_file)
        for name, tensor in from_file.items():
            assert torch.equal(from_memory[name], tensor), name


def test_config_reading() -> None:
    config = preset_config("tiny-deepseek", dtype="bfloat16")
    obj = build_hf_config(config)
    normalized = normalize_hf_config(obj)
    assert normalized == normalize_hf_config(config) == normalize_hf_config(obj.to_dict())
    assert normalized["num_experts"] == 8 and normalized["q_lora_rank"] == 128
    assert normalize_hf_config(normalized) == normalized
    # An explicit null q_lora_rank is no q_lora, not "take the default".
    nolora = normalize_hf_config(preset_config("tiny-deepseek-nolora"))
    assert nolora["q_lora_rank"] is None
    assert normalize_hf_config(build_hf_config(preset_config("tiny-deepseek-nolora"))) == nolora
    # Kimi-K2's model_type, unknown to transformers, is the same family.
    kimi = {**config, "model_type": "kimi_k2"}
    assert normalize_hf_config(kimi) == normalized
    parallelism = ParallelismConfig(tp_size=2, tp_rank=1, ep_size=2)
    assert rank_layout(kimi, parallelism) == rank_layout(obj, parallelism)
    # A config.json that leaves keys out reads as transformers' DeepseekV3Config does.
    for sparse in ({"model_type": "deepseek_v3"}, {"model_type": "kimi_k2"}):
        assert normalize_hf_config(sparse) == normalize_hf_config(build_hf_config(sparse))
    assert (
        normalize_hf_config({"model_type": "deepseek_v3", "q_lora_rank": None})["q_lora_rank"]
        is None
    )


def test_real_deepseek_v3_shapes_lay_out_fast() -> None:
    # DeepSeek-V3's own sizes (transformers' defaults), bf16, at tp 8 with ep 8 and without.
    config = {"model_type": "deepseek_v3", "dtype": "bfloat16", "vocab_size": 129280 + 1}
    for ep_size in (8, 1):
        layout = rank_layout(config, ParallelismConfig(tp_size=8, tp_rank=3, ep_size=ep_size))
        w13 = layout["model.layers.3.mlp.experts.w13_weight"]
        assert w13.shape == ((32, 2 * 2048, 7168) if ep_size == 8 else (256, 2 * 256, 7168))
        assert layout["model.layers.3.self_attn.q_b_proj.weight"].shape == (16 * 192, 1536)
        assert layout["model.layers.3.mlp.shared_experts.down_proj.weight"].shape == (7168, 256)
        assert "model.layers.2.mlp.gate_up_proj.weight" in layout  # 3 dense layers
        num_bytes = sum(p.num_bytes for p in layout.values())
        # 671B parameters (no MTP layer) over 8 ranks, the replicated parts on each.
        assert 150e9 < num_bytes < 200e9, num_bytes


@pytest.mark.parametrize(
    ("overrides", "parallelism", "message"),
    [
        ({"moe_layer_freq": 2}, {}, "moe_layer_freq=2 is not supported"),
        ({"topk_method": "greedy"}, {}, "topk_method='greedy' is not supported"),
        ({"num_attention_heads": 6}, {"tp_size": 4},
         "num_attention_heads=6 must be divisible by tp_size=4"),
        ({"num_attention_heads": 16}, {"tp_size": 16}, "tp_size=16 exceeds n_routed_experts=8"),
        ({"n_routed_experts": 6}, {"tp_size": 4, "ep_size": 4},
         "n_routed_experts=6 must be divisible by ep_size=4"),
        ({"moe_intermediate_size": 6}, {"tp_size": 4, "ep_size": 1},
         "moe_intermediate_size=6 must be divisible by moe_tp_size=4"),
        ({"moe_intermediate_size": 6}, {"tp_size": 4, "ep_size": 2},
         "moe_intermediate_size * n_shared_experts=6 must be divisible by tp_size=4"),
        ({"intermediate_size": 30}, {"tp_size": 4},
         "intermediate_size=30 must be divisible by tp_size=4"),
        ({"q_lora_rank": 0}, {}, "q_lora_rank must be a positive int"),
        ({"qk_rope_head_dim": 0}, {}, "qk_rope_head_dim must be a positive int"),
        ({"n_shared_experts": 0}, {}, "n_shared_experts must be a positive int"),
        ({"first_k_dense_replace": -1}, {}, "first_k_dense_replace must be an int >= 0"),
        ({"attention_bias": True}, {}, "attention_bias=True is not supported"),
    ],
)  # fmt: skip
def test_configs_that_do_not_lay_out(overrides: dict, parallelism: dict, message: str) -> None:
    config = preset_config("tiny-deepseek", **overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        rank_layout(config, {"tp_size": 1, "tp_rank": 0, **parallelism})


def test_when_sglang_fuses_shared_experts() -> None:
    # DeepSeek-V3/R1's shapes (256 routed experts, 1 shared) at pure TP on CUDA: SGLang 0.5.23
    # fuses the shared expert into the routed experts unless told not to.
    v3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    assert sglang_fuses_shared_experts(v3, ep_size=1)
    assert sglang_fuses_shared_experts({**v3, "model_type": "kimi_k2"}, ep_size=1)
    assert not sglang_fuses_shared_experts(v3, ep_size=1, disable_shared_experts_fusion=True)
    assert not sglang_fuses_shared_experts(v3, ep_size=8)
    assert not sglang_fuses_shared_experts(v3, ep_size=1, device="cpu")
    assert not sglang_fuses_shared_experts({**v3, "architectures": ["Other"]}, ep_size=1)
    kimi_k2 = {**v3, "n_routed_experts": 384}
    assert not sglang_fuses_shared_experts(kimi_k2, ep_size=1)
    assert sglang_fuses_shared_experts(kimi_k2, ep_size=1, enforce_shared_experts_fusion=True)
    tiny = preset_config("tiny-deepseek")
    assert not sglang_fuses_shared_experts(tiny, ep_size=1)
    assert not sglang_fuses_shared_experts(preset_config("tiny-moe"), ep_size=1)
    # Fused, the shared expert is the last expert slot (test_layout_deepseek_parallel.py).
    fused = rank_layout(tiny, {"tp_size": 1, "tp_rank": 0, "num_fused_shared_experts": 1})
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" not in fused
    assert fused["model.layers.1.mlp.experts.w13_weight"].shape[0] == 8 + 1
    # Families without shared experts have nothing to fuse.
    assert rank_layout(
        preset_config("tiny"), {"tp_size": 1, "tp_rank": 0, "num_fused_shared_experts": 1}
    )
