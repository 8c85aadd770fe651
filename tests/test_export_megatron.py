"""A Megatron-core trainer as a source: each rank's boxes of HF tensors, read without a
collective, equal Megatron-Bridge's export of the same trained model and together cover every
tensor; synced straight from the shards into a reference replica of another tp / ep, the
replica holds the Bridge export bit for bit and generates what it generates.

One 4-rank gloo group trains each configuration a few real steps (TP2, PP2, TP2×PP2 and TP4
with fewer key-value groups than TP ranks, uneven PP2 for a dense Qwen3; EP2 and PP2×EP2 for a
Qwen3-MoE; PP2 with 2 virtual stages is built, not trained); data parallel fills the rest of
the 4 ranks.
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
# case: (config, the trainer's parallel sizes, the replica's tp and ep)
CASES = {
    "dense-tp2": (DENSE, {"tp": 2}, {"tp": 1}),
    "dense-pp2": (DENSE, {"pp": 2}, {"tp": 2}),
    "dense-tp2-pp2": (DENSE, {"tp": 2, "pp": 2}, {"tp": 1}),
    # Export only: their rules are what the other cases' syncs do not already show.
    "dense-tp4": (DENSE, {"tp": 4}, None),
    "dense-pp2-vpp2": (DENSE, {"pp": 2, "vpp": 2}, None),  # layers 0, 2 | 1, 3
    "dense-pp2-uneven": (DENSE, {"pp": 2, "first_stage_layers": 1}, None),  # 1 | 3 layers
    "moe-ep2": (MOE, {"ep": 2}, {"tp": 2}),
    "moe-pp2-ep2": (MOE, {"pp": 2, "ep": 2}, {"tp": 1}),
}
PROMPTS = ((3, 14, 15, 92, 65), (2, 71, 82))
DRIFT_CASE = "dense-tp2"  # where a drifted replicated copy must be refused
NEW_TOKENS = 5
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


def _megatron_rank(rank: int, group, cases: list[str], tmp: str) -> dict:
    """Train every case, export it under `no_collectives`, compare with Megatron-Bridge, and
    sync it into a replica that serves the Bridge export (which the sync's check snapshots,
    corrupts and compares)."""
    import time

    from weightsync.testing.collectives import no_collectives
    from weightsync.testing.megatron.trainer import MegatronTrainer

    results = {}
    for case in cases:
        config, parallel, replica = CASES[case]
        trainer = MegatronTrainer(config, **parallel)
        try:
            # Virtual pipeline stages: built and exported, not trained.
            losses = [] if "vpp" in parallel else trainer.train(STEPS)
            export = trainer.export()
            start = time.perf_counter()
            with no_collectives():
                holding = export.holding()
                streamed = [(name, tensor.clone()) for name, tensor in export]
            export_s = time.perf_counter() - start
            oracle = trainer.bridge_state()
            synced = {}
            if replica is not None:
                drift = case == DRIFT_CASE
                synced = _sync(
                    rank, group, trainer, export, oracle, replica, f"{tmp}/{case}", drift
                )
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
            **synced,
        }
    return results


def _sync(rank, group, trainer, export, oracle, replica: dict, folder: str, drift: bool) -> dict:
    """Serve `oracle` from a replica, sync `export` into it (bit-exact check on), and on
    rank 0 compare the replica's tokens with the oracle's; with `drift`, then refuse a sync
    whose replicated copies differ (one rank's norm perturbed)."""
    import asyncio
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import weightsync as ws
    from weightsync.errors import WeightsRefusedError
    from weightsync.testing.launcher import start_replicas
    from weightsync.testing.presets import build_hf_config
    from weightsync.testing.reference import greedy_tokens, served_tokens

    path = Path(folder)
    replicas: list = []
    urls = [None]
    if rank == 0:
        path.mkdir(parents=True)
        build_hf_config(trainer.config).save_pretrained(path)
        tensors = {name: t.contiguous() for name, t in oracle.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        replicas = start_replicas(path, dtype="fp32", log_dir=path, **replica)
        urls = [replicas[0].url]
    dist.broadcast_object_list(urls, src=0, group=group)
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20),
        control=ws.ControlConfig(check_weight_update_equal=True),
        transport=ws.MooncakeConfig(protocol="tcp", timeout_s=30),
        check_replicas=True,
    )
    out: dict = {}
    try:
        with ws.TrainerSync(
            config, hf_config=trainer.config, group=group, replicas=urls, dtype="float32"
        ) as sync:
            report = sync.sync(export)
            out["bit_exact"] = report.bit_exact
            out["per_source"] = {
                r: (s.bytes_written, s.num_writes) for r, s in report.push.per_source.items()
            }
            out["bytes_written"] = report.bytes_written
            if rank == 0:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                out["expected"] = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
                served = asyncio.run(served_tokens(urls, PROMPTS, max_new_tokens=NEW_TOKENS))
                out["served"] = served[urls[0]]
            if not drift:
                return out
            # A copy of the final norm drifts on one rank: the check refuses the sync.
            norm = dict(trainer.model.named_parameters()).get("decoder.final_layernorm.weight")
            saved = None if norm is None else norm.detach().clone()
            last = dist.get_world_size() - 1
            if rank == last and norm is not None:
                with torch.no_grad():
                    norm.add_(1.0)
            try:
                sync.sync(export)
                out["drift_refused"] = None
            except WeightsRefusedError as exc:
                out["drift_refused"] = str(exc)
            if saved is not None:
                with torch.no_grad():
                    norm.copy_(saved)
    finally:
        for served_replica in replicas:
            served_replica.stop()
    return out


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory) -> list[dict]:
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (scripts/setup --tests installs it)")
    tmp = str(tmp_path_factory.mktemp("megatron"))
    return run_in_process_group(WORLD, _megatron_rank, list(CASES), tmp, timeout_s=900)


@pytest.mark.megatron
@pytest.mark.parametrize("case", list(CASES))
def test_boxes_equal_megatron_bridge_and_cover_every_tensor(megatron_runs, case) -> None:
    config, _, replica = CASES[case]
    runs = [run[case] for run in megatron_runs]
    if replica is not None:
        _check_sync(runs, drift=case == DRIFT_CASE)
    hf_shapes = hf_tensor_shapes(config)
    for rank, run in enumerate(runs):
        assert run["differs"] == [], (rank, run["differs"][:5])
        assert run["order"], rank
        assert run["oracle_shapes"] == hf_shapes
    assert "vpp" in CASES[case][1] or any(run["losses"] for run in runs)
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


def _check_sync(runs: list[dict], *, drift: bool) -> None:
    """The sync landed bit-exact, the replica generates the oracle's tokens, the report
    carries every rank's bytes and writes, and drifted copies were refused on every rank."""
    assert all(run["bit_exact"] is True for run in runs)
    assert runs[0]["served"] == runs[0]["expected"]
    per_source = runs[0]["per_source"]
    assert sorted(per_source) == list(range(WORLD))
    assert sum(num_bytes for num_bytes, _ in per_source.values()) == runs[0]["bytes_written"]
    for run in runs if drift else ():
        assert run["drift_refused"] is not None
        assert "model.norm.weight" in run["drift_refused"], run["drift_refused"]
