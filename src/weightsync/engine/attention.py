"""Self-attention over this rank's heads: fused qkv, optional per-head q/k norm, RoPE, GQA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightsync.engine.cache import LayerCache
from weightsync.engine.linear import ColumnParallelLinear, RowParallelLinear
from weightsync.engine.norm import RMSNorm
from weightsync.engine.rotary import apply_rotary


def attention_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Which keys each query sees: causal, and within ``window`` tokens when one is set.

    Args:
        query_positions: ``[num_queries]`` positions of the queries.
        key_positions: ``[num_keys]`` positions of the keys.
        window: the sliding window in tokens, or ``None`` for full attention.

    Returns:
        ``[num_queries, num_keys]`` bool, ``True`` where the query attends to the key.
    """
    delta = query_positions[:, None] - key_positions[None, :]
    visible = delta >= 0
    if window is not None:
        visible &= delta < window
    return visible


class Attention(torch.nn.Module):
    """The attention block of one decoder layer on one TP rank.

    The rank's heads are read off the parameter shapes: ``o_proj`` has ``q_local * head_dim``
    input columns and ``qkv_proj`` has ``(q_local + 2 * kv_local) * head_dim`` output rows
    (``kv_local`` is 1 when the KV heads are replicated over more ranks than there are).

    Args:
        qkv_proj: fused ``[q; k; v]`` projection of this rank's heads.
        o_proj: row-parallel output projection.
        q_norm: per-head RMSNorm of the queries before RoPE (qwen3), or ``None``.
        k_norm: per-head RMSNorm of the keys before RoPE (qwen3), or ``None``.
        head_dim: size of one head.
        window: sliding window of this layer in tokens, or ``None``.
    """

    def __init__(
        self,
        *,
        qkv_proj: ColumnParallelLinear,
        o_proj: RowParallelLinear,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        head_dim: int,
        window: int | None,
    ) -> None:
        super().__init__()
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.head_dim = head_dim
        self.window = window
        self.num_q_heads = o_proj.weight.shape[1] // head_dim
        num_qkv_heads = qkv_proj.weight.shape[0] // head_dim
        self.num_kv_heads = (num_qkv_heads - self.num_q_heads) // 2
        if (
            self.num_q_heads * head_dim != o_proj.weight.shape[1]
            or self.num_q_heads + 2 * self.num_kv_heads != num_qkv_heads
            or self.num_kv_heads < 1
            or self.num_q_heads % self.num_kv_heads
        ):
            raise ValueError(
                f"qkv_proj {tuple(qkv_proj.weight.shape)} and o_proj "
                f"{tuple(o_proj.weight.shape)} do not make whole heads of size {head_dim}"
            )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache | None,
    ) -> torch.Tensor:
        """Attend ``x`` ``[num_tokens, hidden]`` at ``positions``; returns ``[num_tokens, hidden]``.

        With a cache, the new keys and values are stored at ``positions`` and the queries
        attend to every cached position up to their own; without one, the tokens attend to
        each other only.
        """
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_q_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = rotary
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            key_positions = positions
        else:
            k, v = cache.store(k, v, positions)
            key_positions = torch.arange(k.shape[0], device=positions.device)
        mask = None
        if num_tokens > 1 or self.window is not None:
            mask = attention_mask(positions, key_positions, self.window)
        # SDPA wants [heads, tokens, head_dim]; enable_gqa shares each KV head among its group
        # of query heads, the same grouping as HF's repeat_kv.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=self.num_q_heads != self.num_kv_heads,
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(num_tokens, q_size))
