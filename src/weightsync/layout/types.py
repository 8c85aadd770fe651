"""The data the layout rules produce: a rank's parameters and where each element comes from."""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightsync.layout.dtypes import DTYPE_SIZES


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """A contiguous run of a parameter's flattened elements and where it comes from.

    Elements ``[dst_offset, dst_offset + numel)`` of the parameter (row-major) are the box
    ``src_box`` of HF tensor ``hf_name``, read row-major; ``hf_name is None`` means padding,
    which the engine keeps zero.

    Attributes:
        dst_offset: first element of the run in the flattened parameter.
        numel: number of elements in the run.
        hf_name: the HF checkpoint tensor the run comes from, or ``None`` for padding.
        src_box: ``(start, stop)`` per dim of the HF tensor; empty for padding.
    """

    dst_offset: int
    numel: int
    hf_name: str | None
    src_box: tuple[tuple[int, int], ...] = ()

    @property
    def is_padding(self) -> bool:
        """Whether this run is padding (zeros) rather than checkpoint data."""
        return self.hf_name is None


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamLayout:
    """One parameter of one rollout rank: its name, shape, dtype and sources.

    Attributes:
        name: the engine's parameter name (SGLang's: ``...qkv_proj.weight``).
        shape: the parameter's shape on this rank.
        dtype: torch dtype name without the ``torch.`` prefix (``"bfloat16"``).
        segments: runs that cover ``[0, numel)`` exactly once, sorted by ``dst_offset``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        """Number of elements of the parameter."""
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def num_bytes(self) -> int:
        """Bytes of the parameter."""
        return self.numel * self.element_size
