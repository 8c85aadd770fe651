"""Dense and MoE layouts checked against vLLM 0.32.0's own weight loader (its CPU build).

Tiny Qwen3, Qwen2, Llama and Qwen3-MoE configs, the parallel settings of each case (as vLLM
engine arguments and as the `weightsync.layout.ParallelismConfig` fields SGLang's layout gives
the same rank), and the stored tables' location. Both sides import this module:
`layout_loader.py` in vLLM's venv, the project's tests and `scripts/vllm-layouts` in the
project's venv; so it needs only torch and the standard library.

The checkpoint's tensors are bf16 built from integer bit patterns, a pure function of the
tensor's name and shape: writing and reading them involves no float arithmetic a torch version
could round differently, and neighbouring elements differ, so a row taken from the wrong
head, expert or rank changes the digest (the sha256 of a parameter's bytes).

Every head_dim is 32, the smallest vLLM's CPU attention accepts (it checks at construction);
vocab_size 1000 is not a multiple of vLLM's vocabulary padding (64), so the padded rows of the
embedding and lm_head show in the tables.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

# The stored tables: {"vllm": version, "cases": {name: {"case": ..., "ranks": [rank, ...]}}},
# a rank being {"loaded": [row, ...], "after_processing": [[name, shape, digest, same_storage],
# ...]}, a row [param_name, shape, dtype, digest] of vLLM's named_parameters() right after
# load_weights, after_processing the same parameters once vLLM's CPU post-processing has run
# (same_storage: the parameter still has the memory load_weights filled).
TABLES_PATH = HERE / "layouts.json"
VLLM_VERSION = "0.32.0"

MODELS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,  # as the small Qwen2.5 models ship
        "torch_dtype": "bfloat16",
    },
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],  # a dense layer before the MoE one
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}

# name -> model, tensor-parallel size, vLLM's --enable-expert-parallel (tp 2 at most but for
# one case: this machine has 2 cores, and each rank is a process importing vLLM). vLLM's expert
# parallelism spans TP x DP ranks (here DP is 1): with it every rank holds whole experts
# instead of a slice of each.
CASES: dict[str, dict[str, Any]] = {
    "qwen3-tp1": {"model": "qwen3", "tp_size": 1, "expert_parallel": False},
    "qwen3-tp2": {"model": "qwen3", "tp_size": 2, "expert_parallel": False},
    # More ranks than KV heads (2): each KV head is replicated on two ranks.
    "qwen3-tp4": {"model": "qwen3", "tp_size": 4, "expert_parallel": False},
    "qwen2-tp1": {"model": "qwen2", "tp_size": 1, "expert_parallel": False},
    "qwen2-tp2": {"model": "qwen2", "tp_size": 2, "expert_parallel": False},
    "llama-tp1": {"model": "llama", "tp_size": 1, "expert_parallel": False},
    "llama-tp2": {"model": "llama", "tp_size": 2, "expert_parallel": False},
    "qwen3_moe-tp1": {"model": "qwen3_moe", "tp_size": 1, "expert_parallel": False},
    "qwen3_moe-tp2": {"model": "qwen3_moe", "tp_size": 2, "expert_parallel": False},
    "qwen3_moe-tp2-ep": {"model": "qwen3_moe", "tp_size": 2, "expert_parallel": True},
}


def vllm_engine_args(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM ``EngineArgs`` fields of a case, besides the model path."""
    return {
        "tensor_parallel_size": case["tp_size"],
        "enable_expert_parallel": case["expert_parallel"],
        "dtype": "bfloat16",
        "max_model_len": 512,
        "enforce_eager": True,
        "skip_tokenizer_init": True,
    }


def rank_parallelism(case: dict[str, Any], rank: int) -> dict[str, Any]:
    """The `ParallelismConfig` fields weightsync's (SGLang's) layout gives TP rank ``rank``.

    vLLM's EP size is TP x DP; with DP 1 it is the TP size, which SGLang's ``ep_size`` equal to
    ``tp_size`` also gives (whole experts per rank, no MoE tensor parallelism).
    """
    fields: dict[str, Any] = {"tp_size": case["tp_size"], "tp_rank": rank}
    if case["expert_parallel"]:
        fields["ep_size"] = case["tp_size"]
    return fields


def make_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The checkpoint's bf16 tensor ``name``: a sign, an exponent of 2^-15 .. 2^0 and 7
    mantissa bits per element, from integer hashing of the element's index and the name."""
    numel = 1
    for size in shape:
        numel *= size
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") & 0x7FFFFFFF
    x = (torch.arange(numel, dtype=torch.int64) * 0x9E3779B1 + seed) & 0x7FFFFFFF
    for multiplier in (0x45D9F3B, 0x2C1B3C6D):  # two rounds of xor-shift-multiply mixing
        x = ((x ^ (x >> 16)) * multiplier) & 0x7FFFFFFF
    x = x ^ (x >> 16)
    bits = ((x >> 20) & 1) << 15 | (112 + (x >> 8) % 16) << 7 | (x & 0x7F)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)  # as int16's two's complement
    return bits.to(torch.int16).view(torch.bfloat16).reshape(shape)


def digest(tensor: torch.Tensor) -> str:
    """The first 16 hex digits of the sha256 of a tensor's bytes (row-major)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def table_row(name: str, tensor: torch.Tensor) -> list[Any]:
    """One row of a rank's table: name, shape, dtype name, digest."""
    return [name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), digest(tensor)]


def make_state(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The checkpoint's bf16 tensors, given every HF tensor name and shape."""
    return {name: make_tensor(name, tuple(shape)) for name, shape in shapes.items()}


def write_checkpoint(
    path: Path, shapes: dict[str, tuple[int, ...]], config: dict[str, Any]
) -> Path:
    """Write config.json and model.safetensors of a model to ``path``; returns ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(make_state(shapes), str(path / "model.safetensors"))
    return path


__all__ = [
    "CASES",
    "MODELS",
    "TABLES_PATH",
    "VLLM_VERSION",
    "digest",
    "make_state",
    "make_tensor",
    "rank_parallelism",
    "table_row",
    "vllm_engine_args",
    "write_checkpoint",
]
