"""Block-FP8 weights in the reference engine: dequantised per block where they are used.

An FP8 rollout's linear weights are e4m3 codes with a float32 ``weight_scale_inv`` per
``block x block`` block (`weightsync.layout.quant`). The engine multiplies with
``codes * scale`` of each element's block, computed from the parameters' current bytes at
every use (SGLang's ``block_quant_dequant``), so bytes a sync writes take effect at once and
nothing derived from them can go stale but what SGLang derives too (MLA's ``w_kc`` /
``w_vc``, refreshed by `weightsync.engine.mla.MLAttention.post_load`).
"""

from __future__ import annotations

import torch


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``codes`` (``[..., N, K]`` e4m3) times their blocks' ``scales``, in float32."""
    rows, cols = codes.shape[-2:]
    expanded = scales.repeat_interleave(block, -2).repeat_interleave(block, -1)
    return codes.float() * expanded[..., :rows, :cols]


def weight_in(
    weight: torch.Tensor, scale: torch.Tensor | None, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """`weight` for a product in `dtype`: dequantised when it has a block `scale`."""
    if scale is not None:
        return dequantize(weight, scale, block).to(dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)
