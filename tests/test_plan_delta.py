"""Delta maps against a brute-force oracle: every local element of every tensor a source
streams must map to exactly the (layout, parameter, element) its copy items write it to.

The oracle walks each `CopyItem` element by element; the maps are expanded run by run. Real
plans (dense, MoE, a two-dtype DeepSeek) with sources holding whole tensors, row slices and
column slices, and random boxes from hypothesis, are held to it; the table sizes are held to
the number of parameters, not of rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.layout import hf_tensor_shapes
from weightsync.plan import (
    CopyItem,
    SourceHolding,
    SourcePlan,
    StageWork,
    TensorMeta,
    build_plan,
    simulate_sources,
    simulate_targets,
)
from weightsync.plan.delta import DeltaMap, RunFamily, delta_map, delta_maps
from weightsync.testing.presets import preset_config

Key = tuple[str, int, str]  # (hf_name, layout_id, param_name)

TINY = preset_config("tiny")  # qwen3, float32
TINY_MOE = preset_config("tiny-moe")  # qwen3_moe, 8 experts
# DeepSeek-V3 shrunk so the oracle walks it in well under a second; in bf16 its float32
# router bias makes every plan one of two dtype parts.
TINY_DEEPSEEK = preset_config(
    "tiny-deepseek",
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    torch_dtype="bfloat16",
)
MODELS = {"qwen3": (TINY, 1), "qwen3-moe": (TINY_MOE, 2), "deepseek-bf16": (TINY_DEEPSEEK, 4)}


def _strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[k + 1 :]) for k in range(len(shape))]


def _oracle(plan: SourcePlan) -> dict[Key, set[tuple[int, int]]]:
    """``{key: {(local flat element, parameter element)}}``, walking every item's box."""
    landed: dict[Key, set[tuple[int, int]]] = {}
    for hf_name, works in plan.work.items():
        strides = _strides(plan.shapes[hf_name])
        for work in works:
            for item in work.items:
                if item.is_padding:
                    continue
                element_size = item.num_bytes // item.src_numel
                first = item.dst_offset_bytes // element_size
                pairs = landed.setdefault((hf_name, work.layout_id, item.param_name), set())
                ranges = (range(start, stop) for start, stop in item.src_box)
                for k, index in enumerate(itertools.product(*ranges)):
                    flat = sum(i * s for i, s in zip(index, strides, strict=True))
                    pairs.add((flat, first + k))
    return landed


def _expanded(mapped: DeltaMap) -> dict[Key, list[tuple[int, int]]]:
    """``{key: [(local flat element, parameter element)]}`` of every run, duplicates kept."""
    landed: dict[Key, list[tuple[int, int]]] = {}
    for hf_name, targets in mapped.tensors.items():
        for target in targets:
            pairs = landed.setdefault((hf_name, target.layout_id, target.param_name), [])
            for family in target.families:
                for src, dst, length in family.runs():
                    pairs.extend((src + j, dst + j) for j in range(length))
    return landed


def _assert_maps_exactly(plan: SourcePlan, mapped: DeltaMap) -> None:
    """`mapped` sends every element of `plan`'s items where they write it, once, and nothing
    else; its tables keep their stated order and shape."""
    expected = _oracle(plan)
    actual = _expanded(mapped)
    assert actual.keys() == expected.keys()
    for key, pairs in actual.items():
        assert len(pairs) == len(set(pairs)), f"{key}: an element is mapped twice"
        assert set(pairs) == expected[key], f"{key}: elements differ from the items'"
    assert mapped.dtype == plan.dtype
    assert list(mapped.tensors) == list(plan.work)
    assert mapped.shapes == {name: tuple(plan.shapes[name]) for name in plan.work}
    for hf_name, targets in mapped.tensors.items():
        assert len({(t.layout_id, t.param_name) for t in targets}) == len(targets)
        numel = math.prod(plan.shapes[hf_name])
        for target in targets:
            starts = [family.src_start for family in target.families]
            assert starts == sorted(starts) and target.families
            assert target.num_elements == len(
                expected[(hf_name, target.layout_id, target.param_name)]
            )
            for family in target.families:
                assert family.count >= 1 and family.length >= 1
                *_, (last_src, _, length) = family.runs()
                assert last_src + length <= numel


def _source_plans(plan) -> list[SourcePlan]:
    """Every single-dtype source plan of `plan` (the parts of a plan of several)."""
    out = []
    for rank in plan.source_plans:
        source = plan.for_source(rank)
        out += source.parts or [source]
    return out


def _sliced_sources(config: dict, *, dim: int, num_sources: int) -> list[SourceHolding]:
    """Source k holds the k-th of `num_sources` uneven slices along `dim` of every tensor
    with that dim (long enough); the rest whole on source 0."""
    tensors: list[dict[str, TensorMeta]] = [{} for _ in range(num_sources)]
    for name, shape in hf_tensor_shapes(config).items():
        if len(shape) <= dim or shape[dim] < num_sources:
            tensors[0][name] = TensorMeta(shape=shape, dtype="float32")
            continue
        cuts = [0, *sorted(random.Random(name).sample(range(1, shape[dim]), num_sources - 1))]
        cuts.append(shape[dim])
        for k in range(num_sources):
            box = tuple(
                (cuts[k], cuts[k + 1]) if d == dim else (0, extent)
                for d, extent in enumerate(shape)
            )
            tensors[k][name] = TensorMeta(shape=shape, dtype="float32", box=box)
    return [SourceHolding(rank=k, tensors=t) for k, t in enumerate(tensors)]


def _holdings(config: dict, holding: str) -> list[SourceHolding]:
    if holding == "whole":
        return simulate_sources(config, num_sources=2, pp=2)
    return _sliced_sources(config, dim=0 if holding == "rows" else 1, num_sources=3)


def _plan(model: str, holding: str, tp: int):
    config, max_ep = MODELS[model]
    targets = simulate_targets(config, tp=tp, ep=min(tp, max_ep))
    return build_plan(hf_config=config, targets=targets, sources=_holdings(config, holding))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("holding", ["whole", "rows", "columns"])
@pytest.mark.parametrize("model", list(MODELS))
def test_real_plans_map_every_element_where_the_items_write_it(
    model: str, holding: str, tp: int
) -> None:
    plan = _plan(model, holding, tp)
    sources = _source_plans(plan)
    assert len(sources) >= 2
    for source in sources:
        _assert_maps_exactly(source, delta_map(source))


def test_a_plan_of_two_dtypes_maps_part_by_part() -> None:
    plan = _plan("deepseek-bf16", "whole", 2)
    for rank in plan.source_plans:
        source = plan.for_source(rank)
        assert [part.dtype for part in source.parts] == ["bfloat16", "float32"]
        maps = delta_maps(source)
        assert maps == tuple(delta_map(part) for part in source.parts)
        assert [m.dtype for m in maps] == ["bfloat16", "float32"]
        assert {t.element_size for m in maps[:1] for ts in m.tensors.values() for t in ts} == {2}
        with pytest.raises(ValueError, match=f"source rank {rank}: a plan of 2 dtype parts"):
            delta_map(source)
    single = _plan("qwen3", "whole", 2).for_source(0)
    assert delta_maps(single) == (delta_map(single),)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_slices_cut_into_rows_rejoin_into_one_family_per_parameter(tp: int) -> None:
    plan = _plan("qwen3", "columns", tp)
    for rank in plan.source_plans:
        source = plan.for_source(rank)
        mapped = delta_map(source)
        targets = [t for ts in mapped.tensors.values() for t in ts]
        if rank > 0:  # only the slices: thousands of per-row items
            assert source.num_items > 10 * len(targets)
        assert mapped.num_families == len(targets)
        assert all(len(t.families) == 1 for t in targets)


@pytest.mark.parametrize("holding", ["whole", "rows"])
def test_whole_tensors_and_row_slices_keep_at_most_one_family_per_item(holding: str) -> None:
    for source in _source_plans(_plan("qwen3-moe", holding, 4)):
        mapped = delta_map(source)
        for hf_name, targets in mapped.tensors.items():
            for target in targets:
                (work,) = (w for w in source.work[hf_name] if w.layout_id == target.layout_id)
                items = [i for i in work.items if i.param_name == target.param_name]
                assert len(target.families) <= len(items)


def _plan_of(items_by_key: dict[tuple[int, str], list[CopyItem]], shape, dtype="float32"):
    """A plan streaming one tensor ``"w"`` of local `shape`, with the items of each
    ``(layout_id, param_name)``."""
    work: dict[int, list[CopyItem]] = {}
    for (layout_id, _), items in items_by_key.items():
        work.setdefault(layout_id, []).extend(items)
    return SourcePlan(
        rank=0,
        dtype=dtype,
        work={"w": tuple(StageWork(layout_id=i, items=tuple(v)) for i, v in sorted(work.items()))},
        targets={layout_id: () for layout_id in work},
        shapes={"w": tuple(shape)},
    )


def _item(box, dst_element: int, *, param="p", element_size=4, hf_name="w") -> CopyItem:
    numel = math.prod(stop - start for start, stop in box)
    return CopyItem(
        hf_name=hf_name,
        src_box=tuple(box),
        param_name=param,
        dst_offset_bytes=dst_element * element_size,
        num_bytes=numel * element_size,
    )


def _families(plan: SourcePlan) -> tuple[RunFamily, ...]:
    """The families of the one target of tensor ``"w"``, checked against the oracle."""
    mapped = delta_map(plan)
    _assert_maps_exactly(plan, mapped)
    (target,) = mapped.tensors["w"]
    return target.families


def _family(src, src_step, dst, dst_step, count, length) -> RunFamily:
    return RunFamily(
        src_start=src,
        src_step=src_step,
        dst_start=dst,
        dst_step=dst_step,
        count=count,
        length=length,
    )


@pytest.mark.parametrize(
    ("shape", "box", "families"),
    [
        ((6, 10), ((0, 6), (2, 5)), [_family(2, 10, 7, 3, 6, 3)]),  # a column slice
        ((6, 10), ((1, 4), (0, 10)), [_family(10, 0, 7, 0, 1, 30)]),  # a row slice
        ((6, 10), ((0, 6), (0, 10)), [_family(0, 0, 7, 0, 1, 60)]),  # the whole tensor
        ((6, 10), ((3, 4), (2, 5)), [_family(32, 0, 7, 0, 1, 3)]),  # part of one row
        # two partial leading dims: the longer one is the progression
        (
            (4, 5, 6),
            ((1, 3), (1, 4), (2, 5)),
            [_family(38, 6, 7, 3, 3, 3), _family(68, 6, 16, 3, 3, 3)],
        ),
        (
            (4, 5, 6),
            ((1, 4), (1, 3), (2, 5)),
            [_family(38, 30, 7, 6, 3, 3), _family(44, 30, 10, 6, 3, 3)],
        ),
        # the middle dim spans its whole extent: it folds with the outer one
        ((2, 3, 4), ((0, 2), (0, 3), (1, 3)), [_family(1, 4, 7, 2, 6, 2)]),
        # a leading dim of extent 1 drops out
        ((3, 1, 4), ((0, 3), (0, 1), (1, 2)), [_family(1, 4, 7, 1, 3, 1)]),
    ],
)
def test_one_box_becomes_the_fewest_families(shape, box, families) -> None:
    assert list(_families(_plan_of({(0, "p"): [_item(box, 7)]}, shape))) == families


def test_per_row_items_in_any_order_rejoin_and_interleaved_blocks_keep_their_columns() -> None:
    rows = [_item(((r, r + 1), (4, 8)), 100 + 16 * r) for r in range(50)]
    random.Random(0).shuffle(rows)
    assert _families(_plan_of({(0, "p"): rows}, (50, 16))) == (_family(4, 16, 100, 16, 50, 4),)
    # each row's columns 0..3 and 6..9, written a row after the other: two column families
    blocks = [
        _item(((r, r + 1), (c, c + 4)), 8 * r + 4 * (c > 0)) for r in range(50) for c in (0, 6)
    ]
    assert _families(_plan_of({(0, "p"): blocks}, (50, 16))) == (
        _family(0, 16, 0, 8, 50, 4),
        _family(6, 16, 4, 8, 50, 4),
    )
    # row blocks written back to back are one run; padding between them is skipped
    padding = CopyItem(hf_name=None, src_box=(), param_name="p", dst_offset_bytes=0, num_bytes=8)
    chunks = [_item(((r, r + 5), (0, 16)), 2 + 16 * r) for r in range(0, 50, 5)]
    assert _families(_plan_of({(0, "p"): [padding, *chunks]}, (50, 16))) == (
        _family(0, 0, 2, 0, 1, 800),
    )


def test_targets_follow_layouts_then_first_write_and_padding_only_tensors_map_to_nothing() -> None:
    plan = _plan_of(
        {
            (0, "q"): [_item(((2, 4), (0, 3)), 0, param="q")],
            (0, "p"): [_item(((0, 2), (0, 3)), 0)],
            (1, "p"): [_item(((0, 4), (0, 3)), 0)],
        },
        (4, 3),
    )
    pad = CopyItem(hf_name=None, src_box=(), param_name="z", dst_offset_bytes=0, num_bytes=4)
    plan = dataclasses.replace(
        plan,
        work={**plan.work, "b": (StageWork(layout_id=0, items=(pad,)),)},
        shapes={**plan.shapes, "b": (1,)},
    )
    mapped = delta_map(plan)
    assert [(t.layout_id, t.param_name) for t in mapped.tensors["w"]] == [
        (0, "q"),
        (0, "p"),
        (1, "p"),
    ]
    assert mapped.tensors["b"] == ()
    assert [t.num_elements for t in mapped.tensors["w"]] == [6, 6, 12]
    _assert_maps_exactly(plan, mapped)


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (  # the same columns of row 3, twice
            [_item(((0, 4), (1, 3)), 0), _item(((3, 4), (2, 4)), 20)],
            r"HF tensor 'w' \(local shape \(4, 6\)\) into 'p' of layout 0: local element \(3, 2\) "
            "is written twice",
        ),
        (
            [_item(((0, 4), (0, 6)), 0), _item(((0, 4), (0, 6)), 24)],
            r"local element \(0, 0\) is written twice",
        ),
        (
            [
                _item(((0, 1), (0, 6)), 0),
                CopyItem(
                    hf_name="w",
                    src_box=((1, 2), (0, 6)),
                    param_name="p",
                    dst_offset_bytes=26,
                    num_bytes=24,
                ),
            ],
            "byte offset 26 is not a whole number of 4-byte elements",
        ),
        (
            [_item(((0, 1), (0, 6)), 0), _item(((1, 2), (0, 6)), 6, element_size=2)],
            "has 12 bytes for 6 elements; expected 4 bytes each",
        ),
        ([_item(((0, 5), (0, 6)), 0)], r"box \(\(0, 5\), \(0, 6\)\) does not fit the local shape"),
        ([_item(((0, 4),), 0)], r"box \(\(0, 4\),\) does not fit"),
    ],
)
def test_invalid_items_are_refused_naming_tensor_layout_and_parameter(items, message) -> None:
    with pytest.raises(ValueError, match=message):
        delta_map(_plan_of({(0, "p"): items}, (4, 6)))


def test_a_tensor_without_a_shape_is_refused() -> None:
    plan = dataclasses.replace(_plan_of({(0, "p"): [_item(((0, 1),), 0)]}, (4,)), shapes={})
    with pytest.raises(
        ValueError, match="HF tensor 'w' is in the plan's work but not in its shapes"
    ):
        delta_map(plan)


def test_the_oracle_catches_a_map_that_is_off_anywhere() -> None:
    source = _plan("qwen3", "columns", 2).for_source(1)
    mapped = delta_map(source)
    hf_name = next(iter(mapped.tensors))
    first, *rest = mapped.tensors[hf_name]
    (family,) = first.families

    def with_families(*families: RunFamily) -> DeltaMap:
        target = dataclasses.replace(first, families=families)
        return dataclasses.replace(mapped, tensors={**mapped.tensors, hf_name: (target, *rest)})

    wrong = [
        with_families(dataclasses.replace(family, dst_start=family.dst_start + 1)),
        with_families(dataclasses.replace(family, count=family.count - 1)),
        with_families(dataclasses.replace(family, length=family.length - 1)),
        with_families(family, _family(family.src_start, 0, 10**6, 0, 1, 1)),
    ]
    _assert_maps_exactly(source, mapped)
    for bad in wrong:
        with pytest.raises(AssertionError):
            _assert_maps_exactly(source, bad)


@st.composite
def _random_plans(draw) -> tuple[SourcePlan, list[CopyItem]]:
    """A tensor of 1-3 dims cut into a grid; some cells go to parameters of two layouts,
    some of them cut again into slabs along their first dim (a sharded source's runs), with
    random destination order, gaps and padding. Returns the plan and its data items."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    cuts = []
    for extent in shape:
        inner = draw(st.sets(st.integers(1, extent - 1), max_size=3)) if extent > 1 else set()
        cuts.append([0, *sorted(inner), extent])
    cells = list(itertools.product(*(list(itertools.pairwise(c)) for c in cuts)))
    element_size = draw(st.sampled_from([1, 2, 4]))
    rng = draw(st.randoms(use_true_random=False))
    keys = [(0, "a"), (0, "b"), (1, "a")]
    pieces: dict[tuple[int, str], list[list[tuple]]] = {}
    for cell in cells:
        if rng.random() < 0.25:
            continue
        key = rng.choice(keys)
        slabs = [cell]
        if rng.random() < 0.5 and cell[0][1] - cell[0][0] > 1:
            slabs = [((i, i + 1), *cell[1:]) for i in range(*cell[0])]
        pieces.setdefault(key, []).append(slabs)
    items: dict[tuple[int, str], list[CopyItem]] = {}
    data: list[CopyItem] = []
    for (layout_id, param), groups in pieces.items():
        rng.shuffle(groups)
        dst = rng.randrange(3)
        out = items.setdefault((layout_id, param), [])
        for slabs in groups:
            if rng.random() < 0.2:
                out.append(
                    CopyItem(
                        hf_name=None,
                        src_box=(),
                        param_name=param,
                        dst_offset_bytes=dst * element_size,
                        num_bytes=element_size,
                    )
                )
                dst += 1
            for slab in slabs:  # a cut cell's slabs stay one run of the destination
                item = _item(slab, dst, param=param, element_size=element_size)
                out.append(item)
                data.append(item)
                dst += item.src_numel
            dst += rng.choice([0, 0, 1, 5])
        rng.shuffle(out)
    return _plan_of(items, shape, dtype=f"e{element_size}"), data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_random_plans())
def test_random_boxes_map_exactly_like_their_items(drawn) -> None:
    plan, _ = drawn
    _assert_maps_exactly(plan, delta_map(plan))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_random_plans(), st.randoms(use_true_random=False))
def test_random_items_that_write_an_element_twice_are_refused(drawn, rng) -> None:
    plan, data = drawn
    if not data:
        return
    original = rng.choice(data)
    shape = plan.shapes["w"]
    # a box that shares at least one element with the original: an element of it, grown
    inside = [rng.randrange(start, stop) for start, stop in original.src_box]
    box = tuple(
        (rng.randint(0, i), rng.randint(i + 1, extent))
        for i, extent in zip(inside, shape, strict=True)
    )
    element_size = original.num_bytes // original.src_numel
    twice = _item(box, 10**6, param=original.param_name, element_size=element_size)
    layout_id = next(w.layout_id for w in plan.work["w"] if original in w.items)
    work = tuple(
        dataclasses.replace(w, items=(*w.items, twice)) if w.layout_id == layout_id else w
        for w in plan.work["w"]
    )
    with pytest.raises(
        ValueError, match=f"into '{original.param_name}' of layout {layout_id}: local element"
    ):
        delta_map(dataclasses.replace(plan, work={"w": work}))
