"""The reference rollout engine's model: a tensor-parallel causal LM with SGLang's parameters."""

from weightsync.engine.cache import KVCache, LatentCache
from weightsync.engine.generate import generate
from weightsync.engine.model import ReferenceModel
from weightsync.engine.spec import ENGINE_MODEL_TYPES, ModelSpec

__all__ = [
    "ENGINE_MODEL_TYPES",
    "KVCache",
    "LatentCache",
    "ModelSpec",
    "ReferenceModel",
    "generate",
]
