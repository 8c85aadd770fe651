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


# --- --simulate ----------------------------------------------------------------------------

_SMALL_CLUSTER = [
    "--simulate",
    "--preset",
    "qwen3-30b-a3b",
    "--trainer-gpus",
    "32",
    "--trainer-tp",
    "4",
    "--rollout-gpus",
    "16",
    "--rollout-tp",
    "4",
    "--nic-gbps",
    "200",
]


def test_simulate_json_predicts_the_data_phase() -> None:
    result = _run(*_SMALL_CLUSTER, "--json")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["trainer"] == {"gpus": 32, "tp": 4, "ep": 1, "pp": 4, "dp": 2}
    assert summary["rollout"] == {
        "gpus": 16,
        "replicas": 4,
        "tp": 4,
        "ep": 4,
        "dp_attention": 1,
        "fused_shared_experts": False,
        "moe_dense_tp_size": None,
        "dp_lm_head": False,
    }
    assert summary["network"]["nic_gbps"] == 200.0
    assert summary["fp8"] is False
    # Each rollout GPU receives a quarter of the bf16 model through one 25 GB/s NIC.
    config = json.loads((TINY_QWEN3.parent / "qwen3-30b-a3b.json").read_text())
    quarter = sum(
        p.num_bytes
        for p in rank_layout(config, ParallelismConfig(tp_size=4, tp_rank=0, ep_size=4)).values()
    )
    assert summary["ideal_lower_bound_s"] == pytest.approx(quarter / 25e9, rel=0.02)
    assert summary["bytes"] == pytest.approx(4 * 4 * quarter, rel=0.02)
    assert summary["lower_bound_s"] >= summary["ideal_lower_bound_s"]
    assert summary["makespan_s"] >= summary["lower_bound_s"]
    assert summary["ratio"] == pytest.approx(summary["makespan_s"] / summary["lower_bound_s"])
    assert summary["ratio"] < 1.3
    assert summary["round_robin_s"] > summary["makespan_s"]
    assert summary["broadcast_s"] > summary["makespan_s"]
    assert all(p["busy_s"] <= summary["makespan_s"] for p in summary["busiest_ports"])
    assert len(summary["busiest_ports"]) == 5


def test_simulate_table_names_the_plans() -> None:
    result = CliRunner().invoke(app, ["plan", *_SMALL_CLUSTER, "--fp8"])
    assert result.exit_code == 0, result.output
    for text in (
        "qwen3-30b-a3b (FP8): 32 trainer GPUs (tp 4 ep 1 pp 4 dp 2) -> 4 x tp 4 ep 4",
        "network schedule",
        "round robin (Miles-style)",
        "broadcast (full tensors)",
        "Busiest ports",
        "no schedule beats",
    ):
        assert text in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--simulate"], "error: --model-config: give a config (--model-config) or a --preset"),
        (["--simulate", "--preset", "gpt-5"], "error: --preset: unknown preset 'gpt-5'; use one"),
        (
            ["--simulate", "--preset", "dense-70b", "--trainer-gpus", "100"],
            "error: --trainer-gpus: 100 is not a multiple of --trainer-tp x --trainer-ep = 8",
        ),
        (
            ["--simulate", "--preset", "dense-70b", "--rollout-gpus", "12"],
            "error: --rollout-tp: 8 does not divide --rollout-gpus 12",
        ),
        (
            ["--simulate", "--preset", "dense-70b", "--replicas", "3"],
            "error: --replicas: 3 replicas of tp 8 are not --rollout-gpus 128; pass "
            "--rollout-gpus 24",
        ),
        (
            ["--simulate", "--preset", "dense-70b", "--trainer-pp", "3"],
            "error: --trainer-pp: 3 stages must be between 1 and the model's 80 layers",
        ),
        (
            ["--simulate", "--preset", "dense-70b", "--nics-per-node", "3"],
            "error: --nics-per-node: NetworkModel.nics_per_node=3 must divide gpus_per_node=8",
        ),
        (["--model-config", "tiny-qwen3", "--plot", "x.png"], "error: --plot: draws a --simulate"),
    ],
)
def test_simulate_bad_input_is_one_line_exit_code_two(args, expected) -> None:
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(expected), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_simulate_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (weightsync[plot])")
    path = tmp_path / "timeline.png"
    result = CliRunner().invoke(app, ["plan", *_SMALL_CLUSTER, "--plot", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"timeline written to {path}" in result.output.replace("\n", "")


# --- SGLang's DeepSeek layouts: attention DP, fused shared experts, dense TP -----------------


@pytest.fixture
def tiny_deepseek(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-deepseek.json"
    path.write_text(json.dumps(preset_config("tiny-deepseek")))
    return path


_LAYOUT_FLAGS = [
    "--rollout-tp",
    "4",
    "--rollout-ep",
    "2",
    "--rollout-dp-attention",
    "2",
    "--rollout-dp-lm-head",
    "--rollout-fused-shared-experts",
    "--rollout-moe-dense-tp-size",
    "1",
]


def test_plan_prints_attention_dp_fused_shared_experts_and_dense_tp(tiny_deepseek: Path) -> None:
    config = preset_config("tiny-deepseek")
    result = _run("--model-config", str(tiny_deepseek), *_LAYOUT_FLAGS, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rollout"] == {
        "tp": 4,
        "ep": 2,
        "replicas": 1,
        "dp_attention": 2,
        "fused_shared_experts": True,
        "moe_dense_tp_size": 1,
        "dp_lm_head": True,
    }
    for target in summary["targets"]:
        rank = target["rank"]
        parallelism = target["parallelism"]
        assert (parallelism["attn_tp_size"], parallelism["attn_dp_size"]) == (2, 2)
        assert (parallelism["attn_tp_rank"], parallelism["attn_dp_rank"]) == (rank % 2, rank // 2)
        assert parallelism["num_fused_shared_experts"] == 1
        assert parallelism["moe_dense_tp_size"] == 1 and parallelism["enable_dp_lm_head"]
        layout = rank_layout(config, ParallelismConfig.from_dict(parallelism))
        assert [p["name"] for p in target["params"]] == list(layout)
        assert layout["model.layers.1.mlp.experts.w13_weight"].shape[0] == 8 // 2 + 1

    table = _run("--model-config", str(tiny_deepseek), *_LAYOUT_FLAGS)
    assert table.returncode == 0, table.stderr
    for text in ("Rollout layouts", "tp 2 x dp 2", "ep 2 x tp 2", "fused (1 slot)", "replicated"):
        assert text in table.stdout, table.stdout
    assert "attn tp 2" in table.stdout


def test_plan_reports_the_engine_owned_fp8_kv_scales(tmp_path: Path) -> None:
    from weightsync.layout.quant import fp8_quantization_config

    path = tmp_path / "tiny-deepseek-fp8.json"
    config = {**preset_config("tiny-deepseek"), "quantization_config": fp8_quantization_config(128)}
    path.write_text(json.dumps(config))
    result = _run("--model-config", str(path), "--rollout-tp", "2", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    # Three layers, attn_mqa and attn_mha, k_scale and v_scale: on each of two ranks.
    assert summary["num_engine_owned"] == 2 * 3 * 2 * 2
    owned = summary["targets"][0]["engine_owned"]
    assert owned["model.layers.2.self_attn.attn_mha.v_scale"] == "fp8_kv_scale"
    table = _run("--model-config", str(path), "--rollout-tp", "2")
    assert "engine-owned, left alone: 24 parameters (fp8_kv_scale) on 2 rank(s)" in table.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--rollout-tp", "4", "--rollout-dp-attention", "3"],
            "error: --rollout-dp-attention: 3 must be at least 1 and divide --rollout-tp 4",
        ),
        (
            ["--rollout-tp", "4", "--rollout-moe-dense-tp-size", "2"],
            "error: --rollout-moe-dense-tp-size: 2: SGLang accepts only 1 or the TP size (4)",
        ),
        (
            ["--rollout-tp", "4", "--rollout-dp-lm-head"],
            "error: --rollout-dp-lm-head: needs attention DP",
        ),
        (
            ["--rollout-tp", "4", "--rollout-dp-attention", "0"],
            "error: --rollout-dp-attention: 0 must be at least 1",
        ),
    ],
)
def test_layouts_sglang_would_not_run_are_bad_input(tiny_deepseek: Path, args, expected) -> None:
    for simulate in ([], ["--simulate", "--rollout-gpus", "4", "--trainer-gpus", "8"]):
        result = CliRunner().invoke(
            app, ["plan", "--model-config", str(tiny_deepseek), *args, *simulate]
        )
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().startswith(expected), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_fused_shared_experts_need_shared_experts() -> None:
    result = CliRunner().invoke(
        app, ["plan", "--model-config", "tiny-qwen3", "--rollout-fused-shared-experts"]
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --rollout-fused-shared-experts: qwen3 has no")


def test_simulate_accepts_the_deepseek_layouts(tiny_deepseek: Path) -> None:
    base = ["--simulate", "--model-config", str(tiny_deepseek), "--rollout-gpus", "8"]
    cluster = [*base, "--trainer-gpus", "8", "--trainer-tp", "2", "--rollout-tp", "4", "--json"]
    plain = json.loads(_run(*cluster).stdout)
    result = _run(*cluster, *_LAYOUT_FLAGS[4:])
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rollout"]["dp_attention"] == 2 and summary["rollout"]["fused_shared_experts"]
    # Attention and the dense layers replicated over more ranks: more bytes to move.
    assert summary["bytes"] > plain["bytes"]
    assert summary["makespan_s"] >= summary["lower_bound_s"] > 0
    table = _run(*cluster[:-1], *_LAYOUT_FLAGS[4:])
    assert table.returncode == 0, table.stderr
    # The title names the layout (rich may wrap it at the terminal's width).
    title = " ".join(table.stdout.split())
    assert "dp-attention 2 dp-lm-head fused-shared-experts moe-dense-tp 1" in title
