"""`FSDPExport`: an FSDP2 rank's ``Shard(0)`` rows, streamed as views of its local shards
without a collective, equal ``full_tensor()`` of the trained model and cover every HF tensor;
synced straight from the shards into a replica, bit-exact against ``full_tensor()``; and
`no_collectives`, which these tests rely on, really refuses communication."""

from __future__ import annotations

import pytest
import torch

from process_group import run_in_process_group
from weightsync.layout import hf_tensor_shapes
from weightsync.testing.presets import preset_config

# Odd sizes: uneven shards over 2 ranks (3 experts: whole experts split 2 / 1).
pytestmark = pytest.mark.slow

DENSE = preset_config("tiny", vocab_size=1001, num_hidden_layers=2)
MOE = preset_config("tiny-moe", vocab_size=1001, num_hidden_layers=2, num_experts=3)


def _fsdp_rank(rank: int, group, tmp: str) -> dict:
    """Both models, then the guard, in one group (spawning ranks costs more than the runs)."""
    return {
        "dense": _fsdp_model(rank, group, DENSE, {"tp": 2}, f"{tmp}/dense"),
        "moe": _fsdp_model(rank, group, MOE, {"tp": 1}, f"{tmp}/moe"),
        "guard": _guarded(group),
    }


def _fsdp_model(rank: int, group, config: dict, replica: dict, folder: str) -> dict:
    """Train, export under `no_collectives`, compare with ``full_tensor()``, then sync into
    a replica serving the full tensors (the sync's check snapshots, corrupts, compares)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.export.fsdp import FSDPExport
    from weightsync.export.hf import ModelExport
    from weightsync.testing.collectives import no_collectives
    from weightsync.testing.presets import random_model

    mesh = init_device_mesh("cpu", (2,))
    model = random_model(config, seed=3).train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1 + rank)
    for _ in range(2):
        ids = torch.randint(0, config["vocab_size"], (2, 16), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    export = FSDPExport(model)
    with no_collectives():
        holding = export.holding()
        streamed = list(export)
    storages = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
    zero_copy = all(t.untyped_storage().data_ptr() in storages for _, t in streamed)
    # The oracle: the full tensors (collective), as ModelExport names them.
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    reference = dict(ModelExport(full, hf_config=config))
    differs = [
        name
        for name, tensor in streamed
        if not torch.equal(
            reference[name][tuple(slice(a, b) for a, b in holding[name].held_box)], tensor
        )
    ]
    return {
        "boxes": {name: (meta.shape, meta.held_box) for name, meta in holding.items()},
        "differs": differs,
        "zero_copy": zero_copy,
        "order": [name for name, _ in streamed] == list(holding),
        **_sync(rank, group, config, export, reference, replica, folder),
    }


def _sync(rank, group, config, export, reference, replica: dict, folder: str) -> dict:
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    import weightsync as ws
    from weightsync.testing.launcher import start_replicas
    from weightsync.testing.presets import build_hf_config

    path = Path(folder)
    replicas: list = []
    urls = [None]
    if rank == 0:
        path.mkdir(parents=True)
        build_hf_config(config).save_pretrained(path)
        tensors = {name: t.detach().contiguous().clone() for name, t in reference.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        replicas = start_replicas(path, dtype="fp32", log_dir=path, **replica)
        urls = [replicas[0].url]
    dist.broadcast_object_list(urls, src=0, group=group)
    sync_config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20),
        control=ws.ControlConfig(check_weight_update_equal=True),
        transport=ws.MooncakeConfig(protocol="tcp", timeout_s=30),
        check_replicas=True,
    )
    try:
        with ws.TrainerSync(
            sync_config, hf_config=config, group=group, replicas=urls, dtype="float32"
        ) as sync:
            report = sync.sync(export)
    finally:
        for served in replicas:
            served.stop()
    return {
        "bit_exact": report.bit_exact,
        "per_source": {
            r: (s.bytes_written, s.num_writes) for r, s in report.push.per_source.items()
        },
        "bytes_written": report.bytes_written,
    }


def _check(config: dict, runs: list[dict]) -> None:
    hf_shapes = hf_tensor_shapes(config)
    held: dict[str, list] = {}
    for run in runs:
        assert run["differs"] == [] and run["order"] and run["zero_copy"], run["differs"][:5]
        # Synced from the shards, bit-exact against full_tensor(); both ranks wrote.
        assert run["bit_exact"] is True
        assert sorted(run["per_source"]) == [0, 1]
        assert all(num_bytes > 0 for num_bytes, _ in run["per_source"].values())
        assert sum(b for b, _ in run["per_source"].values()) == run["bytes_written"]
        for name, (shape, box) in run["boxes"].items():
            assert tuple(shape) == hf_shapes[name]
            held.setdefault(name, []).append(box)
    assert set(held) == set(hf_shapes)
    for name, boxes in held.items():
        count = torch.zeros(hf_shapes[name], dtype=torch.int8)
        for box in boxes:
            count[tuple(slice(a, b) for a, b in box)] += 1
        assert bool((count == 1).all()), (name, boxes)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("fsdp"))
    return run_in_process_group(2, _fsdp_rank, tmp, timeout_s=600)


def test_fsdp2_dense_shards_equal_full_tensor(fsdp_runs) -> None:
    runs = [run["dense"] for run in fsdp_runs]
    _check(DENSE, runs)
    # The embedding's 1001 rows split 501 / 500.
    assert runs[1]["boxes"]["model.embed_tokens.weight"][1][0] == (501, 1001)


def test_fsdp2_moe_shards_hold_whole_experts(fsdp_runs) -> None:
    runs = [run["moe"] for run in fsdp_runs]
    _check(MOE, runs)
    experts = [
        {int(n.split(".")[5]) for n in run["boxes"] if n.startswith("model.layers.1.mlp.experts.")}
        for run in runs
    ]
    assert experts == [{0, 1}, {2}], experts


def _guarded(group) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.testing.collectives import CollectiveRan, no_collectives

    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(1)),
        "process_group": lambda: group.allreduce(torch.ones(1)),
        "broadcast_object": lambda: dist.broadcast_object_list([1]),
        "full_tensor": lambda: sharded.full_tensor(),
        "local_math": lambda: sharded.to_local() + 1,
    }
    outcome = {}
    for label, call in calls.items():
        try:
            with no_collectives():
                call()
            outcome[label] = "ran"
        except CollectiveRan:
            outcome[label] = "refused"
    dist.all_reduce(torch.ones(1))  # restored on exit
    return outcome


def test_no_collectives_refuses_every_kind_of_communication(fsdp_runs) -> None:
    for outcome in (run["guard"] for run in fsdp_runs):
        assert outcome == {
            "all_reduce": "refused",
            "process_group": "refused",
            "broadcast_object": "refused",
            "full_tensor": "refused",
            "local_math": "ran",
        }
