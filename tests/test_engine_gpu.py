"""The reference engine's model on CUDA: tp=1 on one GPU, tp=2 over NCCL, against HF on CPU."""

from __future__ import annotations

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
from weightsync.layout import ParallelismConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NCCL_RUNS = [(name, 1) for name in CASES] + [("qwen3_moe", 2)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, list]]]:
    """Each case's checkpoint folder and HF's (CPU, float32) reference outputs."""
    root = tmp_path_factory.mktemp("engine_gpu_checkpoints")
    return {
        name: (root / name, hf_reference(write_checkpoint(root / name, config)))
        for name, config in CASES.items()
    }


def _nccl_job(rank: int, group, paths: dict[str, str]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name, ep_size in NCCL_RUNS:
        model = ReferenceModel(
            load_config_dict(paths[name]),
            ParallelismConfig(tp_size=2, tp_rank=rank, ep_size=ep_size),
            dtype=torch.float32,
            device=f"cuda:{rank}",
            group=group,
        )
        model.load_checkpoint(paths[name])
        out[(name, ep_size)] = run_engine(model)
        out[(name, ep_size, "sampled")] = generate(
            model, PROMPTS[2], max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=5
        )
    bf16 = ReferenceModel(
        load_config_dict(paths["qwen3_moe"]),
        ParallelismConfig(tp_size=2, tp_rank=rank, ep_size=2),
        dtype="bfloat16",
        device=f"cuda:{rank}",
        group=group,
    )
    bf16.load_checkpoint(paths["qwen3_moe"])
    out["bf16_tokens"] = generate(bf16, PROMPTS[2], max_new_tokens=MAX_NEW_TOKENS)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_tp1_cuda_matches_hf(checkpoints, name):
    path, reference = checkpoints[name]
    model = ReferenceModel(
        load_config_dict(path), {"tp_size": 1, "tp_rank": 0}, dtype=torch.float32, device="cuda:0"
    )
    model.load_checkpoint(path)
    assert all(p.is_cuda for p in model.parameters())
    check_against_hf(run_engine(model), reference)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_nccl_matches_hf(checkpoints):
    paths = {name: str(path) for name, (path, _) in checkpoints.items()}
    rank0, rank1 = run_in_process_group(2, _nccl_job, paths, backend="nccl", timeout_s=300)
    for name, ep_size in NCCL_RUNS:
        check_against_hf(rank0[(name, ep_size)], checkpoints[name][1])
        assert rank1[(name, ep_size)]["tokens"] == rank0[(name, ep_size)]["tokens"]
        assert rank1[(name, ep_size, "sampled")] == rank0[(name, ep_size, "sampled")]
    assert rank0["bf16_tokens"] == rank1["bf16_tokens"]
    assert len(rank0["bf16_tokens"]) == MAX_NEW_TOKENS
