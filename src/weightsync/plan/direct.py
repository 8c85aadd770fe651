"""Direct writes: the copy items a sender writes from the trainer's own tensors, unstaged.

Part of lowering a source plan into a push program (`weightsync.plan.program`), pure. Where
the transport can read a stream tensor's memory (CUDA IPC within one host, Mooncake once the
tensor's storage is registered), an item whose elements already have the rollout's dtype
needs no staging: its box of the tensor is written straight into the rollout parameter, one
copy per byte instead of two. An item can go direct when

- it carries data (padding is staged: a transport writes from memory, and zeros have none);
- its tensor lies on a device the transport reads and has the plan's dtype (a cast needs a
  buffer to land in);
- its box is contiguous runs of the tensor's storage: one run (a whole tensor, a block of
  rows) or rows a pitch apart (a row-parallel slice). A box read element by element (a
  transposed view) is staged.

Whether it does is a matter of cost (`DirectSpec.policy`). Both ways put the same bytes on
the wire; they differ in what is paid before. Staged, the item costs a copy of its bytes into
the ring, and its destination (a contiguous range of one parameter) one write, or none where
it continues another item's destination (the ring holds them side by side and they go out
as one write: an expert's slice of a fused expert parameter after the expert before).
Direct, it costs a write per run, or one pitched copy where the sender copies into memory
mapped into its process (CUDA IPC). So over CUDA IPC everything that can go direct does; over
a network a tensor goes direct where its bytes take longer to copy than a write costs (over
TCP, whose writes cost tens of microseconds, pieces of a few hundred KiB and more), and a
row-parallel slice only where its rows are that long each.

A `DirectCopy` is the item as contiguous byte runs of the tensor's storage; a step's runs,
merged where they are adjacent in the storage and in the parameter, are its writes (for a
transport that takes lists of ``(src, dst, length)``, and for copies into mapped memory).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from weightsync.layout.digest import sample_run
from weightsync.plan.geometry import TensorGeometry
from weightsync.plan.items import CopyItem

DirectPolicy = Literal["auto", "always", "never"]
"""How a sender chooses between direct and staged writes: ``"auto"`` by cost (see the
module), ``"always"`` every item that can go direct, ``"never"`` nothing."""
DIRECT_POLICIES: tuple[str, ...] = ("auto", "always", "never")


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectSpec:
    """Where a program may write from the stream's tensors directly, and what that costs.

    Plain data: the sender fills it from its transport's `WriteCost` and its staging
    device (`weightsync.sender.staging.direct_spec`), so the same setup lowers the same
    program on every run.

    Attributes:
        devices: the devices whose tensors the transport can write from (``"cpu"``,
            ``"cuda:0"``); empty: everything is staged.
        policy: how items that can go direct are chosen (`DirectPolicy`).
        write_s: the transport's fixed cost of one write request, in seconds.
        stage_bytes_per_s: the rate at which the sender copies bytes into its staging ring.
        pitched: the sender writes a box of rows a pitch apart as one copy (into memory
            mapped into its process), not a write per row.

    Raises:
        ValueError: an unknown policy, a negative cost or a rate that is not positive.
    """

    devices: tuple[str, ...] = ()
    policy: DirectPolicy = "auto"
    write_s: float = 0.0
    stage_bytes_per_s: float = 1.0
    pitched: bool = False

    def __post_init__(self) -> None:
        if self.policy not in DIRECT_POLICIES:
            raise ValueError(
                f"DirectSpec.policy must be one of {DIRECT_POLICIES}, got {self.policy!r}"
            )
        if not self.write_s >= 0:
            raise ValueError(f"DirectSpec.write_s must be >= 0, got {self.write_s!r}")
        if not self.stage_bytes_per_s > 0:
            raise ValueError(
                f"DirectSpec.stage_bytes_per_s must be > 0, got {self.stage_bytes_per_s!r}"
            )

    def writes_of(self, num_runs: int, num_outer_dims: int) -> int:
        """The writes a direct item of `num_runs` runs costs: one per run, or one where the
        sender copies rows evenly spaced (a single outer dimension) as a pitched copy."""
        return 1 if self.pitched and num_outer_dims <= 1 else num_runs

    def pays(self, num_writes: int, num_bytes: int, *, continues: bool = False) -> bool:
        """Whether an item that costs `num_writes` writes direct (`writes_of`) and moves
        `num_bytes` goes direct. Staged, it costs a copy of its bytes into the ring and one
        write, or none where it `continues` another item's destination (see the module)."""
        if self.policy != "auto":
            return self.policy == "always"
        staged_s = num_bytes / self.stage_bytes_per_s + (0.0 if continues else self.write_s)
        return num_writes * self.write_s <= staged_s


class DirectCopy(NamedTuple):
    """One item written from a stream tensor straight into a parameter of every target of
    its layout (a named tuple: a MoE program holds thousands).

    Attributes:
        source: the tensor's program index.
        layout_id: the destination layout.
        param_name: the rollout parameter written.
        dst_offset_bytes: where the item's bytes start in the parameter.
        num_bytes: bytes of the item.
        runs: the item as contiguous ``(storage byte offset, parameter byte offset,
            num_bytes)`` runs, in order (the box read row-major).
    """

    source: int
    layout_id: int
    param_name: str
    dst_offset_bytes: int
    num_bytes: int
    runs: tuple[tuple[int, int, int], ...]


class DirectSample(NamedTuple):
    """One digest sample (`weightsync.layout.digest`) of a direct copy, read from the
    tensor's storage.

    Attributes:
        storage_offset: byte of the sample from the storage's first byte.
        k: its sample number in the parameter.
        digest: the entry of `PushProgram.digests` it adds to.
    """

    storage_offset: int
    k: int
    digest: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectStep:
    """The direct copies from consecutive stream tensors of one storage, written as soon as
    the last of them arrived.

    Attributes:
        source: the program index of the last of the tensors.
        storage: the program index of the first tensor sharing their storage (the storage
            the runs' offsets count from, and the sender registers).
        after: how many stream tensors must have arrived before it runs.
        copies: the copies, in the order the plan lists their items.
        samples: the digest samples of the copies.
        num_bytes: bytes the copies move (to each target of their layouts).
        writes: the copies as writes per target (`weightsync.plan.program.TargetWrites`,
            sources as byte offsets from the storage's first byte).
    """

    source: int
    storage: int
    after: int
    copies: tuple[DirectCopy, ...]
    samples: tuple[DirectSample, ...] = ()
    num_bytes: int = 0
    writes: tuple[Any, ...] = ()


def direct_copy(
    item: CopyItem,
    source: int,
    layout_id: int,
    tensor: TensorGeometry,
    *,
    dtype: str,
    element_size: int,
    spec: DirectSpec,
    continues: bool = False,
) -> DirectCopy | None:
    """`item` of the tensor `tensor` (program index `source`) as a direct copy, or None when
    it is staged (see the module); `continues`: another item of the source's plan ends
    where this one starts in the same parameter."""
    if (
        spec.policy == "never"
        or item.hf_name is None
        or tensor.dtype != dtype
        or tensor.device not in spec.devices
    ):
        return None
    size = tuple(stop - start for start, stop in item.src_box)
    offset = tensor.storage_offset + sum(
        start * stride for (start, _), stride in zip(item.src_box, tensor.stride, strict=True)
    )
    # Collapse the trailing dims that lie contiguously: what is left indexes the runs.
    dims = [(n, s) for n, s in zip(size, tensor.stride, strict=True) if n != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    if not dims:
        outer: list[tuple[int, int]] = []
    elif run == 1:
        return None  # the innermost dim is strided: element by element
    else:
        outer = dims
    run_bytes = run * element_size
    num_runs = math.prod(n for n, _ in outer)
    num_writes = spec.writes_of(num_runs, len(outer))
    if not spec.pays(num_writes, num_runs * run_bytes, continues=continues):
        return None
    runs = []
    dst = item.dst_offset_bytes
    for index in itertools.product(*(range(n) for n, _ in outer)):
        start = offset + sum(i * s for i, (_, s) in zip(index, outer, strict=True))
        runs.append((start * element_size, dst, run_bytes))
        dst += run_bytes
    return DirectCopy(
        source=source,
        layout_id=layout_id,
        param_name=item.param_name,
        dst_offset_bytes=item.dst_offset_bytes,
        num_bytes=item.num_bytes,
        runs=tuple(runs),
    )


def direct_samples(
    copies: Sequence[DirectCopy],
    param_bytes: Mapping[int, Mapping[str, int]],
    digests: dict[tuple[int, str], int],
) -> tuple[DirectSample, ...]:
    """The digest samples of `copies`, located in their tensor's storage.

    Args:
        copies: one step's copies.
        param_bytes: ``{layout_id: {param_name: num_bytes}}`` of the targets' parameters.
        digests: ``{(layout_id, param_name): digest index}``, extended with new entries.
    """
    samples: list[DirectSample] = []
    for copy in copies:
        sizes = param_bytes.get(copy.layout_id)
        total = sizes.get(copy.param_name) if sizes is not None else None
        if total is None:
            continue
        run = sample_run(total, copy.dst_offset_bytes, copy.num_bytes)
        positions = [(run.first_offset + i * run.stride, run.first_k + i) for i in range(run.count)]
        if run.tail_offset >= 0:
            positions.append((run.tail_offset, run.tail_k))
        if not positions:
            continue
        digest = digests.setdefault((copy.layout_id, copy.param_name), len(digests))
        run_bytes = copy.runs[0][2]
        for position, k in positions:
            src, _, _ = copy.runs[position // run_bytes]
            samples.append(DirectSample(src + position % run_bytes, k, digest))
    return tuple(samples)
