"""Sources that hold boxes of HF tensors: the box arithmetic, and what the plan refuses."""

from __future__ import annotations

import pytest

from weightsync.errors import LayoutMismatchError
from weightsync.layout import hf_tensor_shapes
from weightsync.plan import CopyItem, SourceHolding, TensorMeta, build_plan, simulate_targets
from weightsync.plan.boxes import cut, disjoint_or_equal, intersect, numel, runs_within, shift
from weightsync.testing.presets import preset_config

CONFIG = preset_config("tiny")  # qwen3, 4 layers, float32
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"  # (64, 64)
O_PROJ = "model.layers.1.self_attn.o_proj.weight"


def _item(box, dst=0, element_size=4) -> CopyItem:
    return CopyItem(
        hf_name="w",
        src_box=box,
        param_name="p",
        dst_offset_bytes=dst,
        num_bytes=numel(box) * element_size,
    )


def test_intersect_and_numel() -> None:
    assert intersect(((0, 4), (0, 6)), ((2, 8), (3, 4))) == ((2, 4), (3, 4))
    assert intersect(((0, 4),), ((4, 8),)) is None
    assert intersect(((0, 4),), ((0, 4), (0, 1))) is None
    assert numel(((2, 4), (3, 9))) == 12


def test_disjoint_or_equal_finds_a_partial_overlap() -> None:
    halves = [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((0, 2), (0, 4))]
    assert disjoint_or_equal(halves) is None
    assert disjoint_or_equal([*halves, ((1, 3), (0, 4))]) is not None


def test_rows_are_one_run_and_columns_one_run_per_row() -> None:
    item = _item(((0, 4), (0, 6)), dst=100)
    (rows,) = runs_within(item, ((1, 3), (0, 6)))
    assert rows.src_box == ((1, 3), (0, 6))
    assert (rows.dst_offset_bytes, rows.num_bytes) == (100 + 6 * 4, 12 * 4)
    columns = runs_within(item, ((0, 4), (2, 5)))
    assert [run.src_box for run in columns] == [((r, r + 1), (2, 5)) for r in range(4)]
    assert [run.dst_offset_bytes for run in columns] == [100 + (6 * r + 2) * 4 for r in range(4)]
    assert all(run.num_bytes == 3 * 4 for run in columns)
    assert runs_within(item, item.src_box) == [item]


def test_cut_covers_each_element_once_and_counts_what_is_unheld() -> None:
    item = _item(((0, 4), (0, 6)))
    boxes = [((0, 4), (0, 3)), ((0, 2), (3, 6))]  # rows 2-3 of columns 3-5 unheld
    pieces, unheld = cut(item, boxes)
    assert unheld == 6
    assert sum(run.num_bytes for runs in pieces.values() for run in runs) == 18 * 4
    assert set(pieces) == set(boxes)


def test_shift_moves_reads_to_the_holders_origin() -> None:
    moved = shift(_item(((2, 4), (3, 6)), dst=8), (2, 3))
    assert moved.src_box == ((0, 2), (0, 3))
    assert (moved.dst_offset_bytes, moved.num_bytes) == (8, 24)


def _sources(q_boxes: list, o_boxes: list | None = None) -> list[SourceHolding]:
    """Source k holds box k of q_proj (and of o_proj); the rest whole on source 0."""
    shapes = hf_tensor_shapes(CONFIG)
    count = max(len(q_boxes), len(o_boxes or []))
    tensors: list[dict] = [{} for _ in range(count)]
    for name, shape in shapes.items():
        if name == Q_PROJ:
            for k, box in enumerate(q_boxes):
                tensors[k][name] = TensorMeta(shape=shape, dtype="float32", box=box)
        elif name == O_PROJ and o_boxes:
            for k, box in enumerate(o_boxes):
                tensors[k][name] = TensorMeta(shape=shape, dtype="float32", box=box)
        else:
            tensors[0][name] = TensorMeta(shape=shape, dtype="float32")
    return [SourceHolding(rank=k, tensors=t) for k, t in enumerate(tensors)]


def _plan(sources):
    return build_plan(hf_config=CONFIG, targets=simulate_targets(CONFIG, tp=2), sources=sources)


def test_row_and_column_slices_plan_local_reads() -> None:
    rows = [((0, 32), (0, 64)), ((32, 64), (0, 64))]
    columns = [((0, 64), (0, 16)), ((0, 64), (16, 64))]
    plan = _plan(_sources(rows, columns))
    second = plan.for_source(1)
    assert second.boxes == {Q_PROJ: rows[1], O_PROJ: columns[1]}
    assert second.shapes == {Q_PROJ: (32, 64), O_PROJ: (64, 48)}
    for name, shape in second.shapes.items():
        for work in second.work[name]:
            for item in work.items:
                assert all(0 <= a < b <= d for (a, b), d in zip(item.src_box, shape, strict=True))
    units = {key for key in plan.assignments if key[0] in (Q_PROJ, O_PROJ)}
    assert {key[2] for key in units} == set(rows) | set(columns)


def test_partially_overlapping_boxes_are_refused_naming_tensor_ranks_and_boxes() -> None:
    boxes = [((0, 40), (0, 64)), ((32, 64), (0, 64))]
    with pytest.raises(LayoutMismatchError) as caught:
        _plan(_sources(boxes))
    message = str(caught.value)
    assert Q_PROJ in message and "overlap without being equal" in message
    assert "((0, 40), (0, 64))" in message and "[1]" in message


def test_whole_beside_boxes_is_refused() -> None:
    sources = _sources([((0, 32), (0, 64)), ((32, 64), (0, 64))])
    whole = dict(sources[0].tensors)
    whole[Q_PROJ] = TensorMeta(shape=(64, 64), dtype="float32")
    sources.append(SourceHolding(rank=2, tensors={Q_PROJ: whole[Q_PROJ]}))
    with pytest.raises(LayoutMismatchError, match="hold all of it while ranks"):
        _plan(sources)


def test_elements_in_no_box_are_refused_with_their_count() -> None:
    boxes = [((0, 32), (0, 64)), ((40, 64), (0, 64))]  # rows 32..39 held by nobody
    with pytest.raises(LayoutMismatchError) as caught:
        _plan(_sources(boxes))
    message = str(caught.value)
    assert f"{8 * 64} elements of HF tensor {Q_PROJ!r}" in message
    assert "lie in no trainer source's box" in message


def test_a_box_past_the_shape_is_refused_by_the_tensor_meta() -> None:
    with pytest.raises(ValueError, match="is not a non-empty window"):
        TensorMeta(shape=(64, 64), dtype="float32", box=((0, 65), (0, 64)))
