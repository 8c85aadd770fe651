"""The decoder: embedding, pre-norm decoder layers and the final norm, built from the layout."""

from __future__ import annotations

import torch

from weightsync.engine.attention import Attention
from weightsync.engine.cache import KVCache, LatentCache
from weightsync.engine.embedding import VocabParallelEmbedding
from weightsync.engine.groups import ModelGroups
from weightsync.engine.linear import ColumnParallelLinear, RowParallelLinear
from weightsync.engine.mla import MLAttention
from weightsync.engine.mlp import MLP
from weightsync.engine.moe import Experts, GroupedTopkRouter, Router, SparseMoE
from weightsync.engine.norm import RMSNorm
from weightsync.engine.parameters import LayoutParameters
from weightsync.engine.rotary import RotaryEmbedding
from weightsync.engine.spec import MlaSpec, ModelSpec
from weightsync.engine.tp_group import TensorParallelGroup
from weightsync.layout.parallelism import ParallelismConfig


class DecoderLayer(torch.nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``; the MLP is dense or sparse (MoE).

    Args:
        input_layernorm: the norm before attention.
        self_attn: the attention block (grouped heads, or MLA).
        post_attention_layernorm: the norm before the MLP.
        mlp: a dense `MLP` or a `SparseMoE`.
    """

    def __init__(
        self,
        *,
        input_layernorm: RMSNorm,
        self_attn: Attention | MLAttention,
        post_attention_layernorm: RMSNorm,
        mlp: MLP | SparseMoE,
    ) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    @classmethod
    def build(
        cls,
        index: int,
        *,
        params: LayoutParameters,
        spec: ModelSpec,
        groups: ModelGroups,
        parallelism: ParallelismConfig,
    ) -> DecoderLayer:
        """Build layer ``index`` from the layout's parameters, taking them in layout order."""
        prefix = f"model.layers.{index}"
        eps = spec.rms_norm_eps
        input_layernorm = RMSNorm(params.take(f"{prefix}.input_layernorm.weight"), eps)
        attn_group = groups.attention
        if spec.mla is not None:
            self_attn: Attention | MLAttention = _build_mla(
                f"{prefix}.self_attn", params, spec.mla, eps, attn_group, spec.fp8_block_size
            )
        else:
            self_attn = _build_attention(f"{prefix}.self_attn", index, params, spec, attn_group)
        post_norm = RMSNorm(params.take(f"{prefix}.post_attention_layernorm.weight"), eps)
        return cls(
            input_layernorm=input_layernorm,
            self_attn=self_attn,
            post_attention_layernorm=post_norm,
            mlp=_build_mlp(f"{prefix}.mlp", params, spec, groups, parallelism),
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | LatentCache | None,
        index: int,
    ) -> torch.Tensor:
        """Run the layer on ``x`` ``[num_tokens, hidden]``; ``index`` picks its cache slice."""
        layer_cache = cache.layer(index) if cache is not None else None
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, layer_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def _scale(params: LayoutParameters, weight_name: str) -> torch.nn.Parameter | None:
    """A block-FP8 weight's ``weight_scale_inv`` (after the weight in the layout), or None."""
    name = weight_name + "_scale_inv"
    return params.take(name) if params.has(name) else None


def column(params: LayoutParameters, weight_name: str, block: int) -> ColumnParallelLinear:
    """A column-parallel (or replicated) linear of `weight_name`, with its FP8 scales."""
    weight = params.take(weight_name)
    return ColumnParallelLinear(weight, weight_scale_inv=_scale(params, weight_name), block=block)


def row(
    params: LayoutParameters, weight_name: str, tp_group: TensorParallelGroup, block: int
) -> RowParallelLinear:
    """A row-parallel linear of `weight_name`, with its FP8 scales."""
    weight = params.take(weight_name)
    return RowParallelLinear(
        weight, tp_group, weight_scale_inv=_scale(params, weight_name), block=block
    )


def _build_attention(
    prefix: str,
    index: int,
    params: LayoutParameters,
    spec: ModelSpec,
    tp_group: TensorParallelGroup,
) -> Attention:
    eps = spec.rms_norm_eps
    bias = f"{prefix}.qkv_proj.bias"
    qkv_proj = ColumnParallelLinear(
        params.take(f"{prefix}.qkv_proj.weight"),
        params.take(bias) if params.has(bias) else None,
    )
    o_proj = RowParallelLinear(params.take(f"{prefix}.o_proj.weight"), tp_group)
    q_norm = k_norm = None
    if params.has(f"{prefix}.q_norm.weight"):
        q_norm = RMSNorm(params.take(f"{prefix}.q_norm.weight"), eps)
        k_norm = RMSNorm(params.take(f"{prefix}.k_norm.weight"), eps)
    return Attention(
        qkv_proj=qkv_proj,
        o_proj=o_proj,
        q_norm=q_norm,
        k_norm=k_norm,
        head_dim=spec.head_dim,
        window=spec.sliding_windows[index],
    )


def _build_mla(
    prefix: str,
    params: LayoutParameters,
    mla: MlaSpec,
    eps: float,
    tp_group: TensorParallelGroup,
    block: int,
) -> MLAttention:
    def linear(name: str) -> ColumnParallelLinear:
        # Replicated and column-parallel projections multiply alike; only o_proj reduces.
        return column(params, f"{prefix}.{name}.weight", block)

    projections: dict[str, ColumnParallelLinear | RMSNorm] = {}
    if params.has(f"{prefix}.fused_qkv_a_proj_with_mqa.weight"):
        projections["fused_qkv_a_proj_with_mqa"] = linear("fused_qkv_a_proj_with_mqa")
        projections["q_a_layernorm"] = RMSNorm(params.take(f"{prefix}.q_a_layernorm.weight"), eps)
        projections["q_b_proj"] = linear("q_b_proj")
    else:
        projections["q_proj"] = linear("q_proj")
        projections["kv_a_proj_with_mqa"] = linear("kv_a_proj_with_mqa")
    return MLAttention(
        kv_b_proj=linear("kv_b_proj"),
        o_proj=row(params, f"{prefix}.o_proj.weight", tp_group, block),
        kv_a_layernorm=RMSNorm(params.take(f"{prefix}.kv_a_layernorm.weight"), eps),
        spec=mla,
        **projections,
    )


def _build_mlp(
    prefix: str,
    params: LayoutParameters,
    spec: ModelSpec,
    groups: ModelGroups,
    parallelism: ParallelismConfig,
) -> MLP | SparseMoE:
    block = spec.fp8_block_size
    tp_group = groups.tp
    if not params.has(f"{prefix}.experts.w13_weight"):
        return MLP(
            column(params, f"{prefix}.gate_up_proj.weight", block),
            row(params, f"{prefix}.down_proj.weight", groups.dense_mlp, block),
        )
    gate: Router | GroupedTopkRouter
    shared_experts = None
    if spec.grouped_routing is not None:
        routing = spec.grouped_routing
        gate = GroupedTopkRouter(
            params.take(f"{prefix}.gate.weight"),
            params.take(f"{prefix}.gate.e_score_correction_bias"),
            top_k=spec.num_experts_per_tok,
            n_group=routing.n_group,
            topk_group=routing.topk_group,
            norm_topk_prob=spec.norm_topk_prob,
            routed_scaling_factor=routing.routed_scaling_factor,
        )
        # Fused, the shared experts are the experts' last slots (no parameters of their own).
        if params.has(f"{prefix}.shared_experts.gate_up_proj.weight"):
            shared_experts = MLP(
                column(params, f"{prefix}.shared_experts.gate_up_proj.weight", block),
                row(params, f"{prefix}.shared_experts.down_proj.weight", tp_group, block),
            )
    else:
        gate = Router(
            params.take(f"{prefix}.gate.weight"),
            top_k=spec.num_experts_per_tok,
            norm_topk_prob=spec.norm_topk_prob,
        )
    experts = Experts(
        params.take(f"{prefix}.experts.w13_weight"),
        params.take(f"{prefix}.experts.w2_weight"),
        ep_rank=parallelism.ep_rank,
        ep_size=parallelism.ep_size,
        num_fused_shared_experts=parallelism.num_fused_shared_experts,
        w13_weight_scale_inv=_scale(params, f"{prefix}.experts.w13_weight"),
        w2_weight_scale_inv=_scale(params, f"{prefix}.experts.w2_weight"),
        block=block,
    )
    return SparseMoE(gate, experts, tp_group, shared_experts)


class Decoder(torch.nn.Module):
    """Embedding, decoder layers and final norm (SGLang's ``model.`` submodule).

    Args:
        params: the rank's parameters, taken in layout order.
        spec: the model's non-shape numbers.
        groups: the groups each part splits over (`weightsync.engine.groups.model_groups`).
        parallelism: this rank's parallelism (its EP rank and size, fused shared experts).
        compute_dtype: the dtype activations are computed in.
    """

    def __init__(
        self,
        *,
        params: LayoutParameters,
        spec: ModelSpec,
        groups: ModelGroups,
        parallelism: ParallelismConfig,
        compute_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            params.take("model.embed_tokens.weight"), groups.attention, compute_dtype
        )
        self.layers = torch.nn.ModuleList(
            DecoderLayer.build(i, params=params, spec=spec, groups=groups, parallelism=parallelism)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(params.take("model.norm.weight"), spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.rope, spec.rotary_dim, self.embed_tokens.weight.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | LatentCache | None
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of ``input_ids`` at ``positions``."""
        x = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, positions, rotary, cache, index)
        return self.norm(x)
