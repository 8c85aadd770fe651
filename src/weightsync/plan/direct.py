"""Direct writes: the copy items a sender writes from the trainer's own tensors, unstaged.

Part of lowering a source plan into a push program (`weightsync.plan.program`), pure. Where
the transport can read a stream tensor's memory (CUDA IPC within one host, Mooncake once the
tensor's storage is registered), an item whose elements already have the rollout's dtype
needs no staging: its box of the tensor is written straight into the rollout parameter, one
copy per byte instead of two. An item goes direct when

- it carries data (padding is staged: a transport writes from memory, and zeros have none);
- its tensor lies on a device the transport reads and has the plan's dtype (a cast needs a
  buffer to land in);
- its box is a few long contiguous runs of the tensor's storage: one run (a whole tensor, a
  block of rows), or rows of at least `DirectSpec.min_run_bytes` each (a row-parallel slice,
  a pitched 2-D copy). A box read element by element (a transposed view) is staged.

A `DirectCopy` is the item as contiguous byte runs of the tensor's storage; a step's runs,
merged where they are adjacent in the storage and in the parameter, are its writes (for a
transport that takes lists of ``(src, dst, length)``, and for copies into mapped memory).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from weightsync.layout.digest import sample_run
from weightsync.plan.geometry import TensorGeometry
from weightsync.plan.items import CopyItem

DEFAULT_MIN_RUN_BYTES = 4096
"""Rows of a strided box shorter than this are staged: a write request per few hundred bytes
costs more than the copy into the ring saves."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectSpec:
    """Where a program may write from the stream's tensors directly.

    Attributes:
        devices: the devices whose tensors the transport can write from (``"cpu"``,
            ``"cuda:0"``); empty: everything is staged.
        min_run_bytes: the shortest contiguous run of a strided box worth a write of its own.
    """

    devices: tuple[str, ...] = ()
    min_run_bytes: int = DEFAULT_MIN_RUN_BYTES


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
) -> DirectCopy | None:
    """`item` of the tensor `tensor` (program index `source`) as a direct copy, or None when
    it must be staged (see the module)."""
    if item.hf_name is None or tensor.dtype != dtype or tensor.device not in spec.devices:
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
    if num_runs > 1 and run_bytes < spec.min_run_bytes:
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
