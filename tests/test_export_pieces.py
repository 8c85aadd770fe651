"""Pieces of HF tensors a sharded rank holds: one box per tensor, a stream of views (or one
buffer kept between iterations), and the replica check's comparison."""

from __future__ import annotations

import pytest
import torch

from weightsync.export.consistency import replica_mismatches
from weightsync.export.pieces import HeldPiece, PieceStream, held_tensors


def _piece(param: torch.Tensor, box, window, name: str = "w", shape=(8, 4)) -> HeldPiece:
    return HeldPiece(
        param_name="p", hf_name=name, hf_shape=shape, box=box, window=window, param=param
    )


def test_one_piece_streams_a_view_of_the_parameter() -> None:
    param = torch.arange(32.0).reshape(8, 4)
    held = held_tensors([_piece(param, ((2, 6), (0, 4)), ((0, 4), (0, 4)))])
    assert held[0].meta.box == ((2, 6), (0, 4)) and held[0].meta.local_shape == (4, 4)
    ((name, tensor),) = list(PieceStream()(held))
    assert name == "w" and tensor.data_ptr() == param.data_ptr()


def test_pieces_apart_in_the_parameter_fill_one_buffer_kept_between_iterations() -> None:
    # Rows [0, 2) and [4, 6) of the parameter are HF rows [0, 2) and [2, 4): one box.
    param = torch.arange(32.0).reshape(8, 4)
    pieces = [
        _piece(param, ((0, 2), (0, 4)), ((0, 2), (0, 4))),
        _piece(param, ((2, 4), (0, 4)), ((4, 6), (0, 4))),
    ]
    held = held_tensors(pieces)
    assert held[0].meta.box == ((0, 4), (0, 4))
    stream = PieceStream()
    first = dict(stream(held))["w"]
    assert torch.equal(first, torch.cat([param[0:2], param[4:6]]))
    param.add_(1.0)
    second = dict(stream(held))["w"]
    assert second.data_ptr() == first.data_ptr()
    assert torch.equal(second, torch.cat([param[0:2], param[4:6]]))


def test_pieces_that_do_not_tile_one_box_are_refused() -> None:
    param = torch.zeros(8, 4)
    gap = [
        _piece(param, ((0, 2), (0, 4)), ((0, 2), (0, 4))),
        _piece(param, ((4, 6), (0, 4)), ((2, 4), (0, 4))),
    ]
    with pytest.raises(ValueError, match="do not tile one box"):
        held_tensors(gap)
    with pytest.raises(ValueError, match="extents"):
        held_tensors([_piece(param, ((0, 3), (0, 4)), ((0, 2), (0, 4)))])


def test_replica_mismatches_name_the_tensor_box_and_ranks() -> None:
    box = ((0, 4),)
    same = {"model.norm.weight": (box, "aa")}
    assert replica_mismatches([same, same]) == []
    problems = replica_mismatches([same, same, {"model.norm.weight": (box, "bb")}])
    assert len(problems) == 1
    assert "model.norm.weight" in problems[0] and "ranks [0, 1] vs ranks [2]" in problems[0]
    # Different boxes of one tensor are not copies of each other.
    assert replica_mismatches([same, {"model.norm.weight": (((4, 8),), "bb")}]) == []
