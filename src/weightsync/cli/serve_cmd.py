"""`weightsync serve`: run one reference rollout replica (every route of docs/protocol.md)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from weightsync.server.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BOOTSTRAP_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_UNAUTHENTICATED_TIMEOUT_S,
    ServeConfig,
)
from weightsync.server.lifetime import (
    PARENT_PID_ENV,
    ParentGoneError,
    exit_with_parent,
    parent_pid_from_env,
)

# Exit code for bad command-line input, as click uses for usage errors.
_USAGE_ERROR = 2
# What `weightsync serve` serves beyond docs/protocol.md's main routes: the broadcast
# baseline's routes, so that the benchmarks can compare against it on the same replicas.
SERVER_EXTENSIONS = (
    "weightsync.baseline.receiver.extension",
    "weightsync.baseline.receiver.from_tensor",
)
API_KEY_ENV = "WEIGHTSYNC_API_KEY"


def serve(
    model: Annotated[
        Path,
        typer.Option(
            "--model",
            help="HF checkpoint folder (config.json + *.safetensors; config.json only with "
            "--load-format dummy).",
            exists=True,
            file_okay=False,
        ),
    ],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks (processes).")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel size; divides --tp.")] = 1,
    attn_dp_size: Annotated[
        int | None,
        typer.Option(
            "--attn-dp-size",
            help="Attention data-parallel groups inside the TP group (DeepSeek-V3 family): "
            "attention split over --tp / N ranks and replicated across groups, the MoE over "
            "all --tp ranks.",
            show_default=False,
        ),
    ] = None,
    enable_dp_attention: Annotated[
        bool,
        typer.Option(
            "--enable-dp-attention",
            help="SGLang's older spelling of DP attention: with --dp-size N, the same as "
            "--attn-dp-size N.",
        ),
    ] = False,
    dp_size: Annotated[
        int,
        typer.Option(
            "--dp-size",
            help="With --enable-dp-attention: the attention-DP groups. Without it, one "
            "replica serves one copy of the model (1).",
        ),
    ] = 1,
    enable_dp_lm_head: Annotated[
        bool,
        typer.Option(
            "--enable-dp-lm-head",
            help="Split an untied lm_head over attention TP, not the whole TP group (needs "
            "DP attention).",
        ),
    ] = False,
    moe_dense_tp_size: Annotated[
        int | None,
        typer.Option(
            "--moe-dense-tp-size",
            help="1: dense MLP layers whole on every rank (common with DP attention); "
            "default: split over TP.",
            show_default=False,
        ),
    ] = None,
    enforce_shared_experts_fusion: Annotated[
        bool,
        typer.Option(
            "--enforce-shared-experts-fusion",
            help="Hold DeepSeek's shared expert as the experts' last slot (w13_weight / "
            "w2_weight), as SGLang's flag does; default: fuse where SGLang fuses by default.",
        ),
    ] = False,
    disable_shared_experts_fusion: Annotated[
        bool,
        typer.Option(
            "--disable-shared-experts-fusion",
            help="Never fuse DeepSeek's shared experts into the routed experts.",
        ),
    ] = False,
    device: Annotated[
        str, typer.Option(help="cpu (gloo) or cuda (NCCL; rank r uses GPU base-gpu-id + r).")
    ] = "cpu",
    base_gpu_id: Annotated[
        int,
        typer.Option(
            help="GPU of TP rank 0 with --device cuda, among the visible ones "
            "(CUDA_VISIBLE_DEVICES applies first)."
        ),
    ] = 0,
    host: Annotated[
        str,
        typer.Option(
            help="Interface the replica listens on: both HTTP servers and the TP group "
            "(loopback unless told). Mooncake's ports listen on every interface regardless."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Main server port; 0 picks a free one.")] = 30000,
    bootstrap_port: Annotated[
        int, typer.Option(help="Engine-info bootstrap server port; 0 picks a free one.")
    ] = 6789,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Bearer token every route but /health and /ready requires. Visible to every "
            "user in the process list: prefer --api-key-file or $WEIGHTSYNC_API_KEY.",
            show_default=False,
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            help="Read the API key from this file (stripped; keep it mode 600). Default: "
            "$WEIGHTSYNC_API_KEY; neither: no auth.",
            exists=True,
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="Parameter dtype: bf16, fp16 or fp32 (default: the checkpoint's)."),
    ] = None,
    transport: Annotated[
        str,
        typer.Option(
            help="Transport trainers write with: mooncake (TCP/RDMA) or cuda_ipc (trainer on "
            "the same host; needs --device cuda)."
        ),
    ] = "mooncake",
    mooncake_protocol: Annotated[
        str, typer.Option(help="Mooncake protocol: tcp, rdma or auto.")
    ] = "tcp",
    weight_version: Annotated[
        str, typer.Option(help="Weight version of the checkpoint until the first update.")
    ] = "default",
    ready_file: Annotated[
        Path | None,
        typer.Option(
            help="Write {url, bootstrap_url, port, bootstrap_port, ...} as JSON here once serving."
        ),
    ] = None,
    num_threads: Annotated[int, typer.Option(help="Torch threads per rank.")] = 1,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    load_format: Annotated[
        str,
        typer.Option(
            help="safetensors (the checkpoint's weights) or dummy (seeded synthetic weights; "
            "the folder needs only config.json)."
        ),
    ] = "safetensors",
    seed: Annotated[int, typer.Option(help="Seed of --load-format dummy weights.")] = 0,
    max_body_bytes: Annotated[
        int, typer.Option(help="Largest request body of the main server; larger: 413.")
    ] = DEFAULT_MAX_BODY_BYTES,
    max_bootstrap_body_bytes: Annotated[
        int,
        typer.Option(
            help="Largest request body of the bootstrap server (rank registrations carry "
            "every parameter's address); larger: 413."
        ),
    ] = DEFAULT_MAX_BOOTSTRAP_BODY_BYTES,
    max_connections: Annotated[
        int,
        typer.Option(
            help="Most open connections of each HTTP server; past it the oldest one that has "
            "not sent the API key is closed to make room, else the new one gets 503."
        ),
    ] = DEFAULT_MAX_CONNECTIONS,
    unauthenticated_timeout_s: Annotated[
        float,
        typer.Option(
            metavar="<s>",
            help="Seconds a connection that has not yet sent the API key has to send each "
            "request head, then its body (408 and closed past it); authenticated "
            "connections stay open 10 minutes between requests.",
        ),
    ] = DEFAULT_UNAUTHENTICATED_TIMEOUT_S,
    max_new_tokens_limit: Annotated[
        int | None,
        typer.Option(
            help="Most tokens one /generate may ask for (default: the model's context "
            "length, max_position_embeddings).",
            show_default=False,
        ),
    ] = None,
    fused_lifecycle: Annotated[
        bool,
        typer.Option(
            help="Serve /begin_weight_sync and /end_weight_sync (the update lifecycle in two "
            "calls) and advertise them; off: only SGLang's eight calls."
        ),
    ] = True,
    loop: Annotated[
        str,
        typer.Option(
            help="The main process's event loop: auto (uvloop where installed), asyncio or uvloop."
        ),
    ] = "auto",
    delta_region_mb: Annotated[
        int,
        typer.Option(
            help="MiB of the delta region each rank registers beside its parameters, which "
            "trainers write only what changed into (advertised as weight_sync_delta); 0: "
            "none, full syncs only."
        ),
    ] = 0,
) -> None:
    """Serve a reference rollout replica: the main HTTP server, the engine-info bootstrap
    server, and one process per TP rank holding SGLang-layout weights that trainers write
    into over Mooncake or, on the same host, CUDA IPC. Parameters never move or get
    offloaded while it runs.

    Prints `weightsync serve: listening on http://HOST:PORT (bootstrap :BPORT)` once ready;
    stops cleanly on SIGINT / SIGTERM. Started with $WEIGHTSYNC_PARENT_PID (a launcher's
    pid), it stops as on SIGTERM when that process dies.
    """
    # The environment is read here, at the entry point, and nowhere else.
    _follow_parent(os.environ.pop(PARENT_PID_ENV, None))
    api_key = _api_key(api_key, api_key_file, os.environ.pop(API_KEY_ENV, None))
    attn_dp = _attention_dp_size(attn_dp_size, enable_dp_attention, dp_size)
    try:
        config = ServeConfig(
            model_path=str(model),
            tp_size=tp,
            ep_size=ep,
            attn_dp_size=attn_dp,
            enable_dp_lm_head=enable_dp_lm_head,
            moe_dense_tp_size=moe_dense_tp_size,
            enforce_shared_experts_fusion=enforce_shared_experts_fusion,
            disable_shared_experts_fusion=disable_shared_experts_fusion,
            device=device,
            base_gpu_id=base_gpu_id,
            dtype=dtype,
            host=host,
            port=port,
            bootstrap_port=bootstrap_port,
            api_key=api_key,
            transport=transport,
            mooncake_protocol=mooncake_protocol,
            weight_version=weight_version,
            ready_file=str(ready_file) if ready_file else None,
            num_threads=num_threads,
            log_level=log_level,
            load_format=load_format,
            seed=seed,
            extensions=SERVER_EXTENSIONS,
            max_body_bytes=max_body_bytes,
            max_bootstrap_body_bytes=max_bootstrap_body_bytes,
            max_connections=max_connections,
            unauthenticated_timeout_s=unauthenticated_timeout_s,
            max_new_tokens_limit=max_new_tokens_limit,
            fused_lifecycle=fused_lifecycle,
            event_loop=loop,
            delta_region_mb=delta_region_mb,
        )
    except ValueError as exc:
        typer.echo(f"weightsync serve: {exc}", err=True)
        raise typer.Exit(_USAGE_ERROR) from exc
    if device == "cuda":
        import torch

        needed = base_gpu_id + tp
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < needed:
            typer.echo(
                f"weightsync serve: --device cuda --tp {tp} --base-gpu-id {base_gpu_id} needs "
                f"{needed} visible GPUs, found {found}",
                err=True,
            )
            raise typer.Exit(_USAGE_ERROR)

    from weightsync.server.serve import serve as run_replica

    try:
        code = run_replica(config)
    except (OSError, ValueError) as exc:
        typer.echo(f"weightsync serve: {exc}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


def _attention_dp_size(attn_dp_size: int | None, enable_dp_attention: bool, dp_size: int) -> int:
    """The attention-DP width from --attn-dp-size, or --dp-size with --enable-dp-attention
    (SGLang resolves the older spelling to the same width in one copy of the model).

    Raises:
        typer.Exit: --dp-size above 1 without --enable-dp-attention (several copies of the
            model in one replica), or the two spellings disagreeing (code 2).
    """
    if dp_size != 1 and not enable_dp_attention:
        _usage_error(
            f"--dp-size {dp_size} without --enable-dp-attention asks for {dp_size} copies of "
            "the model; a reference replica serves one (start one replica per copy), or add "
            "--enable-dp-attention for attention-DP groups"
        )
    width = dp_size if enable_dp_attention else 1
    if attn_dp_size is not None and enable_dp_attention and attn_dp_size != width:
        _usage_error(
            f"--attn-dp-size {attn_dp_size} and --enable-dp-attention --dp-size {dp_size} "
            "disagree; give one of them"
        )
    return attn_dp_size if attn_dp_size is not None else width


def _follow_parent(parent_pid: str | None) -> None:
    """With a launcher's pid, stop (SIGTERM) when the launcher dies; exit if it already has."""
    try:
        pid = parent_pid_from_env(parent_pid)
        if pid is not None:
            exit_with_parent(pid)
    except ValueError as exc:
        typer.echo(f"weightsync serve: {exc}", err=True)
        raise typer.Exit(_USAGE_ERROR) from exc
    except (ParentGoneError, OSError) as exc:
        typer.echo(f"weightsync serve: {exc}; not starting", err=True)
        raise typer.Exit(1) from exc


def _api_key(option: str | None, key_file: Path | None, env_value: str | None) -> str | None:
    """The API key from --api-key, --api-key-file or the environment, in that order.

    Raises:
        typer.Exit: both options given, or a key file that is empty or unreadable (code 2).
    """
    if option is not None and key_file is not None:
        _usage_error("give the API key once: --api-key or --api-key-file, not both")
    if option is not None:
        typer.echo(
            "weightsync serve: warning: --api-key puts the key in the process list, where "
            "every user of this machine can read it; use --api-key-file or "
            f"${API_KEY_ENV} instead",
            err=True,
        )
        return option
    if key_file is not None:
        try:
            mode = key_file.stat().st_mode
            key = key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            _usage_error(f"cannot read the API key from --api-key-file {key_file}: {exc}")
        if not key:
            _usage_error(
                f"--api-key-file {key_file} is empty: write the key into it, or leave the "
                "option out to serve without auth"
            )
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            typer.echo(
                f"weightsync serve: warning: --api-key-file {key_file} is readable by other "
                f"users (mode {stat.S_IMODE(mode):o}); chmod 600 it",
                err=True,
            )
        return key
    return env_value or None


def _usage_error(message: str) -> NoReturn:
    typer.echo(f"weightsync serve: {message}", err=True)
    raise typer.Exit(_USAGE_ERROR)


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to the ``weightsync`` app."""
    app.command("serve")(serve)
