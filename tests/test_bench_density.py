"""`bench/density.py`: the counting on a hand-made change, and ``--quick`` as a smoke run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "bench" / "density.py"


def _bench_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_density", BENCH)
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up by name while the class is made.
    monkeypatch.setitem(sys.modules, spec.name, module)
    monkeypatch.setattr(sys, "path", [*sys.path])  # the bench puts bench/ first
    spec.loader.exec_module(module)
    return module


def test_one_changed_element_is_counted_in_every_encoding(monkeypatch):
    density = _bench_module(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 256, generator=gen) * 0.02
    weight[5, 7] = 0.01  # well inside its block's range, so the block's scale stays
    tensors = {"model.layers.0.mlp.down_proj.weight": weight, "model.norm.weight": torch.ones(256)}
    before = density.rollout_bits(tensors, 128)
    weight[5, 7] = -0.01
    after = density.rollout_bits(tensors, 128)
    row = density.compare(before, after)
    elements = 256 * 256 + 256
    assert row["bf16_changed"] == 1 and row["bf16_elements"] == elements
    assert row["fp8_codes_changed"] == 1 and row["fp8_codes"] == 256 * 256
    assert row["fp8_scales_changed"] == 0 and row["fp8_scales"] == 4
    assert row["bf16_delta_ratio"] == 4 / (2 * elements)
    # One code (offset + 1 byte) against codes, four float32 scales and the bf16 norm.
    assert row["fp8_delta_ratio"] == 3 / (256 * 256 + 4 * 4 + 2 * 256)
    # The library's payload adds its tables: more bytes than the bare entry, still few.
    assert 4 < row["bf16_codec_ratio"] * 2 * elements < 512
    unchanged = density.compare(after, after)
    assert unchanged["bf16_changed"] == unchanged["fp8_codes_changed"] == 0
    assert unchanged["fp8_codec_ratio"] > 0  # an empty payload is its header


def test_quick_bench_prints_a_table_and_one_json_line():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["bench"] == "density" and result["steps"] == 2
    rows = result["rows"]
    # Two models (a real LM loss, synthetic grads), three learning rates, two steps each.
    assert len(rows) == 2 * 3 * 2
    assert {row["grads"].split(" ")[0] for row in rows} == {"real", "synthetic"}
    for row in rows:
        for key in ("bf16_density", "fp8_code_density", "fp8_scale_density"):
            assert 0.0 < row[key] <= 1.0, (key, row)
        assert row["bf16_delta_ratio"] == 2 * row["bf16_density"]
        assert row["bf16_codec_ratio"] >= row["bf16_delta_ratio"]
    for model in {row["model"] for row in rows}:
        first = [r["bf16_density"] for r in rows if r["model"] == model and r["step"] == 1]
        assert first == sorted(first), "a larger lr changes more elements"
    assert "synthetic grads" in done.stdout and "fp8 delta/full" in done.stdout
