"""`ServeConfig`: everything `weightsync serve` needs to start one rollout replica."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync.control.loops import event_loop_factory
from weightsync.layout.config import model_dims
from weightsync.layout.dtypes import ROLLOUT_DTYPE_CHOICES, canonical_dtype_name
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.shared_experts import sglang_fuses_shared_experts
from weightsync.transport import TRANSPORTS
from weightsync.transport.mooncake import PROTOCOLS as MOONCAKE_PROTOCOLS

DEVICES = ("cpu", "cuda")
LOAD_FORMATS = ("safetensors", "dummy")
LOG_LEVELS = ("debug", "info", "warning", "error")
# The dtypes a reference replica holds its parameters in, by canonical name.
SERVED_DTYPES = tuple(canonical_dtype_name(choice) for choice in ROLLOUT_DTYPE_CHOICES)
MIB = 1 << 20
# Generation requests and control calls are small; the bootstrap server takes whole
# parameter tables (~100 bytes of JSON per parameter), so it allows far more.
DEFAULT_MAX_BODY_BYTES = 16 * MIB
DEFAULT_MAX_BOOTSTRAP_BODY_BYTES = 256 * MIB
# Each HTTP server's open connections: a trainer holds a few, a rollout client one per
# request in flight. Both servers full stay under the 1024 open files many systems allow a
# process by default.
DEFAULT_MAX_CONNECTIONS = 256
# A client sends a request head in one write: seconds are plenty, and bound what a caller
# without the key can hold.
DEFAULT_UNAUTHENTICATED_TIMEOUT_S = 5.0
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """One reference rollout replica: its model, parallelism, devices and endpoints.

    Attributes:
        model_path: HF checkpoint folder (config.json + safetensors; only config.json with
            ``load_format="dummy"``).
        tp_size: tensor-parallel ranks (one process each).
        ep_size: expert-parallel size inside the TP group (MoE models).
        attn_dp_size: attention data-parallel groups inside the TP group (SGLang's
            ``--attn-dp-size``, or ``--dp-size N --enable-dp-attention``): attention and
            ``embed_tokens`` split over the ``tp_size // attn_dp_size`` ranks of a group and
            replicated across groups, the MoE over the whole TP group (DeepSeek-V3 family).
        enable_dp_lm_head: an untied ``lm_head`` follows attention TP (SGLang's
            ``--enable-dp-lm-head``; needs ``attn_dp_size > 1``, as SGLang does).
        moe_dense_tp_size: SGLang's ``--moe-dense-tp-size``: None, 1 (dense MLP layers whole
            on every rank) or ``tp_size``.
        enforce_shared_experts_fusion: hold DeepSeek's shared expert as the experts' last slot
            (SGLang's ``--enforce-shared-experts-fusion``); without it the replica fuses where
            SGLang fuses by default (DeepSeek-V3/R1, 256 routed experts, one shared, ep 1,
            on CUDA).
        disable_shared_experts_fusion: never fuse them (SGLang's
            ``--disable-shared-experts-fusion``).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL; rank r uses GPU ``base_gpu_id + r``).
        base_gpu_id: the GPU of TP rank 0, as the process numbers GPUs (after
            ``CUDA_VISIBLE_DEVICES``); ``cuda`` only.
        dtype: parameter dtype name (``bfloat16``, ``float16``, ``float32``); ``None``: the
            checkpoint's.
        host: the interface the replica listens on (loopback unless told otherwise): both
            HTTP servers, and the TP group's rendezvous store and gloo sockets (those on
            `local_host`). Two libraries choose their own: Mooncake's TransferEngine listens
            on every interface whatever it is given (its handshake port on 0.0.0.0, its TCP
            data port on [::]; Mooncake has no setting for this, and every rank logs a
            warning naming both ports), and NCCL's bootstrap (``device="cuda"``) listens
            where ``NCCL_SOCKET_IFNAME`` says.
        port: main server port; 0 picks a free one.
        bootstrap_port: engine-info bootstrap server port; 0 picks a free one.
        api_key: bearer token required by every route of both servers but their health
            and readiness routes; ``None``: no auth.
        transport: ``mooncake`` (TCP / RDMA; GPU memory only with a CUDA build of Mooncake)
            or ``cuda_ipc`` (trainers on the same host write into the GPUs over CUDA IPC;
            needs ``device="cuda"``).
        mooncake_protocol: ``tcp``, ``rdma`` or ``auto``.
        weight_version: the label of the checkpoint's weights until the first update.
        ready_file: where to write the chosen ports as JSON once serving.
        num_threads: torch intra-op threads per rank.
        collective_timeout_s: how long one collective of the TP group may wait.
        log_level: ``debug``, ``info``, ``warning`` or ``error``.
        load_format: ``safetensors`` (the checkpoint's weights) or ``dummy`` (seeded
            synthetic weights, `weightsync.engine.synthetic`, generated on each rank's device).
        seed: the seed of ``dummy`` weights.
        extensions: modules of server extensions to load (`weightsync.server.extensions`),
            each adding routes and rank commands.
        max_body_bytes: the largest request body the main server reads; larger ones are
            answered 413.
        max_bootstrap_body_bytes: the same for the bootstrap server, whose registrations
            carry every parameter's address.
        max_connections: the most connections each HTTP server holds open at once
            (`weightsync.server.connections.ConnectionLimits`): past it, the oldest
            connection that has not sent an authenticated request makes room, or the new one
            is answered 503.
        unauthenticated_timeout_s: how long a connection that has not yet sent a request
            with the API key may take to send each request head, and its body; past it:
            408 and the connection closed. Authenticated connections stay open ten minutes
            between requests.
        max_new_tokens_limit: the most tokens one ``/generate`` may ask for; ``None``: the
            model's context length (``max_position_embeddings``), which also bounds prompt
            plus new tokens.
        fused_lifecycle: serve ``/begin_weight_sync`` and ``/end_weight_sync`` and advertise
            ``weight_sync_fused`` (off: only the eight standard lifecycle calls, as SGLang).
        event_loop: the main process's event loop (`weightsync.control.loops`): ``auto``
            (uvloop where installed), ``asyncio`` or ``uvloop``.
        delta_region_mb: MiB of the delta region each rank registers beside its parameters,
            which trainers write delta payloads into (``weight_sync_delta``); 0: none, the
            replica takes full syncs only.

    Raises:
        ValueError: a value out of range or not one of the choices.
    """

    model_path: str
    tp_size: int = 1
    ep_size: int = 1
    attn_dp_size: int = 1
    enable_dp_lm_head: bool = False
    moe_dense_tp_size: int | None = None
    enforce_shared_experts_fusion: bool = False
    disable_shared_experts_fusion: bool = False
    device: str = "cpu"
    base_gpu_id: int = 0
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int = 6789
    api_key: str | None = field(default=None, repr=False)
    transport: str = "mooncake"
    mooncake_protocol: str = "tcp"
    weight_version: str = "default"
    ready_file: str | None = None
    num_threads: int = 1
    collective_timeout_s: float = 600.0
    log_level: str = "info"
    load_format: str = "safetensors"
    seed: int = 0
    extensions: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_bootstrap_body_bytes: int = DEFAULT_MAX_BOOTSTRAP_BODY_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    unauthenticated_timeout_s: float = DEFAULT_UNAUTHENTICATED_TIMEOUT_S
    max_new_tokens_limit: int | None = None
    fused_lifecycle: bool = True
    event_loop: str = "auto"
    delta_region_mb: int = 0

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path must name a checkpoint folder")
        for name in (
            "tp_size",
            "ep_size",
            "attn_dp_size",
            "num_threads",
            "max_body_bytes",
            "max_bootstrap_body_bytes",
            "max_connections",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")
        self._check_moe_layout()
        for name in ("port", "bootstrap_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value!r}")
        if self.port and self.port == self.bootstrap_port:
            raise ValueError(f"port and bootstrap_port must differ, both are {self.port}")
        _choice("device", self.device, DEVICES)
        _choice("transport", self.transport, tuple(TRANSPORTS))
        if self.transport == "cuda_ipc" and self.device != "cuda":
            raise ValueError("transport cuda_ipc writes GPU memory; it needs device cuda")
        if not isinstance(self.base_gpu_id, int) or self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be a non-negative int, got {self.base_gpu_id!r}")
        if self.base_gpu_id and self.device != "cuda":
            raise ValueError("base_gpu_id picks GPUs; it needs device cuda")
        _choice("mooncake_protocol", self.mooncake_protocol, MOONCAKE_PROTOCOLS)
        _choice("log_level", self.log_level, LOG_LEVELS)
        event_loop_factory(self.event_loop)  # type: ignore[arg-type]  # checks the choice
        _choice("load_format", self.load_format, LOAD_FORMATS)
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.dtype is not None:
            try:
                dtype = canonical_dtype_name(self.dtype)
            except ValueError:
                dtype = None
            if dtype not in SERVED_DTYPES:
                raise ValueError(
                    f"dtype must be one of {', '.join(ROLLOUT_DTYPE_CHOICES)} (or "
                    f"{', '.join(SERVED_DTYPES)}); got {self.dtype!r}"
                )
            object.__setattr__(self, "dtype", dtype)
        if self.api_key is not None:
            if not self.api_key.strip():
                raise ValueError("api_key must not be empty; leave it out to disable auth")
            if any(char.isspace() or not char.isprintable() for char in self.api_key):
                raise ValueError(
                    "api_key must not hold whitespace or control characters (it travels in "
                    "an HTTP header); strip the key file or use another key"
                )
        object.__setattr__(self, "extensions", tuple(self.extensions))
        if any(not isinstance(name, str) or not name for name in self.extensions):
            raise ValueError(f"extensions must be module names, got {self.extensions!r}")
        if self.max_new_tokens_limit is not None and (
            not isinstance(self.max_new_tokens_limit, int) or self.max_new_tokens_limit < 1
        ):
            raise ValueError(
                "max_new_tokens_limit must be a positive int (or None for the model's context "
                f"length), got {self.max_new_tokens_limit!r}"
            )
        check_unauthenticated_timeout(self.unauthenticated_timeout_s)
        if (
            isinstance(self.delta_region_mb, bool)
            or not isinstance(self.delta_region_mb, int)
            or self.delta_region_mb < 0
        ):
            raise ValueError(
                f"delta_region_mb must be a non-negative int (0: no delta region), got "
                f"{self.delta_region_mb!r}"
            )
        if self.collective_timeout_s <= 0:
            raise ValueError(
                f"collective_timeout_s must be positive, got {self.collective_timeout_s}"
            )

    def _check_moe_layout(self) -> None:
        """Refuse the attention-DP, dense-TP and fusion settings SGLang refuses."""
        if self.tp_size % self.attn_dp_size:
            raise ValueError(
                f"attn_dp_size={self.attn_dp_size} must divide tp_size={self.tp_size} "
                "(attention-DP groups of equal size)"
            )
        for name in (
            "enable_dp_lm_head",
            "enforce_shared_experts_fusion",
            "disable_shared_experts_fusion",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if self.enable_dp_lm_head and self.attn_dp_size == 1:
            raise ValueError(
                "enable_dp_lm_head requires attention DP (attn_dp_size > 1), as SGLang does"
            )
        dense = self.moe_dense_tp_size
        if dense is not None and (isinstance(dense, bool) or dense not in (1, self.tp_size)):
            raise ValueError(
                f"moe_dense_tp_size must be None, 1 or tp_size={self.tp_size} (as SGLang "
                f"accepts), got {dense!r}"
            )
        if self.enforce_shared_experts_fusion and self.disable_shared_experts_fusion:
            raise ValueError(
                "enforce_shared_experts_fusion and disable_shared_experts_fusion exclude each other"
            )

    def parallelism(self, hf_config: dict[str, Any], tp_rank: int) -> ParallelismConfig:
        """TP rank `tp_rank`'s parallelism config for a model of `hf_config`, as SGLang
        derives it from the same arguments (fusing the shared experts where it would).

        Raises:
            ValueError: a bad rank or config.
        """
        fused = sglang_fuses_shared_experts(
            hf_config,
            ep_size=self.ep_size,
            disable_shared_experts_fusion=self.disable_shared_experts_fusion,
            enforce_shared_experts_fusion=self.enforce_shared_experts_fusion,
            device=self.device,
        )
        return ParallelismConfig(
            tp_size=self.tp_size,
            tp_rank=tp_rank,
            ep_size=self.ep_size,
            attn_dp_size=self.attn_dp_size,
            num_fused_shared_experts=model_dims(hf_config).n_shared_experts if fused else 0,
            moe_dense_tp_size=self.moe_dense_tp_size,
            enable_dp_lm_head=self.enable_dp_lm_head,
        )

    @property
    def local_host(self) -> str:
        """The address the replica's own processes meet at (the TP group's store and gloo
        sockets): `host`, or loopback when `host` is a wildcard, since nothing outside the
        replica connects there."""
        if self.host in _WILDCARD_HOSTS:
            return "::1" if self.host == "::" else "127.0.0.1"
        return self.host

    def gpu_id(self, tp_rank: int) -> int:
        """The CUDA device index of TP rank `tp_rank` (``device="cuda"``)."""
        return self.base_gpu_id + tp_rank

    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-able dict; ``ServeConfig(**to_dict())`` is an equal config."""
        return asdict(self)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_unauthenticated_timeout(timeout: object) -> None:
    """Refuse a timeout for callers without the key that is not a positive, finite number
    of seconds.

    Raises:
        ValueError: naming the value.
    """
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(
            f"unauthenticated_timeout_s must be a positive number of seconds, got {timeout!r}"
        )
