"""Server extensions: routes and rank commands that packages above the server add to it.

The reference replica serves the routes of docs/protocol.md itself. Routes that belong to another
audience (the broadcast baseline's ``init_weights_update_group`` and its kin) live with that
audience and plug in here, so that the server never imports them and a rank builds their
state only when one of their commands arrives.

Call protocol, per replica process:

1. `load_extensions` imports each extension module named in ``ServeConfig.extensions``
   (``module.EXTENSION``) on every rank;
2. on rank 0, ``add_routes(app, replica)`` once the main app exists: the routes turn requests
   into the extension's commands and run them with ``replica.run_command``;
3. on every rank, ``execute(command, rank)`` for each command of a type in
   ``command_types``, in the same order on every rank (so collectives inside line up);
   ``ValueError`` means bad input (HTTP 400), anything else a failed rank (HTTP 500);
4. on every rank, ``close(rank)`` when the rank shuts down.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from fastapi import FastAPI

    from weightsync.layout.parallelism import ParallelismConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class RankContext:
    """What an extension may use on one rank of a replica.

    Attributes:
        tp_rank: the rank.
        params: the rank's parameters by engine name (registered memory: write in place only).
        hf_config: the model's config.json dict.
        parallelism: the rank's parallelism config.
        device: where the parameters live.
        collective_timeout_s: how long a collective the extension runs may wait.
    """

    tp_rank: int
    params: Mapping[str, torch.Tensor]
    hf_config: Mapping[str, Any]
    parallelism: ParallelismConfig
    device: torch.device
    collective_timeout_s: float


class ReplicaHandle(Protocol):
    """What an extension's routes may ask of the replica (rank 0's controller)."""

    def server_args(self) -> dict[str, Any]:
        """The replica's ``/server_info`` arguments (``tp_size``, ``device``, ...)."""
        ...

    async def run_command(self, command: Any) -> list[Any]:
        """Run `command` on every rank; each rank's value, or raise the failure."""
        ...

    async def abort_request(self, rid: str, abort_all: bool) -> str:
        """Abort queued request `rid`, or every queued request."""
        ...

    async def flush_cache(self) -> str:
        """Drop cached state computed with old weights."""
        ...

    async def set_weight_version(self, version: str) -> None:
        """Label the weights every rank now holds."""
        ...


class ServerExtension(Protocol):
    """Routes and rank commands added to a reference replica (see the module docstring)."""

    name: str
    command_types: tuple[type, ...]

    def add_routes(self, app: FastAPI, replica: ReplicaHandle, *, api_key: str | None) -> None:
        """Add the extension's routes to rank 0's main app (state-changing ones behind
        `api_key`)."""
        ...

    def execute(self, command: Any, rank: RankContext) -> Any:
        """Run one of the extension's commands on this rank."""
        ...

    def close(self, rank: RankContext) -> None:
        """Release what the extension holds on this rank."""
        ...


def load_extensions(modules: Sequence[str]) -> list[ServerExtension]:
    """The extensions of `modules` (each module's ``EXTENSION``), in order.

    Raises:
        ValueError: a module that cannot be imported or has no ``EXTENSION``.
    """
    extensions = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"server extension {module_name!r} cannot be imported: {exc}") from exc
        extension = getattr(module, "EXTENSION", None)
        if extension is None:
            raise ValueError(f"server extension module {module_name!r} has no EXTENSION")
        extensions.append(extension)
    return extensions
