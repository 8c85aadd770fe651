"""A rank's parameter table and the HF checkpoint's tensor list, assembled from the rules."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from weightsync.layout.attention import attention_hf_shapes, attention_params
from weightsync.layout.config import ModelDims, model_dims
from weightsync.layout.dtypes import resolve_dtype_name
from weightsync.layout.embedding import vocab_param
from weightsync.layout.families import family_for
from weightsync.layout.mla import mla_hf_shapes, mla_params
from weightsync.layout.mlp import mlp_hf_shapes, mlp_params
from weightsync.layout.moe import (
    deepseek_moe_hf_shapes,
    deepseek_moe_params,
    moe_hf_shapes,
    moe_params,
)
from weightsync.layout.names import EMBED_TOKENS, FINAL_NORM, LM_HEAD, layer_prefix
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.partition import partition_rank
from weightsync.layout.quant import quantize_params, quantized_hf_shapes
from weightsync.layout.segments import replicated_param
from weightsync.layout.types import ParamLayout

_LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def as_parallelism(parallelism: ParallelismConfig | Mapping[str, Any]) -> ParallelismConfig:
    """``parallelism`` as a `ParallelismConfig` (a dict goes through `from_dict`).

    Raises:
        ValueError: a bad dict, or neither a config nor a mapping.
    """
    if isinstance(parallelism, ParallelismConfig):
        return parallelism
    if isinstance(parallelism, Mapping):
        try:
            return ParallelismConfig.from_dict(parallelism)
        except TypeError as exc:
            # A dict without tp_size / tp_rank reaches the constructor as missing arguments.
            raise ValueError(f"bad parallelism config {dict(parallelism)!r}: {exc}") from exc
    raise ValueError(
        f"parallelism must be a ParallelismConfig or a dict, got {type(parallelism).__name__}"
    )


def rollout_dtype_name(dims: ModelDims, dtype: Any) -> str:
    """The rollout dtype's name: ``dtype``, or the model's own when it is None or ``"auto"``."""
    if dtype is None or dtype == "auto":
        return dims.dtype
    return resolve_dtype_name(dtype)


@functools.lru_cache(maxsize=64)
def _hf_shapes(dims: ModelDims) -> tuple[tuple[str, tuple[int, ...]], ...]:
    family = family_for(dims.model_type)
    hidden = dims.hidden_size
    shapes: dict[str, tuple[int, ...]] = {EMBED_TOKENS: (dims.vocab_size, hidden)}
    for layer in range(dims.num_hidden_layers):
        if family.mla:
            shapes.update(mla_hf_shapes(dims, layer))
        else:
            shapes.update(attention_hf_shapes(dims, family, layer))
        if dims.is_moe_layer(layer):
            if family.deepseek_moe:
                shapes.update(deepseek_moe_hf_shapes(dims, layer))
            else:
                shapes.update(moe_hf_shapes(dims, layer))
        else:
            shapes.update(mlp_hf_shapes(dims, layer))
        for norm in _LAYER_NORMS:
            shapes[layer_prefix(layer) + norm] = (hidden,)
    shapes[FINAL_NORM] = (hidden,)
    if not dims.tie_word_embeddings:
        shapes[LM_HEAD] = (dims.vocab_size, hidden)
    if dims.fp8_block_size:
        shapes = quantized_hf_shapes(shapes, dims.fp8_block_size)
    return tuple(shapes.items())


def hf_tensor_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's HF checkpoint and its shape.

    Names are the checkpoint's (``model.layers.{i}.self_attn.q_proj.weight``, per-expert
    ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``); there is no ``lm_head.weight`` when
    the embeddings are tied. DeepSeek's ``mlp.gate.e_score_correction_bias`` is among them: a
    buffer in transformers' model (in its ``state_dict()``, not its ``named_parameters()``).
    A block-FP8 config (``quantization_config``) adds each linear weight's
    ``weight_scale_inv`` right after it (`weightsync.layout.quant`).

    Args:
        hf_config: a transformers config object or a config.json dict.

    Raises:
        ValueError: unsupported ``model_type`` or a bad config.
    """
    return dict(_hf_shapes(model_dims(hf_config)))


@functools.lru_cache(maxsize=256)
def _rank_layout(
    dims: ModelDims, parallelism: ParallelismConfig, dtype: str
) -> tuple[ParamLayout, ...]:
    family = family_for(dims.model_type)
    part = partition_rank(dims, parallelism)
    hidden = dims.hidden_size
    params = [vocab_param(EMBED_TOKENS, EMBED_TOKENS, dims, part.vocab_rows, dtype)]
    for layer in range(dims.num_hidden_layers):
        if family.mla:
            params += mla_params(dims, part, layer, dtype)
        else:
            params += attention_params(dims, family, part, layer, dtype)
        if dims.is_moe_layer(layer):
            if family.deepseek_moe:
                params += deepseek_moe_params(dims, part, layer, dtype)
            else:
                params += moe_params(dims, part, layer, dtype)
        else:
            params += mlp_params(dims, part, layer, dtype)
        for norm in _LAYER_NORMS:
            name = layer_prefix(layer) + norm
            params.append(replicated_param(name, name, (hidden,), dtype))
    params.append(replicated_param(FINAL_NORM, FINAL_NORM, (hidden,), dtype))
    if not dims.tie_word_embeddings:
        params.append(vocab_param(LM_HEAD, LM_HEAD, dims, part.lm_head_rows, dtype))
    elif family.lm_head_when_tied:
        params.append(vocab_param(LM_HEAD, EMBED_TOKENS, dims, part.lm_head_rows, dtype))
    if dims.fp8_block_size:
        where = f"tp_size={parallelism.tp_size}, ep_size={parallelism.ep_size}"
        if parallelism.attn_dp_size > 1:
            where += f", attn_tp_size={parallelism.attn_tp_size}"
        params = quantize_params(
            params, dict(_hf_shapes(dims)), block=dims.fp8_block_size, where=where
        )
    return tuple(params)


def rank_layout(
    hf_config: Any,
    parallelism: ParallelismConfig | Mapping[str, Any],
    dtype: Any = None,
) -> dict[str, ParamLayout]:
    """Every parameter of one rollout rank, in the engine's parameter order, with sources.

    Names, shapes and the byte layout are SGLang's: fused ``qkv_proj`` = [q; k; v] rows of the
    rank's heads (kv heads replicated when ``tp_size > num_key_value_heads``), fused
    ``gate_up_proj`` = [gate; up], ``o_proj`` / ``down_proj`` split on dim 1, ``embed_tokens``
    / ``lm_head`` padded (see `padded_vocab_size`) and split over TP with zero padding rows,
    experts split by EP then MoE-TP, norms and the router replicated. DeepSeek-V3 / Kimi-K2:
    MLA (`weightsync.layout.mla`: replicated down-projections, per-head up-projections),
    the router with its float32 ``e_score_correction_bias``, shared experts split over TP
    or, with ``parallelism.num_fused_shared_experts``, held as the last expert slot(s) of
    ``mlp.experts`` on every EP rank; under DP attention (``attn_dp_size > 1``) attention and
    ``embed_tokens`` split over attention TP (``lm_head`` too with ``enable_dp_lm_head``);
    ``moe_dense_tp_size`` 1 keeps the dense MLP layers whole. Results are cached, so calling
    it once per rank of many replicas is cheap.

    Every parameter has the rollout dtype except DeepSeek's ``e_score_correction_bias``, which
    is float32 in any rollout (``ParamLayout.dtype`` says so per parameter). A block-FP8
    config (``quantization_config``) makes every linear weight ``float8_e4m3fn`` followed by
    its float32 ``weight_scale_inv`` (`weightsync.layout.quant`; a split that cuts a scale
    block is refused).

    Args:
        hf_config: a transformers config object or a config.json dict.
        parallelism: the rank's `ParallelismConfig`, or a dict of its fields.
        dtype: the rollout dtype (torch dtype or name); None or ``"auto"`` for the config's
            dtype (float32 if it names none).

    Returns:
        ``{param_name: ParamLayout}``; each layout's segments tile the parameter exactly once.

    Raises:
        ValueError: unsupported ``model_type``, a bad config or dtype, a size that does not
            split over the ranks (the message names the config field), or a parallel mode
            SGLang does not run for this model (the message names the option).
    """
    dims = model_dims(hf_config)
    layouts = _rank_layout(dims, as_parallelism(parallelism), rollout_dtype_name(dims, dtype))
    return {layout.name: layout for layout in layouts}
