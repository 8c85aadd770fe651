"""The `weightsync` command line: one Typer app, one sub-command per module in this package."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="weightsync",
    help="Move an RL trainer's weights into running inference engines, point to point.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """weightsync: point-to-point weight sync for RL post-training."""


def _register() -> None:
    # Sub-commands live in their own modules; each exposes `register(app)`.
    import importlib

    for module in ("plan_cmd", "serve_cmd", "demo_cmd", "bench_cmd"):
        try:
            mod = importlib.import_module(f"weightsync.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"weightsync.cli.{module}":
                raise
            continue
        mod.register(app)


_register()
