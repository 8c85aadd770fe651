"""`weightsync doctor`: will a sync work from here into these replicas? One row per check."""

from __future__ import annotations

import json
import os
from typing import Annotated, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from weightsync.cli.doctor_checks import FAIL, OK, CheckRow, DoctorOptions, run_checks
from weightsync.cli.logs import configure_logging

# Exit codes: a check failed, and bad command-line input.
_FAILED = 1
_USAGE_ERROR = 2
_MARKS = {OK: "[green]✓[/green]", FAIL: "[red]✗[/red]"}


def doctor(
    replica: Annotated[
        list[str] | None,
        typer.Option(
            "--replica", help="Base URL of a replica's main server (repeat for each replica)."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="The replicas' API key (default: $WEIGHTSYNC_API_KEY; none: no auth).",
            show_default=False,
        ),
    ] = None,
    transport: Annotated[
        str, typer.Option(help="Mooncake protocol a sync would use: tcp, rdma or auto.")
    ] = "auto",
    timeout_s: Annotated[float, typer.Option(help="Timeout of each remote call.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Show weightsync's and Mooncake's own log lines.")
    ] = False,
) -> None:
    """Check that a sync from this host into the replicas will work, before the first one.

    Checks the transport here (the Mooncake build and its engine, RDMA devices and whether
    it would fall back to TCP, CUDA and peer access between the visible GPUs, the
    memory-lock limit) and every replica: reachable, the protocol it speaks, the API key,
    settings that move weights (the memory saver), every rank's published transfer-engine
    info and parallelism, and a test write read back through the real transport into the
    scratch region the reference server offers (on SGLang, which offers none: a connection
    to every rank's transfer engine). Prints a row per check with what to do; exits 1 when
    any check fails.
    """
    # The environment is read here, at the entry point, and nowhere else.
    api_key = api_key if api_key is not None else os.environ.get("WEIGHTSYNC_API_KEY") or None
    console = Console(stderr=True)
    try:
        options = DoctorOptions(
            replicas=tuple(replica or ()), api_key=api_key, transport=transport,
            timeout_s=timeout_s,
        )  # fmt: skip
    except ValueError as exc:
        _usage(console, str(exc).replace("transport must", "--transport must"))
    configure_logging(verbose=verbose)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=as_json or not console.is_terminal,
    )
    with progress:
        task = progress.add_task("checking")
        rows = run_checks(options, on_step=lambda what: progress.update(task, description=what))
    ok = all(row.status != FAIL for row in rows)
    if as_json:
        print(json.dumps({"ok": ok, "checks": [row.to_dict() for row in rows]}))
    else:
        Console().print(_table(rows))
        failed = sum(row.status == FAIL for row in rows)
        if ok:
            console.print("[green]ok[/green]: every check passed")
        else:
            console.print(f"[red]{failed} check(s) failed[/red]; see 'what to do'")
    if not ok:
        raise typer.Exit(_FAILED)


def _table(rows: list[CheckRow]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title="weightsync doctor", title_justify="left")
    for column in ("", "where", "check", "found", "what to do"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            _MARKS.get(row.status, "[yellow]![/yellow]"), row.subject, row.name, row.detail,
            row.fix,
        )  # fmt: skip
    return table


def _usage(console: Console, message: str) -> NoReturn:
    console.print(f"weightsync doctor: {message}", style="red", markup=False)
    raise typer.Exit(_USAGE_ERROR)


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command to the ``weightsync`` app."""
    app.command("doctor")(doctor)
