"""Column- and row-parallel linear layers.

Which rows or columns of a full HF matrix a rank holds (fused ``[q; k; v]`` of its heads,
``[gate; up]``, a slice of the input dim) is the layout's rule; these layers only multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightsync.engine.fp8 import weight_in
from weightsync.engine.tp_group import TensorParallelGroup


def as_compute(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """`weight` in the dtype of the activations `x` (a no-op when they already agree).

    Parameters keep the dtype the rollout publishes (the bytes a sync writes); the engine
    may compute in a wider dtype, e.g. float32 on CPU.
    """
    if weight is None or weight.dtype == x.dtype:
        return weight
    return weight.to(x.dtype)


class ColumnParallelLinear(torch.nn.Module):
    """``y = x W^T (+ b)`` with this rank's output rows; the outputs stay sharded.

    Args:
        weight: ``[out_local, in]``.
        bias: ``[out_local]`` or ``None``.
        weight_scale_inv: a block-FP8 weight's float32 block scales, or ``None``.
        block: the FP8 block size (with ``weight_scale_inv``).
    """

    def __init__(
        self,
        weight: torch.nn.Parameter,
        bias: torch.nn.Parameter | None = None,
        *,
        weight_scale_inv: torch.nn.Parameter | None = None,
        block: int = 0,
    ):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.weight_scale_inv = weight_scale_inv
        self.block = block

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (dequantised when it is FP8)."""
        return weight_in(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out_local]``."""
        return F.linear(x, self.dense_weight(x.dtype), as_compute(self.bias, x))


class RowParallelLinear(torch.nn.Module):
    """``y = x W^T`` over this rank's input columns, summed over the TP ranks.

    Args:
        weight: ``[out, in_local]``.
        tp_group: the group whose ranks hold the other input columns.
        weight_scale_inv: a block-FP8 weight's float32 block scales, or ``None``.
        block: the FP8 block size (with ``weight_scale_inv``).
    """

    def __init__(
        self,
        weight: torch.nn.Parameter,
        tp_group: TensorParallelGroup,
        *,
        weight_scale_inv: torch.nn.Parameter | None = None,
        block: int = 0,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.tp_group = tp_group
        self.weight_scale_inv = weight_scale_inv
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_local]`` (this rank's shard) -> the full ``[..., out]``."""
        return self.tp_group.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum `forward` returns (no all-reduce), for a caller that
        adds several partial sums before reducing them once."""
        return F.linear(x, weight_in(self.weight, self.weight_scale_inv, self.block, x.dtype))
