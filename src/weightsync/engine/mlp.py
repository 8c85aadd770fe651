"""The dense SwiGLU MLP: fused gate/up projection, SiLU(gate) * up, row-parallel down."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightsync.engine.linear import ColumnParallelLinear, RowParallelLinear


class MLP(torch.nn.Module):
    """``down(SiLU(gate(x)) * up(x))`` over this rank's slice of the intermediate dim.

    Args:
        gate_up_proj: ``[gate; up]`` rows of this rank, ``[2 * I / tp_size, hidden]``.
        down_proj: this rank's input columns of the down projection, summed over ranks.
    """

    def __init__(self, gate_up_proj: ColumnParallelLinear, down_proj: RowParallelLinear):
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``, equal on every rank."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of `forward`'s result, before the all-reduce over TP."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj.partial(F.silu(gate) * up)
