"""`FSDPExport`: an FSDP2 rank's ``Shard(0)`` rows, streamed as views of its local shards
without a collective, equal ``full_tensor()`` of the trained model and cover every HF tensor;
and `no_collectives`, which these tests rely on, really refuses communication."""

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


def _fsdp_rank(rank: int, group) -> dict:
    """Both models, then the guard, in one group (spawning ranks costs more than the runs)."""
    return {
        "dense": _fsdp_model(rank, DENSE),
        "moe": _fsdp_model(rank, MOE),
        "guard": _guarded(group),
    }


def _fsdp_model(rank: int, config: dict) -> dict:
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
    }


def _check(config: dict, runs: list[dict]) -> None:
    hf_shapes = hf_tensor_shapes(config)
    held: dict[str, list] = {}
    for run in runs:
        assert run["differs"] == [] and run["order"] and run["zero_copy"], run["differs"][:5]
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
def fsdp_runs() -> list[dict]:
    return run_in_process_group(2, _fsdp_rank, timeout_s=300)


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
