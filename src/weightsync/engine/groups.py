"""Which ranks each part of the forward pass splits over, as SGLang groups them.

Without DP attention every part splits over the replica's whole TP group. With it
(``attn_dp_size > 1``), the TP ranks form ``attn_dp_size`` attention-DP groups of
``attn_tp_size`` consecutive ranks: attention and ``embed_tokens`` split over the ranks of one
group and are replicated across groups, while the MoE (routed and shared experts) stays split
over the whole TP group; ``lm_head`` follows the attention group only with
``enable_dp_lm_head``. ``moe_dense_tp_size == 1`` replicates the dense MLP layers on every rank.

Every attention-DP group runs attention for every token of the batch (the groups compute the
same rows; SGLang gives each group its own requests), so the MoE's input is the same on every
rank and its partial sums reduce over the whole TP group as they do without DP attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from weightsync.engine.tp_group import TensorParallelGroup
from weightsync.layout.parallelism import ParallelismConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelGroups:
    """The group each part of one rank's forward pass reduces or gathers over.

    Attributes:
        tp: the replica's whole TP group (routed and shared experts, generation's broadcast).
        attention: the rank's attention-TP group (attention, ``embed_tokens``); ``tp`` itself
            without DP attention.
        dense_mlp: the dense MLP layers' group: ``tp``, or this rank alone when
            ``moe_dense_tp_size`` is 1.
        lm_head: an untied ``lm_head``'s group: ``attention`` with ``enable_dp_lm_head``,
            ``tp`` otherwise.
    """

    tp: TensorParallelGroup
    attention: TensorParallelGroup
    dense_mlp: TensorParallelGroup
    lm_head: TensorParallelGroup

    @property
    def can_communicate(self) -> bool:
        """Whether every group can run its collectives."""
        return self.tp.can_communicate and self.attention.can_communicate

    def check_can_communicate(self) -> None:
        """Raise unless a forward pass can run.

        Raises:
            ValueError: a group of more than one rank has no process group.
        """
        self.tp.check_can_communicate()
        self.attention.check_can_communicate()


def single_rank_group() -> TensorParallelGroup:
    """A group of this rank alone: its linears hold whole weights and reduce nothing."""
    return TensorParallelGroup(None, tp_size=1, tp_rank=0)


def _attention_group(
    group: dist.ProcessGroup | None, parallelism: ParallelismConfig
) -> TensorParallelGroup:
    attn_tp_size, attn_tp_rank = parallelism.attn_tp_size, parallelism.attn_tp_rank
    if attn_tp_size == 1 or group is None:
        # Without a group no forward pass runs at tp_size > 1 anyway (`check_can_communicate`).
        return TensorParallelGroup(None, tp_size=attn_tp_size, tp_rank=attn_tp_rank)
    ranks = dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    own = None
    # new_group is collective over the default group: every rank creates every attention-DP
    # group, in the same order, and keeps its own.
    for dp_rank in range(parallelism.attn_dp_size):
        members = ranks[dp_rank * attn_tp_size : (dp_rank + 1) * attn_tp_size]
        subgroup = dist.new_group(members, backend=backend)
        if dp_rank == parallelism.attn_dp_rank:
            own = subgroup
    return TensorParallelGroup(own, tp_size=attn_tp_size, tp_rank=attn_tp_rank)


def model_groups(group: dist.ProcessGroup | None, parallelism: ParallelismConfig) -> ModelGroups:
    """The groups of one rank of a replica.

    Call protocol: with DP attention and a process group, every process of the default
    process group calls this with its own parallelism, at the same point (it creates the
    attention-DP groups, a collective over the default group).

    Args:
        group: the replica's TP process group, in TP-rank order, or ``None``.
        parallelism: this rank's parallelism config.

    Raises:
        ValueError: the group's size or this process's rank in it disagree with
            ``tp_size`` / ``tp_rank``.
    """
    tp = TensorParallelGroup(group, tp_size=parallelism.tp_size, tp_rank=parallelism.tp_rank)
    attention = tp if parallelism.attn_dp_size == 1 else _attention_group(group, parallelism)
    dense_mlp = single_rank_group() if parallelism.moe_dense_tp_size == 1 else tp
    lm_head = attention if parallelism.enable_dp_lm_head else tp
    return ModelGroups(tp=tp, attention=attention, dense_mlp=dense_mlp, lm_head=lm_head)
