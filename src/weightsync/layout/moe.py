"""Sparse MoE blocks: experts ``w13_weight`` / ``w2_weight`` split by EP then MoE-TP, and the
router; DeepSeek's adds the router's score-correction bias and the shared experts, either a
TP-split MLP of their own or fused into the experts as extra slots."""

from __future__ import annotations

from weightsync.layout.config import ModelDims
from weightsync.layout.names import hf_expert_prefix, layer_prefix
from weightsync.layout.partition import RankPartition
from weightsync.layout.segments import SegmentBuilder, replicated_param
from weightsync.layout.types import ParamLayout

# SGLang allocates DeepSeek's e_score_correction_bias in float32 whatever the model dtype
# (MoEGate, deepseek_v2.py; bf16 only on ROCm with aiter and a quantised checkpoint), as
# transformers keeps it: a bias a few bf16 ulps wide would reorder the top-k choice.
ROUTER_BIAS_DTYPE = "float32"


def _expert_hf_shapes(dims: ModelDims, layer: int) -> dict[str, tuple[int, ...]]:
    hidden, inter = dims.hidden_size, dims.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for expert in range(dims.num_experts):
        prefix = hf_expert_prefix(layer, expert)
        shapes[f"{prefix}gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}down_proj.weight"] = (hidden, inter)
    return shapes


def moe_hf_shapes(dims: ModelDims, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of layer ``layer``'s MoE block: per-expert MLPs, then the router."""
    shapes = _expert_hf_shapes(dims, layer)
    shapes[layer_prefix(layer) + "mlp.gate.weight"] = (dims.num_experts, dims.hidden_size)
    return shapes


def deepseek_moe_hf_shapes(dims: ModelDims, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of layer ``layer``'s DeepSeek MoE block: per-expert MLPs, the router
    (``gate.weight`` and the ``gate.e_score_correction_bias`` buffer), the shared experts."""
    prefix = layer_prefix(layer) + "mlp."
    hidden = dims.hidden_size
    shared = dims.moe_intermediate_size * dims.n_shared_experts
    shapes = _expert_hf_shapes(dims, layer)
    shapes[f"{prefix}gate.weight"] = (dims.num_experts, hidden)
    shapes[f"{prefix}gate.e_score_correction_bias"] = (dims.num_experts,)
    shapes[f"{prefix}shared_experts.gate_proj.weight"] = (shared, hidden)
    shapes[f"{prefix}shared_experts.up_proj.weight"] = (shared, hidden)
    shapes[f"{prefix}shared_experts.down_proj.weight"] = (hidden, shared)
    return shapes


def _expert_params(
    dims: ModelDims, part: RankPartition, layer: int, dtype: str
) -> list[ParamLayout]:
    prefix = layer_prefix(layer) + "mlp."
    hidden, inter = dims.hidden_size, dims.moe_intermediate_size
    rows = part.moe_intermediate
    local_inter = rows[1] - rows[0]
    w13 = SegmentBuilder()
    w2 = SegmentBuilder()
    for expert in range(*part.experts):
        expert_prefix = hf_expert_prefix(layer, expert)
        w13.add_rows(f"{expert_prefix}gate_proj.weight", (inter, hidden), rows)
        w13.add_rows(f"{expert_prefix}up_proj.weight", (inter, hidden), rows)
        w2.add_columns(f"{expert_prefix}down_proj.weight", (hidden, inter), rows)
    # SGLang's FusedMoE gives every EP rank its routed block and then the fused shared slot(s)
    # (local id num_local_routed + i), each split over MoE-TP like a routed expert. Slot i is
    # the shared MLP's intermediate block i: a SiLU-gated MLP is the sum of its blocks, which
    # is what the fused kernel computes over the slots.
    num_fused = part.num_fused_shared_experts
    shared = inter * num_fused
    for slot in range(num_fused):
        slot_rows = (slot * inter + rows[0], slot * inter + rows[1])
        shared_prefix = f"{prefix}shared_experts."
        w13.add_rows(f"{shared_prefix}gate_proj.weight", (shared, hidden), slot_rows)
        w13.add_rows(f"{shared_prefix}up_proj.weight", (shared, hidden), slot_rows)
        w2.add_columns(f"{shared_prefix}down_proj.weight", (hidden, shared), slot_rows)
    num_local = part.experts[1] - part.experts[0] + num_fused
    return [
        w13.build(f"{prefix}experts.w13_weight", (num_local, 2 * local_inter, hidden), dtype),
        w2.build(f"{prefix}experts.w2_weight", (num_local, hidden, local_inter), dtype),
    ]


def moe_params(dims: ModelDims, part: RankPartition, layer: int, dtype: str) -> list[ParamLayout]:
    """Layer ``layer``'s MoE parameters on the rank ``part`` describes, in SGLang order.

    Local expert ``e`` is global expert ``part.experts[0] + e``. ``w13_weight[e]`` is [its
    gate rows; its up rows] of the rank's MoE-TP slice, ``w2_weight[e]`` the matching columns
    of its down projection. The router ``mlp.gate`` is replicated.
    """
    prefix = layer_prefix(layer) + "mlp."
    router = replicated_param(
        f"{prefix}gate.weight", f"{prefix}gate.weight", (dims.num_experts, dims.hidden_size), dtype
    )
    return [*_expert_params(dims, part, layer, dtype), router]


def deepseek_moe_params(
    dims: ModelDims, part: RankPartition, layer: int, dtype: str
) -> list[ParamLayout]:
    """Layer ``layer``'s DeepSeek MoE parameters on the rank ``part`` describes, in SGLang
    order (DeepseekV2MoE registers ``gate``, ``experts``, then ``shared_experts``).

    The router (``gate.weight``, and ``gate.e_score_correction_bias`` in `ROUTER_BIAS_DTYPE`)
    is replicated; the routed experts are split as in `moe_params`. Unfused, the shared
    experts are a dense MLP of ``moe_intermediate_size * n_shared_experts`` split over the
    whole TP group (``part.shared_intermediate``). Fused
    (``part.num_fused_shared_experts == n_shared_experts``), SGLang has no ``shared_experts``
    parameters: every EP rank holds them as its last slots of ``experts.w13_weight`` /
    ``w2_weight`` (slot ``i``: intermediate block ``i`` of ``moe_intermediate_size``), split
    over MoE-TP like a routed expert.
    """
    prefix = layer_prefix(layer) + "mlp."
    hidden = dims.hidden_size
    bias = f"{prefix}gate.e_score_correction_bias"
    router = [
        replicated_param(
            f"{prefix}gate.weight", f"{prefix}gate.weight", (dims.num_experts, hidden), dtype
        ),
        replicated_param(bias, bias, (dims.num_experts,), ROUTER_BIAS_DTYPE),
    ]
    if part.num_fused_shared_experts:
        return [*router, *_expert_params(dims, part, layer, dtype)]
    shared = dims.moe_intermediate_size * dims.n_shared_experts
    rows = part.shared_intermediate
    local = rows[1] - rows[0]
    gate_up = SegmentBuilder()
    gate_up.add_rows(f"{prefix}shared_experts.gate_proj.weight", (shared, hidden), rows)
    gate_up.add_rows(f"{prefix}shared_experts.up_proj.weight", (shared, hidden), rows)
    down = SegmentBuilder()
    down.add_columns(f"{prefix}shared_experts.down_proj.weight", (hidden, shared), rows)
    return [
        *router,
        *_expert_params(dims, part, layer, dtype),
        gate_up.build(f"{prefix}shared_experts.gate_up_proj.weight", (2 * local, hidden), dtype),
        down.build(f"{prefix}shared_experts.down_proj.weight", (hidden, local), dtype),
    ]
