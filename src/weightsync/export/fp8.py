"""`Fp8Export`: a bf16 trainer's export as the block-FP8 checkpoint an FP8 rollout serves.

Each linear weight ``X.weight`` of the wrapped export (`weightsync.layout.quant` says which)
is yielded as its e4m3 codes followed by ``X.weight_scale_inv``, quantised on the tensor's own
device (`weightsync.export.quantize`); every other tensor passes through. Codes and scales
live in buffers the export keeps (allocated on first use, again only when the wrapped
stream's geometry changes), so the stream's geometry stays fixed between pushes and the push
program is reused; they cost one byte per quantised element and four per block.

A push iterates the stream once per dtype part of its plan (`weightsync.plan.parts`) and once
more for its finite check: the sender calls `begin_push` once before, and the export
quantises each weight on its first iteration after that call only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from weightsync.export.base import WeightExport
from weightsync.export.geometry import tensor_geometry
from weightsync.export.quantize import quantize_block_fp8, scale_shape
from weightsync.layout.quant import FP8_DTYPE, SCALE_DTYPE, is_quantized_hf_name, scale_name
from weightsync.plan.geometry import StreamGeometry
from weightsync.plan.types import TensorMeta


class Fp8Export:
    """`export` with every linear weight quantised to block FP8 (e4m3 codes, float32 scales).

    A `weightsync.WeightExport`. A rank holding a box of a weight (a sharded trainer's slice)
    quantises its box: the box must start and end on block boundaries (or at the tensor's
    end), and its scale is the box in blocks, so the bytes equal those of the whole tensor
    quantised and cut.

    Args:
        export: the trainer rank's export (bf16 or float32 tensors).
        block: the rollout checkpoint's block size (``weight_block_size``).

    Raises:
        ValueError: a block size below 1.
    """

    def __init__(self, export: WeightExport, *, block: int) -> None:
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"Fp8Export block must be a positive int, got {block!r}")
        self.export = export
        self.block = block
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._inner_geometry: StreamGeometry | None = None
        self._geometry: StreamGeometry | None = None
        self._fresh: set[str] = set()

    def begin_push(self) -> None:
        """A push starts: the next iteration quantises every weight again (the trainer's
        weights changed since the last push); later iterations reuse the codes."""
        self._fresh = set()

    def holding(self) -> Mapping[str, TensorMeta]:
        """The wrapped holding with each weight as e4m3 and its float32 scale after it.

        Raises:
            ValueError: a held box of a weight cuts a block.
        """
        out: dict[str, TensorMeta] = {}
        for name, meta in self.export.holding().items():
            if not self._quantized(name, meta.shape):
                out[name] = meta
                continue
            out[name] = TensorMeta(shape=meta.shape, dtype=FP8_DTYPE, box=meta.box)
            box = None if meta.box is None else self._scale_box(name, meta)
            out[scale_name(name)] = TensorMeta(
                shape=scale_shape(meta.shape, self.block), dtype=SCALE_DTYPE, box=box
            )
        return out

    def geometry(self) -> StreamGeometry:
        """The stream's geometry: the wrapped one with the codes and scales buffers."""
        inner = self.export.geometry()
        if self._geometry is not None and inner == self._inner_geometry:
            return self._geometry
        buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        keys: list[str] = []
        tensors = []
        # The first passed-through tensor of each of the wrapped stream's storages.
        first_of_storage: dict[int, int] = {}
        storages: dict[int, int] = {}
        for key, geo in zip(inner.keys, inner.tensors, strict=True):
            if not self._quantized(key, geo.shape):
                storage = first_of_storage.setdefault(geo.storage, len(keys))
                tensors.append(geo._replace(storage=storage))
                keys.append(key)
                continue
            old = self._buffers.get(key)
            device = torch.device(geo.device)
            if old is not None and old[0].shape == geo.shape and old[0].device == device:
                codes, scales = old
            else:
                codes = torch.empty(geo.shape, dtype=torch.float8_e4m3fn, device=device)
                shape = scale_shape(geo.shape, self.block)
                scales = torch.empty(shape, dtype=torch.float32, device=device)
            buffers[key] = (codes, scales)
            for name, tensor in ((key, codes), (scale_name(key), scales)):
                # Buffers own their storage: offset past the wrapped stream's indices.
                geometry = tensor_geometry(tensor, storages, len(keys))
                tensors.append(geometry)
                keys.append(name)
        self._buffers = buffers
        self._fresh = set()
        self._inner_geometry = inner
        self._geometry = StreamGeometry(keys=tuple(keys), tensors=tuple(tensors))
        return self._geometry

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream: quantised weights (codes, then scale) and the other tensors."""
        self.geometry()
        for name, tensor in self.export:
            buffers = self._buffers.get(name)
            if buffers is None:
                yield name, tensor
                continue
            codes, scales = buffers
            if name not in self._fresh:
                quantize_block_fp8(tensor, block=self.block, out=codes, scale_out=scales)
                self._fresh.add(name)
            yield name, codes
            yield scale_name(name), scales

    def _quantized(self, name: str, shape: tuple[int, ...]) -> bool:
        return is_quantized_hf_name(name) and len(shape) == 2

    def _scale_box(self, name: str, meta: TensorMeta) -> tuple[tuple[int, int], ...]:
        box = []
        for dim, ((start, stop), size) in enumerate(zip(meta.held_box, meta.shape, strict=True)):
            if start % self.block or (stop % self.block and stop != size):
                raise ValueError(
                    f"tensor {name!r}: this rank holds [{start}, {stop}) of dim {dim} (of "
                    f"{size}), which cuts a {self.block}x{self.block} FP8 block; shard the "
                    f"trainer's weights on multiples of {self.block}"
                )
            box.append((start // self.block, -(-stop // self.block)))
        return tuple(box)
