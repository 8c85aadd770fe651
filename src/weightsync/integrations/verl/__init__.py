"""weightsync as verl's checkpoint-engine backend.

Select it in a verl job (every process verl starts imports this module, through
``custom_backend_module``, before it builds a checkpoint engine)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.model_path=${actor_rollout_ref.model.path}

Importing it registers `WeightsyncCheckpointEngine` under ``weightsync`` and ``p2p`` in
verl's ``CheckpointEngineRegistry``; it imports nothing of weightsync's data path (torch
distributed, Mooncake, the plan) until the first update, so it stays cheap in the driver, the
actor ranks and the rollout workers. The settings are `VerlOptions`; on verl with
weightsync's patch (`weightsync.integrations.verl.patches`) the backend also gets the
manager hook (`weightsync.integrations.verl.hook.ManagerHook`) and PP-local export.
"""

from __future__ import annotations

from verl.checkpoint_engine.base import CheckpointEngineRegistry

from weightsync.integrations.verl.backend import WeightsyncCheckpointEngine
from weightsync.integrations.verl.options import VerlOptions

BACKEND_NAMES: tuple[str, ...] = ("weightsync", "p2p")

for _name in BACKEND_NAMES:
    CheckpointEngineRegistry.register(_name)(WeightsyncCheckpointEngine)

__all__ = ["BACKEND_NAMES", "VerlOptions", "WeightsyncCheckpointEngine"]
