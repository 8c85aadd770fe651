"""`BroadcastGroup`: trainer rank 0's weights update group with every rank of the replicas."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weightsync.baseline.trainer.config import BroadcastConfig
from weightsync.baseline.update_group import (
    create_store,
    destroy_custom_process_group,
    init_custom_process_group,
)
from weightsync.control import RolloutClient
from weightsync.errors import RemoteReplicaError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupMember:
    """One replica in the group: its ranks are ``rank_offset .. rank_offset + num_ranks - 1``.

    Attributes:
        url: the replica's main server.
        num_ranks: its TP ranks.
        rank_offset: the group rank of its TP rank 0.
    """

    url: str
    num_ranks: int
    rank_offset: int


class BroadcastGroup:
    """A torch.distributed group of trainer rank 0 (group rank 0) and every replica rank.

    Call protocol, on trainer rank 0's event loop: `open` (every replica joins over
    ``/init_weights_update_group`` while this process joins as rank 0; returns once all
    did), then any number of broadcasts over `group` with `update` calls to the replicas,
    then `close`. A group is for a fixed set of replicas: when membership changes it must be
    closed and a new one opened (the baseline's cost of elasticity).

    Args:
        config: the baseline's settings.
        api_key: the replicas' API key.
        device: where the trainer's broadcast buffers live.
    """

    def __init__(
        self, config: BroadcastConfig, *, api_key: str | None, device: torch.device
    ) -> None:
        self._config = config
        self._api_key = api_key
        self._device = device
        self._group: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None
        self._members: tuple[GroupMember, ...] = ()
        self._clients: dict[str, RolloutClient] = {}
        self._name = ""
        self._count = 0

    @property
    def group(self) -> dist.ProcessGroup:
        """The open group.

        Raises:
            ValueError: the group is not open.
        """
        if self._group is None:
            raise ValueError("the broadcast group is not open; call open() first")
        return self._group

    @property
    def name(self) -> str:
        """The open group's name."""
        return self._name

    @property
    def members(self) -> tuple[GroupMember, ...]:
        """The replicas of the open group."""
        return self._members

    @property
    def is_open(self) -> bool:
        """Whether a group is open."""
        return self._group is not None

    async def open(self, replicas: Sequence[tuple[str, int]]) -> None:
        """Create the group with `replicas` (``(url, num_ranks)`` each).

        Raises:
            RemoteReplicaError: a replica could not join (named in the error).
        """
        if self._group is not None:
            await self.close()
        members, offset = [], 1
        for url, num_ranks in replicas:
            members.append(GroupMember(url=url, num_ranks=num_ranks, rank_offset=offset))
            offset += num_ranks
        world_size = offset
        self._count += 1
        name = f"{self._config.group_name}_{self._count}"
        timeout_s = self._config.timeout_s
        store = create_store(
            self._config.master_address, 0, world_size=world_size, rank=0, timeout_s=timeout_s
        )
        clients = {
            m.url: RolloutClient(m.url, api_key=self._api_key, timeout_s=timeout_s) for m in members
        }
        backend = self._config.backend_for(self._device)
        local = asyncio.to_thread(
            init_custom_process_group,
            backend=backend,
            store=store,
            world_size=world_size,
            rank=0,
            group_name=name,
            timeout_s=timeout_s,
            device=self._device,
        )
        remote = [
            clients[m.url].init_weights_update_group(
                master_address=self._config.master_address,
                master_port=store.port,
                rank_offset=m.rank_offset,
                world_size=world_size,
                group_name=name,
                backend=backend,
            )
            for m in members
        ]
        results = await asyncio.gather(local, *remote, return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            if not isinstance(results[0], BaseException):
                destroy_custom_process_group(results[0])
            await asyncio.gather(*(c.aclose() for c in clients.values()))
            index, exc = failed[0]
            if index == 0:
                raise exc
            url = members[index - 1].url
            raise RemoteReplicaError(
                f"replica {url} could not join the weights update group {name}: {exc}",
                replica=url,
                route="/init_weights_update_group",
            ) from exc
        self._group, self._store, self._name = results[0], store, name
        self._members, self._clients = tuple(members), clients
        logger.info("weights update group %s: %d ranks", name, world_size)

    async def update(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
    ) -> None:
        """Tell every replica to receive one broadcast and load it; returns once all loaded.

        Raises:
            RemoteReplicaError: a replica failed (the first one is named).
        """
        results = await asyncio.gather(
            *(
                client.update_weights_from_distributed(
                    names=names,
                    dtypes=dtypes,
                    shapes=shapes,
                    group_name=self._name,
                    flush_cache=False,
                    load_format=self._config.load_format,
                )
                for client in self._clients.values()
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def close(self) -> None:
        """Every replica leaves the group (best effort), then this process does."""
        if self._group is None:
            return
        await asyncio.gather(
            *(c.destroy_weights_update_group(self._name) for c in self._clients.values()),
            return_exceptions=True,
        )
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))
        destroy_custom_process_group(self._group)
        self._group, self._store, self._clients, self._members = None, None, {}, ()
