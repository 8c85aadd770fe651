"""`CheckpointExport`: a safetensors checkpoint on disk as the stream a sync reads (what
``weightsync push`` sends)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from weightsync.checkpoint import SafetensorsCheckpoint
from weightsync.export.base import ExportDefaults
from weightsync.plan.geometry import StreamGeometry, TensorGeometry
from weightsync.plan.types import TensorMeta


class CheckpointExport(ExportDefaults):
    """The tensors of a checked `weightsync.checkpoint.SafetensorsCheckpoint`, whole, as a
    `weightsync.WeightExport`.

    Its holding and geometry come from the checked headers, so nothing is read for them;
    every iteration reads each tensor from its file when it reaches it
    (`SafetensorsCheckpoint.stream`), into memory that goes back to the system once the
    consumer drops the tensor. Host memory so follows what the push holds: a bucket when
    every byte is staged (``SenderConfig(direct="never")``); a direct write would keep each
    tensor it reads until the push ends. A file truncated during a push fails the push with
    a `ValueError` naming the file and the tensor.
    """

    def __init__(self, checkpoint: SafetensorsCheckpoint) -> None:
        """Export `checkpoint`'s tensors in its `entries` order (it must stay open while the
        export is iterated)."""
        self.checkpoint = checkpoint
        entries = checkpoint.entries
        self._holding = {e.name: TensorMeta(shape=e.shape, dtype=e.dtype) for e in entries}
        tensors = []
        first_empty: int | None = None
        for index, entry in enumerate(entries):
            storage = index
            if entry.num_bytes == 0:
                # Empty tensors have no memory: they all answer the same (null) address.
                first_empty = index if first_empty is None else first_empty
                storage = first_empty
            stride = torch.empty(entry.shape, device="meta").stride()
            tensors.append(TensorGeometry(entry.shape, stride, 0, entry.dtype, "cpu", storage))
        self._geometry = StreamGeometry(keys=tuple(e.name for e in entries), tensors=tuple(tensors))

    def holding(self) -> Mapping[str, TensorMeta]:
        """``{hf_name: TensorMeta}`` of every tensor (whole), in stream order."""
        return self._holding

    def geometry(self) -> StreamGeometry:
        """Every tensor contiguous on the host, in storage of its own."""
        return self._geometry

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``(hf_name, tensor)`` stream, each tensor read from its file as it comes.

        Raises:
            ValueError: a file ended early or changed since its header was checked, naming
                the file and the tensor.
        """
        return self.checkpoint.stream()
