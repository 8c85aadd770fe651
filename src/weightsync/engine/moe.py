"""The sparse mixture-of-experts block (Qwen3-MoE): router, local experts, one all-reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightsync.engine.linear import as_compute
from weightsync.engine.tp_group import TensorParallelGroup


class Router(torch.nn.Module):
    """Softmax top-k routing over all experts (replicated on every rank).

    Args:
        weight: ``[num_experts, hidden]``.
        top_k: experts per token.
        norm_topk_prob: renormalise the chosen experts' probabilities to sum to one.
    """

    def __init__(self, weight: torch.nn.Parameter, *, top_k: int, norm_topk_prob: bool):
        super().__init__()
        if not 1 <= top_k <= weight.shape[0]:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={weight.shape[0]}]")
        self.weight = weight
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``x`` ``[num_tokens, hidden]``.

        Returns:
            ``(weights, experts)``, both ``[num_tokens, top_k]``: routing weights in ``x``'s
            dtype and global expert indices.
        """
        probs = torch.softmax(F.linear(x, as_compute(self.weight, x)), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(torch.nn.Module):
    """This rank's experts and, of each, its MoE-TP slice of the intermediate dim.

    The rank holds experts ``[ep_rank * E_local, (ep_rank + 1) * E_local)``; of each, the
    ``[gate; up]`` rows and ``down`` columns of its ``moe_tp_rank``. Its output is a partial
    sum: the caller adds up all ranks' outputs.

    Args:
        w13_weight: ``[E_local, 2 * I / moe_tp_size, hidden]``.
        w2_weight: ``[E_local, hidden, I / moe_tp_size]``.
        ep_rank: which block of experts this rank holds.
    """

    def __init__(
        self, w13_weight: torch.nn.Parameter, w2_weight: torch.nn.Parameter, *, ep_rank: int
    ) -> None:
        super().__init__()
        self.w13_weight = w13_weight
        self.w2_weight = w2_weight
        self.first_expert = ep_rank * w13_weight.shape[0]

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """This rank's share of the experts' weighted outputs, ``[num_tokens, hidden]``."""
        out = torch.zeros_like(x)
        local = experts - self.first_expert
        for index in range(self.w13_weight.shape[0]):
            token_ids, slot = torch.where(local == index)
            if token_ids.numel() == 0:
                continue
            gate, up = F.linear(x[token_ids], as_compute(self.w13_weight[index], x)).chunk(
                2, dim=-1
            )
            expert_out = F.linear(F.silu(gate) * up, as_compute(self.w2_weight[index], x))
            out.index_add_(0, token_ids, expert_out * weights[token_ids, slot, None])
        return out


class SparseMoE(torch.nn.Module):
    """Router, then every rank's local experts, combined with one all-reduce over TP.

    Args:
        gate: the router (SGLang's ``mlp.gate``).
        experts: this rank's experts.
        tp_group: all TP ranks of the replica (``ep_size * moe_tp_size`` of them).
    """

    def __init__(self, gate: Router, experts: Experts, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``, equal on every rank."""
        weights, experts = self.gate(x)
        return self.tp_group.all_reduce(self.experts(x, weights, experts))
