"""The geometry of a source's tensor stream: what a push program's copies depend on.

A push program (`weightsync.plan.program`) reads each tensor of a trainer rank's stream with
strided copies computed ahead of time, so it is valid only for streams whose tensors sit in
memory the same way: same names in the same order, and per tensor the same shape, strides,
storage offset, dtype, device, and the same sharing of storages between tensors. This module
holds that description as plain data; exports compute it (`weightsync.export`), the sender
checks every arriving tensor against it. Addresses are not part of it: a model whose memory
moved but kept its layout keeps its program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

StreamKey = str
"""How a stream names one of its tensors: the HF checkpoint name."""


class TensorGeometry(NamedTuple):
    """How one stream tensor lies in memory (a named tuple: one is made per arriving tensor).

    Attributes:
        shape: the tensor's shape.
        stride: its strides, in elements.
        storage_offset: its first element's offset in its storage, in elements.
        dtype: its dtype name (``"bfloat16"``).
        device: its device (``"cpu"``, ``"cuda:0"``).
        storage: the stream index of the first tensor that shares its storage (its own index
            when none before it does).
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: str
    device: str
    storage: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamGeometry:
    """Every tensor of one stream, in stream order.

    Attributes:
        keys: the tensors' names, in the order the stream yields them.
        tensors: each one's `TensorGeometry` (``storage`` indexes into `keys`).

    Raises:
        ValueError: the two sequences differ in length, a name repeats, or a ``storage``
            index does not point at an earlier (or the same) tensor.
    """

    keys: tuple[StreamKey, ...]
    tensors: tuple[TensorGeometry, ...] = field(compare=True)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        keys, tensors = tuple(self.keys), tuple(self.tensors)
        if len(keys) != len(tensors):
            raise ValueError(
                f"StreamGeometry: {len(keys)} keys but {len(tensors)} tensor geometries"
            )
        seen: set[str] = set()
        for key in keys:
            if key in seen:
                raise ValueError(f"the tensor stream yields {key!r} twice")
            seen.add(key)
        for index, tensor in enumerate(tensors):
            if not 0 <= tensor.storage <= index:
                raise ValueError(
                    f"StreamGeometry: tensor {keys[index]!r} (index {index}) shares the storage "
                    f"of index {tensor.storage}, which does not come before it"
                )
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "_hash", hash((keys, tensors)))

    def __hash__(self) -> int:
        return self._hash

    def __len__(self) -> int:
        return len(self.keys)

    def index(self) -> dict[StreamKey, int]:
        """``{key: stream index}``."""
        return {key: i for i, key in enumerate(self.keys)}


def restrict(geometry: StreamGeometry, keys: Sequence[StreamKey]) -> tuple[TensorGeometry, ...]:
    """The geometries of `keys` (a subsequence of the stream, in stream order), with each
    ``storage`` renumbered to index into `keys`: the first of them sharing that storage.

    A sender sees only the tensors its plan needs; storage sharing among those is what it
    can check, and what copy fusion may use.

    Raises:
        ValueError: a key is not in the stream, or `keys` are not in stream order.
    """
    index = geometry.index()
    first_needed: dict[int, int] = {}
    out: list[TensorGeometry] = []
    last = -1
    for position, key in enumerate(keys):
        stream_index = index.get(key)
        if stream_index is None:
            raise ValueError(f"{key!r} is not in the tensor stream")
        if stream_index <= last:
            raise ValueError(f"{key!r} comes before an earlier key in the tensor stream")
        last = stream_index
        tensor = geometry.tensors[stream_index]
        group = first_needed.setdefault(tensor.storage, position)
        out.append(tensor._replace(storage=group))
    return tuple(out)
