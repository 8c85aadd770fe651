"""The block-FP8 layout of the DeepSeek-V3 family: e4m3 weights, float32 block scales in
SGLang's names, shapes and order, TP/EP shards on block boundaries.

Random configs with small blocks are laid out at every parallelism they allow; an independent
check fills every HF weight element with a code of (tensor, row, column) and every scale
element with a code of (tensor, block row, block column), applies each rank's segments, and
requires every weight element of every rank to sit beside its own block's scale; all ranks'
segments rebuild every HF tensor, weights and scales. Worked shapes and the refusals follow.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.layout import ParallelismConfig, hf_tensor_shapes, normalize_hf_config, rank_layout
from weightsync.testing.presets import preset_config

FP8 = "float8_e4m3fn"


def _fp8(block: int) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block] * 2}


@st.composite
def cases(draw: st.DrawFn) -> dict:
    """A random small block-FP8 DeepSeek-V3 config and a tp / ep it splits over."""
    block = draw(st.sampled_from([2, 4]))
    tp_size = draw(st.sampled_from([1, 2, 4]))
    ep_size = draw(st.sampled_from([d for d in (1, 2, 4) if tp_size % d == 0]))
    num_layers = draw(st.integers(1, 3))
    fewest = -(-tp_size // ep_size)
    per_head = st.sampled_from([block, 2 * block])
    cfg = {
        "model_type": draw(st.sampled_from(["deepseek_v3", "kimi_k2"])),
        "vocab_size": draw(st.integers(1, 60)),
        # K dims need not be whole blocks: the last block of a row is partial.
        "hidden_size": draw(st.sampled_from([block, 3 * block - 1, 4 * block])),
        "intermediate_size": tp_size * block * draw(st.integers(1, 2)),
        "moe_intermediate_size": tp_size * block * draw(st.integers(1, 2)),
        "num_hidden_layers": num_layers,
        "num_attention_heads": tp_size * draw(st.integers(1, 2)),
        "q_lora_rank": draw(st.sampled_from([None, block, 2 * block])),
        "kv_lora_rank": draw(st.sampled_from([block, 2 * block + 1])),
        "qk_nope_head_dim": draw(per_head),
        "qk_rope_head_dim": draw(per_head),
        "v_head_dim": draw(per_head),
        "n_routed_experts": ep_size * draw(st.integers(fewest, fewest + 1)),
        "n_shared_experts": draw(st.integers(1, 2)),
        "first_k_dense_replace": draw(st.integers(0, num_layers)),
        "tie_word_embeddings": draw(st.booleans()),
        "dtype": "bfloat16",
        "quantization_config": _fp8(block),
    }
    return {"cfg": cfg, "block": block, "tp_size": tp_size, "ep_size": ep_size}


def _codes(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Every HF tensor filled with ``tensor_id * 2**40 + flat index`` (int64)."""
    return {
        name: torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape) + (i << 40)
        for i, (name, shape) in enumerate(shapes.items())
    }


def _apply(layout, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    """The parameter built from its segments (padding -1)."""
    flat = torch.full((layout.numel,), -1, dtype=torch.int64)
    for seg in layout.segments:
        if seg.hf_name is None:
            continue
        box = hf[seg.hf_name][tuple(slice(a, b) for a, b in seg.src_box)]
        flat[seg.dst_offset : seg.dst_offset + seg.numel] = box.reshape(-1)
    return flat.reshape(layout.shape)


def _check(cfg: dict, block: int, tp_size: int, ep_size: int) -> None:
    shapes = hf_tensor_shapes(cfg)
    names = list(shapes)
    index = {name: i for i, name in enumerate(names)}
    hf = _codes(shapes)
    covered = {name: torch.zeros(shape, dtype=torch.bool) for name, shape in shapes.items()}
    for tp_rank in range(tp_size):
        par = ParallelismConfig(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size)
        layout = rank_layout(cfg, par)
        params = list(layout.values())
        for position, param in enumerate(params):
            built = _apply(param, hf)
            for seg in param.segments:
                if seg.hf_name is not None:
                    covered[seg.hf_name][tuple(slice(a, b) for a, b in seg.src_box)] = True
            if param.dtype != FP8:
                assert not param.name.endswith("_scale_inv") or param.dtype == "float32"
                continue
            scale = layout[param.name + "_scale_inv"]
            assert scale.dtype == "float32"
            *lead, rows, cols = param.shape
            assert scale.shape == (*lead, -(-rows // block), -(-cols // block))
            # SGLang's order: a linear's scale right after its weight, the experts' after w2.
            expected_at = position + (2 if ".mlp.experts." in param.name else 1)
            assert params[expected_at] is scale
            # The scale of every weight element is its own block's.
            tensor_id = built >> 40
            flat_index = built & ((1 << 40) - 1)
            scales = _apply(scale, hf)
            expanded = scales.repeat_interleave(block, -2).repeat_interleave(block, -1)
            expanded = expanded[..., :rows, :cols]
            for name_id in tensor_id.unique().tolist():
                name = names[name_id]
                mask = tensor_id == name_id
                hf_cols = shapes[name][1]
                r, c = flat_index[mask] // hf_cols, flat_index[mask] % hf_cols
                scale_name = name + "_scale_inv"
                scale_cols = shapes[scale_name][1]
                want = (index[scale_name] << 40) + (r // block) * scale_cols + c // block
                assert torch.equal(expanded[mask], want), (param.name, name)
    for name, mask in covered.items():
        assert bool(mask.all()), f"{name} is not rebuilt from the ranks' segments"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_every_weight_element_sits_beside_its_block_scale(case: dict) -> None:
    _check(case["cfg"], case["block"], case["tp_size"], case["ep_size"])


@pytest.mark.parametrize("preset", ["tiny-deepseek", "tiny-deepseek-nolora"])
@pytest.mark.parametrize(("tp_size", "ep_size"), [(1, 1), (2, 1), (2, 2)])
def test_tiny_presets_lay_out_in_fp8(preset: str, tp_size: int, ep_size: int) -> None:
    cfg = {**preset_config(preset), "dtype": "bfloat16", "quantization_config": _fp8(128)}
    _check(cfg, 128, tp_size, ep_size)


def test_sglang_names_shapes_and_dtypes_of_one_rank() -> None:
    cfg = {**preset_config("tiny-deepseek"), "dtype": "bfloat16", "quantization_config": _fp8(128)}
    layout = rank_layout(cfg, {"tp_size": 2, "tp_rank": 1, "ep_size": 2})
    got = {n: (p.shape, p.dtype) for n, p in layout.items() if ".layers.1." in n}
    prefix = "model.layers.1."
    # Rq=128, Rkv=128, dr=64, D=256, 2 of 4 heads of dq=192, dn+dv=256, dv=128,
    # 4 of 8 experts of Im=256, shared Is=256 split over tp=2.
    assert got == {
        f"{prefix}self_attn.fused_qkv_a_proj_with_mqa.weight": ((320, 256), FP8),
        f"{prefix}self_attn.fused_qkv_a_proj_with_mqa.weight_scale_inv": ((3, 2), "float32"),
        f"{prefix}self_attn.q_a_layernorm.weight": ((128,), "bfloat16"),
        f"{prefix}self_attn.q_b_proj.weight": ((384, 128), FP8),
        f"{prefix}self_attn.q_b_proj.weight_scale_inv": ((3, 1), "float32"),
        f"{prefix}self_attn.kv_b_proj.weight": ((512, 128), FP8),
        f"{prefix}self_attn.kv_b_proj.weight_scale_inv": ((4, 1), "float32"),
        f"{prefix}self_attn.o_proj.weight": ((256, 256), FP8),
        f"{prefix}self_attn.o_proj.weight_scale_inv": ((2, 2), "float32"),
        f"{prefix}self_attn.kv_a_layernorm.weight": ((128,), "bfloat16"),
        f"{prefix}mlp.gate.weight": ((8, 256), "bfloat16"),
        f"{prefix}mlp.gate.e_score_correction_bias": ((8,), "float32"),
        f"{prefix}mlp.experts.w13_weight": ((4, 512, 256), FP8),
        f"{prefix}mlp.experts.w2_weight": ((4, 256, 256), FP8),
        f"{prefix}mlp.experts.w13_weight_scale_inv": ((4, 4, 2), "float32"),
        f"{prefix}mlp.experts.w2_weight_scale_inv": ((4, 2, 2), "float32"),
        f"{prefix}mlp.shared_experts.gate_up_proj.weight": ((256, 256), FP8),
        f"{prefix}mlp.shared_experts.gate_up_proj.weight_scale_inv": ((2, 2), "float32"),
        f"{prefix}mlp.shared_experts.down_proj.weight": ((256, 128), FP8),
        f"{prefix}mlp.shared_experts.down_proj.weight_scale_inv": ((2, 1), "float32"),
        f"{prefix}input_layernorm.weight": ((256,), "bfloat16"),
        f"{prefix}post_attention_layernorm.weight": ((256,), "bfloat16"),
    }
    assert layout["model.embed_tokens.weight"].dtype == "bfloat16"
    assert layout["lm_head.weight"].dtype == "bfloat16"
    shapes = hf_tensor_shapes(cfg)
    assert shapes[f"{prefix}mlp.experts.3.down_proj.weight_scale_inv"] == (2, 2)
    assert shapes[f"{prefix}self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == (2, 2)
    assert f"{prefix}mlp.gate.weight_scale_inv" not in shapes
    assert "model.embed_tokens.weight_scale_inv" not in shapes
    # The quantisation survives normalisation.
    assert rank_layout(normalize_hf_config(cfg), {"tp_size": 2, "tp_rank": 1, "ep_size": 2}) == (
        layout
    )


def test_real_deepseek_v3_fp8_lays_out_at_tp8_and_refuses_tp32() -> None:
    cfg = {
        "model_type": "deepseek_v3",
        "dtype": "bfloat16",
        "quantization_config": _fp8(128),
        "num_hidden_layers": 4,
    }
    layout = rank_layout(cfg, {"tp_size": 8, "tp_rank": 3, "ep_size": 8})
    assert layout["model.layers.3.mlp.experts.w13_weight"].shape == (32, 4096, 7168)
    assert layout["model.layers.3.mlp.experts.w13_weight_scale_inv"].shape == (32, 32, 56)
    assert layout["model.layers.0.self_attn.o_proj.weight_scale_inv"].shape == (56, 16)
    # 18432 / 32 = 576 rows of the dense MLP per rank: not whole 128-blocks.
    with pytest.raises(ValueError, match=r"gate_up_proj.*cuts a 128x128 scale block"):
        rank_layout(cfg, {"tp_size": 32, "tp_rank": 0, "ep_size": 32})


def _tiny_fp8(**overrides) -> dict:
    return {
        **preset_config("tiny-deepseek"),
        "dtype": "bfloat16",
        "quantization_config": _fp8(128),
        **overrides,
    }


@pytest.mark.parametrize(
    ("overrides", "parallelism", "message"),
    [
        ({}, {"tp_size": 4, "tp_rank": 1}, r"q_b_proj.*tp_size=4, ep_size=1.*\[192, 384\)"),
        ({"q_lora_rank": 64}, {"tp_size": 1, "tp_rank": 0}, r"fused_qkv_a.*kv_a_proj.*row 64"),
        ({"moe_intermediate_size": 192}, {"tp_size": 1, "tp_rank": 0}, r"w13_weight.*row 192"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}},
            {"tp_size": 1, "tp_rank": 0},
            r"weight_block_size=\[128, 64\].*square blocks",
        ),
        (
            {"quantization_config": {"quant_method": "awq"}},
            {"tp_size": 1, "tp_rank": 0},
            r"quant_method='awq' is not supported",
        ),
        (
            {"quantization_config": {**_fp8(128), "activation_scheme": "static"}},
            {"tp_size": 1, "tp_rank": 0},
            r"activation_scheme='static'",
        ),
        (
            {"quantization_config": {**_fp8(128), "ignored_layers": ["lm_head"]}},
            {"tp_size": 1, "tp_rank": 0},
            r"ignored_layers is not supported",
        ),
    ],
)
def test_fp8_configs_that_do_not_lay_out(overrides: dict, parallelism: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rank_layout(_tiny_fp8(**overrides), parallelism)


def test_fp8_is_refused_outside_the_deepseek_family() -> None:
    cfg = {**preset_config("tiny"), "quantization_config": _fp8(128)}
    with pytest.raises(ValueError, match=re.escape("DeepSeek-V3 family only")):
        rank_layout(cfg, {"tp_size": 1, "tp_rank": 0})
