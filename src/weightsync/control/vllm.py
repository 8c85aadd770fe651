"""`VLLMClient`: the rollout client of a vLLM replica, speaking vLLM's routes.

vLLM 0.32 has RL routes of its own (``/pause``, ``/resume``, ``/update_weight_version``,
``/weight_info``, ``/collective_rpc``, served with ``VLLM_SERVER_DEV_MODE=1``) but no
bootstrap server, no transfer-engine info and no weight-update session that takes one-sided
writes. weightsync's worker extension (`weightsync.integrations.vllm.WorkerExtension`,
started with ``--worker-extension-cls``) serves those inside every worker, through
``POST /collective_rpc``. This client maps the calls `RolloutClient` makes for SGLang onto
them, so the manager drives a vLLM replica with the same lifecycle:

=============================  ==============================================================
`RolloutClient` call           on vLLM
=============================  ==============================================================
``get_server_info``            ``GET /server_info?config_format=json``, ``GET /version`` and
                               the extension's ``weightsync_init`` (what every rank
                               publishes), as one SGLang-shaped dict (`server_info`)
``get_model_info``             ``GET /weight_info`` (the label served)
``pause_generation``           ``POST /pause?mode=abort`` (``retract``/``in_place``: ``keep``)
``continue_generation``        ``POST /resume``
``release_memory_occupation``  nothing: vLLM's KV cache stays where it is (``/sleep`` would
                               free the weights trainers write into)
``flush_cache``                ``POST /reset_prefix_cache``
``begin_weight_update``        ``weightsync_begin`` on every worker
``end_weight_update``          ``weightsync_end`` on every worker (each takes its rank's
                               digests; staged parameters go through vLLM's own processing)
``update_weight_version``      ``POST /update_weight_version``
``weights_checker``            ``weightsync_checker`` on every worker
``delta_checksums``,           ``weightsync_delta_checksums`` and ``weightsync_apply_delta``
``apply_delta``                on every worker (ranks with a delta region)
transfer-engine info,          the ranks' ``weightsync_init`` replies
parallelism config
``generate``                   ``POST /v1/completions`` with token ids
=============================  ==============================================================
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from weightsync.control.client import RolloutClient
from weightsync.control.models import (
    ApplyDeltaRank,
    BeginWeightUpdateResponse,
    CheckerAction,
    GenerateResponse,
    PauseMode,
    Selector,
    StatusResponse,
    SuccessResponse,
    TransferEngineInfoResponse,
    UpdateWeightVersionResponse,
)
from weightsync.errors import RemoteReplicaError
from weightsync.layout.parallelism import ParallelismConfig

ENGINE = "vllm"
EXTENSION_CLS = "weightsync.integrations.vllm.WorkerExtension"
RPC_ROUTE = "/collective_rpc"
# vLLM's pause modes for SGLang's: "abort" drops running requests; SGLang's "retract" and
# "in_place" keep them to finish after the update, which vLLM's "keep" does.
_PAUSE_MODES: dict[str, str] = {"abort": "abort", "retract": "keep", "in_place": "keep"}


def is_vllm_server_info(server_info: Mapping[str, Any]) -> bool:
    """Whether `server_info` is vLLM's own ``/server_info`` reply (it carries
    ``vllm_config``), or what `VLLMClient.get_server_info` made of it."""
    return "vllm_config" in server_info or server_info.get("engine") == ENGINE


class VLLMClient(RolloutClient):
    """Async client of one vLLM replica started with weightsync's worker extension.

    Same calls as `RolloutClient` (the manager does not know which it holds); see the module
    docstring for what each one sends. Calls the extension serves go to every worker at once
    through ``/collective_rpc``; a worker that reports failure raises `RemoteReplicaError`
    naming its rank and its message.

    Args:
        base_url: the replica's API server, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer <api_key>`` (vLLM's ``--api-key``).
        timeout_s: default timeout of each call in seconds.
        host: the address trainers reach the workers' Mooncake engines at (their session
            ids); None: the workers' own choice (``VLLM_HOST_IP``, else loopback).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        host: str | None = None,
    ) -> None:
        super().__init__(base_url, api_key=api_key, timeout_s=timeout_s)
        self._host = host
        self._model_name: str | None = None

    @classmethod
    def like(cls, client: RolloutClient) -> VLLMClient:
        """A `VLLMClient` of the same replica, with `client`'s key and timeout."""
        return cls(client.base_url, api_key=client._api_key, timeout_s=client._timeout_s)

    async def rpc(
        self, method: str, request: Mapping[str, Any] | None = None, *, timeout_s: float | None
    ) -> list[dict[str, Any]]:
        """Call the extension's `method` on every worker with `request` (sent as one JSON
        string: vLLM passes only strings through); each worker's reply, in rank order.

        Raises:
            RemoteReplicaError: no reply, a reply that is not one object per worker, or a
                worker that reports failure (its rank and message named). A vLLM without
                the extension answers 500: the message says to start it with
                ``--worker-extension-cls``.
        """
        body = {"method": method, "args": [json.dumps(dict(request or {}))]}
        if timeout_s is not None:
            body["timeout"] = timeout_s
        route = f"{RPC_ROUTE} {method}"
        response = await self._call("POST", RPC_ROUTE, body=body, timeout_s=timeout_s, check=False)
        if response.status_code >= 400:
            text = response.content.decode(errors="replace")[:500]
            hint = (
                f"; is vLLM started with --worker-extension-cls {EXTENSION_CLS} "
                "and VLLM_SERVER_DEV_MODE=1?"
                if response.status_code in (404, 500)
                else ""
            )
            raise RemoteReplicaError(
                f"replica {self.base_url}: {route} answered {response.status_code}: {text}{hint}",
                replica=self.base_url,
                route=route,
                status_code=response.status_code,
            )
        data = self._json(response, route=route)
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise RemoteReplicaError(
                f"replica {self.base_url}: {route} answered {str(data)[:300]!r}, not one "
                "object per worker",
                replica=self.base_url,
                route=route,
                status_code=response.status_code,
            )
        failed = [
            f"rank {rank}: {r.get('message', '')}"
            for rank, r in enumerate(results)
            if not r.get("success")
        ]
        if failed:
            raise RemoteReplicaError(
                f"replica {self.base_url}: {route} reported failure: {'; '.join(failed)}",
                replica=self.base_url,
                route=route,
                status_code=response.status_code,
            )
        return results

    async def ranks(self, *, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """What every worker publishes (the extension's ``weightsync_init``; the first call
        in a worker's life captures its weights, later ones answer at once)."""
        request = {"host": self._host} if self._host else {}
        return await self.rpc("weightsync_init", request, timeout_s=timeout_s)

    async def get_server_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """vLLM's configuration and its ranks, as the SGLang-shaped dict the manager reads
        (`server_info`)."""
        config = await self._object("/server_info?config_format=json", timeout_s)
        version = await self._object("/version", timeout_s)
        try:
            ranks = await self.ranks(timeout_s=timeout_s)
            extension: dict[str, Any] = {"ranks": ranks}
        except RemoteReplicaError as exc:
            extension = {"error": str(exc)}
        return server_info(config, str(version.get("version", "unknown")), extension)

    async def get_model_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /weight_info``: ``{"weight_version": label}``."""
        return await self._object("/weight_info", timeout_s)

    async def get_transfer_engine_reply(
        self, rank: int, *, timeout_s: float | None = None
    ) -> TransferEngineInfoResponse:
        """Rank `rank`'s session id, ``weights_info``, registered regions and delta region."""
        info = await self._rank(rank, timeout_s)
        return TransferEngineInfoResponse(
            rank=rank,
            remote_instance_transfer_engine_info=(info["session_id"], info["weights_info"]),
            registered_regions=info.get("registered_regions"),
            delta_region=info.get("delta_region"),
        )

    async def get_transfer_engine_info(
        self, rank: int, *, timeout_s: float | None = None
    ) -> tuple[str, dict[str, tuple[int, int, int]]]:
        """``(session_id, weights_info)`` of rank `rank`."""
        reply = await self.get_transfer_engine_reply(rank, timeout_s=timeout_s)
        return reply.remote_instance_transfer_engine_info

    async def get_parallelism_config(
        self, rank: int, *, timeout_s: float | None = None
    ) -> ParallelismConfig:
        """Where rank `rank` sits, as its worker derived it from vLLM's parallel state."""
        info = await self._rank(rank, timeout_s)
        try:
            return ParallelismConfig.from_dict(info["parallelism_config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteReplicaError(
                f"replica {self.base_url}: rank {rank} published an invalid parallelism "
                f"config: {exc}",
                replica=self.base_url,
                route=f"{RPC_ROUTE} weightsync_init",
            ) from exc

    async def pause_generation(
        self, mode: PauseMode = "abort", *, timeout_s: float | None = None
    ) -> StatusResponse:
        """``POST /pause?mode=...``: ``abort`` drops running requests; ``retract`` and
        ``in_place`` keep them (vLLM's ``keep``) to run after `continue_generation`."""
        route = f"/pause?mode={_PAUSE_MODES[mode]}"
        await self._call("POST", route, timeout_s=timeout_s)
        return StatusResponse(status="ok", message="paused")

    async def continue_generation(
        self, torch_empty_cache: bool = False, *, timeout_s: float | None = None
    ) -> StatusResponse:
        """``POST /resume``."""
        await self._call("POST", "/resume", timeout_s=timeout_s)
        return StatusResponse(status="ok", message="resumed")

    async def abort_request(
        self, rid: str = "", abort_all: bool | None = None, *, timeout_s: float | None = None
    ) -> None:
        """``POST /abort_requests``: request `rid`, or every request."""
        body = {"request_ids": [rid]} if rid and not abort_all else {}
        await self._call("POST", "/abort_requests", body=body, timeout_s=timeout_s)

    async def release_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None
    ) -> None:
        """Nothing: a paused vLLM keeps its KV cache, and its ``/sleep`` would free the weight
        memory trainers write into."""

    async def resume_memory_occupation(
        self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None
    ) -> None:
        """Nothing (see `release_memory_occupation`)."""

    async def flush_cache(self, *, timeout_s: float | None = None) -> None:
        """``POST /reset_prefix_cache``: drop prefixes computed with the old weights."""
        await self._call("POST", "/reset_prefix_cache", timeout_s=timeout_s)

    async def begin_weight_update(
        self,
        selector: Selector = "target",
        *,
        lease_s: float | None = None,
        timeout_s: float | None = None,
    ) -> BeginWeightUpdateResponse:
        """Open a session on every worker (``weightsync_begin``); the reply has rank 0's
        process identity, the label served and what changed outside a session on any rank.

        Raises:
            ValueError: a lease was asked for: the extension holds none (it cannot stop
                ``/resume`` from another client).
        """
        if lease_s is not None:
            raise ValueError(f"replica {self.base_url}: vLLM sessions are not leases")
        results = await self.rpc("weightsync_begin", {"selector": selector}, timeout_s=timeout_s)
        label = (await self.get_model_info(timeout_s=timeout_s)).get("weight_version")
        changed = sorted({name for r in results for name in r.get("changed", ())})
        return BeginWeightUpdateResponse(
            success=True,
            changed_outside=changed,
            weight_version=None if label is None else str(label),
            instance=_instance(results),
        )

    async def end_weight_update(
        self,
        *,
        session_token: str | None = None,
        digests: dict[int, dict[str, int]] | None = None,
        unverified: bool = False,
        abandoned: str | None = None,
        timeout_s: float | None = None,
    ) -> SuccessResponse:
        """Close the session on every worker (``weightsync_end``): each checks what arrived
        against its rank's `digests` (every worker gets the list of all ranks' and takes its
        own) and hands staged parameters to vLLM's own processing. vLLM keeps no verdict on
        its weights between sessions (no ``weight_update_lease``), so `abandoned` changes
        nothing here: the manager keeps a replica whose update failed paused and dirty, and
        its next update writes it in full.

        Raises:
            RemoteReplicaError: a rank's bytes differ from its digests (the parameters are
                named), or vLLM's processing failed there.
        """
        by_rank = None
        if digests is not None:  # a list in rank order: each worker takes its own
            by_rank = [digests.get(rank) for rank in range(max(digests, default=-1) + 1)]
        request = {"digests": by_rank}
        results = await self.rpc("weightsync_end", request, timeout_s=timeout_s)
        verified = all(r.get("verified") for r in results)
        return SuccessResponse(
            success=True,
            message="verified" if verified else "ended (no digests to verify against)",
        )

    async def update_weight_version(
        self,
        new_version: str,
        abort_all_requests: bool = False,
        *,
        session_token: str | None = None,
        timeout_s: float | None = None,
    ) -> UpdateWeightVersionResponse:
        """``POST /update_weight_version``: label the weights the replica now holds."""
        route = "/update_weight_version"
        response = await self._call(
            "POST", route, body={"new_version": new_version}, timeout_s=timeout_s
        )
        return self._parse(response, UpdateWeightVersionResponse, route=route)

    async def weights_checker(
        self,
        action: CheckerAction,
        *,
        allow_quant_error: bool = False,
        selector: Selector = "target",
        skip_tensor_list: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> SuccessResponse:
        """The extension's checker on every worker (``weightsync_checker``): it covers the
        bytes trainers write (live parameters read in place, and the staging views of the
        ones vLLM repacks).

        Raises:
            RemoteReplicaError: the action failed on a rank; for ``compare`` the message
                lists the parameters that differ.
        """
        request = {"action": action, "skip_tensor_list": list(skip_tensor_list)}
        results = await self.rpc("weightsync_checker", request, timeout_s=timeout_s)
        return SuccessResponse(
            success=True, message="; ".join(r.get("message", "") for r in results)
        )

    async def delta_checksums(
        self, *, session_token: str | None, timeout_s: float | None = None
    ) -> dict[int, dict[str, int]]:
        """Every rank's checksums of the bytes trainers write (``weightsync_delta_checksums``):
        ``{tp_rank: {param_name: checksum}}``."""
        results = await self.rpc("weightsync_delta_checksums", {}, timeout_s=timeout_s)
        return {int(r["rank"]): {k: int(v) for k, v in r["checksums"].items()} for r in results}

    async def apply_delta(
        self,
        *,
        session_token: str | None,
        ranks: Mapping[int, tuple[Sequence[tuple[int, int]], Mapping[str, int]]],
        check: Literal["changes", "full"] = "changes",
        timeout_s: float | None = None,
    ) -> dict[int, ApplyDeltaRank]:
        """Every rank applies the payloads trainers wrote into its delta region, inside the
        open session, and checks them (``weightsync_apply_delta``; see
        `RolloutClient.apply_delta`).

        Raises:
            RemoteReplicaError: a rank refused or did not verify (named, with the
                parameters); its weights are not what the trainers meant until a full write.
        """
        request = {
            "ranks": {
                str(rank): {
                    "payloads": [[int(o), int(n)] for o, n in payloads],
                    "expected": {k: int(v) for k, v in expected.items()},
                }
                for rank, (payloads, expected) in ranks.items()
            },
            "check": check,
        }
        results = await self.rpc("weightsync_apply_delta", request, timeout_s=timeout_s)
        return {int(r["rank"]): ApplyDeltaRank.model_validate(r) for r in results}

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
        """``POST /v1/completions`` with the prompt as token ids (the replica may serve
        without a tokenizer); ``meta_info.weight_version`` is the label ``/weight_info``
        reports after the reply."""
        if self._model_name is None:
            models = await self._object("/v1/models", timeout_s)
            self._model_name = str(models["data"][0]["id"])
        body: dict[str, Any] = {
            "model": self._model_name,
            "prompt": list(input_ids),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "return_token_ids": True,
        }
        if sampling_seed is not None:
            body["seed"] = sampling_seed
        route = "/v1/completions"
        response = await self._call("POST", route, body=body, timeout_s=timeout_s)
        choice = self._json(response, route=route)["choices"][0]
        label = (await self.get_model_info(timeout_s=timeout_s)).get("weight_version")
        return GenerateResponse(
            output_ids=list(choice["token_ids"]),
            meta_info={
                "weight_version": None if label is None else str(label),
                "finish_reason": None,
            },
        )

    async def _rank(self, rank: int, timeout_s: float | None) -> dict[str, Any]:
        ranks = await self.ranks(timeout_s=timeout_s)
        if not 0 <= rank < len(ranks):
            raise RemoteReplicaError(
                f"replica {self.base_url}: no rank {rank} (it has {len(ranks)})",
                replica=self.base_url,
                route=f"{RPC_ROUTE} weightsync_init",
                status_code=400,
            )
        return ranks[rank]


def _instance(results: Sequence[Mapping[str, Any]]) -> str | None:
    """The replica's process identity: its workers' instances, joined (a restarted worker is
    a new replica process)."""
    instances = [r.get("instance") for r in results]
    if not instances or any(not isinstance(i, str) for i in instances):
        return None
    return "+".join(instances)


def server_info(
    config: Mapping[str, Any], version: str, extension: Mapping[str, Any]
) -> dict[str, Any]:
    """The SGLang-shaped ``/server_info`` of a vLLM replica: its sizes (``tp_size``,
    ``pp_size``, ``dp_size``), ``dtype``, ``model_path``, ``quantization``, what could move
    its weights (``enable_sleep_mode``, ``cpu_offload_gb``, ``offload_group_size``),
    ``engine: "vllm"``, ``version``, and
    ``weightsync_extension`` (its ranks' ``weightsync_init`` replies, or the ``error`` that
    asking for them raised).

    Args:
        config: vLLM's ``GET /server_info?config_format=json`` reply.
        version: vLLM's version (``GET /version``).
        extension: ``{"ranks": [...]}`` or ``{"error": message}``.
    """
    vllm_config = config.get("vllm_config")
    if not isinstance(vllm_config, Mapping):
        vllm_config = {}
    parallel = vllm_config.get("parallel_config") or {}
    model = vllm_config.get("model_config") or {}
    load = vllm_config.get("load_config") or {}
    offload = vllm_config.get("offload_config") or {}
    ranks = extension.get("ranks") or []
    instance = _instance(ranks) if ranks else None
    dtype = model.get("dtype")
    if isinstance(dtype, str):
        dtype = dtype.removeprefix("torch.")
    return {
        "engine": ENGINE,
        "version": version,
        "model_path": model.get("model"),
        "served_model_name": model.get("served_model_name"),
        "tp_size": parallel.get("tensor_parallel_size", 1),
        "pp_size": parallel.get("pipeline_parallel_size", 1),
        "dp_size": parallel.get("data_parallel_size", 1),
        "enable_expert_parallel": bool(parallel.get("enable_expert_parallel")),
        "dtype": dtype,
        "quantization": model.get("quantization"),
        "enable_sleep_mode": bool(model.get("enable_sleep_mode")),
        "load_format": load.get("load_format"),
        "cpu_offload_gb": (offload.get("uva") or {}).get("cpu_offload_gb", 0),
        "offload_group_size": (offload.get("prefetch") or {}).get("offload_group_size", 0),
        "weightsync_extension": {**extension, "instance": instance},
    }
