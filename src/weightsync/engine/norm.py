"""RMSNorm, computed in float32 like the HF reference."""

from __future__ import annotations

import torch

from weightsync.engine.linear import as_compute


class RMSNorm(torch.nn.Module):
    """Root-mean-square normalisation over the last dim, scaled by ``weight``.

    Args:
        weight: the scale, shape ``[dim]`` (replicated on every TP rank).
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` ``[..., dim]``; the result has ``x``'s dtype."""
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return as_compute(self.weight, x) * x32.to(input_dtype)
