"""A plain block-FP8 quantiser to check the sender's against: one block at a time, written
from DeepGEMM's ``per_block_cast_to_fp8`` (``use_ue8m0=False``) and nothing of weightsync."""

from __future__ import annotations

import torch


def reference_quantize(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 codes, float32 scales)`` of a 2-D or stacked 3-D weight, block by block."""
    if weight.dim() == 3:
        pairs = [reference_quantize(w, block) for w in weight]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // block), -(-cols // block)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(row_blocks, col_blocks, dtype=torch.float32)
    x = weight.detach().cpu().float()
    for i in range(row_blocks):
        for j in range(col_blocks):
            tile = x[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = torch.clamp(tile.abs().max(), min=1e-4)
            scale = amax / 448.0
            scales[i, j] = scale
            codes[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                tile * (1.0 / scale)
            ).to(torch.float8_e4m3fn)
    return codes, scales
