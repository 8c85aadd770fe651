"""The reference engine's model against HF transformers, at tp=1 in-process and tp=2 over gloo.

qwen3_moe runs at tp=2 with ep=1 (experts split by MoE-TP) and ep=2 (experts split by EP).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_cases import (
    CASES,
    MAX_NEW_TOKENS,
    PROMPTS,
    check_against_hf,
    hf_reference,
    run_engine,
    write_checkpoint,
)
from process_group import run_in_process_group
from weightsync.checkpoint import load_config_dict
from weightsync.engine import ReferenceModel, generate
from weightsync.layout import ParallelismConfig, rank_layout

TP2_RUNS = [(name, 1) for name in CASES] + [("qwen3_moe", 2)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, list]]]:
    """Each case's checkpoint folder and HF reference outputs."""
    root = tmp_path_factory.mktemp("engine_checkpoints")
    result = {}
    for name, config in CASES.items():
        path = root / name
        result[name] = (path, hf_reference(write_checkpoint(path, config)))
    return result


def _param_table(model: ReferenceModel) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]


def _layout_table(config: Any, parallelism: ParallelismConfig) -> list[tuple]:
    layout = rank_layout(config, parallelism, torch.float32)
    return [(p.name, p.shape, f"torch.{p.dtype}") for p in layout.values()]


def _tp2_job(rank: int, group, checkpoints: dict[str, str]) -> dict[str, Any]:
    """On each of two ranks: every case's outputs, parameter table and a few properties."""
    out: dict[str, Any] = {}
    for name, ep_size in TP2_RUNS:
        path = checkpoints[name]
        parallelism = ParallelismConfig(tp_size=2, tp_rank=rank, ep_size=ep_size)
        model = ReferenceModel(
            load_config_dict(path), parallelism, dtype=torch.float32, device="cpu", group=group
        )
        model.load_checkpoint(path)
        out[(name, ep_size)] = {**run_engine(model), "params": _param_table(model)}
    # Sampling: every rank draws the same tokens; the seed decides them.
    model = ReferenceModel(
        load_config_dict(checkpoints["qwen2"]),
        ParallelismConfig(tp_size=2, tp_rank=rank),
        dtype=torch.float32,
        device="cpu",
        group=group,
    )
    model.load_checkpoint(checkpoints["qwen2"])
    out["sampled"] = [
        generate(model, PROMPTS[1], max_new_tokens=16, temperature=1.5, seed=seed)
        for seed in (7, 7, 8)
    ]
    out["sampled_unseeded"] = generate(model, PROMPTS[1], max_new_tokens=16, temperature=1.5)
    # The best of three, so one stall of a busy host does not count.
    durations = []
    for _ in range(3):
        start = time.perf_counter()
        generate(model, PROMPTS[1], max_new_tokens=16)
        durations.append(time.perf_counter() - start)
    out["generate_16_s"] = min(durations)
    # bfloat16 runs over gloo too (the server's --dtype bf16 on CPU).
    bf16 = ReferenceModel(
        load_config_dict(checkpoints["qwen3_moe"]),
        ParallelismConfig(tp_size=2, tp_rank=rank, ep_size=2),
        dtype="bfloat16",
        device="cpu",
        group=group,
    )
    bf16.load_checkpoint(checkpoints["qwen3_moe"])
    out["bf16_tokens"] = generate(bf16, PROMPTS[2], max_new_tokens=MAX_NEW_TOKENS)
    try:
        ReferenceModel(
            load_config_dict(checkpoints["qwen2"]),
            ParallelismConfig(tp_size=4, tp_rank=rank),
            dtype=torch.float32,
            device="cpu",
            group=group,
        )
        out["group_mismatch"] = None
    except ValueError as exc:
        out["group_mismatch"] = str(exc)
    return out


@pytest.fixture(scope="module")
def tp2_results(checkpoints) -> list[dict[str, Any]]:
    """One spawned two-rank gloo job that runs every tp=2 case; results by rank."""
    paths = {name: str(path) for name, (path, _) in checkpoints.items()}
    return run_in_process_group(2, _tp2_job, paths, timeout_s=240)


@pytest.mark.parametrize("name", list(CASES))
def test_tp1_matches_hf(checkpoints, name):
    path, reference = checkpoints[name]
    model = ReferenceModel(
        load_config_dict(path), {"tp_size": 1, "tp_rank": 0}, dtype=torch.float32, device="cpu"
    )
    model.load_checkpoint(path)
    check_against_hf(run_engine(model), reference)


@pytest.mark.parametrize(("name", "ep_size"), TP2_RUNS)
def test_tp2_matches_hf(checkpoints, tp2_results, name, ep_size):
    path, reference = checkpoints[name]
    rank0, rank1 = (result[(name, ep_size)] for result in tp2_results)
    check_against_hf(rank0, reference)
    assert rank1["tokens"] == rank0["tokens"]
    for logits0, logits1 in zip(rank0["logits"], rank1["logits"], strict=True):
        assert torch.equal(logits0, logits1)
    for rank, result in enumerate((rank0, rank1)):
        parallelism = ParallelismConfig(tp_size=2, tp_rank=rank, ep_size=ep_size)
        assert result["params"] == _layout_table(load_config_dict(path), parallelism)


def test_tp2_sampling_is_seeded_and_shared_by_ranks(tp2_results):
    rank0, rank1 = tp2_results
    assert rank0["sampled"] == rank1["sampled"]
    assert rank0["sampled_unseeded"] == rank1["sampled_unseeded"]
    same_seed_a, same_seed_b, other_seed = rank0["sampled"]
    assert same_seed_a == same_seed_b
    assert other_seed != same_seed_a
    assert all(len(tokens) == 16 for tokens in rank0["sampled"])


def test_tp2_generation_is_fast_and_bf16_runs(tp2_results):
    rank0, rank1 = tp2_results
    # 16 tokens of a tiny model over gloo take ~0.1-0.25 s on a busy two-core host.
    assert rank0["generate_16_s"] < 1.0
    assert rank0["bf16_tokens"] == rank1["bf16_tokens"]
    assert len(rank0["bf16_tokens"]) == MAX_NEW_TOKENS


def test_group_must_match_parallelism(tp2_results):
    message = tp2_results[0]["group_mismatch"]
    assert message is not None
    assert "tp_size=4" in message
