"""Property tests of `build_plan` over random models, replicas and trainer holdings.

Each plan is executed into byte arrays, one per target rank, the way a sender would execute
it: every copy item read from the HF tensors (cast to the plan dtype) or zeros, written at the
parameter's address plus its offset. The result must equal the engine-side loader
`shard_state_dict` byte for byte, with every byte written exactly once.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.layout import ParallelismConfig, hf_tensor_shapes
from weightsync.plan import (
    SourceHolding,
    SyncPlan,
    TargetRank,
    TensorMeta,
    build_plan,
    simulate_sources,
    simulate_targets,
)
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import preset_config
from weightsync.torch_dtypes import torch_dtype

torch.set_num_threads(1)


@st.composite
def model_configs(draw: st.DrawFn) -> dict:
    """Small configs of every family: kv heads fewer than tp, odd vocabularies, tied or not."""
    model_type = draw(st.sampled_from(["llama", "qwen2", "qwen3", "qwen3_moe"]))
    head_dim = draw(st.sampled_from([2, 4]))
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    num_heads = num_kv_heads * draw(st.sampled_from([1, 2]))
    config = {
        "model_type": model_type,
        "vocab_size": draw(st.integers(1, 150)),
        "hidden_size": draw(st.sampled_from([4, 8])),
        "intermediate_size": 8 * draw(st.integers(1, 2)),
        "num_hidden_layers": draw(st.integers(1, 3)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "tie_word_embeddings": draw(st.booleans()),
        "torch_dtype": "float32",
    }
    if model_type == "qwen3_moe":
        config |= {
            "num_experts": draw(st.sampled_from([4, 8])),
            "moe_intermediate_size": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": draw(st.sampled_from([[], [0]])),
        }
    return config


def _tp_sizes(config: dict) -> list[int]:
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    return [
        tp
        for tp in (1, 2, 4, 8)
        if heads % tp == 0
        and (kv % tp == 0 or tp % kv == 0)
        and config["intermediate_size"] % tp == 0
    ]


def _ep_sizes(config: dict, tp: int) -> list[int]:
    if config["model_type"] != "qwen3_moe":
        return [1]
    return [
        ep
        for ep in range(1, tp + 1)
        if tp % ep == 0
        and config["num_experts"] % ep == 0
        and config["moe_intermediate_size"] % (tp // ep) == 0
    ]


@st.composite
def clusters(draw: st.DrawFn) -> tuple[dict, list[TargetRank], list[SourceHolding], str]:
    """A config, replicas of possibly different tp/ep, and random overlapping holdings."""
    config = draw(model_configs())
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    targets: list[TargetRank] = []
    for replica in range(draw(st.integers(1, 3))):
        tp = draw(st.sampled_from(_tp_sizes(config)))
        ep = draw(st.sampled_from(_ep_sizes(config, tp)))
        for target in simulate_targets(config, tp=tp, ep=ep, dtype=dtype):
            targets.append(
                TargetRank(
                    replica=f"r{replica}",
                    rank=target.rank,
                    session_id=f"r{replica}-{target.session_id}",
                    parallelism=target.parallelism,
                    weights_info=target.weights_info,
                )
            )
    # Every tensor held by a random non-empty set of sources, each source in its own order.
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    num_sources = draw(st.integers(1, 5))
    held: dict[int, dict[str, TensorMeta]] = {rank: {} for rank in range(num_sources)}
    for name, shape in hf_tensor_shapes(config).items():
        for rank in rng.sample(range(num_sources), rng.randint(1, num_sources)):
            held[rank][name] = TensorMeta(shape=shape, dtype="float32")
    sources = []
    for rank, tensors in held.items():
        names = list(tensors)
        rng.shuffle(names)
        sources.append(SourceHolding(rank=rank * 3, tensors={n: tensors[n] for n in names}))
    return config, targets, sources, dtype


def _grid_boxes(shape: tuple[int, ...], rng: random.Random) -> list[tuple]:
    """A random grid of boxes that tile `shape`: each dim cut at up to two random points."""
    cuts = []
    for dim in shape:
        points = sorted(rng.sample(range(1, dim), min(dim - 1, rng.randint(0, 2))))
        edges = [0, *points, dim]
        cuts.append(list(itertools.pairwise(edges)))
    boxes: list[tuple] = [()]
    for windows in cuts:
        boxes = [(*box, window) for box in boxes for window in windows]
    return boxes


@st.composite
def sharded_clusters(draw: st.DrawFn) -> tuple[dict, list[TargetRank], list[SourceHolding], str]:
    """As `clusters`, but every tensor is cut into a random grid of boxes (TP slices, expert
    ranges, FSDP rows), each box held by a random non-empty set of sources (its DP copies);
    some tensors stay whole on some sources."""
    config, targets, _, dtype = draw(clusters())
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    held: dict[int, dict[str, TensorMeta]] = {rank: {} for rank in range(draw(st.integers(1, 6)))}
    for name, shape in hf_tensor_shapes(config).items():
        boxes = [None] if rng.random() < 0.2 else _grid_boxes(shape, rng)
        free = list(held)  # sources that hold nothing of this tensor yet
        rng.shuffle(free)
        for box in boxes:
            for copy in range(rng.randint(1, 2)):
                if not free and copy > 0:
                    break
                if not free:  # more boxes than sources: one more source
                    free.append(len(held))
                    held[len(held)] = {}
                held[free.pop()][name] = TensorMeta(shape=shape, dtype="float32", box=box)
    sources = [
        SourceHolding(rank=rank, tensors=tensors) for rank, tensors in held.items() if tensors
    ]
    return config, targets, sources, dtype


def random_hf_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator)
        for name, shape in hf_tensor_shapes(config).items()
    }


def execute(plan: SyncPlan, hf_state_dict: dict[str, torch.Tensor]) -> dict:
    """Run the plan into one byte array per target; returns memory and write counts."""
    element_size = torch.empty((), dtype=torch_dtype(plan.dtype)).element_size()
    memory, counts, bases = {}, {}, {}
    for target in plan.targets:
        base = min(addr for addr, _, _ in target.weights_info.values())
        end = max(addr + n * es for addr, n, es in target.weights_info.values())
        key = (target.replica, target.rank)
        bases[key] = base
        memory[key] = np.full(end - base, 0xAB, dtype=np.uint8)
        counts[key] = np.zeros(end - base, dtype=np.int32)
    for source_rank in plan.source_plans:
        source_plan = plan.for_source(source_rank)
        assert source_plan.dtype == plan.dtype
        for hf_name, works in source_plan.work.items():
            for work in works:
                for item in work.items:
                    if item.hf_name is None:
                        payload = np.zeros(item.num_bytes, dtype=np.uint8)
                    else:
                        assert item.hf_name == hf_name
                        local = hf_state_dict[item.hf_name]
                        if hf_name in source_plan.boxes:  # the source holds only this box
                            held = source_plan.boxes[hf_name]
                            local = local[tuple(slice(a, b) for a, b in held)]
                        assert tuple(local.shape) == tuple(source_plan.shapes[hf_name])
                        box = tuple(slice(a, b) for a, b in item.src_box)
                        assert all(
                            b <= d for (_, b), d in zip(item.src_box, local.shape, strict=True)
                        )
                        data = local[box].to(torch_dtype(plan.dtype))
                        payload = data.contiguous().view(-1).view(torch.uint8).numpy()
                    assert payload.size == item.num_bytes
                    assert item.num_bytes % element_size == 0
                    for target in source_plan.targets[work.layout_id]:
                        key = (target.replica, target.rank)
                        start = target.weights_info[item.param_name][0] - bases[key]
                        start += item.dst_offset_bytes
                        memory[key][start : start + item.num_bytes] = payload
                        counts[key][start : start + item.num_bytes] += 1
    return {"memory": memory, "counts": counts, "bases": bases}


def check_against_loader(
    plan: SyncPlan, config: dict, hf_state_dict: dict[str, torch.Tensor]
) -> None:
    result = execute(plan, hf_state_dict)
    for target in plan.targets:
        key = (target.replica, target.rank)
        assert (result["counts"][key] == 1).all(), f"{key}: a byte not written exactly once"
        expected = shard_state_dict(
            hf_state_dict, config, target.parallelism, torch_dtype(plan.dtype)
        )
        assert list(expected) == list(target.weights_info)
        for name, tensor in expected.items():
            addr, numel, element_size = target.weights_info[name]
            start = addr - result["bases"][key]
            got = result["memory"][key][start : start + numel * element_size]
            want = tensor.contiguous().view(-1).view(torch.uint8).numpy()
            assert np.array_equal(got, want), f"{key} {name}: bytes differ from the loader"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sharded_clusters())
def test_sources_holding_boxes_write_exactly_what_the_loader_leaves(cluster) -> None:
    config, targets, sources, dtype = cluster
    plan = build_plan(hf_config=config, targets=targets, sources=sources, dtype=dtype)
    check_against_loader(plan, config, random_hf_state_dict(config))
    metas = {s.rank: s.tensors for s in sources}
    for (hf_name, _, box), rank in plan.assignments.items():
        assert (metas[rank][hf_name].box or ()) == box  # written by a holder of its box
        if box:
            assert plan.for_source(rank).boxes[hf_name] == box


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_plan_writes_exactly_what_the_loader_leaves(cluster) -> None:
    config, targets, sources, dtype = cluster
    plan = build_plan(hf_config=config, targets=targets, sources=sources, dtype=dtype)
    check_against_loader(plan, config, random_hf_state_dict(config))
    holders = {s.rank: s.tensors for s in sources}
    for (hf_name, layout_id, _), rank in plan.assignments.items():
        assert hf_name in holders[rank]
        assert layout_id in plan.for_source(rank).targets
    # Work lists each source's tensors in the order that source yields them.
    for source in sources:
        order = list(source.tensors)
        positions = [order.index(name) for name in plan.for_source(source.rank).work]
        assert positions == sorted(positions)


@settings(max_examples=25, deadline=None)
@given(clusters(), st.randoms(use_true_random=False))
def test_plan_is_deterministic_and_ignores_input_order(cluster, rng) -> None:
    config, targets, sources, dtype = cluster
    plan = build_plan(hf_config=config, targets=targets, sources=sources, dtype=dtype)
    again = build_plan(hf_config=config, targets=targets, sources=sources, dtype=dtype)
    assert plan == again
    assert plan.summary() == again.summary()
    shuffled_targets, shuffled_sources = list(targets), list(sources)
    rng.shuffle(shuffled_targets)
    rng.shuffle(shuffled_sources)
    permuted = build_plan(
        hf_config=config, targets=shuffled_targets, sources=shuffled_sources, dtype=dtype
    )
    assert permuted.assignments == plan.assignments
    assert permuted.source_plans.keys() == plan.source_plans.keys()
    for rank, source_plan in plan.source_plans.items():
        assert permuted.for_source(rank).work == source_plan.work


@settings(max_examples=30, deadline=None)
@given(
    model_configs(),
    st.integers(1, 6),
    st.integers(1, 3),
)
def test_assignment_bound_when_every_source_holds_everything(config, num_sources, replicas) -> None:
    # Contiguous runs and largest-first alike: the fullest source exceeds the mean by at most
    # one unit.
    tp = max(_tp_sizes(config))
    targets = simulate_targets(config, tp=tp, replicas=replicas)
    sources = simulate_sources(config, num_sources=num_sources, pp=1)
    plan = build_plan(hf_config=config, targets=targets, sources=sources)
    loads = plan.bytes_written_per_source
    mean = sum(loads.values()) / len(loads)
    groups = {g.layout_id: g for g in plan.groups}
    largest_unit = max(
        sum(
            item.num_bytes
            for work in plan.for_source(rank).work[hf_name]
            if work.layout_id == layout_id
            for item in work.items
        )
        * len(groups[layout_id].targets)
        for (hf_name, layout_id, _), rank in plan.assignments.items()
    )
    assert max(loads.values()) <= mean + largest_unit
    assert plan.imbalance <= 1 + largest_unit / mean
    assert plan.num_bytes_written == sum(g.num_bytes * len(g.targets) for g in plan.groups)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_many_units_balance_well(pp: int) -> None:
    config = preset_config("small", num_hidden_layers=16)
    targets = simulate_targets(config, tp=4, replicas=3)
    sources = simulate_sources(config, num_sources=8, pp=pp)
    plan = build_plan(hf_config=config, targets=targets, sources=sources)
    assert plan.imbalance < 1.15
    assert all(load > 0 for load in plan.bytes_written_per_source.values())


def test_simulated_cluster_with_pipeline_stages_matches_loader() -> None:
    config = preset_config("tiny-moe", tie_word_embeddings=True)
    targets = simulate_targets(config, tp=4, ep=2, replicas=2, dtype="bfloat16")
    sources = simulate_sources(config, num_sources=6, pp=3)
    plan = build_plan(hf_config=config, targets=targets, sources=sources, dtype="bfloat16")
    check_against_loader(plan, config, random_hf_state_dict(config, seed=1))
    assert len(plan.groups) == 4
    assert {rank for rank in plan.assignments.values()} == set(range(6))


def test_targets_with_one_layout_share_one_group() -> None:
    config = preset_config("tiny")
    targets = simulate_targets(config, tp=2, replicas=3)
    plan = build_plan(
        hf_config=config, targets=targets, sources=simulate_sources(config, num_sources=2)
    )
    assert [g.layout_key for g in plan.groups] == sorted(
        {ParallelismConfig(tp_size=2, tp_rank=r).layout_key() for r in range(2)}
    )
    for group in plan.groups:
        assert [(t.replica, t.rank) for t in group.targets] == [
            (f"replica{i}", group.layout_id) for i in range(3)
        ]
