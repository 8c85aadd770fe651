"""The decoder: embedding, pre-norm decoder layers and the final norm, built from the layout."""

from __future__ import annotations

import torch

from weightsync.engine.attention import Attention
from weightsync.engine.cache import KVCache
from weightsync.engine.embedding import VocabParallelEmbedding
from weightsync.engine.linear import ColumnParallelLinear, RowParallelLinear
from weightsync.engine.mlp import MLP
from weightsync.engine.moe import Experts, Router, SparseMoE
from weightsync.engine.norm import RMSNorm
from weightsync.engine.parameters import LayoutParameters
from weightsync.engine.rotary import RotaryEmbedding
from weightsync.engine.spec import ModelSpec
from weightsync.engine.tp_group import TensorParallelGroup


class DecoderLayer(torch.nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``; the MLP is dense or sparse (MoE).

    Args:
        input_layernorm: the norm before attention.
        self_attn: the attention block.
        post_attention_layernorm: the norm before the MLP.
        mlp: a dense `MLP` or a `SparseMoE`.
    """

    def __init__(
        self,
        *,
        input_layernorm: RMSNorm,
        self_attn: Attention,
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
        tp_group: TensorParallelGroup,
        ep_rank: int,
    ) -> DecoderLayer:
        """Build layer ``index`` from the layout's parameters, taking them in layout order."""
        prefix = f"model.layers.{index}"
        eps = spec.rms_norm_eps
        input_layernorm = RMSNorm(params.take(f"{prefix}.input_layernorm.weight"), eps)
        attn = f"{prefix}.self_attn"
        qkv_proj = ColumnParallelLinear(
            params.take(f"{attn}.qkv_proj.weight"),
            params.take(f"{attn}.qkv_proj.bias") if params.has(f"{attn}.qkv_proj.bias") else None,
        )
        o_proj = RowParallelLinear(params.take(f"{attn}.o_proj.weight"), tp_group)
        q_norm = k_norm = None
        if params.has(f"{attn}.q_norm.weight"):
            q_norm = RMSNorm(params.take(f"{attn}.q_norm.weight"), eps)
            k_norm = RMSNorm(params.take(f"{attn}.k_norm.weight"), eps)
        self_attn = Attention(
            qkv_proj=qkv_proj,
            o_proj=o_proj,
            q_norm=q_norm,
            k_norm=k_norm,
            head_dim=spec.head_dim,
            window=spec.sliding_windows[index],
        )
        post_norm = RMSNorm(params.take(f"{prefix}.post_attention_layernorm.weight"), eps)
        mlp_prefix = f"{prefix}.mlp"
        mlp: MLP | SparseMoE
        if params.has(f"{mlp_prefix}.experts.w13_weight"):
            gate = Router(
                params.take(f"{mlp_prefix}.gate.weight"),
                top_k=spec.num_experts_per_tok,
                norm_topk_prob=spec.norm_topk_prob,
            )
            experts = Experts(
                params.take(f"{mlp_prefix}.experts.w13_weight"),
                params.take(f"{mlp_prefix}.experts.w2_weight"),
                ep_rank=ep_rank,
            )
            mlp = SparseMoE(gate, experts, tp_group)
        else:
            mlp = MLP(
                ColumnParallelLinear(params.take(f"{mlp_prefix}.gate_up_proj.weight")),
                RowParallelLinear(params.take(f"{mlp_prefix}.down_proj.weight"), tp_group),
            )
        return cls(
            input_layernorm=input_layernorm,
            self_attn=self_attn,
            post_attention_layernorm=post_norm,
            mlp=mlp,
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None,
        index: int,
    ) -> torch.Tensor:
        """Run the layer on ``x`` ``[num_tokens, hidden]``; ``index`` picks its cache slice."""
        layer_cache = cache.layer(index) if cache is not None else None
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, layer_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(torch.nn.Module):
    """Embedding, decoder layers and final norm (SGLang's ``model.`` submodule).

    Args:
        params: the rank's parameters, taken in layout order.
        spec: the model's non-shape numbers.
        tp_group: the replica's TP ranks.
        ep_rank: this rank's expert-parallel rank.
        compute_dtype: the dtype activations are computed in.
    """

    def __init__(
        self,
        *,
        params: LayoutParameters,
        spec: ModelSpec,
        tp_group: TensorParallelGroup,
        ep_rank: int,
        compute_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            params.take("model.embed_tokens.weight"), tp_group, compute_dtype
        )
        self.layers = torch.nn.ModuleList(
            DecoderLayer.build(i, params=params, spec=spec, tp_group=tp_group, ep_rank=ep_rank)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(params.take("model.norm.weight"), spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, self.embed_tokens.weight.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of ``input_ids`` at ``positions``."""
        x = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, positions, rotary, cache, index)
        return self.norm(x)
