"""A torch.distributed group between trainer and rollout ranks, beside each process's own.

The broadcast baseline (SGLang's ``init_weights_update_group``) joins trainer rank 0 and every
rank of every replica into one group. Each of those processes already has a default process
group (the trainer's ranks, the replica's TP ranks), and ``init_process_group`` cannot be
called twice, so the group is built the way SGLang's ``init_custom_process_group`` builds it:
a rendezvous store of its own (hosted by group rank 0), prefixed by the group name, and
``_new_process_group_helper`` with no global ranks, which makes a stand-alone group. Its
ranks are its own (0..world_size-1); collectives on it take ``group_src`` / ``group_dst``.

Stand-alone also for NCCL: when the process's default group is bound to a device (a replica
binds each rank's GPU), torch builds every new NCCL group by splitting the default group's
communicator (``ncclCommSplit``), which can only make a group out of the default group's
own ranks, never one with the trainer. So while the group is made, the default group's
device binding is lifted, and NCCL creates a fresh communicator through the group's store.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _get_default_group,
    _new_process_group_helper,
    _world,
)

BACKENDS = ("gloo", "nccl")

# Held while the default group's device binding is lifted: no other group is made meanwhile.
_UNBIND_LOCK = threading.Lock()


def create_store(
    master_address: str, master_port: int, *, world_size: int, rank: int, timeout_s: float
) -> dist.TCPStore:
    """The group's rendezvous store: hosted by rank 0 (``master_port`` 0 picks a free port,
    read it back from ``store.port``), joined by the others.

    Raises:
        torch.distributed.DistNetworkError: the store could not be reached in time.
    """
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def init_custom_process_group(
    *,
    backend: str,
    store: dist.Store,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
    device: torch.device | None = None,
) -> dist.ProcessGroup:
    """Join a stand-alone process group of `world_size` processes; every member calls this
    with the same `group_name`, `world_size` and `backend`, and its own `rank`.

    Blocks until every member joined (or `timeout_s` passes).

    Args:
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        store: the rendezvous store (`create_store`), shared by every member.
        world_size: members of the group.
        rank: this process's rank in the group.
        group_name: the group's name; unique within the process.
        timeout_s: how long the rendezvous and each collective may wait.
        device: the CUDA device of an NCCL group's tensors (current while the group is
            made).

    Raises:
        ValueError: unknown backend, a rank outside the group, or a name already in use in
            this process.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    if group_name in _world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this process")
    timeout = timedelta(seconds=timeout_s)
    cuda = device is not None and device.type == "cuda"
    # No device_id: the group's NCCL communicator is made by its first collective, as
    # SGLang's and the trainers' groups do it, not eagerly here.
    with _default_group_unbound(), torch.cuda.device(device) if cuda else contextlib.nullcontext():
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            timeout=timeout,
        )
    # A stand-alone group: its ranks are the group ranks (torch looks them up here when a
    # collective names a global rank).
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@contextlib.contextmanager
def _default_group_unbound() -> Iterator[None]:
    """Lift the default group's device binding for the duration, so that a new NCCL group
    gets a communicator of its own instead of a split of the default group's."""
    with _UNBIND_LOCK:
        default = _get_default_group() if dist.is_initialized() else None
        bound = default.bound_device_id if default is not None else None
        if default is None or bound is None:
            yield
            return
        default.bound_device_id = None
        try:
            yield
        finally:
            default.bound_device_id = bound


def destroy_custom_process_group(group: dist.ProcessGroup) -> None:
    """Tear down a group made by `init_custom_process_group` (local; no collective)."""
    dist.destroy_process_group(group)
