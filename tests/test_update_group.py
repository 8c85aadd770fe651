"""The weights update group is stand-alone: it forms beside a default group that is bound to
a device (as a replica's is) and leaves that binding as it was."""

from __future__ import annotations

from typing import Any

import torch

from process_group import run_in_process_group


def _join(rank: int, group: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from weightsync.baseline.update_group import (
        create_store,
        destroy_custom_process_group,
        init_custom_process_group,
    )

    # Rank 0 hosts the update group's own store; the others learn its port over the world.
    store = None
    if rank == 0:
        store = create_store("127.0.0.1", 0, world_size=2, rank=0, timeout_s=60.0)
    box = [store.port if store is not None else None]
    dist.broadcast_object_list(box, src=0, group=group)
    if store is None:
        store = create_store("127.0.0.1", box[0], world_size=2, rank=rank, timeout_s=60.0)
    # A replica binds its GPU to the default group; torch then splits new NCCL groups from
    # it. The binding is all that decides that, so a gloo world stands in here.
    group.bound_device_id = torch.device("cuda", rank)
    update = init_custom_process_group(
        backend="gloo", store=store, world_size=2, rank=rank, group_name="wu", timeout_s=60.0
    )
    value = torch.full((4,), float(rank + 7))
    dist.broadcast(value, group=update, group_src=0)
    result = {
        "value": value.tolist(),
        "size": update.size(),
        "rank": update.rank(),
        "bound_after": str(group.bound_device_id),
    }
    destroy_custom_process_group(update)
    group.bound_device_id = None
    return result


def test_update_group_forms_beside_a_bound_default_group():
    results = run_in_process_group(2, _join)
    for rank, result in enumerate(results):
        assert result["value"] == [7.0] * 4
        assert result["size"] == 2 and result["rank"] == rank
        assert result["bound_after"] == f"cuda:{rank}"
