"""`ManagerHook`: the backend's driver-side companion on verl with weightsync's patch.

The patched ``CheckpointEngineManager`` creates one through
``WeightsyncCheckpointEngine.create_manager_hook`` and calls it (its call protocol):

1. ``on_replicas_changed(replicas, added, removed)`` when the manager is created and on every
   ``add_replicas`` / ``remove_replicas``: the replicas are checked (settings one-sided
   writes cannot serve are refused) and their workers registered with their addresses, so
   the next update writes to exactly these replicas;
2. per update, after verl paused generation and released the KV cache,
   ``begin_update(replicas, global_steps)``; the actor ranks then run weightsync's part of
   the lifecycle (rank 0 begins the sessions, fetches metadata, all ranks push, rank 0 sets
   the version and ends the sessions);
3. ``end_update(replicas, global_steps, error)`` exactly once, also when the update failed:
   it returns the replicas that must stay paused (those actor rank 0 wrote to part-way),
   and the manager resumes generation on the others only.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from weightsync.integrations.verl.replicas import HOOKED, url_of

logger = logging.getLogger(__name__)


def refusal(replica: Any) -> str | None:
    """Why a verl rollout replica cannot take weightsync's writes, or None."""
    config = replica.config
    if getattr(config, "name", None) != "sglang":
        return None
    sglang = dict((getattr(config, "engine_kwargs", None) or {}).get("sglang") or {})
    saver = sglang.get("enable_memory_saver")
    seeded = bool(sglang.get("remote_instance_weight_loader_start_seed_via_transfer_engine"))
    # verl's SGLang server turns the memory saver on unless told otherwise (the patch turns
    # it off by default where the transfer-engine seed is on); SGLang then moves weights.
    if saver is True or (saver is None and not seeded):
        return (
            "verl starts SGLang with the memory saver on, which moves the weights weightsync "
            "writes into: set actor_rollout_ref.rollout.engine_kwargs.sglang."
            "enable_memory_saver=false"
        )
    if not seeded:
        return (
            "SGLang publishes its weights only with actor_rollout_ref.rollout.engine_kwargs."
            "sglang.remote_instance_weight_loader_start_seed_via_transfer_engine=true"
        )
    return None


def port_collisions(replicas: Sequence[Any]) -> list[str]:
    """Replicas on one host that would share one engine-info bootstrap port."""
    by_endpoint: dict[tuple[str, int], list[int]] = defaultdict(list)
    for replica in replicas:
        port = getattr(replica, "engine_info_bootstrap_port", None)
        address = replica.server_address or ""
        if port is not None:
            by_endpoint[(address.rpartition(":")[0], int(port))].append(replica.replica_rank)
    return [
        f"replicas {ranks} on host {host} share engine-info bootstrap port {port}"
        for (host, port), ranks in by_endpoint.items()
        if len(ranks) > 1
    ]


class ManagerHook:
    """Driver-side hooks of the weightsync backend (patched verl's
    ``CheckpointEngineManagerHook`` protocol); see the module docstring for the order."""

    def __init__(self, manager: Any) -> None:
        """Hook into `manager` (verl's ``CheckpointEngineManager``)."""
        self._manager = manager
        logger.info(
            "weightsync verl backend: patched verl, manager hook active (replicas, their "
            "addresses and a guaranteed end of every update come from CheckpointEngineManager)"
        )

    def on_replicas_changed(
        self, replicas: Sequence[Any], added: Sequence[Any], removed: Sequence[Any]
    ) -> None:
        """Check the replicas added and record the manager's current replicas.

        Raises:
            ValueError: an added replica runs with settings one-sided writes cannot serve,
                or two replicas of one host share an engine-info bootstrap port.
        """
        for replica in added:
            why = refusal(replica)
            if why is not None:
                raise ValueError(
                    f"rollout replica {replica.replica_rank} cannot take weightsync's "
                    f"point-to-point updates: {why}"
                )
        collisions = port_collisions(replicas)
        if collisions:
            raise ValueError(
                "; ".join(collisions) + ": SGLang refuses a second bootstrap server on one "
                "port; leave engine_kwargs.sglang.engine_info_bootstrap_port unset (the "
                "patched verl then picks a free one per replica)"
            )
        HOOKED.forget(removed)
        HOOKED.register(replicas)

    async def begin_update(self, replicas: Sequence[Any], global_steps: int | None) -> None:
        """Record this update's replicas (the actor ranks write to exactly these)."""
        HOOKED.register(replicas)

    async def end_update(
        self, replicas: Sequence[Any], global_steps: int | None, error: BaseException | None
    ) -> list[Any]:
        """The replicas that must stay paused: none after a success; after a failure, those
        actor rank 0's sync wrote to part-way (every replica if rank 0 cannot say)."""
        if error is None:
            return []
        actor_wg = self._manager.actor_wg
        try:
            refs = actor_wg.execute_checkpoint_engine(["paused_replicas"] * actor_wg.world_size)
            answers = await asyncio.gather(*refs)
        except Exception as exc:  # the actors may be what failed
            logger.error(
                "update %s failed (%s) and the actor ranks cannot say which replicas were "
                "written to (%s): every replica stays paused",
                global_steps,
                error,
                exc,
            )
            return list(replicas)
        dirty = {url for answer in answers for url in answer}
        return [r for r in replicas if url_of(r.server_address) in dirty]
