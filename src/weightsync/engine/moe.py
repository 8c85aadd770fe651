"""Sparse mixture-of-experts blocks: a router, the local experts and (DeepSeek) the shared
experts, combined with one all-reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightsync.engine.fp8 import weight_in
from weightsync.engine.linear import as_compute
from weightsync.engine.mlp import MLP
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


class GroupedTopkRouter(torch.nn.Module):
    """DeepSeek-V3's router (``noaux_tc``), replicated on every rank.

    Sigmoid scores of every expert; the correction bias is added for choosing only: the
    ``topk_group`` groups of experts with the highest sums of their two best biased scores
    are kept, and the ``top_k`` best biased scores among them chosen. The chosen experts'
    unbiased scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``,
    weigh their outputs (transformers' DeepseekV3TopkRouter, SGLang's biased grouped top-k).

    Args:
        weight: ``[num_experts, hidden]``.
        e_score_correction_bias: ``[num_experts]`` (float32 in SGLang's layout).
        top_k: experts per token.
        n_group: groups the experts are split into, in order.
        topk_group: groups a token's experts may come from.
        norm_topk_prob: renormalise the chosen experts' scores to sum to one.
        routed_scaling_factor: what the routing weights are multiplied by.

    Raises:
        ValueError: the groups do not split the experts into groups of at least two, or
            ``top_k`` / ``topk_group`` are out of range.
    """

    def __init__(
        self,
        weight: torch.nn.Parameter,
        e_score_correction_bias: torch.nn.Parameter,
        *,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        num_experts = weight.shape[0]
        if n_group < 1 or num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(
                f"n_group={n_group} must split num_experts={num_experts} into groups of at "
                "least two experts (a group's score is its two best experts')"
            )
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        if not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(
                f"top_k={top_k} must be in [1, {topk_group * (num_experts // n_group)}] (the "
                f"experts of topk_group={topk_group} groups)"
            )
        self.weight = weight
        self.e_score_correction_bias = e_score_correction_bias
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``x`` ``[num_tokens, hidden]``.

        Returns:
            ``(weights, experts)``, both ``[num_tokens, top_k]``: routing weights in ``x``'s
            dtype and global expert indices.
        """
        num_tokens, num_experts = x.shape[0], self.weight.shape[0]
        logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32))
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias.to(torch.float32)
        grouped = biased.view(num_tokens, self.n_group, num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        biased = biased.masked_fill(expert_mask == 0, float("-inf"))
        experts = torch.topk(biased, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            # transformers' and SGLang's epsilon, so an all-zero row stays finite.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling_factor).to(x.dtype), experts


class Experts(torch.nn.Module):
    """This rank's experts and, of each, its MoE-TP slice of the intermediate dim.

    The rank holds routed experts ``[ep_rank * E_local, (ep_rank + 1) * E_local)`` and, when
    DeepSeek's shared experts are fused into them (SGLang's default for DeepSeek-V3 on
    NVIDIA GPUs, ``--enforce-shared-experts-fusion``), the shared expert(s) as its last
    ``num_fused_shared_experts`` slots, on every EP rank. Of each, the ``[gate; up]`` rows and
    ``down`` columns of its ``moe_tp_rank``. Its output is a partial sum: the caller adds up
    all ranks' outputs.

    Args:
        w13_weight: ``[E_local + num_fused_shared_experts, 2 * I / moe_tp_size, hidden]``.
        w2_weight: ``[E_local + num_fused_shared_experts, hidden, I / moe_tp_size]``.
        ep_rank: which block of routed experts this rank holds.
        ep_size: how many EP ranks share the routed experts (each also holds the fused shared
            slots).
        num_fused_shared_experts: shared experts held as the last slots (0: none fused).
        w13_weight_scale_inv: block-FP8 scales of ``w13_weight``, or ``None``.
        w2_weight_scale_inv: block-FP8 scales of ``w2_weight``, or ``None``.
        block: the FP8 block size (with the scales).

    Raises:
        ValueError: no routed expert slot is left beside the fused shared ones.
    """

    def __init__(
        self,
        w13_weight: torch.nn.Parameter,
        w2_weight: torch.nn.Parameter,
        *,
        ep_rank: int,
        ep_size: int = 1,
        num_fused_shared_experts: int = 0,
        w13_weight_scale_inv: torch.nn.Parameter | None = None,
        w2_weight_scale_inv: torch.nn.Parameter | None = None,
        block: int = 0,
    ) -> None:
        super().__init__()
        num_local_routed = w13_weight.shape[0] - num_fused_shared_experts
        if num_local_routed < 1:
            raise ValueError(
                f"w13_weight holds {w13_weight.shape[0]} expert slots, not more than "
                f"num_fused_shared_experts={num_fused_shared_experts}"
            )
        self.w13_weight = w13_weight
        self.w2_weight = w2_weight
        self.w13_weight_scale_inv = w13_weight_scale_inv
        self.w2_weight_scale_inv = w2_weight_scale_inv
        self.block = block
        self.num_local_routed = num_local_routed
        self.num_routed_experts = num_local_routed * ep_size
        self.first_expert = ep_rank * num_local_routed
        self.ep_size = ep_size
        self.num_fused_shared_experts = num_fused_shared_experts

    def with_fused_shared(
        self, weights: torch.Tensor, experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the fused shared experts to every token's routing, as SGLang's top-k does.

        Shared expert ``s`` is global expert ``num_routed_experts + s``, chosen for every
        token. Its weight is 1 (the router's weights already carry
        ``routed_scaling_factor``, which the shared output must not get; SGLang gives the
        slot ``1 / routed_scaling_factor`` when it scales after the experts instead), over
        ``ep_size``: every EP rank holds the slot and computes it for every token, and the
        reduction over the ranks sums those copies (SGLang's
        ``fused_shared_experts_scaling_factor``). A no-op without fused shared experts.

        Args:
            weights: ``[num_tokens, top_k]`` routing weights.
            experts: ``[num_tokens, top_k]`` global routed expert ids.

        Returns:
            ``(weights, experts)``, ``[num_tokens, top_k + num_fused_shared_experts]``.
        """
        if not self.num_fused_shared_experts:
            return weights, experts
        num_tokens, count = experts.shape[0], self.num_fused_shared_experts
        shared_ids = torch.arange(count, device=experts.device) + self.num_routed_experts
        shared_weights = torch.full(
            (num_tokens, count), 1.0 / self.ep_size, dtype=weights.dtype, device=weights.device
        )
        return (
            torch.cat([weights, shared_weights], dim=1),
            torch.cat([experts, shared_ids.expand(num_tokens, count)], dim=1),
        )

    def _local_slots(self, experts: torch.Tensor) -> torch.Tensor:
        """Each global expert id's slot on this rank, or -1 where this rank does not hold it."""
        local = experts - self.first_expert
        local = local.masked_fill((local < 0) | (local >= self.num_local_routed), -1)
        if self.num_fused_shared_experts:
            shared = experts >= self.num_routed_experts
            local = torch.where(
                shared, experts - self.num_routed_experts + self.num_local_routed, local
            )
        return local

    def _expert(self, weight: torch.Tensor, scale: torch.Tensor | None, index: int, x):
        return weight_in(
            weight[index], None if scale is None else scale[index], self.block, x.dtype
        )

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """This rank's share of the experts' weighted outputs, ``[num_tokens, hidden]``.

        ``experts`` are global ids (fused shared slots included, see `with_fused_shared`);
        ids this rank does not hold contribute nothing here.
        """
        out = torch.zeros_like(x)
        local = self._local_slots(experts)
        for index in range(self.w13_weight.shape[0]):
            token_ids, slot = torch.where(local == index)
            if token_ids.numel() == 0:
                continue
            w13 = self._expert(self.w13_weight, self.w13_weight_scale_inv, index, x)
            w2 = self._expert(self.w2_weight, self.w2_weight_scale_inv, index, x)
            gate, up = F.linear(x[token_ids], w13).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, w2)
            out.index_add_(0, token_ids, expert_out * weights[token_ids, slot, None])
        return out


class SparseMoE(torch.nn.Module):
    """Router, then every rank's local experts (and the shared experts), combined with one
    all-reduce over TP.

    Args:
        gate: the router (SGLang's ``mlp.gate``).
        experts: this rank's experts.
        tp_group: all TP ranks of the replica (``ep_size * moe_tp_size`` of them).
        shared_experts: DeepSeek's shared experts, every token's dense MLP, split over the
            whole TP group; ``None`` for models without and when they are fused into
            ``experts``.
    """

    def __init__(
        self,
        gate: Router | GroupedTopkRouter,
        experts: Experts,
        tp_group: TensorParallelGroup,
        shared_experts: MLP | None = None,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.tp_group = tp_group
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``, equal on every rank."""
        weights, experts = self.experts.with_fused_shared(*self.gate(x))
        out = self.experts(x, weights, experts)
        if self.shared_experts is not None:
            # Both are partial sums over the TP ranks: one all-reduce serves them (SGLang's
            # shared experts do not reduce their own output either).
            out = out + self.shared_experts.partial(x)
        return self.tp_group.all_reduce(out)
