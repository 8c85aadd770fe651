"""Which rollout replicas an update writes to, as seen from verl's driver.

verl hands a backend's driver side (``build_topology``) only what each worker's
``prepare()`` returned. Every rollout worker (a ``CheckpointEngineWorker``) reports its Ray
actor id and, where its actor name says it (``rollout_standalone_{replica_rank}...``, as
verl's ``RolloutReplica`` names them), its replica rank. Two sources turn those into replica
addresses:

- patched verl: the manager hook (`weightsync.integrations.verl.hook`) registers every
  replica's workers with the replica's ``server_address``, on each update and on every scale
  up or down; a worker it registered is resolved from that;
- stock verl: the replica's first-node server actor, named as verl's SGLang server names it
  (``sglang_server_{replica_rank}_{node_rank}``, `VerlOptions.server_actor_name`), is
  asked for its address (``get_server_address``), as verl's own ``SGLangReplica`` does.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# RolloutReplica.init_standalone / init_colocated name their workers
# f"rollout_standalone_{replica_rank}{name_suffix}" + class name (+ placement-group suffix);
# name_suffix starts with "_", the class name with a capital.
_WORKER_NAME_RE = re.compile(r"^rollout_(?:standalone|colocate)_(\d+)(?:_|[A-Z])")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaAddress:
    """One rollout replica of an update.

    Attributes:
        replica_rank: verl's ``RolloutReplica.replica_rank``.
        url: base URL of the replica's HTTP server (``http://`` + ``server_address``).
    """

    replica_rank: int
    url: str


def replica_rank_of(actor_name: str | None) -> int | None:
    """The replica rank verl wrote into a rollout worker's Ray actor name, or None."""
    match = _WORKER_NAME_RE.match(actor_name or "")
    return int(match.group(1)) if match else None


def url_of(server_address: str) -> str:
    """A replica's base URL from verl's ``"host:port"`` server address."""
    return server_address if "://" in server_address else f"http://{server_address}"


class HookRegistry:
    """Replica addresses the manager hook registered, by rollout worker actor id (driver)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_worker: dict[str, ReplicaAddress] = {}

    def register(self, replicas: Sequence[Any]) -> None:
        """Record every worker of `replicas` (verl ``RolloutReplica`` objects)."""
        with self._lock:
            for replica in replicas:
                address = ReplicaAddress(
                    replica_rank=int(replica.replica_rank), url=url_of(replica.server_address)
                )
                for worker in replica.workers:
                    self._by_worker[worker._actor_id.hex()] = address

    def forget(self, replicas: Sequence[Any]) -> None:
        """Drop the workers of `replicas`."""
        with self._lock:
            for replica in replicas:
                for worker in replica.workers:
                    self._by_worker.pop(worker._actor_id.hex(), None)

    def lookup(self, actor_id: str | None) -> ReplicaAddress | None:
        """The replica a worker belongs to, if the hook registered it."""
        with self._lock:
            return self._by_worker.get(actor_id or "")


HOOKED = HookRegistry()
"""The driver process's registry, filled by every manager hook of this backend."""


def resolve(rollout_metadata: Sequence[dict[str, Any]]) -> tuple[list[ReplicaAddress], str]:
    """The replicas of an update, in replica-rank order, and how they were found.

    Args:
        rollout_metadata: what each rollout worker's ``prepare()`` returned.

    Returns:
        The replicas, and ``"patched hook"`` (every worker registered by the manager hook) or
        ``"stock"`` (found by server actor name).

    Raises:
        ValueError: a worker whose replica can be found neither way, named with what to do.
    """
    import ray

    found: dict[int, ReplicaAddress] = {}
    hooked = 0
    for meta in rollout_metadata:
        address = HOOKED.lookup(meta.get("actor_id"))
        if address is not None:
            hooked += 1
            found.setdefault(address.replica_rank, address)
            continue
        rank, server_actor = meta.get("replica_rank"), meta.get("server_actor")
        if rank is None or server_actor is None:
            raise ValueError(
                f"rollout worker {meta.get('actor_name')!r}: cannot tell which replica it "
                "serves (its Ray actor name is not verl's rollout_standalone_<replica_rank>...); "
                "apply weightsync's verl patch (python -m weightsync.integrations.verl.patches "
                "apply), whose manager hook names the replicas"
            )
        if rank in found:
            continue
        try:
            server = ray.get_actor(server_actor)
        except ValueError as exc:
            raise ValueError(
                f"replica {rank}: no Ray actor named {server_actor!r} (the replica's first-node "
                "server); set checkpoint_engine.engine_kwargs.weightsync.server_actor_name to "
                "how this rollout names its server actors, or apply weightsync's verl patch"
            ) from exc
        host, port = ray.get(server.get_server_address.remote())
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        found[rank] = ReplicaAddress(replica_rank=rank, url=url_of(f"{host}:{port}"))
    mode = "patched hook" if rollout_metadata and hooked == len(rollout_metadata) else "stock"
    return [found[rank] for rank in sorted(found)], mode
