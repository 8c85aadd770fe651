"""The command line is part of the API: its commands and options are frozen here.

A deliberate change regenerates the frozen copy:
``WEIGHTSYNC_UPDATE_CLI=1 .venv/bin/pytest tests/test_cli_surface.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer.main

from weightsync.cli.main import app

FROZEN = Path(__file__).with_name("cli_surface.json")


def _surface() -> dict:
    root = typer.main.get_command(app)
    commands = {}
    for name, command in sorted(root.commands.items()):
        params = []
        for param in command.params:
            default = param.default if isinstance(param.default, (int, float, str)) else None
            params.append(
                {
                    "opts": sorted(param.opts),
                    "default": default,
                    "is_flag": bool(getattr(param, "is_flag", False)),
                }
            )
        commands[name] = sorted(params, key=lambda p: p["opts"])
    return commands


def test_cli_surface_is_frozen():
    surface = _surface()
    if os.environ.get("WEIGHTSYNC_UPDATE_CLI"):
        FROZEN.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
    frozen = json.loads(FROZEN.read_text())
    assert surface == frozen, (
        "the CLI changed; if that is deliberate, regenerate tests/cli_surface.json with "
        "WEIGHTSYNC_UPDATE_CLI=1 .venv/bin/pytest tests/test_cli_surface.py"
    )
