"""The reference rollout replica (`weightsync serve`): the SGLang-compatible main HTTP server,
the engine-info bootstrap server, the controller of its serving state, and its rank
processes (`weightsync.server.ranks`)."""

from weightsync.server.config import ServeConfig
from weightsync.server.serve import serve

__all__ = ["ServeConfig", "serve"]
