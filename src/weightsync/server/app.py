"""The main HTTP server of a reference replica: every route of PROTOCOL.md, and SGLang's
routes of the broadcast baseline (``init_weights_update_group``,
``update_weights_from_distributed``, ``destroy_weights_update_group``).

Status codes: 200 success; 400 a call that contradicts the state or bad input (begin while a
session is open, end without one, a failed weights check, release while busy, an unknown
rank for transfer-engine info), with ``{"success": false, "message"}`` on the routes whose
reply is ``{"success", "message"}`` and ``{"error": {"message"}}`` elsewhere; 401 missing or
wrong API key on a POST route; 404 an unknown rank for ``/parallelism_config``; 422 a body
that does not parse; 500 a rank failed; 503 not now (``/generate`` while paused, during a
weight-update session or with memory released; ``/health`` while shutting down).

Handlers never block the event loop: the engine runs in rank 0's engine thread and handlers
await its futures, so ``/health`` answers during a long generation or weights check.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from weightsync import __version__
from weightsync.control.models import (
    AbortRequestRequest,
    BeginWeightUpdateRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    MemoryOccupationRequest,
    ParallelismConfigModel,
    PauseGenerationRequest,
    ServerInfo,
    StatusResponse,
    SuccessResponse,
    TransferEngineInfoResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
    UpdateWeightVersionResponse,
    WeightsCheckerRequest,
    WeightVersionResponse,
)
from weightsync.server.controller import ReplicaController
from weightsync.server.http import (
    ERROR_RESPONSES,
    ControlError,
    bearer_auth,
    error_response,
    install_error_handler,
)


def _errors(*codes: int, auth: bool = True) -> dict[int | str, dict[str, Any]]:
    responses: dict[int | str, dict[str, Any]] = dict(ERROR_RESPONSES) if auth else {}
    for code in codes:
        responses[code] = {"model": ErrorResponse}
    return responses


def _success_reply(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


def create_main_app(controller: ReplicaController, *, api_key: str | None = None) -> FastAPI:
    """The main server's app over `controller`; see the module docstring for status codes.

    With `api_key`, every POST route needs ``Authorization: Bearer <api_key>``.
    """
    app = FastAPI(
        title="weightsync reference rollout server",
        version=__version__,
        description="SGLang's weight-update control protocol over the reference engine.",
    )
    install_error_handler(app)
    authorized = [Depends(bearer_auth(api_key))]

    @app.get("/health", response_class=PlainTextResponse, responses=_errors(503, auth=False))
    async def health() -> Any:
        """200 ``OK`` while the replica serves; 503 while it shuts down."""
        if not controller.healthy:
            return error_response("the server is shutting down", 503)
        return "OK"

    @app.get("/server_info", response_model=ServerInfo)
    @app.get("/get_server_info", response_model=ServerInfo)
    async def server_info() -> dict[str, Any]:
        """Server arguments (model path, tp_size, dtype, device, ports), state and version."""
        return controller.server_info()

    @app.get(
        "/remote_instance_transfer_engine_info",
        response_model=TransferEngineInfoResponse,
        responses=_errors(400, auth=False),
    )
    @app.get(
        "/get_remote_instance_transfer_engine_info",
        response_model=TransferEngineInfoResponse,
        responses=_errors(400, auth=False),
    )
    async def remote_instance_transfer_engine_info(rank: int | None = None) -> dict[str, Any]:
        """``[session_id, weights_info]`` of one rank; 400 for a missing or unknown rank."""
        return controller.info.transfer_engine_info(rank)

    @app.get(
        "/parallelism_config",
        response_model=ParallelismConfigModel,
        responses=_errors(400, 404, auth=False),
    )
    async def parallelism_config(rank: int) -> dict[str, int]:
        """The parallelism config dict of one rank."""
        return controller.info.parallelism_config(rank)

    @app.post(
        "/pause_generation",
        response_model=StatusResponse,
        dependencies=authorized,
        responses=_errors(),
    )
    async def pause_generation(body: PauseGenerationRequest | None = None) -> dict[str, str]:
        """Stop starting requests (``abort`` drops queued ones); returns when none runs."""
        body = body or PauseGenerationRequest()
        return {"status": "ok", "message": await controller.pause_generation(body.mode)}

    @app.post(
        "/continue_generation",
        response_model=StatusResponse,
        dependencies=authorized,
        responses=_errors(),
    )
    async def continue_generation(
        body: ContinueGenerationRequest | None = None,
    ) -> dict[str, str]:
        """Serve requests again."""
        body = body or ContinueGenerationRequest()
        message = await controller.continue_generation(body.torch_empty_cache)
        return {"status": "ok", "message": message}

    @app.post(
        "/abort_request",
        response_model=StatusResponse,
        dependencies=authorized,
        responses=_errors(),
    )
    async def abort_request(body: AbortRequestRequest | None = None) -> dict[str, str]:
        """Abort queued request ``rid``, or every queued request."""
        body = body or AbortRequestRequest()
        message = await controller.abort_request(body.rid, body.abort_all)
        return {"status": "ok", "message": message}

    @app.post(
        "/release_memory_occupation",
        response_model=StatusResponse,
        dependencies=authorized,
        responses=_errors(400),
    )
    async def release_memory_occupation(
        body: MemoryOccupationRequest | None = None,
    ) -> dict[str, str]:
        """Release the KV cache; refused (400) unless paused or idle, and for ``weights``."""
        body = body or MemoryOccupationRequest()
        message = await controller.release_memory_occupation(body.tags)
        return {"status": "ok", "message": message}

    @app.post(
        "/resume_memory_occupation",
        response_model=StatusResponse,
        dependencies=authorized,
        responses=_errors(400),
    )
    async def resume_memory_occupation(
        body: MemoryOccupationRequest | None = None,
    ) -> dict[str, str]:
        """Take back released memory."""
        body = body or MemoryOccupationRequest()
        message = await controller.resume_memory_occupation(body.tags)
        return {"status": "ok", "message": message}

    @app.post(
        "/flush_cache", response_model=StatusResponse, dependencies=authorized, responses=_errors()
    )
    async def flush_cache() -> dict[str, str]:
        """Drop caches computed with the old weights."""
        return {"status": "ok", "message": await controller.flush_cache()}

    @app.post(
        "/begin_weight_update",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**_errors(), 400: {"model": SuccessResponse}},
    )
    async def begin_weight_update(body: BeginWeightUpdateRequest | None = None) -> Any:
        """Open a weight-update session; 400 if one is already open."""
        body = body or BeginWeightUpdateRequest()
        try:
            return _success_reply(True, await controller.begin_weight_update(body.selector))
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return _success_reply(False, str(exc))

    @app.post(
        "/end_weight_update",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**_errors(), 400: {"model": SuccessResponse}},
    )
    async def end_weight_update(body: EndWeightUpdateRequest | None = None) -> Any:
        """Run post-load processing and close the session; 400 if none is open."""
        try:
            return _success_reply(True, await controller.end_weight_update())
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return _success_reply(False, str(exc))

    @app.post(
        "/update_weight_version",
        response_model=UpdateWeightVersionResponse,
        dependencies=authorized,
        responses={**_errors(), 400: {"model": SuccessResponse}},
    )
    async def update_weight_version(body: UpdateWeightVersionRequest) -> Any:
        """Label the weights the replica now holds."""
        try:
            message = await controller.update_weight_version(
                body.new_version, body.abort_all_requests
            )
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return _success_reply(False, str(exc))
        return _success_reply(True, message, new_version=body.new_version)

    @app.get("/get_weight_version", response_model=WeightVersionResponse)
    async def get_weight_version() -> dict[str, str]:
        """The label of the weights the replica serves."""
        return {"weight_version": controller.weight_version}

    @app.post(
        "/weights_checker",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**_errors(), 400: {"model": SuccessResponse}},
    )
    async def weights_checker(body: WeightsCheckerRequest) -> Any:
        """snapshot / reset_tensors / compare / checksum; 400 with the per-parameter report
        when it fails."""
        try:
            success, message = await controller.weights_checker(body)
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return _success_reply(False, str(exc))
        return _success_reply(success, message)

    @app.post(
        "/init_weights_update_group",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**_errors(500), 400: {"model": SuccessResponse}},
    )
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> Any:
        """Join the trainer's torch.distributed group for broadcast updates (each rank as
        ``rank_offset + tp_rank``); answers once every member joined. 400 for a group that
        exists, a rank that does not fit, or a backend that cannot carry the replica's
        tensors."""
        try:
            return _success_reply(True, await controller.init_weights_update_group(body))
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return _success_reply(False, str(exc))

    @app.post(
        "/update_weights_from_distributed",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**_errors(500), 400: {"model": SuccessResponse}},
    )
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> Any:
        """Receive HF tensors broadcast by the trainer and load them; 400 for an unknown group
        or tensors that are not the model's, 500 when the broadcast failed."""
        try:
            return _success_reply(True, await controller.update_weights_from_distributed(body))
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return _success_reply(False, str(exc))

    @app.post(
        "/destroy_weights_update_group",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**_errors(), 400: {"model": SuccessResponse}},
    )
    async def destroy_weights_update_group(
        body: DestroyWeightsUpdateGroupRequest | None = None,
    ) -> Any:
        """Leave a weights update group; 400 when there is no such group."""
        body = body or DestroyWeightsUpdateGroupRequest()
        try:
            return _success_reply(True, await controller.destroy_weights_update_group(body))
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return _success_reply(False, str(exc))

    @app.post(
        "/generate",
        response_model=GenerateResponse,
        dependencies=authorized,
        responses=_errors(400, 500, 503),
    )
    async def generate(body: GenerateRequest) -> GenerateResponse:
        """Token ids in, new token ids out; 503 while paused or in a weight-update session."""
        return await controller.generate(body)

    return app
