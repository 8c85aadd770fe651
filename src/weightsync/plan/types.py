"""The plan's inputs: what each rollout rank wants and what each trainer source rank holds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.layout.dtypes import canonical_dtype_name
from weightsync.layout.parallelism import ParallelismConfig


def _dtype_name(dtype: Any) -> str:
    # Accepts "bfloat16", "torch.bfloat16" or a torch dtype without importing torch here.
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetRank:
    """One rank of one rollout replica, as it published itself.

    Attributes:
        replica: the replica's name (its base URL, or any label unique per replica).
        rank: the rank inside the replica (the ``rank=N`` of the bootstrap routes).
        session_id: the rank's transport session id (``"host:rpc_port"``).
        parallelism: the rank's parallelism config; a dict of its fields is converted.
        weights_info: ``{param_name: (addr, numel, element_size)}`` as the rank published it;
            lists (from JSON) are converted to tuples.
        dtype: the parameters' dtype as the replica reports it (``/server_info``), when it
            names one; `build_plan` plans with it unless told another.
        regions: the ``(addr, num_bytes)`` memory regions the rank registered with its
            transport, when it publishes them (the reference server does): every parameter
            must lie inside one, which the plan checks before any byte moves.
        fp8_block_size: the block of the block-FP8 weights the replica serves (its
            ``/server_info``), 0 for unquantised ones: trainers quantise to it.
        delta_region: the ``(addr, num_bytes)`` region the rank registered for delta syncs
            (trainers write encoded changes there and the rank applies them), when it
            offers one.

    Raises:
        ValueError: an empty replica or session id, a negative rank, or a ``weights_info``
            entry that is not three non-negative ints.
    """

    replica: str
    rank: int
    session_id: str
    parallelism: ParallelismConfig
    weights_info: Mapping[str, tuple[int, int, int]] = field(hash=False)
    dtype: str | None = None
    regions: tuple[tuple[int, int], ...] | None = field(default=None, hash=False)
    fp8_block_size: int = 0
    delta_region: tuple[int, int] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.delta_region is not None:
            addr, num_bytes = (int(v) for v in self.delta_region)
            object.__setattr__(self, "delta_region", (addr, num_bytes))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", canonical_dtype_name(self.dtype))
        if not self.replica:
            raise ValueError("TargetRank.replica must be a non-empty name")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"TargetRank.rank must be a non-negative int, got {self.rank!r}")
        if not self.session_id:
            raise ValueError(f"TargetRank {self.replica} rank {self.rank}: empty session_id")
        if isinstance(self.parallelism, Mapping):
            object.__setattr__(self, "parallelism", ParallelismConfig.from_dict(self.parallelism))
        elif not isinstance(self.parallelism, ParallelismConfig):
            raise ValueError(
                f"TargetRank {self.replica} rank {self.rank}: parallelism must be a "
                f"ParallelismConfig or a dict, got {type(self.parallelism).__name__}"
            )
        info: dict[str, tuple[int, int, int]] = {}
        for name, entry in self.weights_info.items():
            values = tuple(entry)
            if len(values) != 3 or not all(isinstance(v, int) and v >= 0 for v in values):
                raise ValueError(
                    f"TargetRank {self.replica} rank {self.rank}: weights_info[{name!r}] must be "
                    f"[addr, numel, element_size] (non-negative ints), got {entry!r}"
                )
            info[name] = values  # type: ignore[assignment]
        object.__setattr__(self, "weights_info", info)
        if self.regions is not None:
            regions = tuple((int(a), int(n)) for a, n in self.regions)
            object.__setattr__(self, "regions", regions)

    @property
    def label(self) -> str:
        """``"replica <name> rank <r> (session <id>)"``, for messages."""
        return f"replica {self.replica} rank {self.rank} (session {self.session_id})"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """Shape and dtype of one HF tensor as a trainer source rank produces it, and which part
    of it the rank holds.

    A rank of a sharded trainer (Megatron-core TP/EP, FSDP2) holds a box of the HF tensor:
    a window per dim (rows of a column-parallel weight, columns of a row-parallel one, the
    rows of an FSDP shard). Its stream then yields exactly that box, as a tensor of the box's
    extents, and the plan writes from it only the destination bytes inside the box. Ranks
    that hold the same box (data-parallel copies, replicated norms) share its work.

    Attributes:
        shape: the full (unsharded) HF shape.
        dtype: torch dtype name without the ``torch.`` prefix (a torch dtype is converted);
            the sender casts to the rollout's dtype, so it may differ from it.
        box: ``(start, stop)`` per dim of the part this rank holds, or None for the whole
            tensor (the same as a box of every full dim).

    Raises:
        ValueError: a negative dim, an empty dtype, or a box that is empty, has another
            number of dims, or reaches past the shape.
    """

    shape: tuple[int, ...]
    dtype: str
    box: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"TensorMeta.shape must be non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        name = _dtype_name(self.dtype)
        if not name:
            raise ValueError("TensorMeta.dtype must be a dtype name such as 'bfloat16'")
        object.__setattr__(self, "dtype", name)
        if self.box is None:
            return
        box = tuple((int(start), int(stop)) for start, stop in self.box)
        if len(box) != len(shape) or any(
            not 0 <= start < stop <= dim for (start, stop), dim in zip(box, shape, strict=True)
        ):
            raise ValueError(
                f"TensorMeta.box {self.box!r} is not a non-empty window of shape {shape}: one "
                "(start, stop) per dim with 0 <= start < stop <= dim"
            )
        # The whole tensor is the same as no box: one spelling for one holding.
        full = all(
            start == 0 and stop == dim for (start, stop), dim in zip(box, shape, strict=True)
        )
        object.__setattr__(self, "box", None if full else box)

    @property
    def held_box(self) -> tuple[tuple[int, int], ...]:
        """The part this rank holds, the whole tensor spelled as a box."""
        return self.box if self.box is not None else tuple((0, dim) for dim in self.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the rank's stream yields: the box's extents."""
        return tuple(stop - start for start, stop in self.held_box)


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceHolding:
    """The HF tensors one trainer source rank can produce, in the order it yields them.

    PP-local: a pipeline stage holds only its own layers, named with their global layer
    numbers. Every data-parallel copy of a stage holds the same tensors, so the plan may pick
    any of them to write a tensor.

    Attributes:
        rank: the trainer source rank.
        tensors: ``{hf_name: TensorMeta}`` in the order the source's iterator yields them.

    Raises:
        ValueError: a negative rank or a value that is not a ``TensorMeta``.
    """

    rank: int
    tensors: Mapping[str, TensorMeta] = field(hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"SourceHolding.rank must be a non-negative int, got {self.rank!r}")
        for name, meta in self.tensors.items():
            if not isinstance(meta, TensorMeta):
                raise ValueError(
                    f"SourceHolding rank {self.rank}: tensors[{name!r}] must be a TensorMeta, "
                    f"got {type(meta).__name__}"
                )
        object.__setattr__(self, "tensors", dict(self.tensors))
