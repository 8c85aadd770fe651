"""`Fp8Export`: a bf16 trainer's export as the block-FP8 checkpoint an FP8 rollout serves.

Each linear weight ``X.weight`` of the wrapped export (`weightsync.layout.quant` says which)
is yielded as its e4m3 codes followed by ``X.weight_scale_inv``, quantised on the tensor's own
device (`weightsync.export.quantize`); every other tensor passes through. Weights that lie
at a constant step in one storage (the per-expert views of a fused expert tensor) are
quantised by one launch. Codes and scales live in buffers the export keeps (allocated on
first use, again only when the wrapped stream's geometry changes), so the stream's geometry
stays fixed between pushes and the push program is reused; they cost one byte per quantised
element and four per block.

A push iterates the stream once per dtype part of its plan (`weightsync.plan.parts`) and once
more for its finite check: the sender calls `begin_push` once before, and the export
quantises each weight on its first iteration after that call only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from weightsync.export.base import ExportDefaults, WeightExport
from weightsync.export.geometry import tensor_geometry
from weightsync.export.quantize import quantize_block_fp8, scale_shape
from weightsync.layout.dtypes import DTYPE_SIZES
from weightsync.layout.quant import FP8_DTYPE, SCALE_DTYPE, is_quantized_hf_name, scale_name
from weightsync.plan.geometry import StreamGeometry, TensorGeometry
from weightsync.plan.types import TensorMeta


@dataclass(slots=True, kw_only=True)
class _Run:
    """Weights quantised by one launch: the stream indices, their common geometry, the
    element step between two of them, and the run's codes and scales buffers."""

    name: str
    indices: list[int]
    last_offset: int
    geo: TensorGeometry
    step: int | None = None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    @property
    def step_bytes(self) -> int:
        """Bytes between two weights of the run."""
        return (self.step or 0) * DTYPE_SIZES[self.geo.dtype]

    def view(self, first: torch.Tensor) -> torch.Tensor:
        """All weights of the run as one ``[count, rows, cols]`` view of `first`'s storage."""
        return first.as_strided(
            (len(self.indices), *first.shape),
            (self.step or 0, *first.stride()),
            first.storage_offset(),
        )


class Fp8Export(ExportDefaults):
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
        """The wrapped holding as `fp8_holding` turns it.

        Raises:
            ValueError: a held box of a weight cuts a block.
        """
        return fp8_holding(self.export.holding(), self.block)

    def geometry(self) -> StreamGeometry:
        """The stream's geometry: the wrapped one with the codes and scales buffers."""
        inner = self.export.geometry()
        if self._geometry is not None and inner == self._inner_geometry:
            return self._geometry
        runs = self._runs(inner)
        buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._run_of: dict[str, tuple[_Run, int]] = {}
        for run in runs:
            first = inner.tensors[run.indices[0]]
            device = torch.device(first.device)
            count = len(run.indices)
            codes = torch.empty((count, *first.shape), dtype=torch.float8_e4m3fn, device=device)
            shape = scale_shape(first.shape, self.block)
            scales = torch.empty((count, *shape), dtype=torch.float32, device=device)
            run.codes, run.scales = codes, scales
            for position, index in enumerate(run.indices):
                key = inner.keys[index]
                buffers[key] = (codes[position], scales[position])
                self._run_of[key] = (run, position)
        keys: list[str] = []
        tensors = []
        # The first passed-through tensor of each of the wrapped stream's storages.
        first_of_storage: dict[int, int] = {}
        storages: dict[int, int] = {}
        for key, geo in zip(inner.keys, inner.tensors, strict=True):
            if key not in buffers:
                storage = first_of_storage.setdefault(geo.storage, len(keys))
                tensors.append(geo._replace(storage=storage))
                keys.append(key)
                continue
            for name, tensor in zip((key, scale_name(key)), buffers[key], strict=True):
                tensors.append(tensor_geometry(tensor, storages, len(keys)))
                keys.append(name)
        self._buffers = buffers
        self._fresh = set()
        self._inner_geometry = inner
        self._geometry = StreamGeometry(keys=tuple(keys), tensors=tuple(tensors))
        return self._geometry

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream: quantised weights (codes, then scale) and the other tensors.

        Raises:
            ValueError: a weight is not where the stream's geometry said (the export's
                memory moved after `geometry`).
        """
        self.geometry()
        firsts: dict[int, torch.Tensor] = {}
        for name, tensor in self.export:
            buffers = self._buffers.get(name)
            if buffers is None:
                yield name, tensor
                continue
            run, position = self._run_of[name]
            if position == 0:
                firsts[id(run)] = tensor
            first = firsts.get(id(run))
            expected = None if first is None else first.data_ptr() + position * run.step_bytes
            if tensor.data_ptr() != expected:
                raise ValueError(
                    f"tensor {name!r} of the export's stream is not where its geometry put it; "
                    "call geometry() again after the trainer's weights move"
                )
            if run.name not in self._fresh:
                quantize_block_fp8(
                    run.view(first), block=self.block, out=run.codes, scale_out=run.scales
                )
                self._fresh.add(run.name)
            yield name, buffers[0]
            yield scale_name(name), buffers[1]

    def _runs(self, inner: StreamGeometry) -> list[_Run]:
        """The weights to quantise, as runs that one batched launch covers: weights of one
        storage, shape, strides and dtype at a constant offset step, in stream order (the
        per-expert views of a fused expert tensor)."""
        runs: list[_Run] = []
        open_runs: dict[tuple, _Run] = {}
        for index, (key, geo) in enumerate(zip(inner.keys, inner.tensors, strict=True)):
            if not self._quantized(key, geo.shape):
                continue
            signature = (geo.storage, geo.shape, geo.stride, geo.dtype, geo.device)
            run = open_runs.get(signature)
            if run is not None:
                step = geo.storage_offset - run.last_offset
                if step > 0 and (run.step is None or step == run.step):
                    run.step = step
                    run.last_offset = geo.storage_offset
                    run.indices.append(index)
                    continue
            run = _Run(name=key, indices=[index], last_offset=geo.storage_offset, geo=geo)
            open_runs[signature] = run
            runs.append(run)
        return runs

    def _quantized(self, name: str, shape: tuple[int, ...]) -> bool:
        return _quantized(name, shape)


def _quantized(name: str, shape: tuple[int, ...]) -> bool:
    return is_quantized_hf_name(name) and len(shape) == 2


def fp8_holding(holding: Mapping[str, TensorMeta], block: int) -> dict[str, TensorMeta]:
    """What an `Fp8Export` of an export holding `holding` holds: each linear weight as e4m3
    with its float32 ``weight_scale_inv`` after it (a held box's scale: the box in blocks).

    Raises:
        ValueError: a held box of a weight cuts a block.
    """
    out: dict[str, TensorMeta] = {}
    for name, meta in holding.items():
        if not _quantized(name, meta.shape):
            out[name] = meta
            continue
        out[name] = TensorMeta(shape=meta.shape, dtype=FP8_DTYPE, box=meta.box)
        box = None if meta.box is None else _scale_box(name, meta, block)
        out[scale_name(name)] = TensorMeta(
            shape=scale_shape(meta.shape, block), dtype=SCALE_DTYPE, box=box
        )
    return out


def _scale_box(name: str, meta: TensorMeta, block: int) -> tuple[tuple[int, int], ...]:
    box = []
    for dim, ((start, stop), size) in enumerate(zip(meta.held_box, meta.shape, strict=True)):
        if start % block or (stop % block and stop != size):
            raise ValueError(
                f"tensor {name!r}: this rank holds [{start}, {stop}) of dim {dim} (of {size}), "
                f"which cuts a {block}x{block} FP8 block; shard the trainer's weights on "
                f"multiples of {block}"
            )
        box.append((start // block, -(-stop // block)))
    return tuple(box)
