"""`MegatronExport`: a Megatron-core rank's boxes of HF tensors, read without a collective,
equal Megatron-Bridge's export of the same trained model, and together cover every tensor.

One 4-rank gloo group trains each configuration a few real steps (TP2, PP2, TP2×PP2 and TP4
with fewer key-value groups than TP ranks for a dense Qwen3; EP2 and PP2×EP2 for a Qwen3-MoE);
data parallel fills the rest of the 4 ranks.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from process_group import run_in_process_group
from weightsync.export.megatron import qkv_row_pieces
from weightsync.layout import hf_tensor_shapes
from weightsync.testing.presets import preset_config

DENSE = preset_config("tiny")
MOE = preset_config("tiny-moe", mlp_only_layers=[], num_experts=4)
CASES = {
    "dense-tp2": (DENSE, {"tp": 2}),
    "dense-pp2": (DENSE, {"pp": 2}),
    "dense-tp2-pp2": (DENSE, {"tp": 2, "pp": 2}),
    "dense-tp4": (DENSE, {"tp": 4}),
    "moe-ep2": (MOE, {"ep": 2}),
    "moe-pp2-ep2": (MOE, {"pp": 2, "ep": 2}),
}
WORLD = 4
STEPS = 2


def test_qkv_rows_split_per_query_group() -> None:
    # 2 groups of 2 q heads, head_dim 16: a group is [q 32; k 16; v 16] rows.
    assert qkv_row_pieces(2, 2, 16, 0, 128) == [
        (0, 32, "q", 0),
        (32, 48, "k", 0),
        (48, 64, "v", 0),
        (64, 96, "q", 32),
        (96, 112, "k", 16),
        (112, 128, "v", 16),
    ]
    # TP4 over 2 groups: windows of 32 rows cut a group inside q and across k / v.
    assert qkv_row_pieces(2, 2, 16, 32, 64) == [(32, 48, "k", 0), (48, 64, "v", 0)]
    assert qkv_row_pieces(2, 2, 16, 16, 40) == [(16, 32, "q", 16), (32, 40, "k", 0)]


def _megatron_rank(rank: int, group, cases: list[str]) -> dict:
    """Train every case, export it under `no_collectives`, compare with Megatron-Bridge."""
    import time

    from weightsync.testing.collectives import no_collectives
    from weightsync.testing.megatron.trainer import MegatronTrainer

    results = {}
    for case in cases:
        config, parallel = CASES[case]
        trainer = MegatronTrainer(config, **parallel)
        try:
            losses = trainer.train(STEPS)
            export = trainer.export()
            start = time.perf_counter()
            with no_collectives():
                holding = export.holding()
                streamed = [(name, tensor.clone()) for name, tensor in export]
            export_s = time.perf_counter() - start
            oracle = trainer.bridge_state()
        finally:
            trainer.close()
        differs = []
        for name, tensor in streamed:
            box = holding[name].held_box
            expected = oracle[name][tuple(slice(a, b) for a, b in box)]
            if expected.dtype != tensor.dtype or not torch.equal(expected, tensor):
                differs.append(f"{name}{box}")
        results[case] = {
            "losses": losses,
            "boxes": {name: (meta.shape, meta.held_box) for name, meta in holding.items()},
            "oracle_shapes": {name: tuple(t.shape) for name, t in oracle.items()},
            "differs": differs,
            "order": [name for name, _ in streamed] == list(holding),
            "export_s": export_s,
        }
    return results


@pytest.fixture(scope="module")
def megatron_runs() -> list[dict]:
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (scripts/setup installs it)")
    return run_in_process_group(WORLD, _megatron_rank, list(CASES), timeout_s=600)


@pytest.mark.megatron
@pytest.mark.parametrize("case", list(CASES))
def test_boxes_equal_megatron_bridge_and_cover_every_tensor(megatron_runs, case) -> None:
    config = CASES[case][0]
    runs = [run[case] for run in megatron_runs]
    hf_shapes = hf_tensor_shapes(config)
    for rank, run in enumerate(runs):
        assert run["differs"] == [], (rank, run["differs"][:5])
        assert run["order"], rank
        assert run["oracle_shapes"] == hf_shapes
    assert any(run["losses"] for run in runs)
    # Every element of every HF tensor lies in exactly one distinct box (replicas hold the
    # same box).
    held: dict[str, set] = {}
    for run in runs:
        for name, (shape, box) in run["boxes"].items():
            assert tuple(shape) == hf_shapes[name], name
            held.setdefault(name, set()).add(tuple(map(tuple, box)))
    assert set(held) == set(hf_shapes)
    for name, boxes in held.items():
        count = torch.zeros(hf_shapes[name], dtype=torch.int8)
        for box in boxes:
            count[tuple(slice(a, b) for a, b in box)] += 1
        assert bool((count == 1).all()), (name, sorted(boxes))
    # Sharded: no rank holds everything (with PP or TP or EP each rank holds less).
    total = sum(math.prod(s) for s in hf_shapes.values())
    for run in runs:
        mine = sum(math.prod(b - a for a, b in box) for _, box in run["boxes"].values())
        assert mine < total
