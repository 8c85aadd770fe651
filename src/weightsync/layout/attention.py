"""Attention: fused ``qkv_proj`` of this rank's heads, row-parallel ``o_proj``, q/k norms."""

from __future__ import annotations

from weightsync.layout.config import ModelDims
from weightsync.layout.families import ModelFamily
from weightsync.layout.names import layer_prefix
from weightsync.layout.partition import RankPartition
from weightsync.layout.segments import SegmentBuilder, replicated_param
from weightsync.layout.types import ParamLayout

_QKV = ("q_proj", "k_proj", "v_proj")


def attention_hf_shapes(
    dims: ModelDims, family: ModelFamily, layer: int
) -> dict[str, tuple[int, ...]]:
    """The HF tensors of layer ``layer``'s attention and their shapes, in module order."""
    prefix = layer_prefix(layer) + "self_attn."
    hidden, head_dim = dims.hidden_size, dims.head_dim
    q_size = dims.num_attention_heads * head_dim
    kv_size = dims.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for proj, size in zip(_QKV, (q_size, kv_size, kv_size), strict=True):
        shapes[f"{prefix}{proj}.weight"] = (size, hidden)
        if family.qkv_bias:
            shapes[f"{prefix}{proj}.bias"] = (size,)
    shapes[f"{prefix}o_proj.weight"] = (hidden, q_size)
    if family.qk_norm:
        shapes[f"{prefix}q_norm.weight"] = (head_dim,)
        shapes[f"{prefix}k_norm.weight"] = (head_dim,)
    return shapes


def attention_params(
    dims: ModelDims, family: ModelFamily, part: RankPartition, layer: int, dtype: str
) -> list[ParamLayout]:
    """Layer ``layer``'s attention parameters on the rank ``part`` describes, in SGLang order.

    ``qkv_proj`` stacks this rank's q rows, then its k rows, then its v rows (the bias
    likewise); ``o_proj`` holds the columns of this rank's query heads.
    """
    prefix = layer_prefix(layer) + "self_attn."
    hidden = dims.hidden_size
    q_size = dims.num_attention_heads * dims.head_dim
    kv_size = dims.num_key_value_heads * dims.head_dim
    q_local = part.q_rows[1] - part.q_rows[0]
    kv_local = part.kv_rows[1] - part.kv_rows[0]
    rows = {"q_proj": (q_size, part.q_rows), "k_proj": (kv_size, part.kv_rows)}
    rows["v_proj"] = rows["k_proj"]

    weight = SegmentBuilder()
    bias = SegmentBuilder()
    for proj in _QKV:
        size, proj_rows = rows[proj]
        weight.add_rows(f"{prefix}{proj}.weight", (size, hidden), proj_rows)
        bias.add_rows(f"{prefix}{proj}.bias", (size,), proj_rows)
    fused_size = q_local + 2 * kv_local
    params = [weight.build(f"{prefix}qkv_proj.weight", (fused_size, hidden), dtype)]
    if family.qkv_bias:
        params.append(bias.build(f"{prefix}qkv_proj.bias", (fused_size,), dtype))

    o_proj = SegmentBuilder()
    o_proj.add_columns(f"{prefix}o_proj.weight", (hidden, q_size), part.q_rows)
    params.append(o_proj.build(f"{prefix}o_proj.weight", (hidden, q_local), dtype))

    if family.qk_norm:
        norms = [
            replicated_param(
                f"{prefix}{norm}.weight", f"{prefix}{norm}.weight", (dims.head_dim,), dtype
            )
            for norm in ("q_norm", "k_norm")
        ]
        params = norms + params if family.qk_norm_first else params + norms
    return params
