"""`RolloutClient`: one method per route of a rollout replica's main HTTP server."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel

from weightsync.control.base import AsyncHttpClient
from weightsync.control.models import (
    AbortRequestRequest,
    ApplyDeltaRank,
    ApplyDeltaRankRequest,
    ApplyDeltaRequest,
    ApplyDeltaResponse,
    BeginWeightSyncRequest,
    BeginWeightUpdateRequest,
    BeginWeightUpdateResponse,
    CheckerAction,
    ContinueGenerationRequest,
    DeltaChecksumsRequest,
    DeltaChecksumsResponse,
    DestroyWeightsUpdateGroupRequest,
    EndWeightSyncRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    PauseMode,
    RenewWeightUpdateRequest,
    SamplingParams,
    Selector,
    StatusResponse,
    SuccessResponse,
    TransferEngineInfoResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    UpdateWeightVersionResponse,
    WeightsCheckerRequest,
    WeightsInfo,
    WeightSyncStepResponse,
    WeightVersionResponse,
)
from weightsync.control.replies import check_reply
from weightsync.errors import LifecycleStepError, RemoteReplicaError
from weightsync.layout.parallelism import ParallelismConfig


class RolloutClient(AsyncHttpClient):
    """Async client of one rollout replica's main server (SGLang or `weightsync serve`).

    Every method sends one request. A reply that is not a 2xx, or a ``{"success": false}``
    body, raises `RemoteReplicaError` naming the replica URL, the route, the HTTP status and
    the server's message; a replica that cannot be reached raises it with ``status_code=None``.
    Each method takes ``timeout_s`` to override the client's default for that call.

    Use it as an async context manager, or call `aclose` when done::

        async with RolloutClient("http://127.0.0.1:30000", api_key=key) as client:
            await client.pause_generation(mode="abort")

    Args:
        base_url: the replica's main server, e.g. ``http://127.0.0.1:30000``.
        api_key: sent as ``Authorization: Bearer <api_key>`` (needed by state-changing routes
            of a server started with ``--api-key``).
        timeout_s: default timeout of each call in seconds.
    """

    async def health(self, *, timeout_s: float | None = None) -> None:
        """``GET /health``: return when the replica serves generation. SGLang's runs a
        one-token generation and answers 503 (after ~20 s) while paused: never a liveness
        probe during an update (use `get_server_info`).

        Raises:
            RemoteReplicaError: not reachable, or not serving (a non-2xx status).
        """
        await self._call("GET", "/health", timeout_s=timeout_s)

    async def get_server_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /server_info``: the server's arguments (``tp_size``, ``dtype``, ports, ...)
        and ``version``, as the server sent them."""
        return await self._object("/server_info", timeout_s)

    async def get_model_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /model_info``: the model path and type and the weight version served (SGLang
        0.5.23's place for the version)."""
        return await self._object("/model_info", timeout_s)

    async def served_weight_version(self, *, timeout_s: float | None = None) -> str | None:
        """The label of the weights the replica serves: ``/model_info``'s
        ``weight_version``, which SGLang as released and the reference server both serve."""
        return (await self.get_model_info(timeout_s=timeout_s)).get("weight_version")

    async def get_transfer_engine_info(
        self, rank: int, *, timeout_s: float | None = None
    ) -> tuple[str, WeightsInfo]:
        """``GET /remote_instance_transfer_engine_info?rank=N``.

        Returns:
            ``(session_id, {param_name: (data_ptr, numel, element_size)})`` of rank `rank`.
        """
        return await self._transfer_engine_info(
            "/remote_instance_transfer_engine_info", rank, timeout_s
        )

    async def get_transfer_engine_reply(
        self, rank: int, *, timeout_s: float | None = None
    ) -> TransferEngineInfoResponse:
        """``GET /remote_instance_transfer_engine_info?rank=N``, the whole reply (with the
        ``registered_regions`` the reference server adds)."""
        route = "/remote_instance_transfer_engine_info"
        response = await self._call("GET", route, params={"rank": rank}, timeout_s=timeout_s)
        return self._parse(response, TransferEngineInfoResponse, route=route)

    async def get_parallelism_config(
        self, rank: int, *, timeout_s: float | None = None
    ) -> ParallelismConfig:
        """``GET /parallelism_config?rank=N``: where rank `rank` sits in the replica."""
        return await self._parallelism_config("/parallelism_config", rank, timeout_s)

    async def pause_generation(
        self, mode: PauseMode = "abort", *, timeout_s: float | None = None
    ) -> StatusResponse:
        """``POST /pause_generation``: stop starting requests (``abort`` also drops the queued
        ones); returns when no request runs."""
        route = "/pause_generation"
        body = PauseGenerationRequest(mode=mode)
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        return self._parse(response, StatusResponse, route=route)

    async def continue_generation(
        self, torch_empty_cache: bool = False, *, timeout_s: float | None = None
    ) -> StatusResponse:
        """``POST /continue_generation``: serve requests again."""
        route = "/continue_generation"
        body = ContinueGenerationRequest(torch_empty_cache=torch_empty_cache)
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        return self._parse(response, StatusResponse, route=route)

    async def abort_request(
        self, rid: str = "", abort_all: bool | None = None, *, timeout_s: float | None = None
    ) -> None:
        """``POST /abort_request``: abort request `rid`, or every request (the default when
        no `rid` is given)."""
        body = AbortRequestRequest(rid=rid, abort_all=not rid if abort_all is None else abort_all)
        await self._call("POST", "/abort_request", body=body, timeout_s=timeout_s)

    async def release_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None
    ) -> None:
        """``POST /release_memory_occupation``: free e.g. the KV cache (``tags=None``: all).
        The replica refuses unless it is idle."""
        body = MemoryOccupationRequest(tags=list(tags) if tags is not None else None)
        await self._call("POST", "/release_memory_occupation", body=body, timeout_s=timeout_s)

    async def resume_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None
    ) -> None:
        """``POST /resume_memory_occupation``: take back what was released."""
        body = MemoryOccupationRequest(tags=list(tags) if tags is not None else None)
        await self._call("POST", "/resume_memory_occupation", body=body, timeout_s=timeout_s)

    async def flush_cache(self, *, timeout_s: float | None = None) -> None:
        """``POST /flush_cache``: drop cached prefixes computed with the old weights."""
        await self._call("POST", "/flush_cache", timeout_s=timeout_s)

    async def begin_weight_update(
        self,
        selector: Selector = "target",
        *,
        lease_s: float | None = None,
        timeout_s: float | None = None,
    ) -> BeginWeightUpdateResponse:
        """``POST /begin_weight_update``: open a weight-update session (no generation runs
        until `end_weight_update`).

        Args:
            selector: which weights the session updates.
            lease_s: make the session a lease of that many seconds (servers with capability
                ``weight_update_lease``); the reply's ``session_token`` must then accompany
                the session's calls, and `renew_weight_update` extend it.
            timeout_s: this call's timeout.
        """
        body = _without_none(BeginWeightUpdateRequest(selector=selector, lease_s=lease_s))
        route = "/begin_weight_update"
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        reply = self._parse(response, BeginWeightUpdateResponse, route=route)
        self._check_success(reply, route=route, status_code=response.status_code)
        return reply

    async def renew_weight_update(
        self, session_token: str, lease_s: float, *, timeout_s: float | None = None
    ) -> SuccessResponse:
        """``POST /renew_weight_update`` (the reference server's): extend the lease of the
        session `session_token` holds by `lease_s` from now."""
        body = RenewWeightUpdateRequest(session_token=session_token, lease_s=lease_s)
        return await self._success("/renew_weight_update", body, timeout_s)

    async def end_weight_update(
        self,
        *,
        session_token: str | None = None,
        digests: dict[int, dict[str, int]] | None = None,
        unverified: bool = False,
        abandoned: str | None = None,
        timeout_s: float | None = None,
    ) -> SuccessResponse:
        """``POST /end_weight_update``: close the session after the bytes arrived.

        Args:
            session_token: a leased session's token.
            digests: per tp rank, ``{param_name: digest}`` of what the trainers wrote
                (servers with capability ``weight_update_digest`` verify them).
            unverified: the trainers computed no digests: a labelled leased session then
                ends complete but unverified (`EndWeightUpdateRequest`).
            abandoned: why the holder gives the session up after its writes began (servers
                with capability ``weight_update_lease``): the weights are then incomplete,
                since writes may still land after the end.
            timeout_s: this call's timeout.

        Raises:
            RemoteReplicaError: no session is open, or the digests do not match what arrived
                (the message names the parameters).
        """
        body = _without_none(
            EndWeightUpdateRequest(
                session_token=session_token,
                digests=digests,
                unverified=unverified or None,
                abandoned=abandoned,
            )
        )
        return await self._success("/end_weight_update", body, timeout_s)

    async def update_weight_version(
        self,
        new_version: str,
        abort_all_requests: bool = False,
        *,
        session_token: str | None = None,
        timeout_s: float | None = None,
    ) -> UpdateWeightVersionResponse:
        """``POST /update_weight_version``: label the weights the replica now holds
        (`session_token`: a leased session's)."""
        route = "/update_weight_version"
        body = _without_none(
            UpdateWeightVersionRequest(
                new_version=new_version,
                abort_all_requests=abort_all_requests,
                session_token=session_token,
            )
        )
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        reply = self._parse(response, UpdateWeightVersionResponse, route=route)
        self._check_success(reply, route=route, status_code=response.status_code)
        return reply

    async def begin_weight_sync(
        self,
        *,
        pause_mode: PauseMode | None = "abort",
        release_kv_cache: bool = True,
        selector: Selector = "target",
        lease_s: float | None = None,
        budget_s: float | None = None,
        fence: bool = False,
        timeout_s: float | None = None,
        poll_s: float = 0.0,
    ) -> WeightSyncStepResponse:
        """``POST /begin_weight_sync`` (servers with capability ``weight_sync_fused``):
        `pause_generation` (unless `pause_mode` is None), `release_memory_occupation` of the
        KV cache (with `release_kv_cache`) and `begin_weight_update`, in one call; the
        server stops where it runs past `budget_s` seconds (give `timeout_s` a margin over
        it, to hear why). With `fence` (capability ``weight_sync_fence``) the reply's
        ``fences`` name the CUDA events every writer must wait for before it writes.
        `poll_s`: poll for the reply for up to this long (`KeepAliveConnection.request`).

        Raises:
            LifecycleStepError: a step refused: ``route`` names it, ``completed`` the steps
                that ran before it.
            RemoteReplicaError: the call itself failed (unreachable, a 5xx, a bad reply).
        """
        body = BeginWeightSyncRequest(
            pause_mode=pause_mode,
            release_kv_cache=release_kv_cache,
            selector=selector,
            lease_s=lease_s,
            budget_s=budget_s,
            fence=fence,
        )
        return await self._fused("/begin_weight_sync", _without_none(body), timeout_s, poll_s)

    async def end_weight_sync(
        self,
        *,
        new_version: str | None,
        session_token: str | None = None,
        digests: dict[int, dict[str, int]] | None = None,
        unverified: bool = False,
        resume: bool = True,
        resume_kv_cache: bool = True,
        after_events: list[str] | None = None,
        budget_s: float | None = None,
        timeout_s: float | None = None,
        poll_s: float = 0.0,
        poll_after: asyncio.Future[Any] | None = None,
    ) -> WeightSyncStepResponse:
        """``POST /end_weight_sync`` (servers with capability ``weight_sync_fused``):
        `update_weight_version` (unless `new_version` is None), `end_weight_update` with
        `digests` (or `unverified`, as `end_weight_update`), then with `resume`:
        `resume_memory_occupation` of the KV cache (with `resume_kv_cache`), `flush_cache`
        and `continue_generation`, in one call.
        `after_events` (capability ``weight_sync_events``): IPC handles (hex) of the CUDA
        events the trainers' copies complete at, which the end waits for first.
        `poll_s`: poll for the reply for up to this long, from when `poll_after` is done
        (the reply cannot come before the copies land; `KeepAliveConnection.request`).

        Raises:
            LifecycleStepError: a step refused: ``route`` names it, ``completed`` the steps
                that ran before it (a failed verification: ``/end_weight_update``).
            RemoteReplicaError: the call itself failed (unreachable, a 5xx, a bad reply).
        """
        body = EndWeightSyncRequest(
            new_version=new_version,
            session_token=session_token,
            digests=digests,
            unverified=unverified or None,
            resume=resume,
            resume_kv_cache=resume_kv_cache,
            after_events=after_events,
            budget_s=budget_s,
        )
        return await self._fused(
            "/end_weight_sync", _without_none(body), timeout_s, poll_s, poll_after
        )

    async def get_weight_version(self, *, timeout_s: float | None = None) -> str | None:
        """``GET /get_weight_version``: the label of the weights the replica serves."""
        route = "/get_weight_version"
        response = await self._call("GET", route, timeout_s=timeout_s)
        return self._parse(response, WeightVersionResponse, route=route).weight_version

    async def weights_checker(
        self,
        action: CheckerAction,
        *,
        allow_quant_error: bool = False,
        selector: Selector = "target",
        skip_tensor_list: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> SuccessResponse:
        """``POST /weights_checker``: ``snapshot``, ``reset_tensors``, ``compare`` or
        ``checksum`` the replica's weights.

        Raises:
            RemoteReplicaError: the action failed; for ``compare``, the message lists each
                parameter that differs from the snapshot.
        """
        body = WeightsCheckerRequest(
            action=action,
            allow_quant_error=allow_quant_error,
            selector=selector,
            skip_tensor_list=list(skip_tensor_list),
        )
        return await self._success("/weights_checker", body, timeout_s)

    async def delta_checksums(
        self, *, session_token: str | None, timeout_s: float | None = None
    ) -> dict[int, dict[str, int]]:
        """``POST /weightsync/delta_checksums`` (servers with capability
        ``weight_sync_delta``): every rank's checksums of its parameters
        (`weightsync.delta_codec.checksums`), any time.

        Args:
            session_token: the open session's token, where the caller holds it (the
                replica then refuses the call if another client holds the session).
            timeout_s: this call's timeout.

        Returns:
            ``{tp_rank: {param_name: checksum}}``.

        Raises:
            RemoteReplicaError: the replica refused (another holder's token) or failed.
        """
        route = "/weightsync/delta_checksums"
        body = DeltaChecksumsRequest(session_token=session_token)
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        reply = self._parse(response, DeltaChecksumsResponse, route=route)
        self._check_success(reply, route=route, status_code=response.status_code)
        return {rank: dict(entry.checksums) for rank, entry in reply.ranks.items()}

    async def apply_delta(
        self,
        *,
        session_token: str | None,
        ranks: Mapping[int, tuple[Sequence[tuple[int, int]], Mapping[str, int]]],
        check: Literal["changes", "full"] = "changes",
        timeout_s: float | None = None,
    ) -> dict[int, ApplyDeltaRank]:
        """``POST /weightsync/apply_delta`` (servers with capability ``weight_sync_delta``):
        every rank applies the delta payloads the trainers wrote into its delta region,
        inside the open session, and checks its checksums against the expected ones.

        Args:
            session_token: the open session's token (a leased session's).
            ranks: per tp rank (every rank of the replica), ``(payloads, expected)``: the
                ``(offset, num_bytes)`` of its payloads in its delta region, in the order
                to apply them, and ``{param_name: checksum}`` each changed parameter must
                hold after them.
            check: how the ranks check them: ``"changes"`` derives each parameter's
                checksum after from the one it read at `delta_checksums` in this session
                and the elements written; ``"full"`` reads every byte again, which also
                sees bytes written since into elements no payload changed.
            timeout_s: this call's timeout.

        Returns:
            Per tp rank, what applying found (every rank verified).

        Raises:
            RemoteReplicaError: no session is open, another client holds it, a rank is
                missing, a payload lies outside its rank's region (nothing applied), or a
                rank did not verify: the message names the ranks and the parameters that
                differ, and the replica's weights are incomplete until a complete update.
        """
        route = "/weightsync/apply_delta"
        body = ApplyDeltaRequest(
            session_token=session_token,
            ranks={
                rank: ApplyDeltaRankRequest(
                    payloads=[(int(o), int(n)) for o, n in payloads], expected=dict(expected)
                )
                for rank, (payloads, expected) in ranks.items()
            },
            check=check,
        )
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        reply = self._parse(response, ApplyDeltaResponse, route=route)
        self._check_success(reply, route=route, status_code=response.status_code)
        return dict(reply.ranks)

    async def generate(
        self,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        sampling_seed: int | None = None,
        rid: str | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResponse:
        """``POST /generate``: token ids in, token ids out (the reference server's form).

        Returns:
            ``output_ids`` (new tokens only) and ``meta_info`` with the ``weight_version``
            that produced them.
        """
        route = "/generate"
        body = GenerateRequest(
            input_ids=list(input_ids),
            sampling_params=SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, sampling_seed=sampling_seed
            ),
            rid=rid,
        )
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        return self._parse(response, GenerateResponse, route=route)

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> SuccessResponse:
        """``POST /init_weights_update_group``: every rank of the replica joins the trainer's
        group as ``rank_offset + tp_rank``. Returns once every member joined, so the trainer
        must join (rank 0, hosting the store at ``master_address:master_port``) meanwhile."""
        body = InitWeightsUpdateGroupRequest(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return await self._success("/init_weights_update_group", body, timeout_s)

    async def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
        timeout_s: float | None = None,
    ) -> SuccessResponse:
        """``POST /update_weights_from_distributed``: receive the tensors the trainer
        broadcasts (one flattened bucket with ``load_format="flattened_bucket"``, else one
        broadcast per tensor) and load them. Returns once loaded, so the trainer broadcasts
        meanwhile."""
        body = UpdateWeightsFromDistributedRequest(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[list(shape) for shape in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
            weight_version=weight_version,
            load_format=load_format,
        )
        return await self._success("/update_weights_from_distributed", body, timeout_s)

    async def update_weights_from_tensor(
        self,
        *,
        serialized_named_tensors: Sequence[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        selector: Selector = "all",
        timeout_s: float | None = None,
    ) -> SuccessResponse:
        """``POST /update_weights_from_tensor``: every tp rank rebuilds the tensors of its
        payload (``serialized_named_tensors[tp_rank]``, `weightsync.baseline.shared_tensors`:
        shared by reference, so the sender keeps them alive and unchanged until this returns)
        and loads them, with the custom weight loader `load_format` where one is named (a
        delta call, `weightsync.delta_wire`); `selector` names the models it loads into."""
        body = UpdateWeightsFromTensorRequest(
            serialized_named_tensors=list(serialized_named_tensors),
            load_format=load_format,
            flush_cache=flush_cache,
            weight_version=weight_version,
            selector=selector,
        )
        return await self._success("/update_weights_from_tensor", body, timeout_s)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, timeout_s: float | None = None
    ) -> SuccessResponse:
        """``POST /destroy_weights_update_group``: leave the group."""
        body = DestroyWeightsUpdateGroupRequest(group_name=group_name)
        return await self._success("/destroy_weights_update_group", body, timeout_s)

    async def _object(self, route: str, timeout_s: float | None) -> dict[str, Any]:
        """``GET route`` answered with a JSON object."""
        response = await self._call("GET", route, timeout_s=timeout_s)
        data = self._json(response, route=route)
        if not isinstance(data, dict):
            raise RemoteReplicaError(
                f"replica {self.base_url}: {route} answered with a {type(data).__name__}, "
                "not an object",
                replica=self.base_url,
                route=route,
                status_code=response.status_code,
            )
        return data

    async def _fused(
        self,
        route: str,
        body: bytes,
        timeout_s: float | None,
        poll_s: float = 0.0,
        poll_after: asyncio.Future[Any] | None = None,
    ) -> WeightSyncStepResponse:
        """A fused lifecycle call, on the fast path (`_post_quick`); a refusing step raises
        `LifecycleStepError`."""
        response = await self._post_quick(
            route, body, timeout_s=timeout_s, poll_s=poll_s, poll_after=poll_after
        )
        try:
            reply = WeightSyncStepResponse.model_validate_json(response.content)
        except ValueError:  # not JSON, or not this shape: judged below as any reply
            reply = None
        if reply is not None and reply.route is not None and not reply.success:
            raise LifecycleStepError(
                f"replica {self.base_url}: {reply.route} (in {route}) refused: {reply.message}",
                replica=self.base_url,
                route=reply.route,
                status_code=response.status_code,
                completed=tuple(reply.completed),
            )
        check_reply(response, replica=self.base_url, route=route)
        if reply is None:
            reply = self._parse(response, WeightSyncStepResponse, route=route)
        self._check_success(reply, route=route, status_code=response.status_code)
        return reply

    async def _success(self, route: str, body: Any, timeout_s: float | None) -> SuccessResponse:
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        reply = self._parse(response, SuccessResponse, route=route)
        self._check_success(reply, route=route, status_code=response.status_code)
        return reply

    def _check_success(self, reply: SuccessResponse, *, route: str, status_code: int) -> None:
        if not reply.success:
            raise RemoteReplicaError(
                f"replica {self.base_url}: {route} reported failure: {reply.message}",
                replica=self.base_url,
                route=route,
                status_code=status_code,
            )


def _without_none(body: BaseModel) -> bytes:
    """`body` as JSON without its unset extension fields, so a server that does not know
    them (SGLang) sees SGLang's body."""
    return body.model_dump_json(exclude_none=True).encode()
