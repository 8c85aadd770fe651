"""The broadcast baseline's routes on a reference replica, as a server extension.

SGLang's ``init_weights_update_group``, ``update_weights_from_distributed`` and
``destroy_weights_update_group``, with SGLang's fields, served by `weightsync serve` so that
the benchmarks can measure the broadcast engines verl and slime use against the
point-to-point sync on the same replicas. Each route runs one command on every rank of the
replica; a rank builds its `BroadcastReceiver` at the first command that needs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI

from weightsync.baseline.receiver.receiver import BroadcastReceiver
from weightsync.control.models import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    SuccessResponse,
    UpdateWeightsFromDistributedRequest,
)
from weightsync.server.extensions import RankContext, ReplicaHandle
from weightsync.server.http import ControlError, bearer_auth, error_responses, success_reply

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class InitWeightsUpdateGroup:
    """Join a torch.distributed group with the trainer; each rank joins as
    ``rank_offset + tp_rank``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateWeightsFromDistributed:
    """Receive one broadcast of HF tensors from the trainer and load it on every rank."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    load_format: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DestroyWeightsUpdateGroup:
    """Leave a weights update group."""

    group_name: str


class BroadcastExtension:
    """The baseline's routes (rank 0) and its receiver (every rank, built on first use)."""

    name = "broadcast_baseline"
    command_types = (
        InitWeightsUpdateGroup,
        UpdateWeightsFromDistributed,
        DestroyWeightsUpdateGroup,
    )

    def __init__(self) -> None:
        self._receiver: BroadcastReceiver | None = None

    def add_routes(self, app: FastAPI, replica: ReplicaHandle, *, api_key: str | None) -> None:
        """Add the three routes to `app`; they need `api_key` when it is set."""
        authorized = [Depends(bearer_auth(api_key))]
        reply_400 = {400: {"model": SuccessResponse}}

        @app.post(
            "/init_weights_update_group",
            response_model=SuccessResponse,
            dependencies=authorized,
            responses={**error_responses(500), **reply_400},
        )
        async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> Any:
            """Join the trainer's torch.distributed group for broadcast updates (each rank as
            ``rank_offset + tp_rank``); answers once every member joined. 400 for a group that
            exists, a rank that does not fit, or a backend that cannot carry the replica's
            tensors."""
            return await success_reply(self._init_group(replica, body))

        @app.post(
            "/update_weights_from_distributed",
            response_model=SuccessResponse,
            dependencies=authorized,
            responses={**error_responses(500), **reply_400},
        )
        async def update_weights_from_distributed(
            body: UpdateWeightsFromDistributedRequest,
        ) -> Any:
            """Receive HF tensors broadcast by the trainer and load them; 400 for an unknown
            group or tensors that are not the model's, 500 when the broadcast failed."""
            return await success_reply(self._update(replica, body))

        @app.post(
            "/destroy_weights_update_group",
            response_model=SuccessResponse,
            dependencies=authorized,
            responses={**error_responses(), **reply_400},
        )
        async def destroy_weights_update_group(
            body: DestroyWeightsUpdateGroupRequest | None = None,
        ) -> Any:
            """Leave a weights update group; 400 when there is no such group."""
            body = body or DestroyWeightsUpdateGroupRequest()
            return await success_reply(self._destroy(replica, body))

    def execute(self, command: Any, rank: RankContext) -> Any:
        """Run one baseline command on this rank."""
        receiver = self._receiver_for(rank)
        match command:
            case InitWeightsUpdateGroup():
                return receiver.init_group(
                    master_address=command.master_address,
                    master_port=command.master_port,
                    rank_offset=command.rank_offset,
                    world_size=command.world_size,
                    group_name=command.group_name,
                    backend=command.backend,
                )
            case UpdateWeightsFromDistributed():
                stats = receiver.receive(
                    names=command.names,
                    dtypes=command.dtypes,
                    shapes=command.shapes,
                    group_name=command.group_name,
                    load_format=command.load_format,
                )
                if rank.device.type == "cuda":
                    import torch

                    # The reply says the bucket is loaded: the copies queued on the stream
                    # must have run, not only been queued.
                    torch.cuda.synchronize(rank.device)
                return stats
            case DestroyWeightsUpdateGroup(group_name=group_name):
                receiver.destroy_group(group_name)
                return None
        raise ValueError(f"not a broadcast-baseline command: {command!r}")

    def close(self, rank: RankContext) -> None:
        """Leave every weights update group this rank joined."""
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def _receiver_for(self, rank: RankContext) -> BroadcastReceiver:
        if self._receiver is None:
            self._receiver = BroadcastReceiver(
                params=rank.params,
                hf_config=rank.hf_config,
                parallelism=rank.parallelism,
                device=rank.device,
                timeout_s=rank.collective_timeout_s,
            )
        return self._receiver

    async def _init_group(
        self, replica: ReplicaHandle, request: InitWeightsUpdateGroupRequest
    ) -> str:
        # Checked here, for every rank at once: a rank that joined the rendezvous while
        # another refused would wait out the whole timeout.
        args = replica.server_args()
        last = request.rank_offset + args["tp_size"] - 1
        if last >= request.world_size:
            raise ControlError(
                f"rank_offset={request.rank_offset} puts this replica's {args['tp_size']} ranks "
                f"at ranks {request.rank_offset}..{last} of a group of {request.world_size}",
                status_code=400,
            )
        expected = "nccl" if args["device"] == "cuda" else "gloo"
        if request.backend != expected:
            raise ControlError(
                f"backend {request.backend!r} cannot carry {args['device']} tensors; this "
                f"replica needs backend {expected!r}",
                status_code=400,
            )
        ranks = await replica.run_command(
            InitWeightsUpdateGroup(
                master_address=request.master_address,
                master_port=request.master_port,
                rank_offset=request.rank_offset,
                world_size=request.world_size,
                group_name=request.group_name,
                backend=request.backend,
            )
        )
        logger.info("joined weights update group %s as ranks %s", request.group_name, ranks)
        return (
            f"Joined weights update group {request.group_name} as ranks {ranks} of "
            f"{request.world_size}"
        )

    async def _update(
        self, replica: ReplicaHandle, request: UpdateWeightsFromDistributedRequest
    ) -> str:
        # Generation is not refused here (SGLang's semantics: one request is atomic with
        # respect to generation, since commands run one at a time); an update spread over
        # several requests belongs inside a weight-update session, or a pause.
        if request.abort_all_requests:
            await replica.abort_request("", abort_all=True)
        stats = await replica.run_command(
            UpdateWeightsFromDistributed(
                names=tuple(request.names),
                dtypes=tuple(request.dtypes),
                shapes=tuple(tuple(shape) for shape in request.shapes),
                group_name=request.group_name,
                load_format=request.load_format,
            )
        )
        if request.flush_cache:
            await replica.flush_cache()
        if request.weight_version is not None:
            await replica.set_weight_version(request.weight_version)
        slowest = max(stats, key=lambda s: s.receive_s + s.load_s)
        logger.info(
            "received %d tensors (%d bytes): receive %.3f s, load %.3f s (slowest rank)",
            slowest.num_tensors,
            slowest.num_bytes,
            slowest.receive_s,
            slowest.load_s,
        )
        return (
            f"Updated {slowest.num_tensors} tensors ({slowest.num_bytes} bytes) from "
            f"{request.group_name}: receive {slowest.receive_s:.3f} s, load "
            f"{slowest.load_s:.3f} s (slowest rank)"
        )

    async def _destroy(
        self, replica: ReplicaHandle, request: DestroyWeightsUpdateGroupRequest
    ) -> str:
        await replica.run_command(DestroyWeightsUpdateGroup(group_name=request.group_name))
        logger.info("left weights update group %s", request.group_name)
        return f"Destroyed weights update group {request.group_name}"


EXTENSION = BroadcastExtension()
"""The extension `weightsync serve` loads (``ServeConfig.extensions``)."""
