"""Model presets and small HF checkpoints with random weights, for the demo, tests and benches.

No model can be downloaded where weightsync is tested, so every model it runs is built from a
transformers config with random initialisation and saved as safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The tiny DeepSeek-V3 shapes of the research spec (its sizes keep every FP8 128x128 block
# whole at tp <= 2, for the FP8 rollout to come): 3 layers, the first dense; 8 routed experts
# in 2 groups and 1 shared; YaRN as DeepSeek-V3 and Kimi-K2 configure it. Layouts divide for
# tp 1, 2, 4 with ep 1, 2 (4 at tp 4). SGLang reads three keys transformers' DeepseekV3Config
# lacks (moe_layer_freq, scoring_func, topk_method) and fails to load a config without them.
_TINY_DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    # transformers' q_a / kv_a layernorms hard-code 1e-6, SGLang's read rms_norm_eps.
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# Configs by name. "tiny" models run a forward pass in milliseconds on one CPU core; "small"
# is large enough that a sync moves tens of megabytes; the rest are benchmark workloads.
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "qwen3",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    "small": {
        "model_type": "qwen3",
        "vocab_size": 8000,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    "tiny-moe": {
        "model_type": "qwen3_moe",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    "tiny-deepseek": _TINY_DEEPSEEK,
    # DeepSeek-V2-Lite style attention: q_proj instead of q_a_proj / q_b_proj.
    "tiny-deepseek-nolora": {**_TINY_DEEPSEEK, "q_lora_rank": None},
    # Benchmark workloads (qwen3 dense, qwen3_moe MoE shapes; sizes for bf16). Too large to
    # build as transformers models on a CPU: benchmarks use seeded synthetic tensors.
    # ~0.27 GB: a quick CPU run.
    "dense-256m": {
        "model_type": "qwen3",
        "vocab_size": 16000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 10,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
    },
    # ~1.07 GB: the CPU target of the benchmark.
    "dense-1g": {
        "model_type": "qwen3",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 9,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
    },
    # ~16.4 GB: an 8B dense model (GPU).
    "dense-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    # ~65.5 GB: Qwen3-32B's shapes, a 32B dense model (GPU).
    "dense-32b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    # ~0.3 GB MoE with many small experts: per-tensor loading shows on CPU.
    "moe-small": {
        "model_type": "qwen3_moe",
        "vocab_size": 16000,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 64,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # ~61 GB: Qwen3-30B-A3B's shapes (GPU).
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)

# model_types transformers 5.24 does not know, built with the config class of the same
# architecture: Kimi-K2 is DeepSeek-V3 (`architectures: ["DeepseekV3ForCausalLM"]`).
_CONFIG_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}
# The presets small enough for `weightsync demo` to build, train and serve on a CPU.
DEMO_PRESETS: tuple[str, ...] = ("tiny", "small", "tiny-moe", "tiny-deepseek")


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A config.json dict for a named preset (see `PRESET_NAMES`), with overrides.

    Raises:
        ValueError: the name is not a preset.
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(_PRESETS)}")
    return {**_PRESETS[name], **overrides}


def build_hf_config(config: dict[str, Any]):
    """A transformers config object from a config.json dict (its `model_type` picks the class;
    ``kimi_k2``, unknown to transformers, gets DeepSeek-V3's, whose object says
    ``deepseek_v3``)."""
    from transformers import AutoConfig

    data = dict(config)
    model_type = data.pop("model_type")
    return AutoConfig.for_model(_CONFIG_ALIASES.get(model_type, model_type), **data)


def random_model(config: dict[str, Any], *, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A transformers causal-LM with random weights for `config` (a config.json dict)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = build_hf_config(config)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    # transformers initialises some weights (norms) to constants, and DeepSeek's router bias
    # (a buffer) to zeros; perturb them so a wrong mapping between two norms, or a router that
    # ignores its bias, cannot go unnoticed.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model.eval()


def write_random_checkpoint(
    path: str | Path,
    config: dict[str, Any],
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Write a random-init HF checkpoint (config.json + safetensors) to `path` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = random_model(config, dtype=dtype, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_fp8_checkpoint(path: str | Path, checkpoint: str | Path, *, block: int = 128) -> Path:
    """Write the block-FP8 checkpoint of the HF checkpoint `checkpoint` to `path`: its linear
    weights quantised as `weightsync.export.Fp8Export` quantises them (e4m3 codes and float32
    ``weight_scale_inv``), its config with the ``quantization_config``; returns `path`.

    A rollout serving it holds what a sync from a trainer that loaded `checkpoint` writes.
    """
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from weightsync.checkpoint import load_config_dict
    from weightsync.export import ModelExport
    from weightsync.export.quantize import quantize_block_fp8
    from weightsync.layout.quant import fp8_quantization_config, is_quantized_hf_name, scale_name

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in ModelExport(model):
            if is_quantized_hf_name(name) and tensor.dim() == 2:
                tensors[name], tensors[scale_name(name)] = quantize_block_fp8(tensor, block=block)
            else:
                tensors[name] = tensor.detach().contiguous().clone()
    save_file(tensors, str(path / "model.safetensors"))
    config = {**load_config_dict(checkpoint), "quantization_config": fp8_quantization_config(block)}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
