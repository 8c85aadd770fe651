"""Tensor names: HF checkpoint names and SGLang parameter names, and the layer they belong to."""

from __future__ import annotations

import re

EMBED_TOKENS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_prefix(layer: int) -> str:
    """The name prefix of decoder layer ``layer`` (same in HF and SGLang)."""
    return f"model.layers.{layer}."


def hf_expert_prefix(layer: int, expert: int) -> str:
    """The HF name prefix of one expert's MLP (``mlp.experts.{e}.gate_proj.weight`` etc.)."""
    return f"model.layers.{layer}.mlp.experts.{expert}."


def layer_index(hf_name: str) -> int | None:
    """The global decoder layer an HF (or engine) tensor name belongs to.

    Args:
        hf_name: e.g. ``"model.layers.7.self_attn.q_proj.weight"``.

    Returns:
        The layer number, or ``None`` for tensors outside the decoder layers (embeddings, the
        final norm, ``lm_head``).
    """
    match = _LAYER_RE.search(hf_name)
    return int(match.group(1)) if match else None
