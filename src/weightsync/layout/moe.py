"""Sparse MoE block: experts ``w13_weight`` / ``w2_weight`` split by EP then MoE-TP, and router."""

from __future__ import annotations

from weightsync.layout.config import ModelDims
from weightsync.layout.names import hf_expert_prefix, layer_prefix
from weightsync.layout.partition import RankPartition
from weightsync.layout.segments import SegmentBuilder, replicated_param
from weightsync.layout.types import ParamLayout


def moe_hf_shapes(dims: ModelDims, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of layer ``layer``'s MoE block: per-expert MLPs, then the router."""
    hidden, inter = dims.hidden_size, dims.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for expert in range(dims.num_experts):
        prefix = hf_expert_prefix(layer, expert)
        shapes[f"{prefix}gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}down_proj.weight"] = (hidden, inter)
    shapes[layer_prefix(layer) + "mlp.gate.weight"] = (dims.num_experts, hidden)
    return shapes


def moe_params(dims: ModelDims, part: RankPartition, layer: int, dtype: str) -> list[ParamLayout]:
    """Layer ``layer``'s MoE parameters on the rank ``part`` describes, in SGLang order.

    Local expert ``e`` is global expert ``part.experts[0] + e``. ``w13_weight[e]`` is [its
    gate rows; its up rows] of the rank's MoE-TP slice, ``w2_weight[e]`` the matching columns
    of its down projection. The router ``mlp.gate`` is replicated.
    """
    prefix = layer_prefix(layer) + "mlp."
    hidden, inter = dims.hidden_size, dims.moe_intermediate_size
    rows = part.moe_intermediate
    local_inter = rows[1] - rows[0]
    num_local = part.experts[1] - part.experts[0]
    w13 = SegmentBuilder()
    w2 = SegmentBuilder()
    for expert in range(*part.experts):
        expert_prefix = hf_expert_prefix(layer, expert)
        w13.add_rows(f"{expert_prefix}gate_proj.weight", (inter, hidden), rows)
        w13.add_rows(f"{expert_prefix}up_proj.weight", (inter, hidden), rows)
        w2.add_columns(f"{expert_prefix}down_proj.weight", (hidden, inter), rows)
    return [
        w13.build(f"{prefix}experts.w13_weight", (num_local, 2 * local_inter, hidden), dtype),
        w2.build(f"{prefix}experts.w2_weight", (num_local, hidden, local_inter), dtype),
        replicated_param(
            f"{prefix}gate.weight", f"{prefix}gate.weight", (dims.num_experts, hidden), dtype
        ),
    ]
