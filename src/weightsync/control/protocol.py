"""What a replica serves, read from its ``/server_info``: SGLang as released, SGLang with the
Miles extensions, or weightsync's reference server.

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
        kind: ``"weightsync"`` (the reference server) or ``"sglang"`` (SGLang, with or
            without the Miles extensions).
        version: the server's version string.
        capabilities: the routes beyond SGLang 0.5.23 it advertises.
    """

    kind: str
    version: str
    capabilities: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_server_info(cls, server_info: Mapping[str, Any]) -> ReplicaProtocol:
        """Read `server_info` (``GET /server_info``)."""
        advertised = server_info.get("weightsync")
        version = str(server_info.get("version", "unknown"))
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
        if self.kind == "weightsync":
            return self.serves(POST_LOAD_AT_UPDATE_END)
        numbers = []
        for part in self.version.split(".")[:3]:
            digits = "".join(c for c in part if c.isdigit())
            if not digits:
                return False
            numbers.append(int(digits))
        return tuple(numbers) >= _SGLANG_POST_LOAD

    def describe(self) -> str:
        """``"SGLang 0.5.23"`` or ``"weightsync 0.1.0 (parallelism_config, ...)"``."""
        name = "SGLang" if self.kind == "sglang" else "weightsync"
        extras = f" ({', '.join(sorted(self.capabilities))})" if self.capabilities else ""
        return f"{name} {self.version}{extras}"


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


def derive_parallelism(server_info: Mapping[str, Any], rank: int) -> ParallelismConfig:
    """Rank `rank`'s parallelism config, derived from a server's arguments as SGLang does.

    Used for servers without ``/parallelism_config``: ``tp_size``, ``pp_size``, ``ep_size``,
    ``enable_dp_attention`` with ``dp_size``, and ``moe_dense_tp_size``.

    Raises:
        ValueError: a rank outside the replica, or sizes that do not divide.
    """
    tp_size = int(server_info.get("tp_size") or 1)
    pp_size = int(server_info.get("pp_size") or 1)
    ep_size = int(server_info.get("ep_size") or 1)
    if not 0 <= rank < tp_size * pp_size:
        raise ValueError(f"rank {rank} is outside a replica of {tp_size * pp_size} rank(s)")
    pp_rank, tp_rank = divmod(rank, tp_size)
    attn_dp_size = (
        int(server_info.get("dp_size") or 1) if server_info.get("enable_dp_attention") else 1
    )
    if tp_size % attn_dp_size:
        raise ValueError(f"dp_size={attn_dp_size} must divide tp_size={tp_size}")
    attn_tp_size = tp_size // attn_dp_size
    return ParallelismConfig(
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        ep_size=ep_size,
        attn_tp_size=attn_tp_size,
        attn_tp_rank=tp_rank % attn_tp_size,
        attn_dp_size=attn_dp_size,
        attn_dp_rank=tp_rank // attn_tp_size,
        world_size=tp_size * pp_size,
        global_rank=rank,
    )


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


def served_fp8_block(server_info: Mapping[str, Any]) -> int:
    """The block size of the block-FP8 weights a replica serves, 0 for unquantised ones.

    Read from SGLang's ``quantization`` key and the ``weight_block_size`` the reference
    server publishes beside it (DeepSeek-V3's and Kimi-K2's 128 when a server names FP8
    without a block).

    Raises:
        ValueError: a quantisation weightsync does not write (another method, non-square
            blocks).
    """
    method = server_info.get("quantization")
    if method in (None, "", "none"):
        return 0
    if method != "fp8":
        raise ValueError(
            f"the replica serves quantization={method!r}; weightsync writes unquantised and "
            "block-FP8 ('fp8') rollouts"
        )
    block = server_info.get("weight_block_size") or [128, 128]
    if len(block) != 2 or block[0] != block[1] or not isinstance(block[0], int) or block[0] < 1:
        raise ValueError(f"the replica serves FP8 with weight_block_size={block!r}: not square")
    return block[0]


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
    repacking, and layouts weightsync does not write (pipeline or attention data parallelism,
    a dense-MLP TP size of its own)."""
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
    if int(server_info.get("pp_size") or 1) != 1:
        return f"pp_size={server_info.get('pp_size')}: pipeline-parallel rollouts are not written"
    if server_info.get("enable_dp_attention"):
        return "enable_dp_attention: attention data parallelism is not written; restart without it"
    dense = server_info.get("moe_dense_tp_size")
    if dense not in (None, server_info.get("tp_size")):
        return (
            f"moe_dense_tp_size={dense}: dense MLPs split differently from the attention are not "
            "written; restart without --moe-dense-tp-size"
        )
    return None
