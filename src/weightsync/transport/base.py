"""The `Transport` protocol: one-sided writes of bytes into memory a peer registered.

A transport knows bytes and addresses only; it never sees parameter names. Call protocol:

1. The receiving process creates a transport, calls `register(addr, num_bytes)` once for each
   region that peers may write into, and publishes `session_id` with the addresses (the
   rollout's ``weights_info``).
2. The writing process creates its own transport, registers the memory it writes *from*
   (a staging ring), then calls `write(target_session, src_addrs, dst_addrs, lengths)` for
   each batch of regions and `wait(handle, timeout_s)` on every handle it got. `write` does
   not block and may be called from several threads at once; the bytes at the source
   addresses must be final when `write` is called and must stay unchanged until `wait`
   returns.
3. Both sides call `close()` when done; it unregisters everything and may be called again.

Every transport states what a write costs it (`write_cost`, a `WriteCost`): the sender's
lowering weighs it to choose, per piece of a tensor, between a write straight from the
trainer's memory and a copy into its staging ring (`weightsync.plan.direct`).

What a transport offers beyond writes from registered host memory it declares once, in
`Transport.capabilities` (a `TransportCapabilities`): whether it reads registered GPU memory
and of which device, whether `write` takes ``after_stream=`` (a raw CUDA stream whose queued
work produces the source bytes; the copies wait for it on the GPU, so the writer need not
synchronize first), and whether it maps a receiver's memory into this process for the writer
to copy into itself (then it is a `MemoryMapper` too).

Failure semantics: `wait` raises `TransferError` when a region could not be written or the
timeout passed. Such a write may still land later, so the caller treats the destination as
dirty until a later full write to it succeeds.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# How many byte ranges a TransferError names; a failed batch may cover thousands.
MAX_REPORTED_RANGES = 8

DIRTY_NOTE = (
    "a write reported failed or timed out may still land later, so treat the destination "
    "memory as dirty until a later full write to it succeeds"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteCost:
    """What one write costs a transport, as a sender weighs it before a push.

    A write of ``n`` bytes is modelled as ``write_s + n / bytes_per_s``: a fixed cost per
    request (posting it, its completion, the transport's per-request protocol work; paid on
    the writer's CPU) and the rate its bytes then move at. These are configured figures, not
    measured at run time, so a push program is the same on every run of the same setup;
    ``bench/transport.py`` measures both for a link.

    Attributes:
        write_s: fixed cost of one write request, in seconds.
        bytes_per_s: the rate one writer's bytes move at once the write is posted.
        pitched: the writer copies a strided piece (rows of a tensor, a pitch apart) into
            the target as one copy (memory mapped into its process), not one write per row.

    Raises:
        ValueError: a negative cost or a rate that is not positive.
    """

    write_s: float
    bytes_per_s: float
    pitched: bool = False

    def __post_init__(self) -> None:
        if not self.write_s >= 0:
            raise ValueError(f"WriteCost.write_s must be >= 0, got {self.write_s!r}")
        if not self.bytes_per_s > 0:
            raise ValueError(f"WriteCost.bytes_per_s must be > 0, got {self.bytes_per_s!r}")

    def seconds(self, num_writes: int, num_bytes: int) -> float:
        """The modelled time of `num_writes` requests moving `num_bytes` in all."""
        return num_writes * self.write_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportCapabilities:
    """What a transport can do beyond writing from registered host memory.

    The defaults describe a transport that reads host memory only. A writer reads them once
    (per sender, not per write) and checks the fields; nothing else is looked up.

    Attributes:
        reads_cuda: the transport reads registered memory on CUDA devices (a GPU staging
            ring, a direct write from the trainer's GPU memory), not only host memory.
        device: the CUDA device (as this process numbers it) the transport is bound to: the
            only one whose memory it reads, and the one a writer opens its peers' CUDA
            events on; None when it is bound to none.
        stream_ordered: `Transport.write` takes ``after_stream=``, a raw CUDA stream whose
            queued work produces the source bytes; the copies wait for it on the GPU.
        maps_device_memory: the transport maps a receiver's registered GPU memory into this
            process (`MemoryMapper.local_address`), so a writer on `device` may copy into it
            with its own kernels.

    Raises:
        ValueError: a negative device, or GPU-only capabilities on a transport that reads no
            GPU memory.
    """

    reads_cuda: bool = False
    device: int | None = None
    stream_ordered: bool = False
    maps_device_memory: bool = False

    def __post_init__(self) -> None:
        if self.device is not None and (
            not isinstance(self.device, int) or isinstance(self.device, bool) or self.device < 0
        ):
            raise ValueError(
                f"TransportCapabilities.device must be a device index or None, got {self.device!r}"
            )
        if not self.reads_cuda and (self.stream_ordered or self.maps_device_memory):
            raise ValueError(
                "TransportCapabilities: stream_ordered and maps_device_memory need reads_cuda"
            )

    def reads(self, device_type: str, index: int | None = None) -> bool:
        """Whether the transport reads registered memory on a device.

        Args:
            device_type: ``"cpu"``, ``"cuda"``, ... (a ``torch.device``'s ``type``).
            index: the device's index, or None for the current one.
        """
        if device_type == "cpu":
            return True
        if device_type != "cuda" or not self.reads_cuda:
            return False
        return self.device is None or index is None or index == self.device


HOST_ONLY = TransportCapabilities()
"""The capabilities of a transport that reads registered host memory only."""


class WriteHandle:
    """An in-flight `Transport.write`, to be passed to `Transport.wait` of the same transport.

    Opaque apart from what it says about the write; each transport returns its own subclass.

    Attributes:
        target_session: the session id the regions go to.
        num_regions: how many regions the write covers.
        num_bytes: the sum of their lengths.
    """

    __slots__ = ("num_bytes", "num_regions", "target_session")

    def __init__(self, *, target_session: str, num_regions: int, num_bytes: int) -> None:
        self.target_session = target_session
        self.num_regions = num_regions
        self.num_bytes = num_bytes

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(target_session={self.target_session!r}, "
            f"num_regions={self.num_regions}, num_bytes={self.num_bytes})"
        )


@runtime_checkable
class Transport(Protocol):
    """One-sided writes of byte regions into memory that a peer registered.

    See the module docstring for the call protocol and failure semantics.
    """

    @property
    def session_id(self) -> str:
        """The id peers pass as ``target_session`` to write into this process's memory."""
        ...

    @property
    def write_cost(self) -> WriteCost:
        """What one write costs this transport, for the protocol it actually runs."""
        ...

    @property
    def capabilities(self) -> TransportCapabilities:
        """What the transport offers beyond writes from host memory (fixed once it exists)."""
        ...

    def register(self, addr: int, num_bytes: int) -> None:
        """Make ``[addr, addr + num_bytes)`` writable by peers (or readable as a write source).

        Raises:
            ValueError: the region is empty or overlaps one already registered.
            WeightSyncError: the native registration failed.
        """
        ...

    def unregister(self, addr: int) -> None:
        """Undo `register` for the region that starts at `addr`.

        Raises:
            ValueError: no region starts at `addr`.
            WeightSyncError: the native call failed.
        """
        ...

    def write(
        self,
        target_session: str,
        src_addrs: Sequence[int],
        dst_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> WriteHandle:
        """Start writing ``lengths[i]`` bytes from ``src_addrs[i]`` to the peer's ``dst_addrs[i]``.

        Does not block; thread-safe. Failures are reported by `wait`. A transport whose
        capabilities say ``stream_ordered`` also takes ``after_stream=`` (see
        `TransportCapabilities`); no other transport is passed it.

        Raises:
            ValueError: the three sequences differ in length, a length is not positive, or a
                source region is not inside memory registered with this transport.
        """
        ...

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """Block until every region of `handle` landed.

        Raises:
            TransferError: a region failed, or `timeout_s` passed first.
        """
        ...

    def close(self) -> None:
        """Unregister everything and release native resources; idempotent."""
        ...


@runtime_checkable
class MemoryMapper(Protocol):
    """A transport that maps a receiver's registered memory into the writing process
    (``TransportCapabilities.maps_device_memory``)."""

    def local_address(self, target_session: str, addr: int, num_bytes: int) -> int:
        """This process's address of the receiver's ``[addr, addr + num_bytes)``, mapped on
        first use: a writer on the transport's device may copy into it itself.

        Raises:
            TransferError: the receiver cannot be reached, the region is not inside memory
                it registered, or it cannot be mapped.
        """
        ...


def check_regions(
    src_addrs: Sequence[int], dst_addrs: Sequence[int], lengths: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """Validate the three parallel sequences of a `Transport.write` and copy them to lists.

    Raises:
        ValueError: the sequences differ in length, or an address or length is out of range.
    """
    if not len(src_addrs) == len(dst_addrs) == len(lengths):
        raise ValueError(
            f"src_addrs, dst_addrs and lengths must have equal lengths, got "
            f"{len(src_addrs)}, {len(dst_addrs)} and {len(lengths)}"
        )
    src, dst, num_bytes = [int(a) for a in src_addrs], [int(a) for a in dst_addrs], []
    for index, length in enumerate(lengths):
        length = int(length)
        if length <= 0:
            raise ValueError(f"lengths[{index}] must be positive, got {length}")
        if src[index] <= 0 or dst[index] <= 0:
            raise ValueError(
                f"region {index}: addresses must be positive, got src {src[index]:#x}, "
                f"dst {dst[index]:#x}"
            )
        num_bytes.append(length)
    return src, dst, num_bytes


def byte_ranges(
    dst_addrs: Sequence[int], lengths: Sequence[int], indices: Sequence[int]
) -> list[tuple[int, int]]:
    """``(dst_addr, num_bytes)`` of the first `MAX_REPORTED_RANGES` regions in `indices`."""
    return [(dst_addrs[i], lengths[i]) for i in list(indices)[:MAX_REPORTED_RANGES]]


class RegionTable:
    """Non-overlapping ``[start, start + num_bytes)`` regions, looked up by address.

    Not thread-safe; callers hold their own lock.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def items(self) -> list[tuple[int, int]]:
        """``(start, num_bytes)`` of every region, by address."""
        return [(start, self._sizes[start]) for start in self._starts]

    def add(self, start: int, num_bytes: int) -> None:
        """Add a region.

        Raises:
            ValueError: it is empty or overlaps a region already in the table.
        """
        if num_bytes <= 0 or start <= 0:
            raise ValueError(f"cannot register {num_bytes} bytes at {start:#x}")
        index = bisect.bisect_right(self._starts, start)
        if index > 0:
            before = self._starts[index - 1]
            if before + self._sizes[before] > start:
                raise ValueError(
                    f"region [{start:#x}, +{num_bytes}) overlaps registered region "
                    f"[{before:#x}, +{self._sizes[before]})"
                )
        if index < len(self._starts) and start + num_bytes > self._starts[index]:
            after = self._starts[index]
            raise ValueError(
                f"region [{start:#x}, +{num_bytes}) overlaps registered region "
                f"[{after:#x}, +{self._sizes[after]})"
            )
        self._starts.insert(index, start)
        self._sizes[start] = num_bytes

    def remove(self, start: int) -> int:
        """Remove the region that starts at `start` and return its size.

        Raises:
            ValueError: no region starts there.
        """
        if start not in self._sizes:
            raise ValueError(f"no registered region starts at {start:#x}")
        self._starts.remove(start)
        return self._sizes.pop(start)

    def find(self, addr: int, num_bytes: int) -> tuple[int, int] | None:
        """The ``(start, num_bytes)`` of the region holding all of ``[addr, addr + num_bytes)``."""
        index = bisect.bisect_right(self._starts, addr) - 1
        if index < 0:
            return None
        start = self._starts[index]
        size = self._sizes[start]
        if addr + num_bytes > start + size:
            return None
        return start, size

    def require_inside(self, addrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Check that every ``[addrs[i], addrs[i] + lengths[i])`` lies inside one region.

        Raises:
            ValueError: naming the first region that does not.
        """
        for index, (addr, length) in enumerate(zip(addrs, lengths, strict=True)):
            if self.find(addr, length) is None:
                raise ValueError(
                    f"region {index}: source [{addr:#x}, +{length}) is not inside memory "
                    f"registered with this transport"
                )

    def clear(self) -> None:
        """Forget every region."""
        self._starts.clear()
        self._sizes.clear()


def register_tensor(transport: Transport, tensor: object) -> tuple[int, int]:
    """Register the memory of a contiguous tensor (torch, or anything with the same methods).

    Args:
        transport: the transport to register with.
        tensor: a contiguous tensor; host (pinned or not) or GPU memory.

    Returns:
        ``(addr, num_bytes)`` as registered; pass `addr` to `Transport.unregister` later.

    Raises:
        ValueError: the tensor is not contiguous or has no bytes.
    """
    if not tensor.is_contiguous():  # type: ignore[attr-defined]
        raise ValueError("only contiguous tensors can be registered")
    addr = int(tensor.data_ptr())  # type: ignore[attr-defined]
    num_bytes = int(tensor.numel() * tensor.element_size())  # type: ignore[attr-defined]
    if num_bytes == 0:
        raise ValueError("cannot register an empty tensor")
    transport.register(addr, num_bytes)
    return addr, num_bytes
