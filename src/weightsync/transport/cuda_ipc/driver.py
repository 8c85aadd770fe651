"""The few CUDA driver API calls CUDA IPC needs, through ctypes on ``libcuda.so.1``.

The driver library is loaded on first use, so importing this module needs no GPU. Every call
uses the device's primary context, the one PyTorch's runtime uses too, so pointers, streams
and events are shared with PyTorch in the same process.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from weightsync.errors import WeightSyncError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600

IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
STREAM_NON_BLOCKING = 0x1
EVENT_DISABLE_TIMING = 0x2
POINTER_ATTRIBUTE_MEMORY_TYPE = 2
POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
MEMORYTYPE_DEVICE = 2
IPC_HANDLE_BYTES = 64

_CUdeviceptr = ctypes.c_ulonglong
_lock = threading.Lock()
_driver: CudaDriver | None = None


class IpcMemHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed by value."""

    _fields_ = (("reserved", ctypes.c_char * IPC_HANDLE_BYTES),)


class CudaDriver:
    """Thin checked wrappers over ``libcuda``; use `driver()` to get the process's instance."""

    def __init__(self) -> None:
        """Load ``libcuda.so.1`` and call ``cuInit``.

        Raises:
            WeightSyncError: no CUDA driver, or it failed to initialize.
        """
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise WeightSyncError(f"CUDA driver library not found: {exc}") from exc
        self._call("cuInit", ctypes.c_uint(0))
        self._contexts: dict[int, ctypes.c_void_p] = {}

    def error_name(self, code: int) -> str:
        """``cuGetErrorName`` of a driver result."""
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(ctypes.c_int(code), ctypes.byref(name)) != CUDA_SUCCESS:
            return f"CUDA error {code}"
        return (name.value or b"").decode()

    def _function(self, name: str) -> Any:
        # Versioned entry points (``_v2``) replaced the plain names; older drivers lack them.
        try:
            return getattr(self._lib, name)
        except AttributeError:
            return getattr(self._lib, name.removesuffix("_v2"))

    def _call(self, function: str, *args: Any) -> None:
        code = self._function(function)(*args)
        if code != CUDA_SUCCESS:
            raise WeightSyncError(f"{function} failed: {self.error_name(code)} ({code})")

    def try_call(self, function: str, *args: Any) -> int:
        """Call a driver function and return its result code unchecked."""
        return int(self._function(function)(*args))

    def device_count(self) -> int:
        """``cuDeviceGetCount``."""
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def pci_bus_id(self, device: int) -> str:
        """The PCI bus id of a visible device, the same in every process."""
        buffer = ctypes.create_string_buffer(32)
        self._call("cuDeviceGetPCIBusId", buffer, ctypes.c_int(32), ctypes.c_int(device))
        return buffer.value.decode()

    def device_by_pci_bus_id(self, bus_id: str) -> int | None:
        """The ordinal this process sees a device under, or None when it is not visible."""
        ordinal = ctypes.c_int()
        code = self.try_call(
            "cuDeviceGetByPCIBusId", ctypes.byref(ordinal), ctypes.c_char_p(bus_id.encode())
        )
        return ordinal.value if code == CUDA_SUCCESS else None

    def use_device(self, device: int) -> None:
        """Make `device`'s primary context current on the calling thread (retained once)."""
        with _lock:
            context = self._contexts.get(device)
            if context is None:
                context = ctypes.c_void_p()
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), ctypes.c_int(device))
                self._contexts[device] = context
        self._call("cuCtxSetCurrent", context)

    def can_access_peer(self, device: int, peer: int) -> bool:
        """``cuDeviceCanAccessPeer``."""
        result = ctypes.c_int()
        self._call(
            "cuDeviceCanAccessPeer", ctypes.byref(result), ctypes.c_int(device), ctypes.c_int(peer)
        )
        return bool(result.value)

    def pointer_device(self, addr: int) -> int | None:
        """The device ordinal of device memory at `addr`, or None for host memory."""
        memory_type = ctypes.c_uint()
        code = self.try_call(
            "cuPointerGetAttribute",
            ctypes.byref(memory_type),
            ctypes.c_int(POINTER_ATTRIBUTE_MEMORY_TYPE),
            _CUdeviceptr(addr),
        )
        if code != CUDA_SUCCESS or memory_type.value != MEMORYTYPE_DEVICE:
            return None
        ordinal = ctypes.c_int()
        self._call(
            "cuPointerGetAttribute",
            ctypes.byref(ordinal),
            ctypes.c_int(POINTER_ATTRIBUTE_DEVICE_ORDINAL),
            _CUdeviceptr(addr),
        )
        return ordinal.value

    def address_range(self, addr: int) -> tuple[int, int]:
        """``(base, num_bytes)`` of the whole allocation that holds `addr`."""
        base, size = _CUdeviceptr(), ctypes.c_size_t()
        self._call(
            "cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), _CUdeviceptr(addr)
        )
        return int(base.value), int(size.value)

    def ipc_get_handle(self, base: int) -> bytes:
        """``cuIpcGetMemHandle`` of the allocation starting at `base`."""
        handle = IpcMemHandle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), _CUdeviceptr(base))
        # bytes(handle), not handle.reserved: a c_char array field stops at the first NUL.
        return bytes(handle)

    def ipc_open_handle(self, handle: bytes, flags: int = IPC_MEM_LAZY_ENABLE_PEER_ACCESS) -> int:
        """Map another process's allocation into the current context; returns its base."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        mem_handle = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(mem_handle), handle, IPC_HANDLE_BYTES)
        base = _CUdeviceptr()
        self._call("cuIpcOpenMemHandle_v2", ctypes.byref(base), mem_handle, ctypes.c_uint(flags))
        return int(base.value)

    def ipc_close_handle(self, base: int) -> int:
        """``cuIpcCloseMemHandle``; returns the result code."""
        return self.try_call("cuIpcCloseMemHandle", _CUdeviceptr(base))

    def stream_create(self) -> ctypes.c_void_p:
        """A non-blocking stream in the current context."""
        stream = ctypes.c_void_p()
        self._call("cuStreamCreate", ctypes.byref(stream), ctypes.c_uint(STREAM_NON_BLOCKING))
        return stream

    def stream_destroy(self, stream: ctypes.c_void_p) -> None:
        """``cuStreamDestroy``."""
        self._call("cuStreamDestroy_v2", stream)

    def stream_synchronize(self, stream: ctypes.c_void_p) -> None:
        """``cuStreamSynchronize``."""
        self._call("cuStreamSynchronize", stream)

    def memcpy_async(self, dst: int, src: int, num_bytes: int, stream: ctypes.c_void_p) -> int:
        """``cuMemcpyAsync`` (unified addressing picks the direction); returns the result code."""
        return self.try_call(
            "cuMemcpyAsync",
            _CUdeviceptr(dst),
            _CUdeviceptr(src),
            ctypes.c_size_t(num_bytes),
            stream,
        )

    def event_create(self) -> ctypes.c_void_p:
        """An event without timing in the current context."""
        event = ctypes.c_void_p()
        self._call("cuEventCreate", ctypes.byref(event), ctypes.c_uint(EVENT_DISABLE_TIMING))
        return event

    def event_record(self, event: ctypes.c_void_p, stream: ctypes.c_void_p) -> int:
        """``cuEventRecord``; returns the result code."""
        return self.try_call("cuEventRecord", event, stream)

    def event_query(self, event: ctypes.c_void_p) -> int:
        """``cuEventQuery``: 0 when done, `CUDA_ERROR_NOT_READY` while running, else an error."""
        return self.try_call("cuEventQuery", event)

    def stream_wait_event(self, stream: ctypes.c_void_p, event: ctypes.c_void_p) -> int:
        """``cuStreamWaitEvent``: work queued on `stream` from now on waits for `event`'s
        last record; returns the result code."""
        return self.try_call("cuStreamWaitEvent", stream, event, ctypes.c_uint(0))

    def event_destroy(self, event: ctypes.c_void_p) -> None:
        """``cuEventDestroy``."""
        self._call("cuEventDestroy_v2", event)


def driver() -> CudaDriver:
    """The process's `CudaDriver`, created on first use.

    Raises:
        WeightSyncError: no CUDA driver.
    """
    global _driver
    with _lock:
        if _driver is None:
            _driver = CudaDriver()
        return _driver
