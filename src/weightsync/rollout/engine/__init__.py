"""The reference rollout engine's model: a tensor-parallel causal LM with SGLang's parameters."""

from weightsync.rollout.engine.cache import KVCache
from weightsync.rollout.engine.generate import generate
from weightsync.rollout.engine.model import ReferenceModel
from weightsync.rollout.engine.spec import ENGINE_MODEL_TYPES, ModelSpec

__all__ = ["ENGINE_MODEL_TYPES", "KVCache", "ModelSpec", "ReferenceModel", "generate"]
