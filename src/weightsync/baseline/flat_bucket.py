"""The flattened bucket of the broadcast baseline: many tensors in one byte buffer.

``update_weights_from_distributed`` with ``load_format="flattened_bucket"`` broadcasts one
buffer per request instead of one per tensor. Both ends compute the same layout from the
request's ``names``, ``dtypes`` and ``shapes``: tensors back to back in that order, each
starting at a multiple of `FLAT_ALIGN_BYTES`, so the buffer needs no header.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from weightsync.layout import DTYPE_SIZES
from weightsync.layout.dtypes import canonical_dtype_name
from weightsync.torch_dtypes import torch_dtype

# The `load_format` of ``update_weights_from_distributed`` that sends one flattened buffer per
# bucket (SGLang's name); ``None`` sends one broadcast per tensor.
FLATTENED_BUCKET = "flattened_bucket"

# Every tensor starts on a 64-byte boundary: aligned for any element size and for
# vectorised copies.
FLAT_ALIGN_BYTES = 64


def _align(num_bytes: int) -> int:
    return -(-num_bytes // FLAT_ALIGN_BYTES) * FLAT_ALIGN_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpan:
    """Where one tensor lies in a flattened bucket.

    Attributes:
        name: the HF tensor name.
        dtype: its dtype name (``"bfloat16"``).
        shape: its shape.
        offset_bytes: its first byte in the buffer.
        num_bytes: its size in bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    num_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatBucketLayout:
    """The layout of one flattened bucket.

    Attributes:
        spans: the tensors, in buffer order.
        num_bytes: the buffer's size (the end of the last tensor).
    """

    spans: tuple[TensorSpan, ...]
    num_bytes: int

    @classmethod
    def from_metadata(
        cls, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> FlatBucketLayout:
        """The layout of tensors `names` with `dtypes` and `shapes`, in that order.

        Raises:
            ValueError: lists of different lengths, an unknown dtype or a negative dimension.
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor; got {len(names)}, "
                f"{len(dtypes)} and {len(shapes)}"
            )
        spans = []
        offset = 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            dims = tuple(int(d) for d in shape)
            if any(d < 0 for d in dims):
                raise ValueError(f"tensor {name!r} has a negative dimension: {dims}")
            canonical = canonical_dtype_name(dtype)
            num_bytes = math.prod(dims) * DTYPE_SIZES[canonical]
            spans.append(
                TensorSpan(
                    name=name,
                    dtype=canonical,
                    shape=dims,
                    offset_bytes=offset,
                    num_bytes=num_bytes,
                )
            )
            offset = _align(offset + num_bytes)
        end = spans[-1].offset_bytes + spans[-1].num_bytes if spans else 0
        return cls(spans=tuple(spans), num_bytes=end)

    def views(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as a view into `buffer` (uint8, at least `num_bytes` long).

        Raises:
            ValueError: `buffer` is not a contiguous uint8 tensor of at least `num_bytes`.
        """
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
            raise ValueError(f"a flattened bucket is a contiguous uint8 buffer, got {buffer.dtype}")
        if buffer.numel() < self.num_bytes:
            raise ValueError(
                f"buffer of {buffer.numel()} bytes is smaller than the bucket ({self.num_bytes})"
            )
        for span in self.spans:
            raw = buffer[span.offset_bytes : span.offset_bytes + span.num_bytes]
            yield span.name, raw.view(torch_dtype(span.dtype)).view(span.shape)
