"""`CudaIpcTransport`: writes between GPUs of one host over CUDA IPC (NVLink where present).

Receiving side: `register` exports a CUDA IPC handle for the *whole allocation* holding each
registered region (``cuMemGetAddressRange`` + ``cuIpcGetMemHandle``; a caching allocator's
tensor is a slice of a larger block) and publishes handles and regions on a loopback HTTP
server; the session id is ``"ipc:<host>:<port>"``. Destination addresses are the receiver's
own pointers, the ones it publishes in ``weights_info``.

Writing side: on the first write to a session it fetches that registry and opens each
allocation's handle once (cached until `close`), then issues one ``cuMemcpyAsync`` per region
on a dedicated stream and records an event to wait on. `local_address` hands out the mapped
address itself, for a writer that copies into the receiver's memory with its own kernels
(and can capture them in a CUDA graph).

Where the handle is opened decides the speed. A plain cross-process ``dst.copy_(src)`` into
a tensor PyTorch rebuilt from the receiver's handle ran at 37.8 GB/s GPU0 -> GPU1 on the lent
2xH200 (NV18) machine, against 393.5 GB/s for an in-process peer copy: PyTorch opens the
handle under a device guard for the *receiver's* GPU, so the mapping lives in that GPU's
context in the writer process, and the copy, issued from the source GPU's context, is not a
peer copy: it ran at exactly the rate of an in-process copy with peer access never enabled
(37.4 GB/s). Opening the handle with the driver in the context of the source GPU, with
``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`` (which enables peer access for that mapping), gave
396.5 GB/s; opening it in the receiver GPU's context gave 37.7 again; without the flag the
open fails (CUDA_ERROR_INVALID_VALUE). Hiding the peer GPU with ``CUDA_VISIBLE_DEVICES`` does
not matter: with one GPU visible per process the open necessarily lands in the writer's
context and both this path (396.8) and PyTorch's (393.8) reach NVLink rate. No explicit
``cuCtxEnablePeerAccess`` is needed (and it would create a context on the peer GPU).
``bench/gpu_transport.py`` reproduces every variant.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.errors import TransferError, WeightSyncError
from weightsync.transport.base import (
    DIRTY_NOTE,
    RegionTable,
    TransportCapabilities,
    WriteCost,
    WriteHandle,
    byte_ranges,
    check_regions,
)
from weightsync.transport.cuda_ipc.config import CudaIpcConfig
from weightsync.transport.cuda_ipc.driver import CUDA_ERROR_NOT_READY, CUDA_SUCCESS, driver
from weightsync.transport.cuda_ipc.peers import PeerMaps
from weightsync.transport.cuda_ipc.registry import (
    SESSION_PREFIX,
    Allocation,
    RegistryServer,
    RegistrySnapshot,
)

# A 4 GiB copy takes ~11 ms at NVLink rate. With a 1 ms back-off cap the transport measured
# 369 GB/s against 396 for the bare copy: waking up to ~0.7 ms late accounts for the gap. So
# the cap is short; a wake-up every 0.2 ms is still a sleep, not a spin.
_POLL_MIN_S = 0.00005
_POLL_MAX_S = 0.0002
# Smaller pieces are not worth another stream: the launch costs more than the bytes take.
_MIN_PIECE_BYTES = 8 << 20
# The writer copies into memory mapped into its process: a strided piece is one pitched copy,
# short copies share multi-tensor launches, and a push that is all copies is replayed as a
# CUDA graph, so a write costs the host nothing of its own. Its bytes move at a peer copy's
# ~390 GB/s over NV18 (H200), ~2,000 GB/s within one GPU.
WRITE_COST = WriteCost(write_s=0.0, bytes_per_s=390e9, pitched=True)


def _check_num_streams(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"num_streams must be a positive int, got {value!r}")


def spread(
    dst: Sequence[int], src: Sequence[int], lengths: Sequence[int], parts: int, min_piece: int
) -> list[list[tuple[int, int, int, int]]]:
    """Regions dealt, in order, into at most `parts` lists of about equal bytes.

    A region is cut where a list is full, unless a piece would be under `min_piece` bytes.

    Returns:
        Non-empty lists of ``(region index, dst, src, num_bytes)``.
    """
    if parts == 1:
        return [[(i, d, s, n) for i, (d, s, n) in enumerate(zip(dst, src, lengths, strict=True))]]
    share = max(-(-sum(lengths) // parts), min_piece)
    out: list[list[tuple[int, int, int, int]]] = [[]]
    room = share
    for index, (to, frm, left) in enumerate(zip(dst, src, lengths, strict=True)):
        while left > 0:
            if room <= 0 and len(out) < parts:
                out.append([])
                room = share
            take = left if len(out) == parts else min(left, room)
            if left - take < min_piece or take < min_piece:
                take = left
            out[-1].append((index, to, frm, take))
            to, frm, left, room = to + take, frm + take, left - take, room - take
    return [part for part in out if part]


@dataclass(slots=True)
class _Export:
    size: int
    handle: bytes
    num_regions: int = 0


class _IpcWrite(WriteHandle):
    __slots__ = ("dst", "error", "events", "lengths", "lock", "owner")

    def __init__(
        self, owner: CudaIpcTransport, target: str, dst: list[int], lengths: list[int]
    ) -> None:
        super().__init__(target_session=target, num_regions=len(dst), num_bytes=sum(lengths))
        self.owner = owner
        self.lock = threading.Lock()
        self.dst, self.lengths = dst, lengths
        self.events: list[ctypes.c_void_p] = []  # one per stream the copies went to
        self.error: TransferError | None = None


class CudaIpcTransport:
    """`Transport` between processes on one host whose memory is on (NVLink-connected) GPUs.

    The bytes at the source addresses must be final when `write` is called, or be produced by
    work queued on the stream passed as ``after_stream``: the copies run on the transport's
    own stream, which then waits for that work on the GPU (its capabilities say
    ``stream_ordered``).

    One instance per process and GPU. It is a receiver (register GPU memory, publish it) and
    a writer (copy from registered memory of the configured device, or host memory, into a
    peer's GPU memory) at once. See the module docstring for the design.
    """

    def __init__(self, config: CudaIpcConfig | None = None) -> None:
        """Start the registry server and set up the configured device's context.

        Args:
            config: the device, the registry server's address and the streams per write.

        Raises:
            ValueError: no such device.
            WeightSyncError: no CUDA driver.
        """
        config = config or CudaIpcConfig()
        device, hostname, port, num_streams = (
            config.device,
            config.hostname,
            config.port,
            config.num_streams,
        )
        self._config = config
        self._driver = driver()
        if not 0 <= device < self._driver.device_count():
            raise ValueError(f"no CUDA device {device} in this process")
        self._num_streams = num_streams
        self._device = device
        self._driver.use_device(device)
        self._pci_bus_id = self._driver.pci_bus_id(device)
        self._lock = threading.Lock()
        self._copy_lock = threading.Lock()
        self._registered = RegionTable()
        self._exports: dict[int, _Export] = {}
        self._peers = PeerMaps(self._driver, device)
        self._streams: list[ctypes.c_void_p] = []
        self._free_events: list[ctypes.c_void_p] = []
        self._ready_event: ctypes.c_void_p | None = None
        self._closed = False
        self._server = RegistryServer(hostname, port, self._snapshot())
        host = f"[{hostname}]" if ":" in hostname else hostname
        self._session_id = f"{SESSION_PREFIX}{host}:{self._server.port}"
        self._capabilities = TransportCapabilities(
            reads_cuda=True, device=device, stream_ordered=True, maps_device_memory=True
        )

    write_cost = WRITE_COST
    """What a write costs: a copy launch into memory mapped into this process (a strided
    piece one pitched copy), at the rate of a peer copy over NVLink."""

    @property
    def config(self) -> CudaIpcConfig:
        """The transport's settings (`num_streams` as constructed; see `num_streams`)."""
        return self._config

    @property
    def session_id(self) -> str:
        """``"ipc:<host>:<port>"``, the address of this process's registry server."""
        return self._session_id

    @property
    def num_streams(self) -> int:
        """Streams one write's bytes are spread over; settable between writes."""
        return self._num_streams

    @num_streams.setter
    def num_streams(self, value: int) -> None:
        _check_num_streams(value)
        with self._copy_lock:
            self._num_streams = value

    @property
    def capabilities(self) -> TransportCapabilities:
        """Reads host memory and its own GPU's; `write` takes ``after_stream``; it maps the
        receivers' memory (`local_address`)."""
        return self._capabilities

    def register(self, addr: int, num_bytes: int) -> None:
        """Register a region: GPU memory of `device` is exported to peers; host memory can
        only be a write source.

        Raises:
            ValueError: empty, overlapping, or GPU memory of another device.
            WeightSyncError: the allocation cannot be exported (memory from
                ``cuMemCreate``, e.g. PyTorch's ``expandable_segments``, has no legacy IPC
                handle), or the transport is closed.
        """
        self._driver.use_device(self._device)
        owner = self._driver.pointer_device(addr)
        if owner is not None and owner != self._device:
            raise ValueError(
                f"{addr:#x} is memory of CUDA device {owner}; this transport is on {self._device}"
            )
        with self._lock:
            self._check_open()
            self._registered.add(addr, num_bytes)
            if owner is None:
                return
            try:
                base, size = self._driver.address_range(addr)
                if addr + num_bytes > base + size:
                    raise ValueError(
                        f"region [{addr:#x}, +{num_bytes}) runs past its allocation "
                        f"[{base:#x}, +{size})"
                    )
                export = self._exports.get(base)
                if export is None:
                    self._driver.use_device(self._device)
                    try:
                        handle = self._driver.ipc_get_handle(base)
                    except WeightSyncError as exc:
                        raise WeightSyncError(
                            f"cannot export a CUDA IPC handle for {addr:#x}: {exc}; memory "
                            "from cuMemCreate (PyTorch expandable_segments) cannot be shared "
                            "this way"
                        ) from exc
                    export = self._exports[base] = _Export(size=size, handle=handle)
                export.num_regions += 1
            except BaseException:
                self._registered.remove(addr)
                raise
            self._server.publish(self._snapshot())

    def unregister(self, addr: int) -> None:
        """Stop publishing the region that starts at `addr`.

        Writers that already mapped its allocation keep their mapping until they close.

        Raises:
            ValueError: no region starts there.
        """
        with self._lock:
            self._check_open()
            self._registered.remove(addr)
            for base, export in list(self._exports.items()):
                if base <= addr < base + export.size:
                    export.num_regions -= 1
                    if export.num_regions == 0:
                        del self._exports[base]
                    break
            self._server.publish(self._snapshot())

    def write(
        self,
        target_session: str,
        src_addrs: Sequence[int],
        dst_addrs: Sequence[int],
        lengths: Sequence[int],
        *,
        after_stream: int | None = None,
    ) -> WriteHandle:
        """Queue one copy per region on this transport's stream and return at once.

        A region outside the receiver's registered memory fails the whole write before any
        copy is queued.

        Args:
            target_session: the receiver's ``"ipc:<host>:<port>"``.
            src_addrs: source addresses, in registered memory of this process.
            dst_addrs: the receiver's addresses, inside memory it registered.
            lengths: bytes per region.
            after_stream: a CUDA stream of this transport's device (its raw handle, e.g.
                ``torch.cuda.current_stream().cuda_stream``) whose queued work produces the
                source bytes: the copies wait for that work on the GPU instead of the caller
                synchronizing first, so the call never blocks on the device. None: the bytes
                are final already.

        Raises:
            ValueError: bad sequences, or a source region outside registered memory.
            WeightSyncError: the transport is closed.
        """
        src, dst, num_bytes = check_regions(src_addrs, dst_addrs, lengths)
        with self._lock:
            self._check_open()
            self._registered.require_inside(src, num_bytes)
        handle = _IpcWrite(self, target_session, dst, num_bytes)
        try:
            local_dst = self._map_destinations(handle)
        except TransferError as exc:
            handle.error = exc
            return handle
        self._issue(handle, src, local_dst, after_stream)
        return handle

    def local_address(self, target_session: str, addr: int, num_bytes: int) -> int:
        """This process's address of the receiver's ``[addr, addr + num_bytes)``, its
        allocation mapped on first use: a writer on this transport's device may copy into it
        itself, on any stream (the direct writes of `weightsync.sender.direct`).

        Raises:
            TransferError: the receiver cannot be reached, the region is not inside memory
                it registered, or its allocation cannot be mapped.
        """
        handle = _IpcWrite(self, target_session, [addr], [num_bytes])
        return self._map_destinations(handle)[0]

    def _map_destinations(self, handle: _IpcWrite) -> list[int]:
        """This process's address of every destination region of `handle`."""
        return self._peers.local_addresses(
            handle.target_session,
            handle.dst,
            handle.lengths,
            lambda what, indices: self._error(handle, what, None, indices),
        )

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """Poll the write's event until the copies finished.

        Raises:
            ValueError: `handle` did not come from this transport's `write`.
            TransferError: a copy failed, or `timeout_s` passed first.
        """
        if not isinstance(handle, _IpcWrite) or handle.owner is not self:
            raise ValueError("handle did not come from this transport's write()")
        deadline = time.monotonic() + timeout_s
        interval = _POLL_MIN_S
        self._driver.use_device(self._device)
        with handle.lock:
            while handle.error is None and handle.events:
                code = self._driver.event_query(handle.events[-1])
                if code == CUDA_SUCCESS:
                    self._recycle(handle.events.pop())
                    continue
                if code != CUDA_ERROR_NOT_READY:
                    handle.error = self._error(
                        handle, f"the copy failed: {self._driver.error_name(code)}", code, []
                    )
                    break
                now = time.monotonic()
                if now >= deadline:
                    handle.error = TransferError(
                        f"CUDA IPC write of {handle.num_regions} region(s), {handle.num_bytes} "
                        f"bytes to {handle.target_session} timed out after {timeout_s:g} s; "
                        f"{DIRTY_NOTE}",
                        target_session=handle.target_session,
                        byte_ranges=byte_ranges(
                            handle.dst, handle.lengths, range(handle.num_regions)
                        ),
                    )
                    break
                time.sleep(min(interval, deadline - now))
                interval = min(2 * interval, _POLL_MAX_S)
            if handle.error is not None:
                raise handle.error

    def close(self) -> None:
        """Stop the registry server, finish queued copies and unmap every peer; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._registered.clear()
            self._exports.clear()
        self._server.close()
        self._driver.use_device(self._device)
        with self._copy_lock:
            for stream in self._streams:
                self._driver.stream_synchronize(stream)
                self._driver.stream_destroy(stream)
            self._streams.clear()
            for event in self._free_events:
                self._driver.event_destroy(event)
            self._free_events.clear()
            if self._ready_event is not None:
                self._driver.event_destroy(self._ready_event)
                self._ready_event = None
        self._peers.close()

    def __enter__(self) -> CudaIpcTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncError("the CUDA IPC transport is closed")

    def _snapshot(self) -> RegistrySnapshot:
        return RegistrySnapshot(
            pid=os.getpid(),
            pci_bus_id=self._pci_bus_id,
            allocations=tuple(
                Allocation(base=base, size=e.size, handle=e.handle)
                for base, e in sorted(self._exports.items())
            ),
            regions=tuple(
                (addr, size)
                for addr, size in self._registered.items()
                if any(base <= addr < base + e.size for base, e in self._exports.items())
            ),
        )

    def _issue(
        self, handle: _IpcWrite, src: list[int], local_dst: list[int], after_stream: int | None
    ) -> None:
        with self._copy_lock:
            self._driver.use_device(self._device)
            while len(self._streams) < self._num_streams:
                self._streams.append(self._driver.stream_create())
            parts = spread(local_dst, src, handle.lengths, self._num_streams, _MIN_PIECE_BYTES)
            streams = self._streams[: len(parts)]
            if after_stream is not None and not self._wait_for(handle, after_stream, streams):
                return
            for stream, copies in zip(streams, parts, strict=False):
                for index, to, frm, length in copies:
                    code = self._driver.memcpy_async(to, frm, length, stream)
                    if code != CUDA_SUCCESS:
                        name = self._driver.error_name(code)
                        handle.error = self._error(
                            handle,
                            f"cuMemcpyAsync failed with {name} (other regions were queued)",
                            code,
                            [index],
                        )
                        return
                if self._free_events:
                    event = self._free_events.pop()
                else:
                    event = self._driver.event_create()
                code = self._driver.event_record(event, stream)
                if code != CUDA_SUCCESS:
                    self._free_events.append(event)
                    handle.error = self._error(handle, "cuEventRecord failed", code, [])
                    return
                handle.events.append(event)

    def _wait_for(self, handle: _IpcWrite, stream: int, streams: Sequence[ctypes.c_void_p]) -> bool:
        """Make `streams` wait for the work queued on `stream` so far (under the copy lock).
        One event serves every wait: a wait binds to the record before it."""
        if self._ready_event is None:
            self._ready_event = self._driver.event_create()
        code = self._driver.event_record(self._ready_event, ctypes.c_void_p(stream))
        for own in streams:
            if code == CUDA_SUCCESS:
                code = self._driver.stream_wait_event(own, self._ready_event)
        if code != CUDA_SUCCESS:
            handle.error = self._error(
                handle, "cannot order the copies after the producing stream", code, []
            )
            return False
        return True

    def _recycle(self, event: ctypes.c_void_p) -> None:
        with self._copy_lock:
            self._free_events.append(event)

    def _error(
        self, handle: _IpcWrite, what: str, code: int | None, indices: Sequence[int]
    ) -> TransferError:
        return TransferError(
            f"CUDA IPC write of {handle.num_regions} region(s), {handle.num_bytes} bytes to "
            f"{handle.target_session} failed: {what}"
            + (f" (CUDA error {code})" if code is not None else "")
            + f"; {DIRTY_NOTE}",
            target_session=handle.target_session,
            byte_ranges=byte_ranges(handle.dst, handle.lengths, indices),
            return_code=code,
        )
