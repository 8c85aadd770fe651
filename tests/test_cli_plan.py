"""`weightsync plan` from the outside: real processes, real stdout, real exit codes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import weightsync
from weightsync.cli.main import app
from weightsync.layout import ParallelismConfig, rank_layout
from weightsync.testing.presets import preset_config

TINY_QWEN3 = Path(weightsync.__file__).parent / "configs" / "tiny-qwen3.json"
SCRIPT = Path(sys.executable).parent / "weightsync"


def _run(*args: str, module: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "weightsync"] if module else [str(SCRIPT)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    return subprocess.run(
        [*command, "plan", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_bundled_tiny_qwen3_config_is_the_tiny_preset() -> None:
    config = json.loads(TINY_QWEN3.read_text())
    assert config == {
        **preset_config("tiny"),
        "architectures": ["Qwen3ForCausalLM"],
        "torch_dtype": "bfloat16",
    }


def test_plan_json_for_two_replicas_and_four_sources() -> None:
    result = _run(
        "--model-config",
        str(TINY_QWEN3),
        "--rollout-tp",
        "2",
        "--replicas",
        "2",
        "--trainer-sources",
        "4",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    config = json.loads(TINY_QWEN3.read_text())

    targets = summary["targets"]
    assert [(t["replica"], t["rank"]) for t in targets] == [
        ("replica0", 0),
        ("replica0", 1),
        ("replica1", 0),
        ("replica1", 1),
    ]
    for target in targets:
        layout = rank_layout(config, ParallelismConfig(tp_size=2, tp_rank=target["rank"]))
        assert target["params"] == [
            {"name": name, "shape": list(p.shape), "dtype": "bfloat16"}
            for name, p in layout.items()
        ]
        assert target["bytes"] == sum(2 * math.prod(p["shape"]) for p in target["params"])
    assert {"model.layers.3.self_attn.qkv_proj.weight", "lm_head.weight"} <= {
        p["name"] for p in targets[0]["params"]
    }

    sources = summary["sources"]
    assert [s["rank"] for s in sources] == [0, 1, 2, 3]
    loads = [s["bytes"] for s in sources]
    assert all(load > 0 for load in loads)
    assert sum(loads) == sum(t["bytes"] for t in targets)
    assert isinstance(summary["imbalance"], float)
    assert summary["imbalance"] == pytest.approx(max(loads) / (sum(loads) / len(loads)))
    assert summary["imbalance"] < 1.1


def test_plan_table_through_the_console_script() -> None:
    result = _run(
        "--model-config",
        str(TINY_QWEN3),
        "--rollout-tp",
        "4",
        "--replicas",
        "2",
        "--trainer-sources",
        "4",
        "--trainer-pp",
        "2",
        "--dtype",
        "fp32",
        module=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("Rollout target ranks", "Trainer sources", "replica1-rank3:0", "imbalance"):
        assert text in out
    assert "dtype float32, 4 distinct layout(s)" in out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--trainer-sources", "5", "--trainer-pp", "2"],
            "error: --trainer-sources: 5 is not divisible by --trainer-pp 2; use a multiple of 2",
        ),
        (
            ["--rollout-tp", "3"],
            "error: --rollout-tp: 3 does not divide the model's num_attention_heads=4; "
            "use one of 1, 2, 4",
        ),
    ],
)
def test_bad_input_is_one_line_exit_code_two(args, expected) -> None:
    result = _run("--model-config", str(TINY_QWEN3), *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().startswith(expected)
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model-config", "/no/such/config.json"], "error: --model-config: /no/such"),
        (["--model-config", str(TINY_QWEN3.parent)], "error: --model-config: no config.json"),
        (["--model-config", "tiny-qwen3", "--dtype", "int8"], "error: --dtype: unknown dtype"),
        (["--model-config", "tiny-qwen3", "--rollout-ep", "3"], "error: --rollout-ep: 3 must"),
        (["--model-config", "tiny-qwen3", "--replicas", "0"], "error: --replicas: must be at"),
        (
            ["--model-config", "tiny-qwen3", "--trainer-pp", "8", "--trainer-sources", "8"],
            "error: --trainer-pp: 8 stages exceed the model's 4 layers; use at most 4",
        ),
    ],
)
def test_more_bad_input(args, expected) -> None:
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stderr.strip().startswith(expected)
    assert len(result.stderr.strip().splitlines()) == 1


def test_config_from_a_checkpoint_folder_and_unsupported_models(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny-moe")))
    result = CliRunner().invoke(
        app,
        ["plan", "--model-config", str(tmp_path), "--rollout-tp", "2", "--rollout-ep", "2"],
    )
    assert result.exit_code == 0, result.output
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    result = CliRunner().invoke(app, ["plan", "--model-config", str(tmp_path)])
    assert result.exit_code == 2
    assert "error: --model-config: unsupported model_type 'gpt2'" in result.stderr
