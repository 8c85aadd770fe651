"""Multi-head latent attention (DeepSeek-V3, Kimi-K2), as SGLang's DeepseekV2AttentionMLA
registers it.

With ``q_lora_rank`` set, ``fused_qkv_a_proj_with_mqa`` = [``q_a_proj``; ``kv_a_proj_with_mqa``]
is replicated, then ``q_a_layernorm``, ``q_b_proj`` (column-parallel by heads); without it,
``q_proj`` (column-parallel by heads) and ``kv_a_proj_with_mqa`` (replicated). Then
``kv_b_proj`` (column-parallel by heads), ``o_proj`` (row-parallel) and ``kv_a_layernorm``.

SGLang also keeps ``w_kc`` / ``w_vc``, split and transposed from ``kv_b_proj`` after loading
(``post_load_weights``). They are plain attributes, not parameters: SGLang publishes no address
for them, so no sync writes them, and they are not part of the layout. The engine derives them
again at the end of every weight update.
"""

from __future__ import annotations

from weightsync.layout.config import ModelDims
from weightsync.layout.names import layer_prefix
from weightsync.layout.partition import RankPartition
from weightsync.layout.segments import SegmentBuilder, replicated_param
from weightsync.layout.types import ParamLayout


def mla_hf_shapes(dims: ModelDims, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of layer ``layer``'s MLA attention and their shapes, in module order."""
    prefix = layer_prefix(layer) + "self_attn."
    hidden, heads = dims.hidden_size, dims.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if dims.q_lora_rank is not None:
        shapes[f"{prefix}q_a_proj.weight"] = (dims.q_lora_rank, hidden)
        shapes[f"{prefix}q_a_layernorm.weight"] = (dims.q_lora_rank,)
        shapes[f"{prefix}q_b_proj.weight"] = (heads * dims.qk_head_dim, dims.q_lora_rank)
    else:
        shapes[f"{prefix}q_proj.weight"] = (heads * dims.qk_head_dim, hidden)
    shapes[f"{prefix}kv_a_proj_with_mqa.weight"] = (
        dims.kv_lora_rank + dims.qk_rope_head_dim,
        hidden,
    )
    shapes[f"{prefix}kv_a_layernorm.weight"] = (dims.kv_lora_rank,)
    shapes[f"{prefix}kv_b_proj.weight"] = (
        heads * (dims.qk_nope_head_dim + dims.v_head_dim),
        dims.kv_lora_rank,
    )
    shapes[f"{prefix}o_proj.weight"] = (hidden, heads * dims.v_head_dim)
    return shapes


def mla_params(dims: ModelDims, part: RankPartition, layer: int, dtype: str) -> list[ParamLayout]:
    """Layer ``layer``'s MLA parameters on the rank ``part`` describes, in SGLang order.

    Every per-head projection holds the rows (``o_proj``: the columns) of the rank's heads
    ``part.heads``: ``qk_head_dim`` rows a head of ``q_b_proj`` / ``q_proj``
    (``[q_nope; q_rope]``), ``qk_nope_head_dim + v_head_dim`` of ``kv_b_proj``
    (``[k_nope; v]``), ``v_head_dim`` columns of ``o_proj``.
    """
    prefix = layer_prefix(layer) + "self_attn."
    hidden, heads = dims.hidden_size, dims.num_attention_heads
    first, stop = part.heads
    num_local = stop - first
    shapes = mla_hf_shapes(dims, layer)

    def head_rows(hf_name: str, per_head: int, in_dim: int) -> ParamLayout:
        builder = SegmentBuilder()
        builder.add_rows(hf_name, shapes[hf_name], (first * per_head, stop * per_head))
        return builder.build(hf_name, (num_local * per_head, in_dim), dtype)

    def whole(hf_name: str) -> ParamLayout:
        return replicated_param(hf_name, hf_name, shapes[hf_name], dtype)

    kv_a = f"{prefix}kv_a_proj_with_mqa.weight"
    params: list[ParamLayout] = []
    if dims.q_lora_rank is not None:
        q_a = f"{prefix}q_a_proj.weight"
        fused = SegmentBuilder()
        fused.add_whole(q_a, shapes[q_a])
        fused.add_whole(kv_a, shapes[kv_a])
        fused_rows = shapes[q_a][0] + shapes[kv_a][0]
        params.append(
            fused.build(f"{prefix}fused_qkv_a_proj_with_mqa.weight", (fused_rows, hidden), dtype)
        )
        params.append(whole(f"{prefix}q_a_layernorm.weight"))
        params.append(head_rows(f"{prefix}q_b_proj.weight", dims.qk_head_dim, dims.q_lora_rank))
    else:
        params.append(head_rows(f"{prefix}q_proj.weight", dims.qk_head_dim, hidden))
        params.append(whole(kv_a))
    kv_b_per_head = dims.qk_nope_head_dim + dims.v_head_dim
    params.append(head_rows(f"{prefix}kv_b_proj.weight", kv_b_per_head, dims.kv_lora_rank))
    o_proj = f"{prefix}o_proj.weight"
    o_cols = SegmentBuilder()
    v_dim = dims.v_head_dim
    o_cols.add_columns(o_proj, (hidden, heads * v_dim), (first * v_dim, stop * v_dim))
    params.append(o_cols.build(o_proj, (hidden, num_local * v_dim), dtype))
    params.append(whole(f"{prefix}kv_a_layernorm.weight"))
    return params
