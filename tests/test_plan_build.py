"""Table tests of the plan's pieces: items, merging, units, ordering, the simulator."""

from __future__ import annotations

import json

import pytest

from weightsync.layout import ParallelismConfig, hf_tensor_shapes, rank_layout
from weightsync.plan import (
    CopyItem,
    SourceHolding,
    TargetRank,
    TensorMeta,
    build_plan,
    simulate_sources,
    simulate_targets,
    stage_layers,
)
from weightsync.plan.merge import merge_items, merged_box
from weightsync.testing.presets import preset_config

TINY = preset_config("tiny")


def _item(box, offset: int, num_bytes: int, *, hf="w", param="p") -> CopyItem:
    return CopyItem(
        hf_name=hf, src_box=box, param_name=param, dst_offset_bytes=offset, num_bytes=num_bytes
    )


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (((0, 2), (0, 8)), ((2, 5), (0, 8)), ((0, 5), (0, 8))),  # consecutive rows
        (((3, 4), (0, 4)), ((3, 4), (4, 8)), ((3, 4), (0, 8))),  # one row, adjacent columns
        (((1, 2), (5, 6), (0, 3)), ((1, 2), (5, 6), (3, 9)), ((1, 2), (5, 6), (0, 9))),
        (((0, 2), (0, 4)), ((0, 2), (4, 8)), None),  # two rows: the read interleaves
        (((0, 2), (0, 8)), ((3, 5), (0, 8)), None),  # a gap
        (((0, 2), (0, 8)), ((2, 4), (0, 4)), None),  # different widths
        (((2, 4), (0, 8)), ((0, 2), (0, 8)), None),  # out of order
        (((0, 2),), ((0, 2), (0, 1)), None),  # different ranks
    ],
)
def test_merged_box(first, second, expected) -> None:
    assert merged_box(first, second) == expected


def test_merge_items_joins_rows_and_padding_but_not_across_parameters() -> None:
    items = [
        _item(((0, 2), (0, 4)), 0, 32),
        _item(((2, 3), (0, 4)), 32, 16),
        CopyItem(hf_name=None, src_box=(), param_name="p", dst_offset_bytes=48, num_bytes=8),
        CopyItem(hf_name=None, src_box=(), param_name="p", dst_offset_bytes=56, num_bytes=8),
        _item(((3, 4), (0, 4)), 0, 16, param="q"),  # another parameter
        _item(((5, 6), (0, 4)), 16, 16, param="q"),  # not row-contiguous
        _item(((6, 7), (0, 4)), 40, 16, param="q"),  # not destination-contiguous
    ]
    merged = merge_items(items)
    assert merged == (
        _item(((0, 3), (0, 4)), 0, 48),
        CopyItem(hf_name=None, src_box=(), param_name="p", dst_offset_bytes=48, num_bytes=16),
        *items[4:],
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hf_name": "w", "src_box": (), "num_bytes": 4},
        {"hf_name": None, "src_box": ((0, 1),), "num_bytes": 4},
        {"hf_name": "w", "src_box": ((2, 2),), "num_bytes": 4},
        {"hf_name": "w", "src_box": ((0, 1),), "num_bytes": 0},
    ],
)
def test_copy_item_rejects_inconsistent_fields(kwargs) -> None:
    with pytest.raises(ValueError, match="CopyItem for 'p'"):
        CopyItem(param_name="p", dst_offset_bytes=0, **kwargs)


def test_target_rank_converts_json_values_and_rejects_bad_entries() -> None:
    target = TargetRank(
        replica="http://10.0.0.1:30000",
        rank=1,
        session_id="10.0.0.1:15000",
        parallelism={"tp_size": 2, "tp_rank": 1, "unknown_future_field": 3},
        weights_info={"w": [4096, 10, 2]},
    )
    assert target.parallelism == ParallelismConfig(tp_size=2, tp_rank=1)
    assert target.weights_info == {"w": (4096, 10, 2)}
    with pytest.raises(ValueError, match=r"weights_info\['w'\] must be \[addr, numel"):
        TargetRank(
            replica="r",
            rank=0,
            session_id="s:1",
            parallelism=ParallelismConfig(tp_size=1, tp_rank=0),
            weights_info={"w": [1, 2]},
        )
    with pytest.raises(ValueError, match="empty session_id"):
        TargetRank(
            replica="r",
            rank=0,
            session_id="",
            parallelism=ParallelismConfig(tp_size=1, tp_rank=0),
            weights_info={},
        )


def test_tensor_meta_normalises_and_checks() -> None:
    assert TensorMeta(shape=[2, 3], dtype="torch.bfloat16") == TensorMeta(
        shape=(2, 3), dtype="bfloat16"
    )
    with pytest.raises(ValueError, match="non-negative"):
        TensorMeta(shape=(2, -1), dtype="float32")
    with pytest.raises(ValueError, match="must be a TensorMeta"):
        SourceHolding(rank=0, tensors={"w": (2, 3)})


def test_padding_travels_with_the_parameters_first_tensor() -> None:
    # vocab 1000 over tp 2: 1024 padded rows, rank 1 holds rows 512..1023, 24 of them padding.
    plan = build_plan(
        hf_config=TINY,
        targets=simulate_targets(TINY, tp=2),
        sources=simulate_sources(TINY, num_sources=1),
    )
    rank1 = next(g for g in plan.groups if g.targets[0].rank == 1)
    (work,) = [w for w in plan.for_source(0).work["model.embed_tokens.weight"] if w.layout_id == 1]
    real, padding = work.items
    assert real.src_box == ((512, 1000), (0, 64))
    assert (real.dst_offset_bytes, real.num_bytes) == (0, 488 * 64 * 4)
    assert padding.hf_name is None
    assert (padding.dst_offset_bytes, padding.num_bytes) == (488 * 64 * 4, 24 * 64 * 4)
    assert rank1.params[0].num_bytes == real.num_bytes + padding.num_bytes


def test_all_padding_shards_are_written_by_exactly_one_source() -> None:
    # vocab 20 over tp 4: rows 16..63 padding, ranks 2 and 3 hold no real row of either table;
    # tied qwen3_moe keeps an lm_head whose HF tensor is embed_tokens.
    config = preset_config("tiny-moe", vocab_size=20, tie_word_embeddings=True)
    plan = build_plan(
        hf_config=config,
        targets=simulate_targets(config, tp=4, ep=2),
        sources=simulate_sources(config, num_sources=4, pp=2),
    )
    for group in plan.groups[2:]:
        embed, lm_head = group.params[0], group.params[-1]
        assert all(s.hf_name is None for s in embed.segments + lm_head.segments)
        writers = {
            (hf_name, rank)
            for (hf_name, layout_id, _), rank in plan.assignments.items()
            for work in plan.for_source(rank).work[hf_name]
            if work.layout_id == layout_id == group.layout_id
            for item in work.items
            if item.param_name in (embed.name, lm_head.name)
        }
        # embed_tokens' zeros go with the HF tensor of that name; lm_head's with its
        # neighbour, the final norm, which the last stage (ranks 1 and 3) holds.
        units = {hf_name for hf_name, _ in writers}
        assert units == {"model.embed_tokens.weight", "model.norm.weight"}
        assert len(writers) == 2


def test_items_within_a_stage_work_are_in_parameter_then_offset_order() -> None:
    config = preset_config("tiny", tie_word_embeddings=True, model_type="qwen3_moe")
    config |= {"num_experts": 4, "moe_intermediate_size": 32, "vocab_size": 100}
    plan = build_plan(
        hf_config=config,
        targets=simulate_targets(config, tp=2),
        sources=simulate_sources(config, num_sources=1),
    )
    for works in plan.for_source(0).work.values():
        for work in works:
            order = [p.name for p in plan.groups[work.layout_id].params]
            keys = [(order.index(i.param_name), i.dst_offset_bytes) for i in work.items]
            assert keys == sorted(keys)
    # Tied: embed_tokens feeds two parameters of each layout, in engine order; rank 1 holds
    # rows 64..127 of the 128 padded rows, 36 of them real.
    embed = "model.embed_tokens.weight"
    works = plan.for_source(0).work[embed]
    assert [(i.param_name, i.hf_name) for i in works[0].items] == [
        (embed, embed),
        ("lm_head.weight", embed),
    ]
    assert [(i.param_name, i.hf_name, i.num_bytes // 256) for i in works[1].items] == [
        (embed, embed, 36),
        (embed, None, 28),
        ("lm_head.weight", embed, 36),
        ("lm_head.weight", None, 28),
    ]


def test_work_follows_each_sources_own_order() -> None:
    shapes = hf_tensor_shapes(TINY)
    names = list(reversed(shapes))
    sources = [
        SourceHolding(
            rank=5, tensors={n: TensorMeta(shape=shapes[n], dtype="bfloat16") for n in names}
        )
    ]
    plan = build_plan(hf_config=TINY, targets=simulate_targets(TINY, tp=2), sources=sources)
    assert list(plan.for_source(5).work) == names
    assert all(len(works) == 2 for works in plan.for_source(5).work.values())
    assert [w.layout_id for w in plan.for_source(5).work[names[0]]] == [0, 1]


def test_summary_is_json_and_counts_bytes() -> None:
    targets = simulate_targets(TINY, tp=2, replicas=2, dtype="bfloat16")
    plan = build_plan(
        hf_config=TINY,
        targets=targets,
        sources=simulate_sources(TINY, num_sources=4, pp=2),
        dtype="bfloat16",
    )
    summary = json.loads(json.dumps(plan.summary()))
    assert summary["dtype"] == "bfloat16"
    assert summary["num_layout_groups"] == 2
    assert [(t["replica"], t["rank"]) for t in summary["targets"]] == [
        ("replica0", 0),
        ("replica0", 1),
        ("replica1", 0),
        ("replica1", 1),
    ]
    for entry, target in zip(summary["targets"], targets, strict=True):
        layout = rank_layout(TINY, target.parallelism, "bfloat16")
        assert [p["name"] for p in entry["params"]] == list(layout)
        assert entry["bytes"] == sum(p.num_bytes for p in layout.values())
    assert sum(s["bytes"] for s in summary["sources"]) == sum(
        t["bytes"] for t in summary["targets"]
    )
    assert summary["imbalance"] == pytest.approx(
        max(s["bytes"] for s in summary["sources"])
        / (sum(s["bytes"] for s in summary["sources"]) / 4)
    )
    assert summary["num_write_regions"] > 0


def _runs_in_destination_order(plan, source: int, target) -> tuple[int, int]:
    """(items, runs) of `source` for `target`: items sorted by address, runs within a parameter."""
    items = [
        item
        for works in plan.for_source(source).work.values()
        for work in works
        if target in plan.for_source(source).targets[work.layout_id]
        for item in work.items
    ]
    spans = sorted(
        (target.weights_info[i.param_name][0] + i.dst_offset_bytes, i.num_bytes, i.param_name)
        for i in items
    )
    breaks = sum(
        1
        for k in range(1, len(spans))
        if spans[k][0] != spans[k - 1][0] + spans[k - 1][1] or spans[k][2] != spans[k - 1][2]
    )
    return len(items), breaks + 1


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [("tiny", {}), ("tiny-moe", {"num_experts": 16, "tie_word_embeddings": True})],
)
def test_coalescing_estimate_counts_adjacent_items_as_one_write(preset, overrides) -> None:
    # One source writes everything; simulated ranks lay parameters out back to back. The
    # sender sorts a slot's pieces by destination, so each run of items that continues in the
    # destination, within one parameter, is one write (a write never spans two parameters,
    # which may be registered apart). For MoE the source yields an expert's gate, up and down
    # in turn, yet its gate/up halves and the next expert's land next to each other.
    config = preset_config(preset, **overrides)
    plan = build_plan(
        hf_config=config,
        targets=simulate_targets(config, tp=1),
        sources=simulate_sources(config, num_sources=1),
    )
    (target,) = plan.targets
    num_items, runs = _runs_in_destination_order(plan, 0, target)
    assert plan.num_write_regions == runs
    assert runs == len(plan.groups[0].params)
    assert runs < num_items


def test_simulated_targets_are_consistent() -> None:
    targets = simulate_targets(TINY, tp=2, replicas=2)
    assert [t.session_id for t in targets] == [
        "replica0-rank0:0",
        "replica0-rank1:0",
        "replica1-rank0:0",
        "replica1-rank1:0",
    ]
    for target in targets:
        layout = rank_layout(TINY, target.parallelism)
        address = min(addr for addr, _, _ in target.weights_info.values())
        for name, param in layout.items():
            assert target.weights_info[name] == (address, param.numel, param.element_size)
            address += param.num_bytes


def test_simulated_sources_split_layers_into_stages() -> None:
    config = preset_config("tiny", num_hidden_layers=5)
    sources = simulate_sources(config, num_sources=6, pp=3)
    assert [s.rank for s in sources] == list(range(6))
    assert [list(r) for r in stage_layers(5, 3)] == [[0], [1, 2], [3, 4]]
    for source in sources:
        stage = source.rank % 3
        twin = sources[(source.rank + 3) % 6]
        assert source.tensors == twin.tensors
        layers = {int(n.split(".")[2]) for n in source.tensors if n.startswith("model.layers.")}
        assert layers == set(stage_layers(5, 3)[stage])
        others = {n for n in source.tensors if not n.startswith("model.layers.")}
        expected = {
            0: {"model.embed_tokens.weight"},
            1: set(),
            2: {"model.norm.weight", "lm_head.weight"},
        }[stage]
        assert others == expected
    tied = simulate_sources(preset_config("tiny", tie_word_embeddings=True), num_sources=2, pp=2)
    assert "model.embed_tokens.weight" in tied[1].tensors
    assert "lm_head.weight" not in tied[1].tensors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_sources": 5, "pp": 2}, "num_sources=5 must be a positive multiple of pp=2"),
        ({"num_sources": 0}, "num_sources=0"),
        ({"num_sources": 8, "pp": 8}, r"pp=8 stages need 1 <= pp <= num_layers=4"),
    ],
)
def test_simulated_sources_reject_bad_sizes(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        simulate_sources(TINY, **kwargs)


def test_simulated_sources_of_a_block_fp8_checkpoint_hold_e4m3_weights_and_float32_scales():
    from weightsync.layout.quant import fp8_quantization_config

    config = {
        **preset_config("tiny-deepseek"),
        "dtype": "bfloat16",
        "quantization_config": fp8_quantization_config(128),
    }
    sources = simulate_sources(config, num_sources=2)
    held = sources[0].tensors
    weight = "model.layers.0.self_attn.o_proj.weight"
    assert held[weight].dtype == "float8_e4m3fn"
    assert held[weight + "_scale_inv"].dtype == "float32"
    assert held["model.norm.weight"].dtype == "bfloat16"
    plan = build_plan(hf_config=config, targets=simulate_targets(config, tp=2), sources=sources)
    assert plan.num_bytes_written == sum(
        group.num_bytes * len(group.targets) for group in plan.groups
    )
