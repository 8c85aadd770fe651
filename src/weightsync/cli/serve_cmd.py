"""`weightsync serve`: run one reference rollout replica (every route of PROTOCOL.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from weightsync.server.config import ServeConfig

# Exit code for bad command-line input, as click uses for usage errors.
_USAGE_ERROR = 2
# What `weightsync serve` serves beyond PROTOCOL.md: the broadcast baseline's routes, so that
# the benchmarks can compare against it on the same replicas.
SERVER_EXTENSIONS = ("weightsync.baseline.receiver.extension",)


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
        str, typer.Option(help="Interface of both HTTP servers (loopback unless told).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Main server port; 0 picks a free one.")] = 30000,
    bootstrap_port: Annotated[
        int, typer.Option(help="Engine-info bootstrap server port; 0 picks a free one.")
    ] = 6789,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Bearer token every POST/PUT route requires (default: $WEIGHTSYNC_API_KEY; "
            "none: no auth).",
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
) -> None:
    """Serve a reference rollout replica: the main HTTP server, the engine-info bootstrap
    server, and one process per TP rank holding SGLang-layout weights that trainers write
    into over Mooncake or, on the same host, CUDA IPC. Parameters never move or get
    offloaded while it runs.

    Prints `weightsync serve: listening on http://HOST:PORT (bootstrap :BPORT)` once ready;
    stops cleanly on SIGINT / SIGTERM.
    """
    # The environment is read here, at the entry point, and nowhere else.
    api_key = api_key if api_key is not None else os.environ.get("WEIGHTSYNC_API_KEY") or None
    try:
        config = ServeConfig(
            model_path=str(model),
            tp_size=tp,
            ep_size=ep,
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
    except OSError as exc:
        typer.echo(f"weightsync serve: {exc}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to the ``weightsync`` app."""
    app.command("serve")(serve)
