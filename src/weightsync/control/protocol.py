"""What a replica serves, read from its ``/server_info``: SGLang as released, SGLang with the
Miles extensions, weightsync's reference server, or vLLM with weightsync's worker extension
(whose ``/server_info`` `weightsync.control.vllm.VLLMClient` puts in SGLang's shape).

SGLang 0.5.23 serves no ``/parallelism_config`` (a rank's layout is derived here from its
server arguments, as SGLang derives it) and no ``/get_weight_version`` (the version is in
``/model_info``). The reference server advertises what it serves beyond SGLang in
``/server_info["weightsync"]["capabilities"]``; a server that advertises nothing is asked for
the Miles routes once and falls back to SGLang's where they are absent.

Some server settings make one-sided writes land in memory the engine no longer reads
(`refusal`): they are refused before any write, with the flag to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.layout.dtypes import canonical_dtype_name
from weightsync.layout.parallelism import ParallelismConfig

# Capabilities the reference server advertises.
PARALLELISM_CONFIG = "parallelism_config"  # GET /parallelism_config (Miles)
GET_WEIGHT_VERSION = "get_weight_version"  # GET /get_weight_version (Miles)
# Sessions are leases: begin_weight_update takes lease_s and returns a session_token that the
# session's other calls carry; POST /renew_weight_update extends it; an expired or abandoned
# session leaves the replica incomplete (refusing generation until a complete update).
WEIGHT_UPDATE_LEASE = "weight_update_lease"
# end_weight_update takes the trainers' digests (weightsync.layout.digest) and verifies them.
WEIGHT_UPDATE_DIGEST = "weight_update_digest"
# end_weight_update runs the engine's post-load processing (MLA's w_kc / w_vc, FP8 weights'
# post-processing) over the bytes that arrived in the session.
POST_LOAD_AT_UPDATE_END = "post_load_at_update_end"
# The first SGLang release whose end_weight_update re-runs post_load_weights and every
# process_weights_after_loading when nothing was loaded in the session.
_SGLANG_POST_LOAD = (0, 5, 23)
# POST /begin_weight_sync (pause, release the KV cache, begin a session) and POST
# /end_weight_sync (label, end the session, resume, flush, continue): the update lifecycle in
# two calls instead of eight, with each step's semantics and refusals.
WEIGHT_SYNC_FUSED = "weight_sync_fused"
# end_weight_sync takes after_events: IPC handles of the CUDA events a trainer's copies on the
# same host complete at; the replica waits for them (with the call's budget) before it
# verifies, so the end may be sent while the copies still run.
WEIGHT_SYNC_EVENTS = "weight_sync_events"
# begin_weight_sync takes fence: the replica queues the digest a session begins with on its
# GPU and answers at once with the IPC handles (one per tp rank) of the CUDA events it
# completes at; every writer waits for them before it writes (writers on the replica's host:
# a replica whose transport is CUDA IPC), and the end reports what changed outside a session.
WEIGHT_SYNC_FENCE = "weight_sync_fence"
# Delta syncs: every rank registers a delta region (its [addr, num_bytes] is the
# delta_region of /remote_instance_transfer_engine_info) that trainers write encoded changes
# into; POST /weightsync/delta_checksums reads every rank's checksums (weightsync.delta_codec)
# and POST /weightsync/apply_delta applies the payloads inside the open session and checks
# them, so the session's end counts as verified without digests.
WEIGHT_SYNC_DELTA = "weight_sync_delta"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaProtocol:
    """What one replica serves.

    Attributes:
        kind: ``"weightsync"`` (the reference server), ``"sglang"`` (SGLang, with or
            without the Miles extensions) or ``"vllm"`` (vLLM with weightsync's worker
            extension, driven by `weightsync.control.vllm.VLLMClient`).
        version: the server's version string.
        capabilities: the routes beyond SGLang 0.5.23 it advertises (for vLLM: what its
            worker extension serves).
    """

    kind: str
    version: str
    capabilities: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_server_info(cls, server_info: Mapping[str, Any]) -> ReplicaProtocol:
        """Read `server_info` (``GET /server_info``)."""
        advertised = server_info.get("weightsync")
        version = str(server_info.get("version", "unknown"))
        if server_info.get("engine") == "vllm":
            return cls(kind="vllm", version=version, capabilities=_vllm_capabilities(server_info))
        if isinstance(advertised, Mapping):
            return cls(
                kind="weightsync",
                version=str(advertised.get("version", version)),
                capabilities=frozenset(advertised.get("capabilities", ())),
            )
        return cls(kind="sglang", version=version)

    def serves(self, capability: str) -> bool:
        """Whether the replica advertised `capability`."""
        return capability in self.capabilities

    def runs_post_load(self) -> bool:
        """Whether ``end_weight_update`` runs the engine's post-load processing: what one-sided
        writes need for derived state (MLA's ``w_kc`` / ``w_vc``) to follow the weights.
        The reference server says so (`POST_LOAD_AT_UPDATE_END`); SGLang from 0.5.23 does."""
        if self.kind in ("weightsync", "vllm"):
            return self.serves(POST_LOAD_AT_UPDATE_END)
        numbers = []
        for part in self.version.split(".")[:3]:
            digits = "".join(c for c in part if c.isdigit())
            if not digits:
                return False
            numbers.append(int(digits))
        return tuple(numbers) >= _SGLANG_POST_LOAD

    def describe(self) -> str:
        """``"SGLang 0.5.23"``, ``"vLLM 0.32.0 (...)"`` or ``"weightsync 0.1.0
        (parallelism_config, ...)"``."""
        name = {"sglang": "SGLang", "vllm": "vLLM"}.get(self.kind, "weightsync")
        extras = f" ({', '.join(sorted(self.capabilities))})" if self.capabilities else ""
        return f"{name} {self.version}{extras}"


def _vllm_capabilities(server_info: Mapping[str, Any]) -> frozenset[str]:
    """What weightsync's worker extension serves inside a vLLM replica: each rank's
    parallelism, digests checked at the end of a session, and vLLM's own post-load
    processing run there over what arrived; delta syncs where every rank has a delta region.
    Nothing without the extension."""
    extension = server_info.get("weightsync_extension")
    ranks = extension.get("ranks") if isinstance(extension, Mapping) else None
    if not ranks:
        return frozenset()
    served = {PARALLELISM_CONFIG, WEIGHT_UPDATE_DIGEST, POST_LOAD_AT_UPDATE_END}
    if all(isinstance(r, Mapping) and r.get("delta_region") for r in ranks):
        served.add(WEIGHT_SYNC_DELTA)
    return frozenset(served)


def _vllm_refusal(server_info: Mapping[str, Any]) -> str | None:
    """Why a vLLM replica cannot take one-sided writes, naming what to change: no worker
    extension (or one that refused to start), a setting that moves or frees the weights, or
    a layout weightsync does not write into vLLM."""
    if server_info.get("enable_sleep_mode"):
        return (
            "enable_sleep_mode=True: vLLM's sleep frees and re-allocates the weight memory "
            "trainers write into; restart without --enable-sleep-mode"
        )
    for key, flag in (
        ("cpu_offload_gb", "--cpu-offload-gb 0"),
        ("offload_group_size", "--offload-group-size 0"),
    ):
        value = server_info.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return (
                f"{key}={value}: vLLM's weight offloading moves weights between host and "
                f"device, away from the registered memory; restart with {flag}"
            )
    for key, flag, what in (
        ("pp_size", "--pipeline-parallel-size 1", "pipeline-parallel vLLM replicas are"),
        ("dp_size", "--data-parallel-size 1 (one replica per copy)", "vLLM data parallelism is"),
    ):
        if _size(server_info, key) != 1:
            return f"{key}={server_info.get(key)}: {what} not written; restart with {flag}"
    quantization = server_info.get("quantization")
    if quantization not in (None, "", "none"):
        return (
            f"quantization={quantization!r}: quantised vLLM replicas are not written yet; "
            "serve the unquantised checkpoint"
        )
    extension = server_info.get("weightsync_extension")
    error = extension.get("error") if isinstance(extension, Mapping) else None
    if error or not isinstance(extension, Mapping) or not extension.get("ranks"):
        return (
            "weightsync's worker extension did not publish the ranks of this vLLM (start it with "
            "--worker-extension-cls weightsync.integrations.vllm.WorkerExtension and "
            f"VLLM_SERVER_DEV_MODE=1): {error or 'no ranks published'}"
        )
    return None


def num_ranks(server_info: Mapping[str, Any]) -> int:
    """How many ranks publish transfer-engine info (``tp_size * pp_size``).

    Raises:
        ValueError: no valid ``tp_size`` in `server_info`.
    """
    tp_size = server_info.get("tp_size")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"/server_info reports no valid tp_size ({tp_size!r})")
    pp_size = server_info.get("pp_size") or 1
    return tp_size * int(pp_size)


def _size(server_info: Mapping[str, Any], key: str) -> int:
    """``server_info[key]`` as a size: absent or null is 1.

    Raises:
        ValueError: a value that is not a positive int.
    """
    value = server_info.get(key)
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"/server_info reports {key}={value!r}: expected a positive int")
    return value


def attention_dp_size(server_info: Mapping[str, Any]) -> int:
    """How many attention data-parallel groups one replica's TP group holds.

    SGLang 0.5.23 reports the width as ``attn_dp_size`` (its ``--attn-dp-size``; the
    deprecated ``--dp-size N --enable-dp-attention`` resolves to ``attn_dp_size = N``,
    ``dp_size = 1``, and ``enable_dp_attention`` is reported as ``attn_dp_size > 1``). Servers
    that predate the key report the width as ``dp_size`` beside ``enable_dp_attention``; as
    SGLang resolves that spelling, ``dp_size`` counts only when ``attn_dp_size`` says 1.

    Raises:
        ValueError: a width that is not a positive int.
    """
    width = _size(server_info, "attn_dp_size")
    if width == 1 and server_info.get("enable_dp_attention"):
        return _size(server_info, "dp_size")
    return width


def _num_model_copies(server_info: Mapping[str, Any]) -> int:
    """How many copies of the model one server runs (SGLang's data-parallel controller): its
    ``dp_size``, except where the deprecated spelling made ``dp_size`` the attention-DP
    width (`attention_dp_size`).

    Raises:
        ValueError: a width that is not a positive int.
    """
    if _size(server_info, "attn_dp_size") == 1 and server_info.get("enable_dp_attention"):
        return 1
    return _size(server_info, "dp_size")


def derive_parallelism(
    server_info: Mapping[str, Any], rank: int, *, num_fused_shared_experts: int = 0
) -> ParallelismConfig:
    """Rank `rank`'s parallelism config, derived from a server's arguments as SGLang 0.5.23
    derives it (``compute_dp_attention_world_info``, ``derive_parallel_widths``).

    Used for servers without ``/parallelism_config``: ``tp_size``, ``pp_size``, ``ep_size``;
    attention DP (`attention_dp_size`): ``attn_tp_size = tp_size // attn_dp_size``,
    ``attn_tp_rank = tp_rank % attn_tp_size``, ``attn_dp_rank = tp_rank // attn_tp_size``;
    ``moe_dense_tp_size``; and ``enable_dp_lm_head``, which SGLang resolves to off without
    attention DP. ``/server_info`` cannot say whether SGLang fused the shared experts (it
    decides by the GPU): `num_fused_shared_experts` is what the rank's published parameters
    say (`weightsync.plan.served_targets`), 0 until they are read.

    Raises:
        ValueError: a rank outside the replica, sizes that are not positive ints or do not
            divide, or settings SGLang itself refuses (`refusal` names the flag).
    """
    tp_size = _size(server_info, "tp_size")
    pp_size = _size(server_info, "pp_size")
    if not 0 <= rank < tp_size * pp_size:
        raise ValueError(f"rank {rank} is outside a replica of {tp_size * pp_size} rank(s)")
    reason = _layout_refusal(server_info)
    if reason is not None:
        raise ValueError(reason)
    pp_rank, tp_rank = divmod(rank, tp_size)
    attn_dp_size = attention_dp_size(server_info)
    attn_tp_size = tp_size // attn_dp_size
    return ParallelismConfig(
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        ep_size=_size(server_info, "ep_size"),
        attn_tp_size=attn_tp_size,
        attn_tp_rank=tp_rank % attn_tp_size,
        attn_dp_size=attn_dp_size,
        attn_dp_rank=tp_rank // attn_tp_size,
        num_fused_shared_experts=num_fused_shared_experts,
        moe_dense_tp_size=server_info.get("moe_dense_tp_size"),
        enable_dp_lm_head=attn_dp_size > 1 and bool(server_info.get("enable_dp_lm_head")),
        world_size=tp_size * pp_size,
        global_rank=rank,
    )


def _layout_refusal(server_info: Mapping[str, Any]) -> str | None:
    """Why this replica's parallel layout cannot be written, naming the flag: sizes SGLang
    itself refuses (a server that reports them is not one SGLang runs), and layouts
    weightsync does not write.

    Raises:
        ValueError: a size that is not a positive int.
    """
    tp_size = _size(server_info, "tp_size")
    ep_size = _size(server_info, "ep_size")
    if tp_size % ep_size:
        return f"ep_size={ep_size} does not divide tp_size={tp_size}; SGLang refuses --ep-size"
    attn_dp_size = attention_dp_size(server_info)
    if tp_size % attn_dp_size:
        return (
            f"attention DP of {attn_dp_size} groups does not divide tp_size={tp_size} "
            "(--attn-dp-size, or --dp-size with --enable-dp-attention): SGLang does not run it"
        )
    dense = server_info.get("moe_dense_tp_size")
    if dense not in (None, 1, tp_size) or isinstance(dense, bool):
        return (
            f"moe_dense_tp_size={dense!r}: SGLang supports only None, 1 or tp_size={tp_size} "
            "(--moe-dense-tp-size)"
        )
    # SGLang turns --enable-dp-lm-head off when the server has one DP rank in all, and
    # refuses it with several but no attention DP.
    copies = _num_model_copies(server_info)
    if server_info.get("enable_dp_lm_head") and attn_dp_size == 1 and copies > 1:
        return (
            "enable_dp_lm_head without attention DP: SGLang requires --attn-dp-size (or "
            "--enable-dp-attention) for --enable-dp-lm-head"
        )
    if copies > 1:
        return (
            f"dp_size={copies}: one server runs {copies} copies of the model whose ranks "
            "publish their weights under the same tp ranks, so writes would reach one copy; "
            "serve one copy per server (--dp-size 1, one replica each) or use --attn-dp-size"
        )
    # Widths SGLang runs whose weight layouts weightsync does not write yet.
    for key, flag, what in (
        ("attn_cp_size", "--attn-cp-size 1", "attention context parallelism"),
        ("moe_dp_size", "--moe-dp-size 1", "MoE data parallelism"),
    ):
        if _size(server_info, key) != 1:
            return f"{key}={server_info.get(key)}: {what} is not written; restart with {flag}"
    return None


def served_dtype(server_info: Mapping[str, Any]) -> str | None:
    """The parameters' dtype a replica reports, or None when it names none (SGLang's
    ``"auto"`` picks one from the checkpoint by rules of its own)."""
    dtype = server_info.get("dtype")
    if dtype in (None, "auto"):
        return None
    try:
        return canonical_dtype_name(dtype)
    except ValueError:
        return None


# SGLang flags that move, free or repack parameter memory after it was registered, with the
# setting that is safe: (key in /server_info, is it on?, what to change).
_UNSAFE_FLAGS: tuple[tuple[str, Any, str], ...] = (
    (
        "enable_memory_saver",
        lambda v: bool(v),
        "the memory saver frees and re-allocates weight memory; restart without "
        "--enable-memory-saver",
    ),
    (
        "enable_weights_cpu_backup",
        lambda v: bool(v),
        "weights are backed up to and restored from host memory at new addresses; restart "
        "without --enable-weights-cpu-backup",
    ),
    (
        "cpu_offload_gb",
        lambda v: isinstance(v, int | float) and v > 0,
        "offloaded weights move between host and device; restart with --cpu-offload-gb 0",
    ),
    (
        "offload_group_size",
        lambda v: isinstance(v, int) and v > 0,
        "layer offloading moves weights; restart with --offload-group-size -1",
    ),
)
# SGLang's CPU backend repacks linear weights of these dtypes into new tensors on CPUs with
# AMX (at load and at every end_weight_update), so published addresses go stale.
_REPACKED_ON_CPU = frozenset({"bfloat16", "float16", "int8", "uint8", "float8_e4m3fn"})


def refusal(server_info: Mapping[str, Any]) -> str | None:
    """Why one-sided writes into this replica would not land in the weights it serves, or
    None when nothing does: the memory saver, weight offload or backup, SGLang's CPU weight
    repacking, sizes SGLang itself refuses (a server reporting them runs no layout SGLang
    has), and layouts weightsync does not write (pipeline parallelism, attention context
    parallelism, MoE data parallelism). Attention DP, ``--moe-dense-tp-size`` and
    ``--enable-dp-lm-head`` are written (`derive_parallelism`)."""
    if server_info.get("engine") == "vllm":
        try:
            return _vllm_refusal(server_info)
        except ValueError as exc:
            return str(exc)
    for key, is_on, advice in _UNSAFE_FLAGS:
        if is_on(server_info.get(key)):
            return f"{key}={server_info.get(key)!r}: {advice}"
    if ReplicaProtocol.from_server_info(server_info).kind == "sglang":
        device = str(server_info.get("device") or "")
        dtype = server_info.get("dtype")
        try:
            dtype_name = canonical_dtype_name(dtype) if dtype not in (None, "auto") else None
        except ValueError:
            dtype_name = None
        if device == "cpu" and (dtype_name is None or dtype_name in _REPACKED_ON_CPU):
            return (
                f"device=cpu with dtype={dtype!r}: SGLang's CPU backend repacks half-precision "
                "linear weights into new tensors on AMX CPUs, away from the registered "
                "addresses; serve with --dtype float32 (never repacked) or on GPU"
            )
    try:
        if _size(server_info, "pp_size") != 1:
            return (
                f"pp_size={server_info.get('pp_size')}: pipeline-parallel rollouts are not "
                "written; restart with --pp-size 1"
            )
        return _layout_refusal(server_info)
    except ValueError as exc:
        return str(exc)
