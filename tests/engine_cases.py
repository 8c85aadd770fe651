"""Tiny checkpoints of every family the reference engine runs, and HF's outputs on them.

Weights are scaled up from random initialisation so that greedy choices are decisive (top-2
logit gaps ~1e-2, far above float32 reduction-order noise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from weightsync.testing.presets import preset_config, random_model

LOGITS_ATOL = 1e-4
MAX_NEW_TOKENS = 8
PROMPTS = (
    [3],
    [5, 17, 300, 998, 42, 7, 64],
    [11, 12, 13, 500, 600, 700, 8, 9, 10, 900, 1, 2],
)
# Each case exercises something: llama GQA with llama3 RoPE scaling; mistral's sliding window
# (shorter than the prompts); qwen2's qkv bias with one KV head (replicated at tp=2) and a
# vocab that is no multiple of 64; qwen3's q/k norms with tied embeddings; qwen3_moe's dense
# layer 0 and sparse layers.
CASES: dict[str, dict[str, Any]] = {
    "llama": preset_config(
        "tiny",
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": preset_config("tiny", model_type="mistral", sliding_window=6),
    "qwen2": preset_config("tiny", model_type="qwen2", num_key_value_heads=1, vocab_size=1003),
    "qwen3": preset_config("tiny", model_type="qwen3", tie_word_embeddings=True, vocab_size=999),
    "qwen3_moe": preset_config("tiny-moe"),
}


def write_checkpoint(path: Path, config: dict[str, Any]):
    """Save a sharpened random model as an HF checkpoint; returns the in-memory HF model."""
    model = random_model(config, seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(4.0)
    model.save_pretrained(path)
    return model


def hf_reference(model) -> dict[str, list]:
    """HF's full-prompt logits and greedy continuations of `PROMPTS` (no stop token)."""
    model.generation_config.eos_token_id = None
    logits, tokens = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            logits.append(model(ids).logits[0])
            out = model.generate(
                ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return {"logits": logits, "tokens": tokens}


def run_engine(model) -> dict[str, list]:
    """The engine's full-prompt logits (on CPU) and greedy continuations of `PROMPTS`."""
    from weightsync.engine import generate

    device = model.device
    logits = [
        model(torch.tensor(p, device=device), torch.arange(len(p), device=device)).cpu()
        for p in PROMPTS
    ]
    tokens = [generate(model, p, max_new_tokens=MAX_NEW_TOKENS) for p in PROMPTS]
    return {"logits": logits, "tokens": tokens}


def check_against_hf(got: dict[str, list], reference: dict[str, list]) -> None:
    """Logits within `LOGITS_ATOL` of HF's and the same greedy tokens."""
    for prompt, logits, ref_logits in zip(PROMPTS, got["logits"], reference["logits"], strict=True):
        assert logits.shape == ref_logits.shape, prompt
        diff = (logits.float() - ref_logits).abs().max().item()
        assert diff <= LOGITS_ATOL, f"prompt {prompt}: logits differ by {diff}"
    assert got["tokens"] == reference["tokens"]


# The DeepSeek-V3 family, kept apart from CASES (its own test file runs it). The q_lora case
# is the preset as it is; the other has q_proj instead, tied embeddings, a vocabulary that is
# no multiple of 64, rotate-half RoPE and YaRN with mscale != mscale_all_dim (rotary tables
# scaled by an attention factor other than 1).
DEEPSEEK_CASES: dict[str, dict[str, Any]] = {
    "deepseek": preset_config("tiny-deepseek"),
    "deepseek_nolora": preset_config(
        "tiny-deepseek-nolora",
        tie_word_embeddings=True,
        vocab_size=999,
        rope_interleave=False,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ),
}
