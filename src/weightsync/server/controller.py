"""`ReplicaController`: the serving state of a reference replica and what each route does.

It lives on rank 0's event loop and turns route calls into engine commands. Its state:

- paused (``pause_generation`` .. ``continue_generation``): new generation requests are
  refused (503); ``abort`` mode aborts the queued ones, the other modes hold them;
- a weight-update session (``begin_weight_update`` .. ``end_weight_update``): generation is
  refused (503) and queued requests are held, so no token comes from half-written weights;
- released memory (``release_memory_occupation`` .. ``resume_memory_occupation``): allowed
  only when paused or idle; generation is refused meanwhile. Parameters are never released:
  they are registered with the transfer engine and never move.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from weightsync import __version__
from weightsync.control.models import GenerateRequest, GenerateResponse, WeightsCheckerRequest
from weightsync.control.protocol import GET_WEIGHT_VERSION, PARALLELISM_CONFIG
from weightsync.server.http import ControlError
from weightsync.server.ranks.commands import (
    CONFLICT,
    INTERNAL,
    INVALID,
    REFUSED,
    BeginUpdate,
    CheckWeights,
    Command,
    EndUpdate,
    FlushCache,
    Generate,
    SetWeightVersion,
)
from weightsync.server.ranks.driver import EngineDriver, EngineStoppedError
from weightsync.server.replica_info import ReplicaInfo
from weightsync.server.scheduler import GenerationQueue

logger = logging.getLogger(__name__)

# What the reference server serves beyond SGLang 0.5.23, advertised in /server_info.
CAPABILITIES = (PARALLELISM_CONFIG, GET_WEIGHT_VERSION)
_STATUS_OF_KIND = {REFUSED: 503, CONFLICT: 400, INVALID: 400, INTERNAL: 500}
# Tags of SGLang's memory saver. Parameter memory is registered with the transfer engine and
# must never move, so "weights" cannot be released here.
_RELEASABLE_TAGS = frozenset({"kv_cache", "cuda_graph"})
_KNOWN_TAGS = _RELEASABLE_TAGS | {"weights"}


class ReplicaController:
    """The semantics of the main server's routes over an `EngineDriver`.

    Every method raises `ControlError` (carrying the HTTP status to answer) when it refuses.

    Args:
        driver: rank 0's engine thread, started and ready.
        info: the replica's static description.
        weight_version: the label of the weights the replica starts with.
    """

    def __init__(self, driver: EngineDriver, *, info: ReplicaInfo, weight_version: str) -> None:
        self._driver = driver
        self.info = info
        self._weight_version = weight_version
        self._paused_mode: str | None = None
        self._session = "closed"  # closed | opening | open | closing
        self._released: set[str] = set()
        self._stopping = False
        self._queue = GenerationQueue(
            run=self._generate_on_ranks,
            blocked=self.generation_refusal,
            weight_version=lambda: self._weight_version,
        )

    def start(self) -> None:
        """Start handing queued generation requests to the engine."""
        self._queue.start()

    async def stop(self) -> None:
        """Refuse new work and abort the queued requests."""
        self._stopping = True
        await self._queue.stop("the server is shutting down")

    @property
    def healthy(self) -> bool:
        """Whether the replica serves (not shutting down, engine alive)."""
        return not self._stopping and not self._driver.stopped

    @property
    def weight_version(self) -> str:
        """The label of the weights the replica holds."""
        return self._weight_version

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Queue a generation request and return its tokens.

        Raises:
            ControlError: 503 while paused, in a weight-update session, with memory released
                or shutting down; 400 for bad input; 500 if a rank failed.
        """
        refusal = self.generation_refusal()
        if refusal is not None:
            raise ControlError(f"generation refused: {refusal}", status_code=503)
        params = request.sampling_params
        seed = params.sampling_seed
        if seed is None and params.temperature > 0:
            # Every rank must sample with the same seed; rank 0 draws it for all.
            seed = secrets.randbits(63)
        command = Generate(
            input_ids=tuple(request.input_ids),
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            seed=seed,
        )
        return await self._queue.submit(command, rid=request.rid or uuid.uuid4().hex)

    async def pause_generation(self, mode: str) -> str:
        """Stop starting requests; ``abort`` also aborts the queued ones (``retract`` and
        ``in_place`` hold them until `continue_generation`). Returns once none runs."""
        self._paused_mode = mode
        aborted = 0
        if mode == "abort":
            aborted = await self._queue.abort(lambda _: True, "aborted by pause_generation")
        waited = await self._queue.wait_idle()
        logger.info("generation paused (mode=%s): %d queued request(s) aborted", mode, aborted)
        message = f"Generation paused (mode={mode}): {aborted} queued request(s) aborted"
        if self._queue.num_queued:
            message += f", {self._queue.num_queued} held until continue_generation"
        if waited:
            message += "; the running request finished first"
        return message

    async def continue_generation(self, torch_empty_cache: bool) -> str:
        """Serve requests again (``torch_empty_cache``: return cached device memory first)."""
        if torch_empty_cache:
            await self._run(FlushCache(empty_device_cache=True))
        self._paused_mode = None
        await self._queue.notify()
        logger.info("generation continued")
        return "Generation continued"

    async def abort_request(self, rid: str, abort_all: bool) -> str:
        """Abort queued request `rid`, or every queued request."""
        aborted = await self._queue.abort(
            lambda queued: abort_all or queued == rid, "aborted by abort_request"
        )
        logger.info("abort_request(rid=%r, abort_all=%s): %d aborted", rid, abort_all, aborted)
        message = f"{aborted} queued request(s) aborted"
        running = self._queue.running_rid
        if running is not None and (abort_all or running == rid):
            message += "; the running request finishes (generation is not interruptible)"
        return message

    async def release_memory_occupation(self, tags: Sequence[str] | None) -> str:
        """Release KV-cache memory while idle; generation is refused until it is resumed.

        Raises:
            ControlError: 400 when requests are in flight and generation is not paused, for
                the ``weights`` tag (parameters never move) and for unknown tags.
        """
        wanted = _tags(tags, default=_RELEASABLE_TAGS)
        if "weights" in wanted:
            raise ControlError(
                "releasing 'weights' is not supported: parameter memory is registered with "
                "the transfer engine and never moves (no memory saver / weight offload); "
                "release ['kv_cache'] instead",
                status_code=400,
            )
        busy = self._queue.num_queued + self._queue.num_running
        if self._paused_mode is None and busy:
            raise ControlError(
                f"release_memory_occupation refused: the server is not idle ({busy} "
                "request(s) in flight); call pause_generation first",
                status_code=400,
            )
        self._released |= wanted
        logger.info("released memory %s; generation refused until resumed", sorted(wanted))
        return (
            f"Released {sorted(wanted)}; the reference engine keeps no KV cache between "
            "requests and its parameters stay registered in place"
        )

    async def resume_memory_occupation(self, tags: Sequence[str] | None) -> str:
        """Take back what `release_memory_occupation` released."""
        wanted = _tags(tags, default=_KNOWN_TAGS)
        self._released -= wanted
        await self._queue.notify()
        logger.info("resumed memory %s", sorted(wanted))
        return f"Resumed {sorted(wanted)}"

    async def flush_cache(self) -> str:
        """Drop cached state computed with old weights (the engine keeps no prefix cache)."""
        await self._run(FlushCache(empty_device_cache=False))
        return "Cache flushed."

    async def begin_weight_update(self, selector: str) -> str:
        """Open a weight-update session on every rank; generation stops until it ends.

        Raises:
            ControlError: 400 when a session is already open or `selector` is ``draft``.
        """
        if self._session != "closed":
            raise ControlError(
                f"a weight-update session is already {self._session}; call "
                "end_weight_update before beginning another",
                status_code=400,
            )
        self._session = "opening"
        try:
            await self._run(BeginUpdate(selector=selector))
        except BaseException:
            self._session = "closed"
            await self._queue.notify()
            raise
        self._session = "open"
        logger.info("weight-update session opened (selector=%s)", selector)
        return f"Weight update session begun (selector={selector})"

    async def end_weight_update(self) -> str:
        """Run post-load processing and close the session; generation may resume.

        Raises:
            ControlError: 400 when no session is open.
        """
        if self._session != "open":
            raise ControlError(
                f"no weight-update session is open (session {self._session}); call "
                "begin_weight_update first",
                status_code=400,
            )
        self._session = "closing"
        try:
            await self._run(EndUpdate())
        finally:
            self._session = "closed"
            await self._queue.notify()
        logger.info("weight-update session ended (weight version %s)", self._weight_version)
        return "Weight update session ended"

    async def update_weight_version(self, new_version: str, abort_all_requests: bool) -> str:
        """Label the weights every rank holds (and abort queued requests if asked)."""
        if abort_all_requests:
            await self.abort_request("", abort_all=True)
        await self._run(SetWeightVersion(version=new_version))
        self._weight_version = new_version
        logger.info("weight version is now %s", new_version)
        return f"Weight version updated to {new_version}"

    async def weights_checker(
        self, request: WeightsCheckerRequest
    ) -> tuple[bool, str, dict[str, Any]]:
        """Run a checker action on every rank.

        Returns:
            ``(success, message, extra)``: for ``compare`` the message lists every differing
            parameter per rank; for ``checksum`` the message is JSON ``{"ranks": [{"tp_rank",
            "checksums": {name: {"sha256", "sum"}}}]}`` and `extra` holds SGLang's fields
            (``ranks``: per rank ``checksums`` ``{name: sha256}`` and ``parallelism_info``).

        Raises:
            ControlError: 400 for the ``draft`` selector or a bad skip list.
        """
        if request.selector == "draft":
            raise ControlError("this server has no draft model", status_code=400)
        results = await self._run(
            CheckWeights(
                action=request.action,
                allow_quant_error=request.allow_quant_error,
                skip_tensor_list=tuple(request.skip_tensor_list),
            )
        )
        success = all(r.success for r in results)
        if request.action == "checksum":
            ranks = [
                {"tp_rank": rank, "checksums": r.details["checksums"]}
                for rank, r in enumerate(results)
            ]
            tp_size = len(results)
            sglang_ranks = [
                {
                    "checksums": {
                        name: entry["sha256"] for name, entry in r.details["checksums"].items()
                    },
                    "parallelism_info": [
                        {"role": "target", "tp_rank": rank, "tp_size": tp_size, "rank": rank}
                    ],
                }
                for rank, r in enumerate(results)
            ]
            return success, json.dumps({"ranks": ranks}), {"ranks": sglang_ranks}
        message = "\n".join(f"tp rank {rank}: {r.message}" for rank, r in enumerate(results))
        log = logger.info if success else logger.warning
        log("weights_checker %s: %s", request.action, message)
        return success, message, {}

    async def run_command(self, command: Any) -> list[Any]:
        """Run a server extension's `command` on every rank; each rank's value, by rank.

        Raises:
            ControlError: a rank refused (400 for bad input) or failed (500).
        """
        return await self._run(command)

    async def set_weight_version(self, version: str) -> None:
        """Label the weights every rank now holds (an extension's update set them)."""
        await self._run(SetWeightVersion(version=version))
        self._weight_version = version

    def server_args(self) -> dict[str, Any]:
        """The ``/server_info`` fields that describe how the server runs."""
        return self.info.server_args()

    def server_info(self) -> dict[str, Any]:
        """The server's arguments, state and version (``GET /server_info``): SGLang's keys
        for what it has, and what it serves beyond SGLang under ``"weightsync"``."""
        return {
            **self.info.server_args(),
            "status": "ready",
            "weight_version": self._weight_version,
            "weightsync": {"version": __version__, "capabilities": list(CAPABILITIES)},
            "state": {
                "paused": self._paused_mode is not None,
                "pause_mode": self._paused_mode,
                "weight_update_session": self._session,
                "memory_released": sorted(self._released),
                "num_running_requests": self._queue.num_running,
                "num_queued_requests": self._queue.num_queued,
                "engine_command": self._driver.current_command,
            },
        }

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info``: the model and the weight version it serves."""
        hf_config = self.info.hf_config
        return {
            "model_path": self.info.server_args()["model_path"],
            "weight_version": self._weight_version,
            "is_generation": True,
            "model_type": hf_config.get("model_type"),
            "architectures": hf_config.get("architectures"),
        }

    def generation_refusal(self) -> str | None:
        """Why generation may not run now (paused, a session open, memory released, shutting
        down), or ``None``."""
        if self._stopping or self._driver.stopped:
            return "the server is shutting down"
        if self._session != "closed":
            return "a weight-update session is open; generation resumes after end_weight_update"
        if self._paused_mode is not None:
            return "generation is paused (pause_generation); call continue_generation"
        if self._released:
            return f"memory {sorted(self._released)} is released; call resume_memory_occupation"
        return None

    async def _generate_on_ranks(self, command: Generate) -> dict[str, Any]:
        (value, *_) = await self._run(command)
        return value

    async def _run(self, command: Command) -> list[Any]:
        """Run `command` on every rank; return each rank's value, or raise the failure."""
        try:
            replies = await asyncio.wrap_future(self._driver.submit(command))
        except EngineStoppedError as exc:
            raise ControlError(f"the engine is not running: {exc}", status_code=503) from exc
        failed = [r for r in replies if not r.ok]
        if not failed:
            return [r.value for r in replies]
        if len({r.error for r in failed}) == 1 and len(failed) == len(replies):
            message = failed[0].error or ""
        else:
            message = "; ".join(f"tp rank {r.tp_rank}: {r.error}" for r in failed)
        raise ControlError(message, status_code=_STATUS_OF_KIND.get(failed[0].error_kind, 500))


def _tags(tags: Sequence[str] | None, *, default: frozenset[str]) -> set[str]:
    wanted = set(default if tags is None else tags)
    unknown = wanted - _KNOWN_TAGS
    if unknown:
        raise ControlError(
            f"unknown memory tags {sorted(unknown)}; known: {sorted(_KNOWN_TAGS)}",
            status_code=400,
        )
    return wanted
