"""The main HTTP server of a reference replica: every route of PROTOCOL.md, and the routes
of the server extensions it was given (`weightsync.server.extensions`; the broadcast
baseline's ``init_weights_update_group`` and its kin come that way).

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

from collections.abc import Sequence
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse

from weightsync import __version__
from weightsync.control.models import (
    AbortRequestRequest,
    BeginWeightUpdateRequest,
    ContinueGenerationRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResponse,
    MemoryOccupationRequest,
    ParallelismConfigModel,
    PauseGenerationRequest,
    ServerInfo,
    StatusResponse,
    SuccessResponse,
    TransferEngineInfoResponse,
    UpdateWeightVersionRequest,
    UpdateWeightVersionResponse,
    WeightsCheckerRequest,
    WeightVersionResponse,
)
from weightsync.server.controller import ReplicaController
from weightsync.server.extensions import ServerExtension
from weightsync.server.http import (
    SUCCESS_400,
    ControlError,
    bearer_auth,
    error_response,
    error_responses,
    install_error_handler,
    success_body,
    success_reply,
)


def create_main_app(
    controller: ReplicaController,
    *,
    api_key: str | None = None,
    extensions: Sequence[ServerExtension] = (),
) -> FastAPI:
    """The main server's app over `controller`; see the module docstring for status codes.

    With `api_key`, every POST route needs ``Authorization: Bearer <api_key>``. Each of
    `extensions` adds its routes.
    """
    app = FastAPI(
        title="weightsync reference rollout server",
        version=__version__,
        description="SGLang's weight-update control protocol over the reference engine.",
    )
    install_error_handler(app)
    authorized = [Depends(bearer_auth(api_key))]

    @app.get(
        "/health", response_class=PlainTextResponse, responses=error_responses(503, auth=False)
    )
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
        responses=error_responses(400, auth=False),
    )
    @app.get(
        "/get_remote_instance_transfer_engine_info",
        response_model=TransferEngineInfoResponse,
        responses=error_responses(400, auth=False),
    )
    async def remote_instance_transfer_engine_info(rank: int | None = None) -> dict[str, Any]:
        """``[session_id, weights_info]`` of one rank; 400 for a missing or unknown rank."""
        return controller.info.transfer_engine_info(rank)

    @app.get(
        "/parallelism_config",
        response_model=ParallelismConfigModel,
        responses=error_responses(400, 404, auth=False),
    )
    async def parallelism_config(rank: int) -> dict[str, int]:
        """The parallelism config dict of one rank."""
        return controller.info.parallelism_config(rank)

    @app.post(
        "/pause_generation",
        response_model=StatusResponse,
        dependencies=authorized,
        responses=error_responses(),
    )
    async def pause_generation(body: PauseGenerationRequest | None = None) -> dict[str, str]:
        """Stop starting requests (``abort`` drops queued ones); returns when none runs."""
        body = body or PauseGenerationRequest()
        return {"status": "ok", "message": await controller.pause_generation(body.mode)}

    @app.post(
        "/continue_generation",
        response_model=StatusResponse,
        dependencies=authorized,
        responses=error_responses(),
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
        responses=error_responses(),
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
        responses=error_responses(400),
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
        responses=error_responses(400),
    )
    async def resume_memory_occupation(
        body: MemoryOccupationRequest | None = None,
    ) -> dict[str, str]:
        """Take back released memory."""
        body = body or MemoryOccupationRequest()
        message = await controller.resume_memory_occupation(body.tags)
        return {"status": "ok", "message": message}

    @app.post(
        "/flush_cache",
        response_model=StatusResponse,
        dependencies=authorized,
        responses=error_responses(),
    )
    async def flush_cache() -> dict[str, str]:
        """Drop caches computed with the old weights."""
        return {"status": "ok", "message": await controller.flush_cache()}

    @app.post(
        "/begin_weight_update",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**error_responses(), **SUCCESS_400},
    )
    async def begin_weight_update(body: BeginWeightUpdateRequest | None = None) -> Any:
        """Open a weight-update session; 400 if one is already open."""
        body = body or BeginWeightUpdateRequest()
        return await success_reply(controller.begin_weight_update(body.selector))

    @app.post(
        "/end_weight_update",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**error_responses(), **SUCCESS_400},
    )
    async def end_weight_update(body: EndWeightUpdateRequest | None = None) -> Any:
        """Run post-load processing and close the session; 400 if none is open."""
        return await success_reply(controller.end_weight_update())

    @app.post(
        "/update_weight_version",
        response_model=UpdateWeightVersionResponse,
        dependencies=authorized,
        responses={**error_responses(), **SUCCESS_400},
    )
    async def update_weight_version(body: UpdateWeightVersionRequest) -> Any:
        """Label the weights the replica now holds."""
        return await success_reply(
            controller.update_weight_version(body.new_version, body.abort_all_requests),
            new_version=body.new_version,
        )

    @app.get("/get_weight_version", response_model=WeightVersionResponse)
    async def get_weight_version() -> dict[str, str]:
        """The label of the weights the replica serves."""
        return {"weight_version": controller.weight_version}

    @app.post(
        "/weights_checker",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**error_responses(), **SUCCESS_400},
    )
    async def weights_checker(body: WeightsCheckerRequest) -> Any:
        """snapshot / reset_tensors / compare / checksum; 400 with the per-parameter report
        when it fails."""
        try:
            success, message = await controller.weights_checker(body)
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return success_body(False, str(exc))
        return success_body(success, message)

    @app.post(
        "/generate",
        response_model=GenerateResponse,
        dependencies=authorized,
        responses=error_responses(400, 500, 503),
    )
    async def generate(body: GenerateRequest) -> GenerateResponse:
        """Token ids in, new token ids out; 503 while paused or in a weight-update session."""
        return await controller.generate(body)

    for extension in extensions:
        extension.add_routes(app, controller, api_key=api_key)
    return app
