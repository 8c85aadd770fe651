"""The main HTTP server of a reference replica: every route of docs/protocol.md, and the routes
of the server extensions it was given (`weightsync.server.extensions`; the broadcast
baseline's ``init_weights_update_group`` and its kin come that way).

Where SGLang 0.5.23 serves a route, this one answers as SGLang does: the same paths, fields,
defaults (``selector`` "all", ``abort_all_requests`` and ``torch_empty_cache`` true, checker
action "checksum"), status codes and bodies. Status codes: 200 success; 400 a call that
contradicts the state or bad input (begin while a session is open, end without one, a failed
weights check, release while busy, an unknown rank for transfer-engine info, a body that
does not parse, SGLang's ``{"object": "error", ...}``), with ``{"success": false,
"message"}`` on the routes whose reply is ``{"success", "message"}`` and ``{"error":
{"message"}}`` elsewhere; 401 a missing or wrong API key (every route but ``/health`` and
``/ready``); 404 an unknown rank for ``/parallelism_config``; 500 a rank failed; 503 not now
(``/generate``, ``/health`` and ``/ready`` while paused, during a weight-update session or
with memory released, or while shutting down); 507 a rank ran out of memory (the message
says where, in what, how much was asked for and how much was free).

Beyond SGLang it serves ``/parallelism_config`` and ``/get_weight_version`` (the Miles
extensions) and says so in ``/server_info["weightsync"]["capabilities"]``; unless started
with the fused lifecycle off, also ``/begin_weight_sync`` and ``/end_weight_sync`` (capability
``weight_sync_fused``): the update lifecycle's eight calls in two, each step answering as its
own route would; and ``/weightsync/delta_checksums`` and ``/weightsync/apply_delta``, the
delta syncs of a replica started with a delta region (capability ``weight_sync_delta``).

Handlers never wait on the engine in the event loop: the engine runs in rank 0's engine
thread and handlers await its futures, so ``/server_info`` answers during a long generation
or weights check. (A tp=1 replica's idle engine runs a session's begin and end and a label,
each well under a millisecond, in the handler's thread: `EngineDriver.submit`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from weightsync import __version__
from weightsync.control.models import (
    AbortRequestRequest,
    ApplyDeltaRequest,
    ApplyDeltaResponse,
    BeginWeightSyncRequest,
    BeginWeightUpdateRequest,
    BeginWeightUpdateResponse,
    ContinueGenerationRequest,
    DeltaChecksumsRequest,
    DeltaChecksumsResponse,
    EndWeightSyncRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResponse,
    MemoryOccupationRequest,
    ModelInfo,
    ParallelismConfigModel,
    PauseGenerationRequest,
    RenewWeightUpdateRequest,
    ServerInfo,
    StatusResponse,
    SuccessResponse,
    TransferEngineInfoResponse,
    UpdateWeightVersionRequest,
    UpdateWeightVersionResponse,
    WeightsCheckerRequest,
    WeightSyncStepResponse,
    WeightVersionResponse,
)
from weightsync.control.protocol import WEIGHT_SYNC_FUSED
from weightsync.server.controller import ReplicaController, SessionGrant, StepRefusedError
from weightsync.server.direct import DirectApp, DirectRoute
from weightsync.server.extensions import ServerExtension
from weightsync.server.gate import require_key_before_body
from weightsync.server.http import (
    SUCCESS_400,
    ControlError,
    bearer_auth,
    describe_validation_as_400,
    error_response,
    error_responses,
    install_error_handler,
    success_body,
    success_reply,
)


def grant_fields(grant: SessionGrant) -> dict[str, Any]:
    """The fields a begin's reply carries beyond success and message: the session's token
    and lease (leased), what changed outside a session, a fenced begin's events, and what
    the replica holds as the session begins (its label, the largest numeric label it has
    held, its process's identity)."""
    fields: dict[str, Any] = {
        "weight_version": grant.weight_version,
        "instance": grant.instance,
        "highest_numeric_version": grant.highest_version,
    }
    if grant.token:
        fields |= {"session_token": grant.token, "lease_s": grant.lease_s}
    if grant.changed_outside:
        fields["changed_outside"] = list(grant.changed_outside)
    if grant.fences:
        fields["fences"] = list(grant.fences)
    return fields


OPEN_PATHS = ("/health", "/ready")
"""The main server's paths that need no API key."""


def create_main_app(
    controller: ReplicaController,
    *,
    api_key: str | None = None,
    extensions: Sequence[ServerExtension] = (),
    direct_routes: bool = True,
) -> DirectApp:
    """The main server's app over `controller`; see the module docstring for status codes.

    With `api_key`, every route but ``/health`` and ``/ready`` needs ``Authorization: Bearer
    <api_key>`` (as SGLang), judged before a body is read (`require_key_before_body`). Each
    of `extensions` adds its routes. With `direct_routes` a server's connections answer the
    fused lifecycle calls on the fast path (`weightsync.server.direct`), as its routes do.
    """
    app = DirectApp(
        title="weightsync reference rollout server",
        version=__version__,
        description="SGLang's weight-update control protocol over the reference engine.",
    )
    install_error_handler(app)
    describe_validation_as_400(app)
    # Judged from the head, before any route reads a body; each route's dependency below
    # also puts the key in the OpenAPI document.
    require_key_before_body(app, api_key, open_paths=OPEN_PATHS)
    authorized = [Depends(bearer_auth(api_key))]

    @app.get(
        "/health", response_class=PlainTextResponse, responses=error_responses(503, auth=False)
    )
    async def health() -> Any:
        """200 ``OK`` while the replica serves generation; 503 while it does not (paused, in
        a weight-update session, memory released, shutting down): SGLang's ``/health`` runs
        a generation, so it answers 503 then too."""
        refusal = controller.generation_refusal()
        if refusal is not None:
            return error_response(refusal, 503)
        return "OK"

    @app.get("/ready", response_class=PlainTextResponse, responses=error_responses(503, auth=False))
    async def ready() -> Any:
        """200 once the replica serves generation; 503 while it does not, like ``/health``."""
        return await health()

    @app.get(
        "/model_info",
        response_model=ModelInfo,
        dependencies=authorized,
        responses=error_responses(),
    )
    async def model_info() -> dict[str, Any]:
        """The model and the weight version it serves (SGLang's ``/model_info``)."""
        return controller.model_info()

    @app.get(
        "/server_info",
        response_model=ServerInfo,
        dependencies=authorized,
        responses=error_responses(),
    )
    @app.get(
        "/get_server_info",
        response_model=ServerInfo,
        dependencies=authorized,
        responses=error_responses(),
    )
    async def server_info() -> dict[str, Any]:
        """Server arguments (model path, tp_size, dtype, device, ports), state and version."""
        return controller.server_info()

    @app.get(
        "/remote_instance_transfer_engine_info",
        response_model=TransferEngineInfoResponse,
        dependencies=authorized,
        responses=error_responses(400),
    )
    @app.get(
        "/get_remote_instance_transfer_engine_info",
        response_model=TransferEngineInfoResponse,
        dependencies=authorized,
        responses=error_responses(400),
    )
    async def remote_instance_transfer_engine_info(rank: int | None = None) -> dict[str, Any]:
        """``[session_id, weights_info]`` of one rank; 400 for a missing or unknown rank."""
        return controller.info.transfer_engine_info(rank)

    @app.get(
        "/parallelism_config",
        response_model=ParallelismConfigModel,
        dependencies=authorized,
        responses=error_responses(400, 404),
    )
    async def parallelism_config(rank: int) -> dict[str, Any]:
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

    @app.post("/release_memory_occupation", dependencies=authorized, responses=error_responses(400))
    async def release_memory_occupation(body: MemoryOccupationRequest | None = None) -> None:
        """Release the KV cache (JSON ``null``, as SGLang answers); refused (400) unless paused
        or idle, and for ``weights``."""
        body = body or MemoryOccupationRequest()
        await controller.release_memory_occupation(body.tags)

    @app.post("/resume_memory_occupation", dependencies=authorized, responses=error_responses(400))
    async def resume_memory_occupation(body: MemoryOccupationRequest) -> None:
        """Take back released memory (JSON ``null``; a body is required, as in SGLang)."""
        await controller.resume_memory_occupation(body.tags)

    @app.post(
        "/flush_cache",
        response_class=PlainTextResponse,
        dependencies=authorized,
        responses=error_responses(),
    )
    async def flush_cache() -> str:
        """Drop caches computed with the old weights (plain text, as SGLang answers)."""
        return await controller.flush_cache()

    @app.post(
        "/begin_weight_update",
        response_model=BeginWeightUpdateResponse,
        dependencies=authorized,
        responses={**error_responses(), **SUCCESS_400},
    )
    async def begin_weight_update(body: BeginWeightUpdateRequest | None = None) -> Any:
        """Open a weight-update session; 400 if one is already open. With ``lease_s`` the
        session is a lease: the reply's ``session_token`` must accompany its calls."""
        body = body or BeginWeightUpdateRequest()
        try:
            grant = await controller.begin_weight_update(body.selector, lease_s=body.lease_s)
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return success_body(False, str(exc))
        return success_body(True, grant.message, **grant_fields(grant))

    @app.post(
        "/renew_weight_update",
        response_model=BeginWeightUpdateResponse,
        dependencies=authorized,
        responses={**error_responses(), **SUCCESS_400},
    )
    async def renew_weight_update(body: RenewWeightUpdateRequest) -> Any:
        """Extend the open session's lease by ``lease_s`` from now (its holder only)."""
        try:
            lease_s = await controller.renew_weight_update(body.session_token, body.lease_s)
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return success_body(False, str(exc))
        return success_body(True, f"lease renewed for {lease_s:g} s", lease_s=lease_s)

    @app.post(
        "/end_weight_update",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**error_responses(), **SUCCESS_400},
    )
    async def end_weight_update(body: EndWeightUpdateRequest) -> Any:
        """Verify the trainers' ``digests`` (when sent), run post-load processing and close
        the session; 400 if none is open, for another holder's token, for digests that do
        not match (the weights are then incomplete), and without a JSON body (``{}``), as
        SGLang."""

        async def end() -> str:
            ended = await controller.end_weight_update(
                token=body.session_token,
                digests=body.digests,
                unverified=bool(body.unverified),
                abandoned=body.abandoned,
            )
            return ended.message

        return await success_reply(end())

    @app.post(
        "/update_weight_version",
        response_model=UpdateWeightVersionResponse,
        dependencies=authorized,
        responses={**error_responses(), **SUCCESS_400},
    )
    async def update_weight_version(body: UpdateWeightVersionRequest) -> Any:
        """Label the weights the replica now holds."""
        return await success_reply(
            controller.update_weight_version(
                body.new_version, body.abort_all_requests, token=body.session_token
            ),
            new_version=body.new_version,
        )

    if WEIGHT_SYNC_FUSED in controller.capabilities:
        fused = _add_fused_routes(app, controller, authorized)
        if direct_routes:
            app.add_direct_routes(fused, api_key=api_key)

    @app.get(
        "/get_weight_version",
        response_model=WeightVersionResponse,
        dependencies=authorized,
        responses=error_responses(),
    )
    async def get_weight_version() -> dict[str, str]:
        """The label of the weights the replica serves."""
        return {"weight_version": controller.weight_version}

    @app.post(
        "/weights_checker",
        response_model=SuccessResponse,
        dependencies=authorized,
        responses={**error_responses(507), **SUCCESS_400},
    )
    async def weights_checker(body: WeightsCheckerRequest) -> Any:
        """snapshot / reset_tensors / compare / checksum; 400 with the per-parameter report
        when it fails; 507 when a rank runs out of memory (the snapshot says whether it took
        GPU or host memory)."""
        try:
            success, message, extra = await controller.weights_checker(body)
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return success_body(False, str(exc))
        return success_body(success, message, **extra)

    @app.post(
        "/weightsync/delta_checksums",
        response_model=DeltaChecksumsResponse,
        dependencies=authorized,
        responses={**error_responses(507), **SUCCESS_400},
    )
    async def delta_checksums(body: DeltaChecksumsRequest | None = None) -> Any:
        """Every rank's checksums of its parameters (``weightsync.delta_codec``), any time;
        400 for a ``session_token`` while another client holds the open session."""
        body = body or DeltaChecksumsRequest()
        try:
            by_rank = await controller.delta_checksums(body.session_token)
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return success_body(False, str(exc))
        ranks = {str(rank): {"checksums": sums} for rank, sums in enumerate(by_rank)}
        return success_body(True, f"checksums of {len(ranks)} rank(s)", ranks=ranks)

    @app.post(
        "/weightsync/apply_delta",
        response_model=ApplyDeltaResponse,
        dependencies=authorized,
        responses={**error_responses(507), 400: {"model": ApplyDeltaResponse}},
    )
    async def apply_delta(body: ApplyDeltaRequest) -> Any:
        """Apply the delta payloads trainers wrote into every rank's delta region, inside
        the open session, and check every rank's checksums; 400 with no session open, for
        another holder's token, a rank missing, a payload outside its region (nothing
        applied), or a rank that did not verify (its ``ranks`` entry says what differs;
        the weights are then incomplete and the session's end will not verify)."""
        ranks = {rank: (entry.payloads, entry.expected) for rank, entry in body.ranks.items()}
        try:
            problem, results = await controller.apply_delta(
                body.session_token, ranks, check=body.check
            )
        except ControlError as exc:
            if exc.status_code != 400:
                raise
            return success_body(False, str(exc))
        replies = {str(rank): result.to_dict() for rank, result in enumerate(results)}
        if problem is not None:
            return success_body(False, problem, ranks=replies)
        num_elements = sum(result.num_elements for result in results)
        message = f"delta applied and verified: {num_elements} element(s) on {len(results)} rank(s)"
        return success_body(True, message, ranks=replies)

    @app.post(
        "/generate",
        response_model=GenerateResponse,
        dependencies=authorized,
        responses=error_responses(400, 500, 503, 507),
    )
    async def generate(body: GenerateRequest) -> GenerateResponse:
        """Token ids in, new token ids out; 503 while paused or in a weight-update session."""
        return await controller.generate(body)

    for extension in extensions:
        extension.add_routes(app, controller, api_key=api_key)
    return app


# A fused call's refusals: a step's 400 (or 503), or 504 past its budget, as the step body.
STEP_REFUSED: dict[int | str, dict[str, Any]] = {
    code: {"model": WeightSyncStepResponse} for code in (400, 503, 504)
}


def _add_fused_routes(
    app: FastAPI, controller: ReplicaController, authorized: list
) -> tuple[DirectRoute, ...]:
    """``/begin_weight_sync`` and ``/end_weight_sync`` (capability ``weight_sync_fused``);
    returns them as direct routes over the same handlers, for the fast path."""

    def refused(exc: StepRefusedError) -> JSONResponse:
        body = {"success": False, "message": str(exc), "completed": list(exc.completed)}
        return JSONResponse({**body, "route": exc.route}, status_code=exc.status_code)

    async def begin(body: BeginWeightSyncRequest | None) -> JSONResponse:
        body = body or BeginWeightSyncRequest()
        try:
            grant, completed = await controller.begin_weight_sync(
                pause_mode=body.pause_mode,
                release_kv_cache=body.release_kv_cache,
                selector=body.selector,
                lease_s=body.lease_s,
                budget_s=body.budget_s,
                fence=body.fence,
            )
        except StepRefusedError as exc:
            return refused(exc)
        return success_body(True, grant.message, completed=list(completed), **grant_fields(grant))

    async def end(body: EndWeightSyncRequest) -> JSONResponse:
        try:
            ended, completed = await controller.end_weight_sync(
                new_version=body.new_version,
                token=body.session_token,
                digests=body.digests,
                unverified=bool(body.unverified),
                resume=body.resume,
                resume_kv_cache=body.resume_kv_cache,
                torch_empty_cache=body.torch_empty_cache,
                after_events=body.after_events or (),
                budget_s=body.budget_s,
            )
        except StepRefusedError as exc:
            return refused(exc)
        extra: dict[str, Any] = {"completed": list(completed)}
        if ended.changed_outside:
            extra["changed_outside"] = list(ended.changed_outside)
        return success_body(True, ended.message, **extra)

    @app.post(
        "/begin_weight_sync",
        response_model=WeightSyncStepResponse,
        dependencies=authorized,
        responses={**error_responses(), **STEP_REFUSED},
    )
    async def begin_weight_sync(body: BeginWeightSyncRequest | None = None) -> Any:
        """``pause_generation``, ``release_memory_occupation(["kv_cache"])`` and
        ``begin_weight_update``, in that order, in one call; a step that refuses answers with
        its own status and message, names itself in ``route`` and stops the rest."""
        return await begin(body)

    @app.post(
        "/end_weight_sync",
        response_model=WeightSyncStepResponse,
        dependencies=authorized,
        responses={**error_responses(), **STEP_REFUSED},
    )
    async def end_weight_sync(body: EndWeightSyncRequest) -> Any:
        """``update_weight_version``, ``end_weight_update`` (verifying ``digests``), then
        ``resume_memory_occupation(["kv_cache"])``, ``flush_cache`` and
        ``continue_generation``, in that order, in one call; a step that refuses answers
        with its own status and message, names itself in ``route`` and stops the rest (a
        failed verification leaves the replica paused)."""
        return await end(body)

    return (
        DirectRoute("/begin_weight_sync", BeginWeightSyncRequest, begin, body_required=False),
        DirectRoute("/end_weight_sync", EndWeightSyncRequest, end),
    )
