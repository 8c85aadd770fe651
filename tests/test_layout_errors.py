"""Bad configs, parallelism, dtypes and state dicts: each a ValueError that says what is wrong."""

from __future__ import annotations

import re

import pytest
import torch

from weightsync.layout import hf_tensor_shapes, normalize_hf_config, rank_layout
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import preset_config
from weightsync.torch_dtypes import torch_dtype

LLAMA = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def _rank(tp_size: int, tp_rank: int = 0, **extra: int) -> dict[str, int]:
    return {"tp_size": tp_size, "tp_rank": tp_rank, **extra}


def test_unknown_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'") as info:
        rank_layout({**LLAMA, "model_type": "gpt2"}, _rank(1))
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"):
        assert model_type in str(info.value)
    with pytest.raises(ValueError, match="unsupported model_type None"):
        hf_tensor_shapes({k: v for k, v in LLAMA.items() if k != "model_type"})


@pytest.mark.parametrize(
    ("overrides", "parallelism", "message"),
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 2}, _rank(4),
         "num_attention_heads=6 must be divisible by tp_size=4"),
        ({"num_attention_heads": 12, "num_key_value_heads": 4}, _rank(6),
         "num_key_value_heads=4 must divide tp_size=6"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3}, _rank(2),
         "num_key_value_heads=3 must be divisible by tp_size=2"),
        ({"intermediate_size": 30}, _rank(4),
         "intermediate_size=30 must be divisible by tp_size=4"),
    ],
)  # fmt: skip
def test_dense_sizes_that_do_not_split(overrides: dict, parallelism: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        rank_layout({**LLAMA, **overrides}, parallelism)


@pytest.mark.parametrize(
    ("overrides", "parallelism", "message"),
    [
        ({"num_experts": 6}, _rank(4, ep_size=4), "num_experts=6 must be divisible by ep_size=4"),
        ({"moe_intermediate_size": 30}, _rank(4, ep_size=1),
         "moe_intermediate_size=30 must be divisible by moe_tp_size=4"),
        ({"moe_intermediate_size": 31}, _rank(4, ep_size=2),
         "moe_intermediate_size=31 must be divisible by moe_tp_size=2"),
        ({"intermediate_size": 30}, _rank(4),
         "intermediate_size=30 must be divisible by tp_size=4"),
    ],
)  # fmt: skip
def test_moe_sizes_that_do_not_split(overrides: dict, parallelism: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        rank_layout(preset_config("tiny-moe", **overrides), parallelism)


def test_sizes_only_need_to_split_where_a_layer_uses_them() -> None:
    # No dense layer: intermediate_size is never split, so it need not divide tp.
    config = preset_config("tiny-moe", mlp_only_layers=[], intermediate_size=30)
    assert rank_layout(config, _rank(4, ep_size=2))
    # Every layer dense: the expert count is never split over ep.
    config = preset_config("tiny-moe", mlp_only_layers=[0, 1, 2, 3], num_experts=6)
    layout = rank_layout(config, _rank(4, ep_size=4))
    assert not any("experts" in name for name in layout)


def test_unsupported_parallel_modes() -> None:
    with pytest.raises(ValueError, match="pp_size=2: rollout pipeline parallelism"):
        rank_layout(LLAMA, _rank(2, pp_size=2))
    with pytest.raises(ValueError, match="attention data parallelism"):
        rank_layout(LLAMA, _rank(2, attn_dp_size=2))
    with pytest.raises(ValueError, match=re.escape("moe_dense_tp_size=1 (--moe-dense-tp-size)")):
        rank_layout(preset_config("tiny-moe"), _rank(2, moe_dense_tp_size=1))
    # SGLang fuses all of DeepSeek's shared experts or none (DeepseekV2MoE asserts it).
    two_shared = preset_config("tiny-deepseek", n_shared_experts=2)
    with pytest.raises(ValueError, match="--disable-shared-experts-fusion"):
        rank_layout(two_shared, _rank(1, num_fused_shared_experts=1))
    # Under DP attention the heads split over attention TP, and must divide by it.
    six_heads = preset_config("tiny-deepseek", num_attention_heads=6)
    with pytest.raises(
        ValueError, match="num_attention_heads=6 must be divisible by attn_tp_size=4"
    ):
        rank_layout(six_heads, _rank(8, attn_dp_size=2))
    with pytest.raises(ValueError, match="bad parallelism config"):
        rank_layout(LLAMA, {"tp_size": 2})
    with pytest.raises(ValueError, match="must be a ParallelismConfig or a dict"):
        rank_layout(LLAMA, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"hidden_size": 0}, "hidden_size must be a positive int, got 0"),
        ({"num_key_value_heads": 3}, "num_attention_heads=8 must be a multiple of "
         "num_key_value_heads=3"),
        ({"dtype": "int8"}, "model dtype must be floating point, got 'int8'"),
        ({"dtype": "float13"}, "unsupported dtype 'float13'"),
    ],
)  # fmt: skip
def test_bad_configs(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        normalize_hf_config({**LLAMA, **overrides})


def test_bad_dtypes() -> None:
    with pytest.raises(ValueError, match="unsupported dtype 'float13'; choose one of"):
        torch_dtype("float13")
    with pytest.raises(ValueError, match="must be floating point"):
        rank_layout(LLAMA, _rank(1), torch.int32)


def _hf_state_dict(config: dict) -> dict[str, torch.Tensor]:
    return {name: torch.randn(shape) for name, shape in hf_tensor_shapes(config).items()}


def test_missing_hf_tensor_names_it_and_the_rank() -> None:
    config = preset_config("tiny-moe")
    hf = _hf_state_dict(config)
    del hf["model.layers.2.mlp.experts.5.up_proj.weight"]
    # Expert 5 lives on ep_rank 1 (tp ranks 2 and 3 with tp=4, ep=2); ranks 0 and 1 never read it.
    assert shard_state_dict(hf, config, _rank(4, 1, ep_size=2))
    with pytest.raises(ValueError) as info:
        shard_state_dict(hf, config, _rank(4, 3, ep_size=2))
    message = str(info.value)
    assert "'model.layers.2.mlp.experts.5.up_proj.weight' is missing" in message
    assert "tp_rank=3/4" in message and "ep_rank=1" in message
    assert "model.layers.2.mlp.experts.w13_weight" in message


def test_wrong_hf_shape_names_expected_and_actual() -> None:
    config = preset_config("tiny")
    hf = _hf_state_dict(config)
    hf["model.layers.1.self_attn.k_proj.weight"] = torch.randn(64, 64)
    with pytest.raises(ValueError) as info:
        shard_state_dict(hf, config, _rank(2))
    message = str(info.value)
    assert "'model.layers.1.self_attn.k_proj.weight' has shape (64, 64), expected (32, 64)" in (
        message
    )


def test_wrong_stacked_expert_shape() -> None:
    config = preset_config("tiny-moe")
    hf = {k: v for k, v in _hf_state_dict(config).items() if ".experts." not in k}
    for layer in (1, 2, 3):
        hf[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.randn(8, 64, 64)
        hf[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.randn(8, 32, 64)
    with pytest.raises(ValueError, match=re.escape("has shape (8, 32, 64), expected (8, 64, 32)")):
        shard_state_dict(hf, config, _rank(1))


def test_non_tensor_value() -> None:
    config = preset_config("tiny")
    hf = _hf_state_dict(config)
    hf["model.norm.weight"] = [1.0] * 64
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is a list, not a torch\.Tensor"):
        shard_state_dict(hf, config, _rank(1))
