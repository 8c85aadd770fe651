"""Multi-head latent attention (DeepSeek-V3, Kimi-K2) over this rank's heads, absorbed as
SGLang's decode path runs it.

Per token, ``kv_a_proj_with_mqa`` makes a kv latent (``kv_lora_rank``, normalised by
``kv_a_layernorm``) and one rope key shared by every head (``qk_rope_head_dim``); the cache
keeps only those (`LatentCache`). ``kv_b_proj`` would expand the latent into each head's
``k_nope`` and ``v``; instead its two halves are folded into the query and the output: a
head's ``q_nope`` goes through ``w_kc`` into latent space, attends over the cached latents and
rope keys, and its latent output goes through ``w_vc`` to ``v_head_dim``. ``w_kc`` / ``w_vc``
are derived from ``kv_b_proj`` by `MLAttention.post_load`, as SGLang's ``post_load_weights``
derives them, and must be derived again whenever ``kv_b_proj``'s bytes change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightsync.engine.attention import attention_mask
from weightsync.engine.cache import LatentLayerCache
from weightsync.engine.linear import ColumnParallelLinear, RowParallelLinear, as_compute
from weightsync.engine.norm import RMSNorm
from weightsync.engine.rotary import apply_rotary, apply_rotary_interleaved
from weightsync.engine.spec import MlaSpec


def derive_w_kc_w_vc(
    kv_b_weight: torch.Tensor, *, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_kc`` and ``w_vc`` of ``kv_b_proj.weight`` ``[heads * (nope + v), kv_lora_rank]``,
    with SGLang's values, shapes and strides (bf16 / float32 branch of
    ``DeepseekV2WeightLoaderMixin.post_load_weights``).

    Returns:
        ``w_kc`` ``[heads, qk_nope_head_dim, kv_lora_rank]`` whose memory is each head's
        k_nope rows transposed (strides ``(nope * rank, 1, nope)``), and ``w_vc``
        ``[heads, kv_lora_rank, v_head_dim]`` whose memory is each head's v rows as they are
        (strides ``(v * rank, 1, rank)``); both new tensors in the weight's dtype.
    """
    w_kc, w_vc = kv_b_weight.unflatten(0, (-1, qk_nope_head_dim + v_head_dim)).split(
        [qk_nope_head_dim, v_head_dim], dim=1
    )
    return w_kc.transpose(1, 2).contiguous().transpose(1, 2), w_vc.contiguous().transpose(1, 2)


class MLAttention(torch.nn.Module):
    """The MLA block of one decoder layer on one TP rank, with SGLang's parameter names.

    Give either ``fused_qkv_a_proj_with_mqa``, ``q_a_layernorm`` and ``q_b_proj`` (with
    ``q_lora_rank``) or ``q_proj`` and ``kv_a_proj_with_mqa`` (without). The rank's heads are
    read off ``o_proj``'s input columns (``heads * v_head_dim``).

    Call protocol: after the parameters are loaded, and after every later change of
    ``kv_b_proj``'s bytes, call `post_load` before the next forward pass; until then the
    attention computes with the previous ``w_kc`` / ``w_vc`` (zeros before the first call).

    Args:
        kv_b_proj: column-parallel ``[k_nope; v]`` rows of this rank's heads.
        o_proj: row-parallel output projection.
        kv_a_layernorm: RMSNorm of the kv latent.
        spec: MLA's sizes, softmax scale and RoPE layout.
        fused_qkv_a_proj_with_mqa: replicated ``[q_a_proj; kv_a_proj_with_mqa]``, or ``None``.
        q_a_layernorm: RMSNorm of the q latent, or ``None``.
        q_b_proj: column-parallel query rows of this rank's heads, or ``None``.
        q_proj: column-parallel query rows of this rank's heads (no q_lora), or ``None``.
        kv_a_proj_with_mqa: replicated kv down-projection (no q_lora), or ``None``.

    Raises:
        ValueError: neither or both sets of query projections, or shapes that do not make
            whole heads of the spec's sizes.
    """

    def __init__(
        self,
        *,
        kv_b_proj: ColumnParallelLinear,
        o_proj: RowParallelLinear,
        kv_a_layernorm: RMSNorm,
        spec: MlaSpec,
        fused_qkv_a_proj_with_mqa: ColumnParallelLinear | None = None,
        q_a_layernorm: RMSNorm | None = None,
        q_b_proj: ColumnParallelLinear | None = None,
        q_proj: ColumnParallelLinear | None = None,
        kv_a_proj_with_mqa: ColumnParallelLinear | None = None,
    ) -> None:
        super().__init__()
        lora = (fused_qkv_a_proj_with_mqa, q_a_layernorm, q_b_proj)
        plain = (q_proj, kv_a_proj_with_mqa)
        with_lora = all(m is not None for m in lora) and all(m is None for m in plain)
        without_lora = all(m is None for m in lora) and all(m is not None for m in plain)
        if not (with_lora or without_lora):
            raise ValueError(
                "MLAttention needs fused_qkv_a_proj_with_mqa, q_a_layernorm and q_b_proj "
                "(q_lora_rank set) or q_proj and kv_a_proj_with_mqa (no q_lora_rank)"
            )
        if with_lora:
            self.fused_qkv_a_proj_with_mqa = fused_qkv_a_proj_with_mqa
            self.q_a_layernorm = q_a_layernorm
            self.q_b_proj = q_b_proj
            self.q_lora_rank = q_a_layernorm.weight.shape[0]
        else:
            self.q_proj = q_proj
            self.kv_a_proj_with_mqa = kv_a_proj_with_mqa
            self.q_lora_rank = None
        self.kv_b_proj = kv_b_proj
        self.o_proj = o_proj
        self.kv_a_layernorm = kv_a_layernorm
        self.spec = spec
        self.num_heads = o_proj.weight.shape[1] // spec.v_head_dim
        q_rows = (q_b_proj if with_lora else q_proj).weight.shape[0]
        qk_head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        kv_b_rows = self.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        if (
            self.num_heads < 1
            or self.num_heads * spec.v_head_dim != o_proj.weight.shape[1]
            or q_rows != self.num_heads * qk_head_dim
            or tuple(kv_b_proj.weight.shape) != (kv_b_rows, spec.kv_lora_rank)
        ):
            raise ValueError(
                f"o_proj {tuple(o_proj.weight.shape)}, q rows {q_rows} and kv_b_proj "
                f"{tuple(kv_b_proj.weight.shape)} do not make whole MLA heads of {spec}"
            )
        # Plain attributes, not parameters or buffers, as in SGLang: no sync writes them and no
        # weights checker sees them. Allocated once with SGLang's strides; post_load refills
        # them in place, as its bind_or_assign does after the first load.
        # An FP8 kv_b_proj gives w_kc / w_vc dequantised, in the model dtype (SGLang's
        # block-FP8 branch: bf16); the norms are never quantised.
        self.derived_dtype = kv_a_layernorm.weight.dtype
        weight = kv_b_proj.weight
        w_kc, w_vc = derive_w_kc_w_vc(
            torch.zeros(weight.shape, dtype=self.derived_dtype, device=weight.device),
            qk_nope_head_dim=spec.qk_nope_head_dim,
            v_head_dim=spec.v_head_dim,
        )
        self.w_kc = w_kc
        self.w_vc = w_vc

    @torch.no_grad()
    def post_load(self) -> None:
        """Derive ``w_kc`` / ``w_vc`` from ``kv_b_proj``'s current bytes, in place (an FP8
        ``kv_b_proj`` dequantised first, as SGLang's ``post_load_weights`` does)."""
        w_kc, w_vc = derive_w_kc_w_vc(
            self.kv_b_proj.dense_weight(self.derived_dtype),
            qk_nope_head_dim=self.spec.qk_nope_head_dim,
            v_head_dim=self.spec.v_head_dim,
        )
        self.w_kc.copy_(w_kc)
        self.w_vc.copy_(w_vc)

    def _rotate(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rotary
        if self.spec.rope_interleave:
            return apply_rotary_interleaved(x, cos, sin)
        return apply_rotary(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: LatentLayerCache | None,
    ) -> torch.Tensor:
        """Attend ``x`` ``[num_tokens, hidden]`` at ``positions``; returns ``[num_tokens, hidden]``.

        With a cache, the new tokens' latents and rope keys are stored at ``positions`` and
        the queries attend to every cached position up to their own; without one, the tokens
        attend to each other only.
        """
        spec = self.spec
        num_tokens = x.shape[0]
        rank, rope_dim = spec.kv_lora_rank, spec.qk_rope_head_dim
        if self.q_lora_rank is not None:
            q_latent, kv_latent = self.fused_qkv_a_proj_with_mqa(x).split(
                [self.q_lora_rank, rank + rope_dim], dim=-1
            )
            q = self.q_b_proj(self.q_a_layernorm(q_latent))
        else:
            q = self.q_proj(x)
            kv_latent = self.kv_a_proj_with_mqa(x)
        q = q.view(num_tokens, self.num_heads, spec.qk_nope_head_dim + rope_dim)
        q_nope, q_rope = q.split([spec.qk_nope_head_dim, rope_dim], dim=-1)
        latent, k_rope = kv_latent.split([rank, rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = self._rotate(q_rope, rotary)
        k_rope = self._rotate(k_rope[:, None, :], rotary)[:, 0]
        entries = torch.cat([latent, k_rope], dim=-1)
        if cache is None:
            key_positions = positions
        else:
            entries = cache.store(entries, positions)
            key_positions = torch.arange(entries.shape[0], device=positions.device)
        # q_nope through w_kc: [heads, tokens, nope] x [heads, nope, rank] -> latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), as_compute(self.w_kc, x))
        query = torch.cat([q_latent, q_rope.transpose(0, 1)], dim=-1)
        mask = attention_mask(positions, key_positions, None) if num_tokens > 1 else None
        # One key/value head shared by every query head (MQA over the latents): the key is
        # the whole entry, the value its latent part.
        out = F.scaled_dot_product_attention(
            query[None],
            entries[None, None],
            entries[None, None, :, :rank],
            attn_mask=mask,
            scale=spec.softmax_scale,
            enable_gqa=True,
        )[0]
        out = torch.bmm(out, as_compute(self.w_vc, x))  # [heads, tokens, v_head_dim]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, -1))
