"""The layers of the design hold: `tests/import_contract.py` finds no violation in the
library, and finds one that is planted."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from import_contract import ALLOWED, check_tree

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "weightsync"


def test_the_library_keeps_its_import_contract() -> None:
    assert check_tree(PACKAGE) == []


def test_every_package_has_a_place_in_the_contract() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert packages | modules <= set(ALLOWED)


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("layout/planted.py", "import torch", "layout imports torch"),
        ("plan/planted.py", "import torch.distributed as dist", "plan imports torch.distributed"),
        ("plan/planted.py", "import aiohttp", "plan imports aiohttp"),
        ("layout/planted.py", "from weightsync.plan import build_plan", "layout imports"),
        (
            "plan/planted.py",
            "from weightsync.predict import predict_sync",
            "plan imports weightsync.predict",
        ),
        (
            "predict/planted.py",
            "import torch.distributed as dist",
            "predict imports torch.distributed",
        ),
        ("predict/planted.py", "import socket", "predict imports socket"),
        (
            "predict/planted.py",
            "from weightsync.transport import MooncakeConfig",
            "predict imports weightsync.transport",
        ),
        (
            "predict/planted.py",
            "from weightsync.sender import WeightSender",
            "predict imports weightsync.sender",
        ),
        (
            "manager/planted.py",
            "from weightsync.predict import predict_sync",
            "manager imports weightsync.predict",
        ),
        (
            "transport/planted.py",
            "from weightsync.layout import rank_layout",
            "transport imports weightsync.layout",
        ),
        ("receiver/planted.py", "from fastapi import FastAPI", "receiver imports fastapi"),
        (
            "manager/planted.py",
            "def f():\n    from weightsync.testing.presets import preset_config\n",
            "manager imports weightsync.testing",
        ),
        ("sender/planted.py", "from weightsync.manager import SyncManager", "sender imports"),
        ("server/planted.py", "from weightsync.baseline import BroadcastSync", "server imports"),
    ],
)
def test_a_planted_violation_is_found(
    tmp_path: Path, module: str, line: str, expected: str
) -> None:
    tree = tmp_path / "weightsync"
    shutil.copytree(PACKAGE, tree, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / module).write_text(line + "\n")
    problems = check_tree(tree)
    assert len(problems) == 1, problems
    assert expected in problems[0] and "planted.py" in problems[0]
