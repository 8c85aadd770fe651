"""Running a program's direct steps (`weightsync.plan.direct`): writes from the trainer's own
tensors, unstaged.

Two ways, chosen by what the transport offers:

- `TransportDirect`, for a transport that writes lists of ``(src, dst, length)`` from memory
  registered with it (Mooncake): each tensor's storage is registered once (`SourceMemory`)
  and the step's precomputed writes go out through the sender's `WriteQueue`, like a chunk's;
- `MappedDirect`, for a transport that maps the receivers' memory into this process (a
  `weightsync.transport.MemoryMapper`, CUDA IPC on one host): the sender copies the step's
  runs from the tensors' storage into the mapped parameters itself, on the current CUDA
  stream (long runs a copy each, short ones in multi-tensor launches, a row-parallel slice
  one pitched copy).
  Such a push is a sequence of stream-ordered launches, so it can be captured as a CUDA
  graph (`weightsync.sender.replay`).

Both keep every tensor they read until the push's writes are done, and report what they
bound, so that a push can be replayed without reading the stream again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weightsync.cuda_events import wait_reached
from weightsync.errors import TransferError, WeightSyncError
from weightsync.plan.direct import DirectStep
from weightsync.plan.types import TargetRank

if TYPE_CHECKING:
    from weightsync.sender.writes import WriteQueue
    from weightsync.transport import MemoryMapper, Transport

DIRECT_SLOT = -1
"""The `WriteQueue` slot direct writes are filed under: they read no staging slot, and are
waited for with the rest at the end of a push."""


def storage_base(tensor: torch.Tensor) -> int:
    """The address of the first byte of `tensor`'s storage."""
    return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()


@dataclass(slots=True)
class BoundStep:
    """What one direct step read in one execution: its tensors (by program index), their
    storage's address and the storage as bytes (for the digest samples)."""

    step: DirectStep
    tensors: dict[int, torch.Tensor]
    base: int
    storage: torch.Tensor


class SourceMemory:
    """The trainer storages registered with a transport as write sources.

    A storage is registered the first time a push writes from it and stays registered
    while pushes keep reading it; one that a push no longer touched is unregistered when a
    new registration would overlap it (the trainer freed it and the memory was reused).
    The senders of one transport share one (`of`): a region is registered once.
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[Any, SourceMemory]] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, transport: Transport) -> SourceMemory:
        """The instance every sender of `transport` shares."""
        try:
            memory = cls._shared.get(transport)
        except TypeError:  # a transport that cannot be weakly referenced
            return cls(transport)
        if memory is None:
            memory = cls._shared[transport] = cls(transport)
        return memory

    def __init__(self, transport: Transport) -> None:
        """Bind to the transport that reads the storages (see `of`)."""
        # Weakly: the shared table's values must not keep their keys alive.
        self._transport = weakref.proxy(transport)
        self._regions: dict[int, int] = {}  # base address -> bytes
        self._touched: set[int] = set()

    def start(self) -> None:
        """A new push begins: nothing is touched by it yet."""
        self._touched = set()

    def ensure(self, base: int, num_bytes: int) -> None:
        """Make ``[base, base + num_bytes)`` readable by the transport.

        Raises:
            WeightSyncError: the transport refused to register it.
        """
        self._touched.add(base)
        size = self._regions.get(base)
        if size == num_bytes:
            return
        if size is not None:
            self._drop(base)
        try:
            self._register(base, num_bytes)
        except ValueError:
            # It overlaps a storage an earlier push read that is gone now.
            for stale in [b for b in self._regions if b not in self._touched]:
                self._drop(stale)
            self._register(base, num_bytes)

    def release(self) -> None:
        """Unregister every storage (a transport already closed unregistered them itself)."""
        for base in list(self._regions):
            try:
                self._drop(base)
            except (ReferenceError, ValueError, WeightSyncError):
                self._regions.pop(base, None)

    def _register(self, base: int, num_bytes: int) -> None:
        try:
            self._transport.register(base, num_bytes)
        except (ValueError, WeightSyncError):
            raise
        except Exception as exc:
            raise WeightSyncError(
                f"registering {num_bytes} bytes of trainer memory at {base:#x} with the "
                f"transport failed: {exc}; SenderConfig(direct='never') stages every byte "
                "instead"
            ) from exc
        self._regions[base] = num_bytes

    def _drop(self, base: int) -> None:
        del self._regions[base]
        self._transport.unregister(base)


class TransportDirect:
    """Direct steps as transport writes from registered trainer memory (see the module)."""

    def __init__(self, queue: WriteQueue, sources: SourceMemory) -> None:
        """Write through `queue`, registering storages in `sources`."""
        self._queue = queue
        self._sources = sources
        self.bound: list[BoundStep] = []

    def run(
        self, step: DirectStep, tensors: dict[int, torch.Tensor], storage: torch.Tensor
    ) -> None:
        """Write `step` from `tensors` (by program index; their storage is `storage`)."""
        base = storage_base(tensors[step.source])
        self._sources.ensure(base, storage.numel())
        for target_writes in step.writes:
            self._queue.submit(
                target_writes.target, target_writes.writes, ring_base=base, slot=DIRECT_SLOT
            )
        self.bound.append(BoundStep(step, tensors, base, storage))


class MappedDirect:
    """Direct steps as copies into the receivers' memory, mapped into this process.

    Each step's copies become byte copies from the tensors' storage into the mapped
    parameter: runs merged where adjacent in the storage and the parameter, and the rows of a
    row-parallel slice as one pitched copy (`weightsync.plan.writes.direct_blocks`).

    Args:
        transport: maps a receiver's registered memory (`MemoryMapper.local_address`).
        failed: where a target that cannot be mapped is recorded (`WriteQueue.failed`).
        params: the mapped parameters, kept by the sender between pushes (filled here).
    """

    def __init__(
        self,
        transport: MemoryMapper,
        *,
        failed: dict[str, TransferError],
        params: dict[tuple[str, str, int], torch.Tensor],
    ) -> None:
        self._transport = transport
        self._failed = failed
        self._params = params
        self.bound: list[BoundStep] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def run(
        self, step: DirectStep, tensors: dict[int, torch.Tensor], storage: torch.Tensor
    ) -> None:
        """Queue `step`'s copies from `tensors` (by program index; their storage is
        `storage`) on the current stream."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for target_writes in step.writes:
            target = target_writes.target
            for block in target_writes.blocks:
                param = self._param(target, block.param_name)
                if param is None:
                    break
                start = block.dst_addr - target.weights_info[block.param_name][0]
                dst = param[start : start + block.num_bytes]
                if block.rows == 1:
                    src = storage[block.src_offset : block.src_offset + block.row_bytes]
                else:
                    shape = (block.rows, block.row_bytes)
                    src = storage.as_strided(shape, (block.src_pitch, 1), block.src_offset)
                    dst = dst.view(shape)
                dsts.append(dst)
                srcs.append(src)
        with torch.no_grad():
            copy_all(dsts, srcs)
        self.copies.extend(zip(dsts, srcs, strict=True))
        self.bound.append(BoundStep(step, tensors, storage_base(tensors[step.source]), storage))

    def _param(self, target: TargetRank, name: str) -> torch.Tensor | None:
        """The target's parameter `name` as a 1-D uint8 tensor over this process's mapping
        of it (None once the target failed)."""
        addr, numel, size = target.weights_info[name]
        key = (target.session_id, name, addr)
        param = self._params.get(key)
        if param is not None:
            return param
        if target.session_id in self._failed:
            return None
        try:
            local = self._transport.local_address(target.session_id, addr, numel * size)
        except TransferError as exc:
            self._failed.setdefault(target.session_id, exc)
            return None
        param = self._params[key] = device_tensor(local, numel * size)
        return param


# On an H200 a multi-tensor copy ran at half a device memcpy's rate (1,040 against 2,075 GB/s
# in a CUDA graph): a run this long takes a memcpy of its own, shorter ones share launches.
_OWN_COPY_BYTES = 1 << 20


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair: small contiguous pairs as multi-tensor launches,
    large ones as a copy each."""
    fused_dst: list[torch.Tensor] = []
    fused_src: list[torch.Tensor] = []
    for dst, src in zip(dsts, srcs, strict=True):
        if (
            src.is_contiguous()
            and dst.is_contiguous()
            and src.numel() * src.element_size() < _OWN_COPY_BYTES
        ):
            fused_dst.append(dst)
            fused_src.append(src)
        else:
            dst.copy_(src)
    if fused_dst:
        torch._foreach_copy_(fused_dst, fused_src)


class _DeviceMemory:
    """Raw device memory as the CUDA array interface describes it (so that torch can wrap
    it without a copy; the memory belongs to whoever mapped it)."""

    def __init__(self, ptr: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def device_tensor(ptr: int, num_bytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over `num_bytes` of device memory at `ptr` (not owned; on the
    device the memory lies on, which torch asks the driver for).

    Raises:
        WeightSyncError: torch copied the memory instead of wrapping it.
    """
    tensor = torch.as_tensor(_DeviceMemory(ptr, num_bytes))
    if tensor.data_ptr() != ptr:
        raise WeightSyncError(f"device memory at {ptr:#x} could not be wrapped without a copy")
    return tensor


def wait_stream(device: torch.device, timeout_s: float) -> bool:
    """Wait until the work queued so far on `device`'s current stream is done; False when it
    did not finish within `timeout_s` (it may still finish later)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return wait_reached((event,), timeout_s)
