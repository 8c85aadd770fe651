"""The `weightsync` command line: one Typer app, one sub-command per module in this package."""

from __future__ import annotations

import typer

from weightsync.cli import demo_cmd, doctor_cmd, plan_cmd, push_cmd, serve_cmd

app = typer.Typer(
    name="weightsync",
    help="Move an RL trainer's weights into running inference engines, point to point.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """weightsync: point-to-point weight sync for RL post-training."""


for _module in (demo_cmd, doctor_cmd, plan_cmd, push_cmd, serve_cmd):
    _module.register(app)


if __name__ == "__main__":  # pragma: no cover
    app()
