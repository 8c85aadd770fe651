"""The DeepSeek-V3 / Kimi-K2 layouts checked against SGLang 0.5.23's own weight loader.

Tiny model configs, the parallel settings of each case (as SGLang server arguments and as the
`weightsync.layout.ParallelismConfig` fields they give each rank), a checkpoint whose tensors are
a pure function of their names and shapes, and the digest a table stores per parameter. Both
sides import this module: `deepseek_loader.py` in SGLang's venv, the project's tests and
`scripts/sglang-deepseek-layouts` in the project's venv; so it needs only torch, safetensors
and the standard library.

The tensors are built from integer bit patterns (bf16 with a bounded exponent, e4m3 without
NaN, positive float32 scales), so writing and reading them involves no float arithmetic that a
torch version could round differently, and every element of every tensor differs from its
neighbours: a row taken from the wrong expert, head or rank changes the digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
# The stored tables: {"sglang": version, "cases": {case_name: {"ranks": [[row, ...], ...]}}},
# a row being [param_name, shape, dtype, digest].
TABLES_PATH = HERE / "deepseek_layouts.json"
SGLANG_VERSION = "0.5.23"
FP8_BLOCK = 128

# tiny-deepseek's config as the stored tables were built from it, kept here rather than read
# from `weightsync.testing.presets`: a change to the preset must not move the tables (this
# module also runs in SGLang's venv, which need not import weightsync's testing helpers).
_DEEPSEEK_V3: dict[str, Any] = {
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
    "rms_norm_eps": 1e-06,
    "rope_interleave": True,
    "rope_theta": 10000.0,
    # SGLang's CPU rotary embedding is built for DeepSeek's yarn scaling only.
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
    "dtype": "bfloat16",
}

# Kimi-K2's shape in miniature: its own model_type, more experts than DeepSeek-V3 relative to
# the heads, one expert group, one dense layer, twice the heads.
_KIMI_K2: dict[str, Any] = {
    **_DEEPSEEK_V3,
    "model_type": "kimi_k2",
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_routed_experts": 12,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
}

_FP8 = {
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
}

MODELS: dict[str, dict[str, Any]] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-v3-nolora": {**_DEEPSEEK_V3, "q_lora_rank": None},
    "deepseek-v3-tied": {**_DEEPSEEK_V3, "tie_word_embeddings": True},
    "kimi-k2": _KIMI_K2,
    "deepseek-v3-fp8": {**_DEEPSEEK_V3, **_FP8},
    "deepseek-v3-nolora-fp8": {**_DEEPSEEK_V3, "q_lora_rank": None, **_FP8},
    "kimi-k2-fp8": {**_KIMI_K2, **_FP8},
}


def _case(
    model: str,
    tp: int,
    ep: int = 1,
    *,
    dp: int = 1,
    fused: bool = True,
    dp_lm_head: bool = False,
    dense_tp: int | None = None,
) -> tuple[str, dict[str, Any]]:
    name = f"{model}-tp{tp}-ep{ep}" + (f"-dp{dp}" if dp > 1 else "")
    name += "-fused" if fused else "-unfused"
    name += "-dplmhead" if dp_lm_head else ""
    name += f"-densetp{dense_tp}" if dense_tp is not None else ""
    return name, {
        "model": model,
        "tp_size": tp,
        "ep_size": ep,
        "attn_dp_size": dp,
        "fused": fused,
        "enable_dp_lm_head": dp_lm_head,
        "moe_dense_tp_size": dense_tp,
    }


CASES: dict[str, dict[str, Any]] = dict(
    [
        # Fused shared experts (SGLang's --enforce-shared-experts-fusion) at TP and EP.
        *(
            _case("deepseek-v3", tp, ep)
            for tp, ep in [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
        ),
        *(_case("deepseek-v3-nolora", tp, ep) for tp, ep in [(1, 1), (2, 2), (4, 1), (4, 4)]),
        *(_case("kimi-k2", tp, ep) for tp, ep in [(1, 1), (2, 1), (4, 2), (4, 4)]),
        # The shared expert apart, as before.
        _case("deepseek-v3", 4, 2, fused=False),
        _case("kimi-k2", 4, 4, fused=False),
        # DP attention: attention and embed_tokens over attention TP; lm_head too with
        # --enable-dp-lm-head; the MoE over the whole TP group.
        _case("deepseek-v3", 2, 1, dp=2),
        _case("deepseek-v3", 4, 1, dp=2),
        _case("deepseek-v3", 4, 4, dp=2),
        _case("deepseek-v3", 4, 2, dp=2, fused=False),
        _case("deepseek-v3", 4, 4, dp=2, dp_lm_head=True),
        _case("deepseek-v3", 4, 4, dp=4, dp_lm_head=True, fused=False),
        _case("deepseek-v3-nolora", 4, 2, dp=2, dp_lm_head=True),
        _case("deepseek-v3-tied", 4, 4, dp=2),
        _case("kimi-k2", 4, 4, dp=2, dp_lm_head=True),
        # --moe-dense-tp-size 1: the dense layers whole on every rank.
        _case("deepseek-v3", 2, 1, dense_tp=1, fused=False),
        _case("deepseek-v3", 4, 4, dp=2, dense_tp=1),
        _case("deepseek-v3", 4, 2, dp=4, dp_lm_head=True, dense_tp=1, fused=False),
        _case("kimi-k2", 4, 4, dp=4, dp_lm_head=True, dense_tp=1),
        # Block FP8 (128x128): every split a whole number of blocks.
        _case("deepseek-v3-fp8", 1, 1),
        _case("deepseek-v3-fp8", 2, 1),
        _case("deepseek-v3-fp8", 2, 2),
        _case("deepseek-v3-fp8", 2, 2, fused=False),
        _case("deepseek-v3-fp8", 4, 4, dp=2),
        _case("deepseek-v3-fp8", 4, 2, dp=2, dp_lm_head=True, dense_tp=1),
        _case("deepseek-v3-nolora-fp8", 2, 2),
        _case("kimi-k2-fp8", 2, 2),
        _case("kimi-k2-fp8", 4, 4, dp=2, dp_lm_head=True),
    ]
)


def case_config(case: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a case's model."""
    return dict(MODELS[case["model"]])


def rank_parallelism(case: dict[str, Any], tp_rank: int) -> dict[str, Any]:
    """The `ParallelismConfig` fields of rank ``tp_rank`` in a case (the rest derived)."""
    config = case_config(case)
    return {
        "tp_size": case["tp_size"],
        "tp_rank": tp_rank,
        "ep_size": case["ep_size"],
        "attn_dp_size": case["attn_dp_size"],
        "enable_dp_lm_head": case["enable_dp_lm_head"],
        "moe_dense_tp_size": case["moe_dense_tp_size"],
        "num_fused_shared_experts": config["n_shared_experts"] if case["fused"] else 0,
    }


def sglang_server_args(case: dict[str, Any]) -> dict[str, Any]:
    """The SGLang ServerArgs fields of a case (beyond model path and device)."""
    args: dict[str, Any] = {
        "tp_size": case["tp_size"],
        "ep_size": case["ep_size"],
        "enable_dp_lm_head": case["enable_dp_lm_head"],
        "moe_dense_tp_size": case["moe_dense_tp_size"],
    }
    if case["attn_dp_size"] > 1:
        args["attn_dp_size"] = case["attn_dp_size"]
    # Tiny configs are not on SGLang's fusion allow-list (256 routed experts, a CUDA GPU):
    # fusion has to be forced, and is kept off explicitly for the unfused cases.
    if case["fused"]:
        args["enforce_shared_experts_fusion"] = True
    else:
        args["disable_shared_experts_fusion"] = True
    return args


def _mix(numel: int, name: str) -> torch.Tensor:
    """``numel`` pseudo-random 31-bit ints, a pure function of ``name`` (int64 arithmetic)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:3], "little")
    x = torch.arange(numel, dtype=torch.int64) * 40503 + seed
    x = x & 0x7FFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0x7FFFFFFF
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & 0x7FFFFFFF
    return x ^ (x >> 15)


def make_tensor(name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """The checkpoint tensor ``name``: ``dtype`` "bfloat16", "float8_e4m3fn" or "float32"."""
    numel = 1
    for size in shape:
        numel *= size
    x = _mix(numel, name)
    if dtype == "bfloat16":
        # sign, an exponent of 2^-15 .. 2^0, 7 mantissa bits
        bits = ((x >> 20) & 1) << 15 | (112 + (x >> 8) % 16) << 7 | (x & 0x7F)
        bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
        return bits.to(torch.int16).view(torch.bfloat16).reshape(shape)
    if dtype == "float8_e4m3fn":
        # sign, exponent 1 .. 14 (15 holds NaN), 3 mantissa bits
        bits = ((x >> 20) & 1) << 7 | (1 + (x >> 8) % 14) << 3 | (x & 0x7)
        return bits.to(torch.uint8).view(torch.float8_e4m3fn).reshape(shape)
    if dtype == "float32":
        # positive, an exponent of 2^-7 .. 2^3, 23 mantissa bits
        bits = (120 + (x >> 23) % 11) << 23 | (x & 0x7FFFFF)
        return bits.to(torch.int32).view(torch.float32).reshape(shape)
    raise ValueError(f"no tensor recipe for dtype {dtype!r}")


def checkpoint_dtype(name: str, config: dict[str, Any]) -> str:
    """The dtype a case's checkpoint stores tensor ``name`` in: e4m3 weights and float32
    scales for block FP8, a float32 router bias (as DeepSeek ships it), bf16 otherwise."""
    if name.endswith("weight_scale_inv") or name.endswith("e_score_correction_bias"):
        return "float32"
    if config.get("quantization_config") and name.endswith("_proj.weight"):
        return "float8_e4m3fn"
    if config.get("quantization_config") and name.endswith("_proj_with_mqa.weight"):
        return "float8_e4m3fn"
    return "bfloat16"


def make_state(shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensors, given every HF tensor name and shape."""
    return {
        name: make_tensor(name, tuple(shape), checkpoint_dtype(name, config))
        for name, shape in shapes.items()
    }


def write_checkpoint(
    path: Path, shapes: dict[str, tuple[int, ...]], config: dict[str, Any]
) -> Path:
    """Write config.json and model.safetensors of a case's model to ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(make_state(shapes, config), str(path / "model.safetensors"))
    return path


def digest(tensor: torch.Tensor) -> str:
    """The first 16 hex digits of the sha256 of a tensor's bytes (row-major)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def table_row(name: str, tensor: torch.Tensor) -> list[Any]:
    """One row of a rank's table: name, shape, dtype name, digest."""
    return [name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."), digest(tensor)]


def run_sglang_loader(
    venv: Path, checkpoint: Path, case_name: str, timeout_s: float = 900.0
) -> list:
    """Every rank's table of case ``case_name`` from SGLang's own loader (`deepseek_loader.py`
    in SGLang's venv ``venv``, one process for all the case's ranks).

    Raises:
        RuntimeError: the loader failed; the message has its stderr tail.
    """
    env = {
        **os.environ,
        "PYTHONPATH": str(HERE / "stubs"),
        "SGLANG_USE_CPU_ENGINE": "1",
        # One thread per loader: several run side by side, and loading is copying.
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [
            str(venv / "bin" / "python"),
            str(HERE / "deepseek_loader.py"),
            str(checkpoint),
            case_name,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"SGLang's loader failed on {case_name} (exit {result.returncode}):\n"
            + "\n".join(result.stderr.splitlines()[-40:])
        )
    return json.loads(result.stdout.splitlines()[-1])["ranks"]


# Parameters SGLang creates that no checkpoint tensor feeds: an FP8 checkpoint's attention
# k_scale / v_scale scalars (RadixAttention's KV-cache scales, fixed at 1.0). The engine owns
# them; weightsync's layout leaves them out and no sync writes them.
ENGINE_OWNED_SUFFIXES = (".k_scale", ".v_scale")


def layout_rows(rows: list) -> list:
    """A rank's table without the engine-owned parameters (`ENGINE_OWNED_SUFFIXES`)."""
    return [row for row in rows if not row[0].endswith(ENGINE_OWNED_SUFFIXES)]
