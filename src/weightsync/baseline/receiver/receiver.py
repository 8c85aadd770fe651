"""`BroadcastReceiver`: one rollout rank's side of the broadcast baseline.

The baseline is how verl's and slime's NCCL engines update SGLang: trainer rank 0 and every
rollout rank join one torch.distributed group (``init_weights_update_group``); per bucket the
trainer tells every replica what comes (``update_weights_from_distributed``: names, dtypes,
shapes) and broadcasts it; every rollout rank receives the whole bucket (full HF tensors, not
its shard), then loads it tensor by tensor through the engine's loader into its parameters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from weightsync.baseline.flat_bucket import FLATTENED_BUCKET, FlatBucketLayout
from weightsync.baseline.update_group import (
    create_store,
    destroy_custom_process_group,
    init_custom_process_group,
)
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.receiver.loader import load_hf_tensors
from weightsync.torch_dtypes import torch_dtype

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiveStats:
    """What one ``update_weights_from_distributed`` did on one rank.

    Attributes:
        num_tensors: tensors received.
        num_bytes: bytes received.
        receive_s: seconds in the broadcast (waiting for the trainer included).
        load_s: seconds loading the tensors into the parameters.
    """

    num_tensors: int
    num_bytes: int
    receive_s: float
    load_s: float


class BroadcastReceiver:
    """Holds a rank's weight-update groups and loads what is broadcast over them.

    Call protocol (every rank of the replica, in the same order, driven by rank 0's
    commands): `init_group` once per group (blocks until the trainer and every other member
    joined), `receive` once per bucket the trainer broadcasts, `destroy_group` at the end.

    Args:
        params: the rank's parameters by engine name; written in place.
        hf_config: the model's config.json dict.
        parallelism: the rank's parallelism config.
        device: where the parameters (and so the receive buffers) live.
        timeout_s: how long the rendezvous and each broadcast may wait.
    """

    def __init__(
        self,
        *,
        params: Mapping[str, torch.Tensor],
        hf_config: Any,
        parallelism: ParallelismConfig,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self._params = dict(params)
        self._hf_config = hf_config
        self._parallelism = parallelism
        self._device = device
        self._dtype = next(iter(self._params.values())).dtype
        self._timeout_s = timeout_s
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._stores: dict[str, dist.Store] = {}
        self._buffer: torch.Tensor | None = None

    @property
    def group_names(self) -> tuple[str, ...]:
        """The groups this rank belongs to."""
        return tuple(self._groups)

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> int:
        """Join group `group_name` as rank ``rank_offset + tp_rank``; return that rank.

        Raises:
            ValueError: a group of that name exists, the rank does not fit in `world_size`,
                or `backend` cannot carry this rank's tensors (``nccl`` on CPU, ``gloo`` on
                CUDA).
        """
        if group_name in self._groups:
            raise ValueError(
                f"weights update group {group_name!r} already exists on tp rank "
                f"{self._parallelism.tp_rank}; destroy it first"
            )
        expected = "nccl" if self._device.type == "cuda" else "gloo"
        if backend != expected:
            raise ValueError(
                f"backend {backend!r} cannot carry {self._device.type} tensors; this replica "
                f"needs backend {expected!r}"
            )
        rank = rank_offset + self._parallelism.tp_rank
        if rank_offset < 1 or rank >= world_size:
            raise ValueError(
                f"rank_offset={rank_offset} puts tp rank {self._parallelism.tp_rank} at rank "
                f"{rank} of a group of {world_size}; rank 0 is the trainer's"
            )
        store = create_store(
            master_address,
            master_port,
            world_size=world_size,
            rank=rank,
            timeout_s=self._timeout_s,
        )
        self._groups[group_name] = init_custom_process_group(
            backend=backend,
            store=store,
            world_size=world_size,
            rank=rank,
            group_name=group_name,
            timeout_s=self._timeout_s,
            device=self._device,
        )
        self._stores[group_name] = store
        logger.info("joined weights update group %s as rank %d of %d", group_name, rank, world_size)
        return rank

    def receive(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
    ) -> ReceiveStats:
        """Receive one broadcast from group rank 0 and load it into the parameters.

        With ``load_format="flattened_bucket"`` the tensors come as one buffer (see
        `FlatBucketLayout`); with ``None`` each tensor is its own broadcast, in order.

        Raises:
            ValueError: unknown group or load format, bad metadata, or a tensor that is not
                the model's (nothing is loaded from a bucket whose metadata is bad).
        """
        group = self._group(group_name)
        layout = FlatBucketLayout.from_metadata(names, dtypes, shapes)
        t0 = time.perf_counter()
        if load_format == FLATTENED_BUCKET:
            buffer = self._receive_buffer(layout.num_bytes)
            dist.broadcast(buffer, group=group, group_src=0)
            tensors = list(layout.views(buffer))
        elif load_format is None:
            tensors = []
            works = []
            for span in layout.spans:
                tensor = torch.empty(span.shape, dtype=torch_dtype(span.dtype), device=self._device)
                works.append(dist.broadcast(tensor, group=group, group_src=0, async_op=True))
                tensors.append((span.name, tensor))
            for work in works:
                work.wait()
        else:
            raise ValueError(
                f"load_format {load_format!r} is not supported; use {FLATTENED_BUCKET!r} or null"
            )
        t1 = time.perf_counter()
        load_hf_tensors(self._params, tensors, self._hf_config, self._parallelism, self._dtype)
        t2 = time.perf_counter()
        return ReceiveStats(
            num_tensors=len(layout.spans),
            num_bytes=sum(span.num_bytes for span in layout.spans),
            receive_s=t1 - t0,
            load_s=t2 - t1,
        )

    def destroy_group(self, group_name: str) -> None:
        """Leave group `group_name` and free the receive buffer.

        Raises:
            ValueError: no such group.
        """
        group = self._group(group_name)
        del self._groups[group_name]
        self._stores.pop(group_name, None)
        destroy_custom_process_group(group)
        if not self._groups:
            self._buffer = None

    def close(self) -> None:
        """Leave every group."""
        for name in list(self._groups):
            try:
                self.destroy_group(name)
            except Exception:
                logger.exception("destroying weights update group %s failed", name)

    def _group(self, group_name: str) -> dist.ProcessGroup:
        group = self._groups.get(group_name)
        if group is None:
            known = ", ".join(self._groups) or "none"
            raise ValueError(
                f"no weights update group {group_name!r} on tp rank "
                f"{self._parallelism.tp_rank} (groups: {known}); call "
                "init_weights_update_group first"
            )
        return group

    def _receive_buffer(self, num_bytes: int) -> torch.Tensor:
        # One buffer, grown to the largest bucket and reused: buckets arrive one at a time.
        if self._buffer is None or self._buffer.numel() < num_bytes:
            self._buffer = None
            self._buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self._device)
        return self._buffer[:num_bytes]
