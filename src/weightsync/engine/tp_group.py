"""The tensor-parallel group's collectives, as the forward pass and generation use them."""

from __future__ import annotations

import torch
import torch.distributed as dist


class TensorParallelGroup:
    """One replica's TP ranks; every collective is a no-op at ``tp_size == 1``.

    Every rank of the group must call the same collectives in the same order, which the
    forward pass does by construction: the same layers run on every rank.

    Args:
        group: the torch.distributed process group of the replica's TP ranks (gloo for CPU
            tensors, NCCL for CUDA tensors), or ``None``. Its group ranks must be the TP ranks.
        tp_size: the TP size of the parallelism config.
        tp_rank: this rank's TP rank.

    Raises:
        ValueError: the group's size or this process's rank in it disagree with
            ``tp_size`` / ``tp_rank``.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, tp_size: int, tp_rank: int) -> None:
        if group is not None:
            group_size, group_rank = dist.get_world_size(group), dist.get_rank(group)
            if (group_size, group_rank) != (tp_size, tp_rank):
                raise ValueError(
                    f"process group has size {group_size} and this process is its rank "
                    f"{group_rank}, but the parallelism config says tp_size={tp_size}, "
                    f"tp_rank={tp_rank}"
                )
        self.group = group
        self.tp_size = tp_size
        self.tp_rank = tp_rank

    @property
    def can_communicate(self) -> bool:
        """Whether collectives over the TP ranks are possible (a group, or one rank only)."""
        return self.tp_size == 1 or self.group is not None

    def check_can_communicate(self) -> None:
        """Raise unless a forward pass can run.

        Raises:
            ValueError: ``tp_size > 1`` and no process group was given.
        """
        if not self.can_communicate:
            raise ValueError(
                f"tp_size={self.tp_size} needs a process group over the TP ranks to run a "
                "forward pass; pass group= to ReferenceModel"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP ranks, in place; returns ``x``."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, in TP-rank order."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite ``x`` on every rank with TP rank 0's ``x``, in place; returns ``x``."""
        if self.tp_size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x
