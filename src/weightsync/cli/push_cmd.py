"""`weightsync push`: write a checkpoint folder into running replicas, point to point."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from weightsync.cli.logs import configure_logging
from weightsync.errors import WeightSyncError

if TYPE_CHECKING:
    from weightsync.checkpoint import SafetensorsCheckpoint

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
    delta_from: Annotated[
        Path | None,
        typer.Option(
            "--delta-from",
            help="Checkpoint folder the replicas serve now: write only what differs from it "
            "(each replica must prove it holds it, by checksums of every parameter).",
            exists=True,
            file_okay=False,
            show_default=False,
        ),
    ] = None,
    full_fallback: Annotated[
        bool,
        typer.Option(
            "--full-fallback",
            help="With --delta-from: write every byte into replicas that do not prove they "
            "serve it (default: refuse the push, writing nothing).",
        ),
    ] = False,
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

    With --delta-from BASE it writes only the elements where CHECKPOINT differs from BASE
    (to roll a fine-tune forward). BASE must hold the same tensors, shapes and dtypes (else
    exit 2, naming the first that differs). Each replica must prove it serves BASE: the
    checksum of every parameter it reports once its session began must equal the one
    computed from BASE as that replica lays it out. If one does not, nothing is written to
    any replica and they all serve on (exit 1, naming the replica and the first parameter
    that differs), unless --full-fallback writes every byte into those. Replicas need a
    delta region (weightsync serve --delta-region-mb); each checks the delta it applied.
    """
    # The environment is read here, at the entry point, and nowhere else.
    api_key = api_key if api_key is not None else os.environ.get("WEIGHTSYNC_API_KEY") or None
    console = Console(stderr=True)
    if transport not in _PROTOCOLS:
        _usage(console, f"--transport must be one of {', '.join(_PROTOCOLS)}, not {transport!r}")
    if bucket_mb < 1 or not timeout_s > 0:
        _usage(console, "--bucket-mb and --timeout-s must be positive")
    if delta_from is None and full_fallback:
        _usage(console, "--full-fallback is for a push with --delta-from")
    if delta_from is not None and check_weight_update_equal:
        # The check overwrites the replicas before the push: they could not prove a base.
        _usage(
            console,
            "--check-weight-update-equal needs replicas that already serve CHECKPOINT; it "
            "cannot be combined with --delta-from",
        )
    configure_logging(verbose=verbose)

    import weightsync as ws
    from weightsync.checkpoint import load_config_dict, open_safetensors
    from weightsync.export import CheckpointExport

    result: dict[str, Any] = {
        "ok": False,
        "bit_exact": None,
        "version": None,
        "replicas": [url.rstrip("/") for url in replica],
        "mode": "delta" if delta_from is not None else "full",
        "bytes": 0,
        "full_bytes": 0,
        "seconds": None,
    }
    failure: str | None = None
    with contextlib.ExitStack() as opened:
        try:
            hf_config = load_config_dict(checkpoint)
            config = ws.SyncConfig(
                # Staged writes only: the reader frees each tensor once it is staged, where a
                # direct write would keep it until the push ends (the whole checkpoint in
                # memory).
                sender=ws.SenderConfig(
                    bucket_bytes=bucket_mb << 20, timeout_s=timeout_s, direct="never"
                ),
                control=ws.ControlConfig(
                    api_key=api_key, check_weight_update_equal=check_weight_update_equal
                ),
                transport=ws.MooncakeConfig(protocol=transport, timeout_s=timeout_s),
                delta=delta_from is not None,
            )
            # Every header is checked here, before any replica is contacted.
            files = opened.enter_context(open_safetensors(checkpoint))
            base = None
            if delta_from is not None:
                base = opened.enter_context(open_safetensors(delta_from))
                differs = _first_difference(base, files)
                if differs is not None:
                    raise ValueError(
                        f"{checkpoint} cannot be pushed as a delta from {delta_from}: "
                        f"{differs}; both must hold the same tensors, shapes and dtypes"
                    )
        except (OSError, ValueError) as exc:
            _usage(console, _one_line(exc))
        what = f"{checkpoint.name} as a delta from {delta_from.name}" if delta_from else ""
        with _progress(console, quiet=as_json) as progress:
            progress.add_task(
                f"pushing {files.num_bytes / 1e9:.2f} GB of {what or checkpoint.name} into "
                f"{len(replica)} replica(s)"
            )
            try:
                with ws.TrainerSync(config, hf_config=hf_config, replicas=replica) as sync:
                    if base is not None:
                        # Writes nothing: the trainers' reference, and the checksums each
                        # replica must prove once its session began.
                        sync.adopt_base(CheckpointExport(base))
                    report = sync.sync(
                        CheckpointExport(files),
                        version=version,
                        require_delta=base is not None and not full_fallback,
                    )
                result.update(report.to_dict(), ok=True)
                result.update(_modes(result))
            except (WeightSyncError, ValueError, OSError) as exc:
                failure = _one_line(exc)
            except Exception as exc:
                # Not an error the library reports (a bug, or a native library failing):
                # still one line; --verbose shows where it came from.
                logger.debug("push failed", exc_info=True)
                failure = f"{type(exc).__name__}: {_one_line(exc)}"
    if as_json:
        print(json.dumps({**result, "error": failure} if failure else result))
    elif failure is None:
        console.print(_table(result))
        if result["writes"]:
            console.print(_writes_table(result))
        exact = {True: ", bit-exact", None: ""}[result["bit_exact"]]
        delta = ""
        if result["mode"] != "full" and result["full_bytes"]:
            share = result["bytes"] / result["full_bytes"]
            delta = f", {result['mode']}: {share:.1%} of a full write's bytes"
        console.print(
            f"[green]ok[/green]: version {result['version']} on {len(replica)} replica(s)"
            f"{exact}{delta}"
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


def _writes_table(result: dict[str, Any]) -> Table:
    """Per replica: delta or full, the bytes put on the wire against a full write's."""
    table = Table(title="per replica", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("replica", "mode", "MiB", "full MiB", "of full", "density"):
        table.add_column(column, justify="left" if column in ("replica", "mode") else "right")
    for url, write in result["writes"].items():
        full = write["full_bytes"]
        density = write["density"]
        table.add_row(
            url,
            write["mode"],
            f"{write['bytes'] / 2**20:.2f}",
            f"{full / 2**20:.2f}",
            f"{write['bytes'] / full:.1%}" if full else "-",
            f"{density:.2%}" if density is not None else "-",
        )
    return table


def _modes(result: dict[str, Any]) -> dict[str, Any]:
    """The push's ``mode`` (``delta``, ``full``, or ``mixed`` where replicas differ) and the
    bytes a full write of every replica takes (``full_bytes``), from its per-replica writes
    (none: a push without --delta-from, every byte written)."""
    writes = result["writes"].values()
    if not writes:
        return {"mode": "full", "full_bytes": result["bytes"]}
    modes = {write["mode"] for write in writes}
    return {
        "mode": modes.pop() if len(modes) == 1 else "mixed",
        "full_bytes": sum(write["full_bytes"] for write in writes),
    }


def _first_difference(base: SafetensorsCheckpoint, new: SafetensorsCheckpoint) -> str | None:
    """The first tensor (in `new`'s order) whose name, shape or dtype differs from `base`'s,
    in words; None when they hold the same tensors."""
    kept = {entry.name: entry for entry in base.entries}
    for entry in new.entries:
        was = kept.pop(entry.name, None)
        if was is None:
            return f"tensor {entry.name!r} is not in the base"
        if (was.dtype, was.shape) != (entry.dtype, entry.shape):
            return (
                f"tensor {entry.name!r} is {entry.dtype} {list(entry.shape)}, but "
                f"{was.dtype} {list(was.shape)} in the base"
            )
    if kept:
        return f"tensor {next(iter(kept))!r} of the base is not in it"
    return None


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
