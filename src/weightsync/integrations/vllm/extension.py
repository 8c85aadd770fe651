"""`WorkerExtension`: the RPC methods vLLM mixes into every worker (``--worker-extension-cls``).

Each method takes one JSON string (``request``, as ``POST /collective_rpc`` passes string
arguments) and returns a JSON-able dict with at least ``"success"`` and ``"message"``; none
raises: a failure is logged and answered with ``"success": false`` and the error's text. The
state of a worker (its `RolloutAgent`, transport and staging) lives in one `_Receiver` on the
worker, made by the first successful `weightsync_init`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from weightsync.integrations.vllm import _vllm
from weightsync.integrations.vllm.staging import StagedLayers, capture
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.vllm import vllm_parallelism, weightsync_name
from weightsync.receiver import RolloutAgent

logger = logging.getLogger(__name__)

# One per worker process: a restarted worker is a new instance (a new target for trainers).
INSTANCE = uuid.uuid4().hex
_STATE_ATTR = "_weightsync_receiver"
DELTA_REGION_ENV = "WEIGHTSYNC_DELTA_REGION_MB"
# Where each parameter is compared by the weights checker, for the init reply.
CHECKER_SCOPE = {
    "in_place": (
        "the live parameter vLLM computes with (for those in 'reprocessed', vLLM computes "
        "with state it derives from it again at each session end)"
    ),
    "staged": (
        "the staging view trainers write (vLLM computes with a copy it derives from it at "
        "each session end; generation shows that it took the bytes)"
    ),
}


class RefusedError(ValueError):
    """vLLM runs with a setting the integration does not support; the message names the flag."""


def _rpc(method: Callable[..., dict[str, Any]]) -> Callable[[Any, Any], dict[str, Any]]:
    """Parse the JSON request, run `method`, and turn any failure into a reply."""

    @functools.wraps(method)
    def rpc(worker: Any, request: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
        try:
            if request is None or request == "":
                body: dict[str, Any] = {}
            elif isinstance(request, str):
                body = json.loads(request)
            else:
                body = dict(request)
            if not isinstance(body, dict):
                raise ValueError(f"the request must be a JSON object, got {type(body).__name__}")
            reply = method(worker, body)
        except Exception as err:  # an RPC never raises into vLLM's worker loop
            logger.exception("weightsync %s failed", method.__name__)
            return {"success": False, "message": f"{type(err).__name__}: {err}"}
        return {"success": True, "message": "ok", **reply}

    return rpc


class WorkerExtension:
    """weightsync's receiver inside a vLLM worker; ``self`` is vLLM's worker.

    Call protocol (through ``POST /collective_rpc``, every worker at once, each method with one
    JSON string argument):

    1. `weightsync_init` once per worker process (idempotent): measures which parameters are
       in place and which staged, registers them with a Mooncake transport and publishes
       ``weights_info``.
    2. Per update, with generation paused: `weightsync_begin`, (trainers write into
       ``weights_info``'s addresses), `weightsync_end` with the trainers' digests: it verifies
       and lets vLLM process the staged parameters.
    3. Any time outside a session: `weightsync_checker`.

    A delta sync (an init with ``delta_region_bytes``): inside the session,
    `weightsync_delta_checksums` (the base), trainers write their payloads into
    ``delta_region``, `weightsync_apply_delta`, then `weightsync_end` (without digests it is
    verified when every delta verified).
    """

    @_rpc
    def weightsync_init(self, request: dict[str, Any]) -> dict[str, Any]:
        """Set the worker up for syncs; later calls answer the first call's info.

        Request: ``{"host": str, "delta_region_bytes": int, "protocol": str, "timeout_s":
        float}`` (all optional: ``host`` defaults to ``VLLM_HOST_IP`` else 127.0.0.1,
        ``delta_region_bytes`` to ``WEIGHTSYNC_DELTA_REGION_MB`` MiB in vLLM's environment,
        else 0 (no delta syncs), ``protocol`` to ``"tcp"``, ``timeout_s``, Mooncake's
        per-write timeout, to 30).
        The first call reloads the checkpoint from disk (`staging.capture`).
        """
        receiver = getattr(self, _STATE_ATTR, None)
        if receiver is None:
            receiver = _Receiver.start(self, request)
            setattr(self, _STATE_ATTR, receiver)
        return receiver.info

    @_rpc
    def weightsync_begin(self, request: dict[str, Any]) -> dict[str, Any]:
        """Open a weight-update session. Request: ``{"selector": "target"}``."""
        agent = _receiver(self).agent
        check = agent.begin_update(request.get("selector") or "target")
        return {
            "instance": INSTANCE,
            "weight_version": agent.weight_version,
            "changed": list(check.changed),
            "digest_s": check.seconds,
        }

    @_rpc
    def weightsync_end(self, request: dict[str, Any]) -> dict[str, Any]:
        """Verify the session's bytes, process the staged parameters and close the session.

        Request: ``{"digests": ..., "weight_version": str | null}``; ``digests`` is null (none
        sent), a list of ``{name: int}`` indexed by tp rank (every worker receives the same
        request through ``/collective_rpc``, so each picks its own), or one ``{name: int}``
        taken by every rank (what tp 1 needs).
        """
        receiver = _receiver(self)
        digests = _rank_digests(request.get("digests"), receiver.agent.parallelism)
        receiver.reset_apply_stats()
        check = receiver.agent.end_update(digests)
        version = request.get("weight_version")
        if version is not None and not check.mismatched:
            receiver.agent.set_weight_version(str(version))
        if check.verified:
            verdict = "verified"
        elif check.delta is False:
            verdict = "not verified (a delta of the session did not verify)"
        else:
            verdict = "not verified (no digests sent)"
        reply = {
            "message": (
                f"tp rank {receiver.agent.parallelism.tp_rank}: {verdict}; vLLM processed "
                f"{receiver.staging.num_layers} layer(s) again in {receiver.apply_s:.3f} s"
            ),
            "instance": INSTANCE,
            "verified": check.verified,
            "mismatched": list(check.mismatched),
            "changed": list(check.changed),
            "digest_s": check.seconds,
            "apply_s": receiver.apply_s,
            "applied_params": receiver.applied_params,
            "weight_version": receiver.agent.weight_version,
        }
        if check.mismatched:
            reply["success"] = False
            reply["message"] = (
                f"tp rank {receiver.agent.parallelism.tp_rank}: {len(check.mismatched)} "
                f"parameter(s) do not hold what the trainers wrote: "
                + ", ".join(check.mismatched[:8])
                + (", ..." if len(check.mismatched) > 8 else "")
            )
        return reply

    @_rpc
    def weightsync_checker(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run a weights-checker action. Request: ``{"action": "snapshot" | "reset_tensors" |
        "compare" | "checksum"}``."""
        action = request.get("action")
        if not isinstance(action, str):
            raise ValueError(
                'the request needs "action": snapshot, reset_tensors, compare or checksum'
            )
        result = _receiver(self).agent.weights_checker(action)
        return {"success": result.success, "message": result.message, "details": result.details}

    @_rpc
    def weightsync_delta_checksums(self, request: dict[str, Any]) -> dict[str, Any]:
        """This rank's checksums of every parameter (`weightsync.delta_codec.checksums`), the
        base a delta is proven against; inside an open session the rank keeps them for its
        deltas' ``"changes"`` check. Request: ``{}``."""
        receiver = _receiver(self)
        return {
            "rank": receiver.agent.parallelism.tp_rank,
            "checksums": receiver.agent.delta_checksums(),
        }

    @_rpc
    def weightsync_apply_delta(self, request: dict[str, Any]) -> dict[str, Any]:
        """Apply the delta payloads trainers wrote into this rank's delta region, inside the
        open session, and check the result (`RolloutAgent.apply_delta`).

        Request: ``{"ranks": {"<tp rank>": {"payloads": [[offset, num_bytes], ...],
        "expected": {name: checksum}}, ...}, "check": "changes" | "full"}``; every worker
        takes its own entry (a rank without one fails). ``success`` is whether the delta
        applied and verified; the session's end will not verify after one that did not.
        """
        receiver = _receiver(self)
        rank = receiver.agent.parallelism.tp_rank
        ranks = request.get("ranks")
        if not isinstance(ranks, dict) or str(rank) not in ranks:
            raise ValueError(f'the request\'s "ranks" has no entry for tp rank {rank}')
        entry = ranks[str(rank)]
        payloads = [(int(offset), int(num_bytes)) for offset, num_bytes in entry["payloads"]]
        expected = {str(name): int(value) for name, value in entry["expected"].items()}
        result = receiver.agent.apply_delta(
            payloads, expected, check=str(request.get("check") or "changes")
        )
        reply: dict[str, Any] = {"rank": rank, **result.to_dict()}
        if not result.verified:
            reply["success"] = False
            reply["message"] = f"tp rank {rank}: the delta did not verify: " + (
                result.error or "mismatched " + ", ".join(result.mismatched[:8])
            )
        return reply


@contextlib.contextmanager
def _every_cpu() -> Iterator[None]:
    """Let the threads started inside the block run on every CPU the process may use.

    vLLM's CPU build pins each worker's thread to the cores of its OpenMP threads
    (``VLLM_CPU_OMP_THREADS_BIND``), and a thread inherits its creator's CPUs: Mooncake's
    transfer threads, started from here, would otherwise share those cores (on a 2-core
    machine, a third of the push rate: 0.21 s against 0.06 s for 133 MB). The worker's own
    thread gets its CPUs back at the end of the block.
    """
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    pinned = os.sched_getaffinity(0)
    try:
        # The kernel keeps only the CPUs the process's cpuset allows.
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pinned = None
    try:
        yield
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)


def _delta_region_bytes(request: Mapping[str, Any]) -> int:
    """The delta region's size: the request's ``delta_region_bytes``, else
    ``WEIGHTSYNC_DELTA_REGION_MB`` MiB from vLLM's environment (the trainer side's first call
    names no size: the replica's operator chooses it, as ``weightsync serve
    --delta-region-mb`` does), else 0.

    Raises:
        ValueError: a size that is not a non-negative integer.
    """
    asked = request.get("delta_region_bytes")
    if asked is not None:
        return int(asked)
    mib = os.environ.get(DELTA_REGION_ENV, "").strip()
    if not mib:
        return 0
    if not mib.isdigit():
        raise ValueError(f"{DELTA_REGION_ENV}={mib!r}: expected a whole number of MiB")
    return int(mib) << 20


def _rank_digests(digests: Any, parallelism: ParallelismConfig) -> dict[str, int] | None:
    """This rank's expected digests out of an end request's ``digests`` (see
    `WorkerExtension.weightsync_end`).

    Raises:
        ValueError: a list whose length is not the TP size, or a value that is not a mapping
            of names to ints.
    """
    if digests is None:
        return None
    if isinstance(digests, list):
        if len(digests) != parallelism.tp_size:
            raise ValueError(
                f"digests is a list of {len(digests)} ranks' digests; this replica has "
                f"tp_size={parallelism.tp_size}"
            )
        digests = digests[parallelism.tp_rank]
        if digests is None:
            return None
    if not isinstance(digests, dict):
        raise ValueError(f"digests must map parameter names to ints, got {type(digests).__name__}")
    return {str(name): int(value) for name, value in digests.items()}


def _receiver(worker: Any) -> _Receiver:
    receiver = getattr(worker, _STATE_ATTR, None)
    if receiver is None:
        raise RuntimeError("weightsync_init has not run on this worker")
    return receiver


class _Receiver:
    """One worker's weightsync state: its agent, staging, init reply and last apply's figures."""

    agent: RolloutAgent
    info: dict[str, Any]

    def __init__(self, staging: StagedLayers) -> None:
        self.staging = staging
        self.apply_s = 0.0
        self.applied_params = 0

    def reset_apply_stats(self) -> None:
        """Forget the last end's apply figures."""
        self.apply_s = 0.0
        self.applied_params = 0

    def apply(self) -> None:
        """`RolloutAgent`'s ``on_update_end``: vLLM processes the staged parameters again."""
        start = time.perf_counter()
        self.applied_params = self.staging.apply()
        self.apply_s = time.perf_counter() - start

    @classmethod
    def start(cls, worker: Any, request: Mapping[str, Any]) -> _Receiver:
        """Check vLLM's settings, measure and stage, register, and build the init reply.

        Raises:
            RefusedError: a vLLM setting the integration does not take.
            RuntimeError: the parameters differ from weightsync's layout of the rank.
        """
        from weightsync import __version__
        from weightsync.transport.mooncake import MooncakeConfig, MooncakeTransport

        config = worker.vllm_config
        parallelism = _parallelism(config)
        model = worker.model_runner.model
        # Reads the checkpoint from disk once more (vLLM's own reload, in place).
        cap = capture(model, lambda: worker.model_runner.reload_weights())
        staging = StagedLayers(cap)
        params = {
            weightsync_name(name): staging.views.get(weightsync_name(name), param)
            for name, param in model.named_parameters()
        }
        dtype = str(config.model_config.dtype).removeprefix("torch.")
        layout_checked = _check_layout(config.model_config.hf_config, parallelism, dtype, params)
        host = request.get("host") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
        with _every_cpu():
            transport = MooncakeTransport(
                MooncakeConfig(
                    hostname=str(host),
                    protocol=str(request.get("protocol") or "tcp"),
                    device_name=os.environ.get("MOONCAKE_DEVICE", ""),
                    timeout_s=float(request.get("timeout_s") or 30.0),
                    # The worker's stderr is vLLM's to format; Mooncake's lines stay on it.
                    capture_native_logs=False,
                )
            )
        receiver = cls(staging)
        try:
            receiver.agent = RolloutAgent(
                params=params,
                parallelism=parallelism,
                transport=transport,
                on_update_end=receiver.apply,
                # vLLM's processing derives its kernel tensors from the views; it rewrites
                # neither them nor the in-place parameters.
                post_load_writes_params=False,
                delta_region_bytes=_delta_region_bytes(request),
            )
        except BaseException:
            transport.close()
            raise
        agent = receiver.agent
        receiver.info = {
            "message": (
                f"tp rank {parallelism.tp_rank}: {len(cap.in_place)} parameter(s) in place "
                f"({len(cap.reprocessed)} of them reprocessed at each end), "
                f"{len(staging.views)} staged ({staging.num_bytes} bytes); capture "
                f"{cap.seconds:.3f} s"
            ),
            "rank": parallelism.tp_rank,
            "instance": INSTANCE,
            "session_id": agent.session_id,
            "weights_info": agent.weights_info(),
            "registered_regions": [list(region) for region in agent.regions],
            "delta_region": None if agent.delta_region is None else list(agent.delta_region),
            "parallelism_config": parallelism.to_dict(),
            "dtype": dtype,
            "in_place": list(cap.in_place),
            "staged": list(staging.views),
            "reprocessed": list(cap.reprocessed),
            "staged_bytes": staging.num_bytes,
            "reprocessed_layers": staging.num_layers,
            "capture_s": cap.seconds,
            "layout_checked": layout_checked,
            "checker": CHECKER_SCOPE,
            "weightsync_version": __version__,
            "vllm_version": _vllm.vllm_version(),
        }
        logger.info(
            "weightsync: tp rank %d ready at %s: %d parameters in place, %d staged (%d bytes), "
            "capture %.2f s",
            parallelism.tp_rank,
            agent.session_id,
            len(cap.in_place),
            len(staging.views),
            staging.num_bytes,
            cap.seconds,
        )
        return receiver


def _check_layout(
    hf_config: Any, parallelism: ParallelismConfig, dtype: str, params: Mapping[str, torch.Tensor]
) -> bool:
    """Check the rank's parameters (names, shapes, dtypes) against weightsync's layout of the
    rank, which trainers plan with.

    Returns:
        True when checked; False when weightsync has no layout rule for the model (trainers
        cannot plan for it either, and say so).

    Raises:
        RuntimeError: a parameter is missing, extra, or differs in shape or dtype.
    """
    from weightsync.layout import rank_layout

    try:
        layout = rank_layout(hf_config, parallelism, dtype)
    except ValueError as err:
        logger.warning("weightsync: no layout to check the rank's parameters against: %s", err)
        return False
    problems = [f"missing {name}" for name in layout if name not in params]
    problems += [f"extra {name}" for name in params if name not in layout]
    for name, param in params.items():
        want = layout.get(name)
        if want is None:
            continue
        have_dtype = str(param.dtype).removeprefix("torch.")
        if tuple(param.shape) != tuple(want.shape) or have_dtype != want.dtype:
            problems.append(
                f"{name}: vLLM {tuple(param.shape)} {have_dtype}, layout {tuple(want.shape)} "
                f"{want.dtype}"
            )
    if problems:
        raise RuntimeError(
            f"tp rank {parallelism.tp_rank}: the parameters differ from weightsync's layout "
            f"({len(problems)} problem(s)): " + "; ".join(problems[:8])
        )
    return True


def _parallelism(config: Any) -> ParallelismConfig:
    """The rank's `ParallelismConfig`, after refusing what the integration does not take.

    Raises:
        RefusedError: pipeline or data parallelism, sleep mode, quantisation, or dummy
            weights (the message names the flag to change).
    """
    par = config.parallel_config
    model_config = config.model_config
    if par.pipeline_parallel_size > 1:
        raise RefusedError(
            f"pipeline parallelism (--pipeline-parallel-size {par.pipeline_parallel_size}) is "
            "not supported; run with --pipeline-parallel-size 1"
        )
    if par.data_parallel_size > 1:
        raise RefusedError(
            f"data parallelism (--data-parallel-size {par.data_parallel_size}) is not "
            "supported: vLLM then splits the MoE over TP x DP ranks of several engines (EP "
            "across DP), which is not taken yet; run each replica with --data-parallel-size 1"
        )
    if getattr(model_config, "enable_sleep_mode", False):
        raise RefusedError(
            "sleep mode (--enable-sleep-mode) frees and moves the weights trainers write "
            "into; start vLLM without it"
        )
    if model_config.quantization is not None:
        raise RefusedError(
            f"quantization {model_config.quantization!r} is not supported (the rank's layout "
            "is the unquantised one); start vLLM without --quantization and with an "
            "unquantised checkpoint"
        )
    load_format = str(getattr(config.load_config, "load_format", ""))
    if load_format == "dummy":
        raise RefusedError(
            "--load-format dummy: the rank measures which parameters vLLM repacks by reloading "
            "the checkpoint, and dummy weights have none; start vLLM with real weights"
        )
    return vllm_parallelism(
        tp_size=par.tensor_parallel_size,
        tp_rank=_vllm.tp_rank(),
        pp_size=par.pipeline_parallel_size,
        enable_expert_parallel=bool(par.enable_expert_parallel),
    )
