"""The colocated baseline's route on a reference replica, as a server extension.

SGLang's ``update_weights_from_tensor``, with SGLang's fields, as verl's ``naive`` backend
drives it when trainer and rollout share the GPUs: per bucket the trainer flattens the full
HF tensors into one buffer, shares it by reference (`weightsync.baseline.shared_tensors`: a
CUDA IPC handle, a shared-memory file on CPU) and sends one payload per tp rank; every rank
maps the buffer, rebuilds the tensors and loads them one by one through the engine's loader
into its parameters (each rank taking its shard of every full tensor).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI

from weightsync.baseline.shared_tensors import deserialize, named_tensors
from weightsync.control.models import SuccessResponse, UpdateWeightsFromTensorRequest
from weightsync.receiver.loader import load_hf_tensors
from weightsync.server.extensions import RankContext, ReplicaHandle
from weightsync.server.http import ControlError, bearer_auth, error_responses, success_reply

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateWeightsFromTensor:
    """Rebuild the tensors of this rank's payload and load them (every rank)."""

    payloads: tuple[str, ...]
    load_format: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadStats:
    """What one ``update_weights_from_tensor`` did on one rank.

    Attributes:
        num_tensors: tensors loaded.
        num_bytes: their bytes (full HF tensors).
        rebuild_s: seconds rebuilding them from the payload (mapping the shared memory).
        load_s: seconds loading them into the parameters.
    """

    num_tensors: int
    num_bytes: int
    rebuild_s: float
    load_s: float


class FromTensorExtension:
    """``/update_weights_from_tensor`` (rank 0) and its loads (every rank)."""

    name = "update_weights_from_tensor"
    command_types = (UpdateWeightsFromTensor,)

    def add_routes(self, app: FastAPI, replica: ReplicaHandle, *, api_key: str | None) -> None:
        """Add the route to `app`; it needs `api_key` when it is set."""
        authorized = [Depends(bearer_auth(api_key))]

        @app.post(
            "/update_weights_from_tensor",
            response_model=SuccessResponse,
            dependencies=authorized,
            responses={**error_responses(500), 400: {"model": SuccessResponse}},
        )
        async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest) -> Any:
            """Rebuild the tensors the trainer shares (one payload per tp rank) and load
            them; 400 for payloads that do not match the ranks, do not parse, or hold tensors
            that are not the model's."""
            return await success_reply(self._update(replica, body))

    def execute(self, command: Any, rank: RankContext) -> Any:
        """Rebuild and load this rank's payload."""
        if not isinstance(command, UpdateWeightsFromTensor):
            raise ValueError(f"not an update_weights_from_tensor command: {command!r}")
        t0 = time.perf_counter()
        # Only this rank's payload is opened: opening another's would take a reference to
        # memory the trainer counts per receiver (CUDA IPC).
        tensors = named_tensors(deserialize(command.payloads[rank.tp_rank]), command.load_format)
        t1 = time.perf_counter()
        dtype = next(iter(rank.params.values())).dtype
        load_hf_tensors(rank.params, tensors, rank.hf_config, rank.parallelism, dtype)
        if rank.device.type == "cuda":
            import torch

            # The reply says the tensors are loaded, and the trainer reuses the buffer after
            # it: the copies queued on the stream must have run.
            torch.cuda.synchronize(rank.device)
        num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        num_tensors = len(tensors)
        del tensors  # drop the mapping now, not at the next request
        return LoadStats(
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            rebuild_s=t1 - t0,
            load_s=time.perf_counter() - t1,
        )

    def close(self, rank: RankContext) -> None:
        """Nothing is held between requests."""

    async def _update(self, replica: ReplicaHandle, request: UpdateWeightsFromTensorRequest) -> str:
        tp_size = replica.server_args()["tp_size"]
        if len(request.serialized_named_tensors) != tp_size:
            raise ControlError(
                f"serialized_named_tensors has {len(request.serialized_named_tensors)} "
                f"payload(s); this replica has {tp_size} tp rank(s): send one per rank",
                status_code=400,
            )
        if request.abort_all_requests:
            await replica.abort_request("", abort_all=True)
        stats = await replica.run_command(
            UpdateWeightsFromTensor(
                payloads=tuple(request.serialized_named_tensors),
                load_format=request.load_format,
            )
        )
        if request.flush_cache:
            await replica.flush_cache()
        if request.weight_version is not None:
            await replica.set_weight_version(request.weight_version)
        slowest = max(stats, key=lambda s: s.rebuild_s + s.load_s)
        return (
            f"Updated {slowest.num_tensors} tensors ({slowest.num_bytes} bytes) from shared "
            f"tensors: rebuild "
            f"{slowest.rebuild_s:.3f} s, load {slowest.load_s:.3f} s (slowest rank)"
        )


EXTENSION = FromTensorExtension()
"""The extension `weightsync serve` loads (``ServeConfig.extensions``)."""
