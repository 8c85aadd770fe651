"""`weightsync push`: write a checkpoint folder into running replicas, point to point."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from weightsync.cli.logs import configure_logging
from weightsync.errors import WeightSyncError

logger = logging.getLogger(__name__)

# Exit codes: a replica did not take the update, and bad command-line input.
_FAILED = 1
_USAGE_ERROR = 2
_PROTOCOLS = ("tcp", "rdma", "auto")


def push(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="HF checkpoint folder: config.json and *.safetensors with HF names.",
            exists=True,
            file_okay=False,
        ),
    ],
    replica: Annotated[
        list[str],
        typer.Option(
            "--replica", help="Base URL of a replica's main server (repeat for each replica)."
        ),
    ],
    api_key: Annotated[
        str | None,
        typer.Option(
            help="The replicas' API key (default: $WEIGHTSYNC_API_KEY; none: no auth).",
            show_default=False,
        ),
    ] = None,
    version: Annotated[
        str | None,
        typer.Option(help="Weight version to label the pushed weights (default: the next)."),
    ] = None,
    check_weight_update_equal: Annotated[
        bool,
        typer.Option(
            "--check-weight-update-equal",
            help="Snapshot and corrupt the replicas first; require the push to restore them "
            "bit-exactly (they must already serve this checkpoint).",
        ),
    ] = False,
    transport: Annotated[
        str, typer.Option(help="Mooncake protocol: tcp, rdma or auto (RDMA where present).")
    ] = "auto",
    bucket_mb: Annotated[int, typer.Option(help="Staging bucket size in MiB.")] = 256,
    timeout_s: Annotated[float, typer.Option(help="Transfer timeout in seconds.")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Show weightsync's and Mooncake's own log lines.")
    ] = False,
) -> None:
    """Push a checkpoint's weights into running replicas (SGLang or `weightsync serve`).

    Checks every safetensors header first (dtypes, shapes, offsets inside the file, sizes,
    no overlaps): a bad file exits 2 naming it and the tensor, before any replica is
    touched. Then plans the copy against what every replica publishes and writes each
    replica's own layout into its registered memory, over Mooncake (RDMA, or TCP where there
    is none), reading the checkpoint a tensor at a time (host memory holds a few tensors and
    buckets, not the checkpoint).
    Runs the update lifecycle on every replica (pause, begin, push, version, end, resume).
    Exits 0 only when every replica took the update; a failure is one line on stderr. A file
    that changes during the push fails it, and the replicas stay paused until a later push
    lands. Operators use it to seed new replicas or roll back to a saved checkpoint.
    """
    # The environment is read here, at the entry point, and nowhere else.
    api_key = api_key if api_key is not None else os.environ.get("WEIGHTSYNC_API_KEY") or None
    console = Console(stderr=True)
    if transport not in _PROTOCOLS:
        _usage(console, f"--transport must be one of {', '.join(_PROTOCOLS)}, not {transport!r}")
    if bucket_mb < 1 or not timeout_s > 0:
        _usage(console, "--bucket-mb and --timeout-s must be positive")
    configure_logging(verbose=verbose)

    import weightsync as ws
    from weightsync.checkpoint import load_config_dict, open_safetensors
    from weightsync.export import CheckpointExport

    result: dict[str, Any] = {
        "ok": False,
        "bit_exact": None,
        "version": None,
        "replicas": [url.rstrip("/") for url in replica],
        "bytes": 0,
        "seconds": None,
    }
    try:
        hf_config = load_config_dict(checkpoint)
        config = ws.SyncConfig(
            # Staged writes only: the reader frees each tensor once it is staged, where a
            # direct write would keep it until the push ends (the whole checkpoint in memory).
            sender=ws.SenderConfig(
                bucket_bytes=bucket_mb << 20, timeout_s=timeout_s, direct="never"
            ),
            control=ws.ControlConfig(
                api_key=api_key, check_weight_update_equal=check_weight_update_equal
            ),
            transport=ws.MooncakeConfig(protocol=transport, timeout_s=timeout_s),
        )
        # Every header is checked here, before any replica is contacted.
        files = open_safetensors(checkpoint)
    except (OSError, ValueError) as exc:
        _usage(console, _one_line(exc))
    failure: str | None = None
    with files, _progress(console, quiet=as_json) as progress:
        progress.add_task(
            f"pushing {files.num_bytes / 1e9:.2f} GB of {checkpoint.name} into "
            f"{len(replica)} replica(s)"
        )
        try:
            with ws.TrainerSync(config, hf_config=hf_config, replicas=replica) as sync:
                report = sync.sync(CheckpointExport(files), version=version)
            result.update(report.to_dict(), ok=True)
        except (WeightSyncError, ValueError, OSError) as exc:
            failure = _one_line(exc)
        except Exception as exc:
            # Not an error the library reports (a bug, or a native library failing): still
            # one line; --verbose shows where it came from.
            logger.debug("push failed", exc_info=True)
            failure = f"{type(exc).__name__}: {_one_line(exc)}"
    if as_json:
        print(json.dumps({**result, "error": failure} if failure else result))
    elif failure is None:
        console.print(_table(result))
        exact = {True: ", bit-exact", None: ""}[result["bit_exact"]]
        console.print(
            f"[green]ok[/green]: version {result['version']} on {len(replica)} replica(s){exact}"
        )
    else:
        # One line however wide the terminal: scripts and log collectors read it whole.
        console.print(f"push failed: {failure}", style="red", markup=False, soft_wrap=True)
    if failure is not None:
        raise typer.Exit(_FAILED)


def _table(result: dict[str, Any]) -> Table:
    phases = result["phases"]
    table = Table(title="push; phases in seconds", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("MiB", "s", "GB/s", "writes", "pause", "meta", "push", "final", "resume"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result['bytes'] / 2**20:.2f}",
        f"{result['seconds']:.3f}",
        f"{result['gbps']:.3f}",
        str(result["num_writes"]),
        *(f"{phases[p]:.3f}" for p in ("pause", "metadata", "push", "finalize", "resume")),
    )
    return table


def _progress(console: Console, *, quiet: bool) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet or not console.is_terminal,
    )


def _one_line(error: BaseException) -> str:
    """`error`'s message and notes (where a failure left the replicas) on one line."""
    parts = [str(error), *getattr(error, "__notes__", ())]
    lines = (line.strip() for part in parts for line in part.splitlines())
    return "; ".join(line for line in lines if line) or type(error).__name__


def _usage(console: Console, message: str) -> NoReturn:
    console.print(f"weightsync push: {message}", style="red", markup=False, soft_wrap=True)
    raise typer.Exit(_USAGE_ERROR)


def register(app: typer.Typer) -> None:
    """Add the ``push`` command to the ``weightsync`` app."""
    app.command("push")(push)
