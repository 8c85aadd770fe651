"""Reading an HF checkpoint folder: its config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_config_dict(path: str | Path) -> dict[str, Any]:
    """Read a config.json, given the file or the checkpoint folder that holds it.

    Raises:
        ValueError: no config.json there, or it has no `model_type`.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json at {path}: pass a config.json or a checkpoint folder")
    data = json.loads(file.read_text())
    if "model_type" not in data:
        raise ValueError(f"{file} has no 'model_type'; is it a Hugging Face config.json?")
    return data
