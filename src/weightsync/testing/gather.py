"""`gather_hf_state`: the full HF tensors of a sharded trainer, assembled from every rank's
boxes, for tests and the demo to build a reference model (a collective; never part of a
sync)."""

from __future__ import annotations

from typing import Any

import torch

from weightsync.export.base import WeightExport


def gather_hf_state(
    export: WeightExport, group: Any, *, dst: int = 0
) -> dict[str, torch.Tensor] | None:
    """Every rank's boxes sent to rank `dst` and pasted into full tensors there.

    Returns:
        ``{hf_name: full tensor}`` on rank `dst` (CPU copies), None on the other ranks.

    Raises:
        ValueError: the boxes leave elements of a tensor unheld.
    """
    import torch.distributed as dist

    holding = export.holding()
    mine = [
        (name, holding[name].shape, holding[name].held_box, tensor.detach().cpu().clone())
        for name, tensor in export
    ]
    rank = dist.get_rank(group)
    gathered: list[Any] = [None] * dist.get_world_size(group) if rank == dst else None
    dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, dst), group=group)
    if rank != dst:
        return None
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for pieces in gathered:
        for name, shape, box, tensor in pieces:
            if name not in full:
                full[name] = torch.empty(shape, dtype=tensor.dtype)
                filled[name] = torch.zeros(shape, dtype=torch.bool)
            index = tuple(slice(a, b) for a, b in box)
            full[name][index] = tensor
            filled[name][index] = True
    unheld = [name for name, mask in filled.items() if not bool(mask.all())]
    if unheld:
        raise ValueError(f"no rank holds some elements of HF tensors {unheld[:5]}")
    return full
