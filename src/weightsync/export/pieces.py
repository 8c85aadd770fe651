"""Pieces of HF tensors a sharded trainer rank holds, and the rank's stream built from them.

A sharded trainer keeps an HF tensor's elements spread over its ranks, and one local
parameter may hold parts of several HF tensors (Megatron's ``linear_qkv`` holds q, k and v
rows; its ``linear_fc1`` gate and up rows). A `HeldPiece` says which box of one HF tensor a
window of one local parameter is. The pieces a rank holds of one HF tensor must tile one box
of it: that box is the rank's `TensorMeta.box`, and the stream yields it as one tensor, a
view of the parameter when the rank holds it in one piece, a buffer refilled from the pieces
at every iteration otherwise (a rank of a Megatron model holding several query groups holds
each group's q rows apart from the next's).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.export.base import ViewExport
from weightsync.plan.types import TensorMeta

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldPiece:
    """One box of one HF tensor that a window of one local parameter holds.

    Attributes:
        param_name: the local parameter, as its module names it.
        hf_name: the HF checkpoint tensor.
        hf_shape: the HF tensor's full shape.
        box: ``(start, stop)`` per HF dim of the elements this piece holds.
        window: ``(start, stop)`` per dim of the local parameter: ``param[window]`` equals
            ``hf_tensor[box]``; it has as many dims as the parameter, the box's extents
            once dims of extent 1 that the HF tensor lacks are dropped (an expert index).
        param: the local parameter.
    """

    param_name: str
    hf_name: str
    hf_shape: tuple[int, ...]
    box: Box
    window: tuple[tuple[int, int] | int, ...]
    param: torch.Tensor = field(repr=False, compare=False)

    def view(self) -> torch.Tensor:
        """``param[window]``, detached: a view, no copy."""
        index = tuple(w if isinstance(w, int) else slice(*w) for w in self.window)
        return self.param.detach()[index]


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldTensor:
    """Everything a rank holds of one HF tensor: the box its pieces tile, and the pieces."""

    hf_name: str
    meta: TensorMeta
    pieces: tuple[HeldPiece, ...]


def held_tensors(pieces: Sequence[HeldPiece]) -> list[HeldTensor]:
    """The pieces grouped by HF tensor, in the order each tensor's first piece comes.

    Raises:
        ValueError: the pieces of one HF tensor overlap, do not tile one box, disagree on the
            tensor's shape, or a piece's window is not its box's extents.
    """
    grouped: dict[str, list[HeldPiece]] = {}
    for piece in pieces:
        grouped.setdefault(piece.hf_name, []).append(piece)
    held = []
    for hf_name, mine in grouped.items():
        shapes = {p.hf_shape for p in mine}
        if len(shapes) != 1:
            raise ValueError(
                f"the rank's parameters {[p.param_name for p in mine]} hold HF tensor "
                f"{hf_name!r} with different full shapes {sorted(shapes)}"
            )
        for piece in mine:
            extents = tuple(stop - start for start, stop in piece.box)
            local = tuple(piece.view().shape)
            if local != extents:
                raise ValueError(
                    f"parameter {piece.param_name!r} window {piece.window} holds "
                    f"{local} elements of HF tensor {hf_name!r}, but its box {piece.box} has "
                    f"extents {extents}"
                )
        bounding = tuple(
            (min(p.box[d][0] for p in mine), max(p.box[d][1] for p in mine))
            for d in range(len(mine[0].hf_shape))
        )
        if sum(_numel(p.box) for p in mine) != _numel(bounding) or _overlap(mine):
            raise ValueError(
                f"the rank holds HF tensor {hf_name!r} in boxes {[p.box for p in mine]} that "
                "do not tile one box; a source rank must hold one box of each tensor"
            )
        meta = TensorMeta(shape=mine[0].hf_shape, dtype=mine[0].param.dtype, box=bounding)
        held.append(HeldTensor(hf_name=hf_name, meta=meta, pieces=tuple(mine)))
    return held


class PieceStream:
    """The ``(hf_name, tensor)`` stream of a rank's held tensors: views where a tensor is one
    piece, otherwise a buffer of the box that each iteration refills from the pieces (the
    buffers are kept between iterations, so the stream's geometry stays the same)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, held: Sequence[HeldTensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each held tensor as its box."""
        for tensor in held:
            if len(tensor.pieces) == 1:
                yield tensor.hf_name, tensor.pieces[0].view()
                continue
            yield tensor.hf_name, self._assembled(tensor)

    def _assembled(self, tensor: HeldTensor) -> torch.Tensor:
        first = tensor.pieces[0].param
        shape = tensor.meta.local_shape
        buffer = self._buffers.get(tensor.hf_name)
        if (
            buffer is None
            or tuple(buffer.shape) != shape
            or buffer.dtype != first.dtype
            or buffer.device != first.device
        ):
            buffer = torch.empty(shape, dtype=first.dtype, device=first.device)
            self._buffers[tensor.hf_name] = buffer
        origin = [start for start, _ in tensor.meta.held_box]
        with torch.no_grad():
            for piece in tensor.pieces:
                index = tuple(
                    slice(start - o, stop - o)
                    for (start, stop), o in zip(piece.box, origin, strict=True)
                )
                buffer[index].copy_(piece.view())
        return buffer


class PiecesExport(ViewExport):
    """The base of the exports of sharded trainers: subclasses say which pieces of HF tensors
    the rank holds (`pieces`, read from its model) and when its memory may have moved
    (`memory_key`); the held tensors are worked out again only then, and the stream is
    built from them by a `PieceStream`."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[HeldTensor] | None = None
        self._held_key: Any = None
        self._held_holding: tuple[list[HeldTensor], Mapping[str, TensorMeta]] | None = None
        self._stream = PieceStream()

    def pieces(self) -> list[HeldPiece]:
        """Every piece of an HF tensor the rank holds, read from its model."""
        raise NotImplementedError

    def held(self) -> list[HeldTensor]:
        """The HF tensors this rank holds part of, with their pieces (worked out again when
        the parameters moved)."""
        if self._pinned and self._held is not None:
            return self._held
        key = self.memory_key()
        if self._held is None or key != self._held_key:
            self._held = held_tensors(self.pieces())
            self._held_key = key
        return self._held

    def views_only(self) -> bool:
        """Whether every held tensor is one piece (so the stream yields views, no buffer
        refilled from pieces)."""
        return all(len(tensor.pieces) == 1 for tensor in self.held())

    def holding(self) -> Mapping[str, TensorMeta]:
        """``{hf_name: TensorMeta}`` with the box this rank holds of each, in stream order
        (the same mapping while the held tensors are)."""
        held = self.held()
        if self._held_holding is None or self._held_holding[0] is not held:
            self._held_holding = (held, {tensor.hf_name: tensor.meta for tensor in held})
        return self._held_holding[1]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each held box as a tensor of its extents: a view of the parameter where the
        rank holds it in one piece."""
        return self._stream(self.held())


def _numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def _overlap(pieces: Sequence[HeldPiece]) -> bool:
    for i, a in enumerate(pieces):
        for b in pieces[i + 1 :]:
            pairs = zip(a.box, b.box, strict=True)
            if all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in pairs):
                return True
    return False
