"""Interprocess CUDA events of this host: opened from their IPC handles, waited for on the host.

Two processes on one host order their GPU work through them without a stream of either
waiting on the other's:

- a trainer writes into a replica's parameters with copies on its own CUDA stream (CUDA IPC)
  and may announce the end of a session while they still run; it names, by IPC handle, the
  event it recorded after them, and the replica waits for it before it verifies what
  arrived;
- a replica that begins a session with a fence queues the digest of what its parameters
  hold and answers at once with the event the digest completes at; every trainer rank that
  writes into it waits for that event before its first copy.

The waits are on the host, with a deadline, rather than on a stream: a peer that never
reaches its event (stuck, or gone) must not stall the waiter's own GPU work. What a
process holds on a stream of its own, it holds behind a `StreamGate` that only it opens.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

# A peer records the same event every sync: the handles seen last stay open.
_KEEP = 16
# How long `IpcEvents.wait` looks without sleeping.
_SPIN_S = 1e-3


def wait_reached(
    events: Sequence[torch.cuda.Event], timeout_s: float, *, spin_s: float = 0.0
) -> bool:
    """Wait on the host until the work before each event's last record is done; False when
    it was not within `timeout_s` (it may still finish later). The first `spin_s` the
    thread looks without sleeping, then it sleeps 50 µs between looks: a push of 16 GB on
    one GPU takes ~9 ms, so waking that often costs nothing and loses at most that much at
    the end."""
    started = time.monotonic()
    while not all(event.query() for event in events):
        waited = time.monotonic() - started
        if waited > timeout_s:
            return False
        if waited >= spin_s:
            time.sleep(5e-5)
    return True


class IpcEvents:
    """The interprocess CUDA events of other processes of this host, opened from their IPC
    handles on `device` and kept while they are used.

    Args:
        device: the CUDA device of this process's work (a replica's rank 0, a trainer
            rank's).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._opened: OrderedDict[str, torch.cuda.Event] = OrderedDict()

    def open(self, handles: Sequence[str]) -> list[torch.cuda.Event]:
        """The events of `handles` (IPC handles, in hex), opened here once and kept.

        Raises:
            ValueError: a handle is not one, or cannot be opened here (a process on another
                host, or one that is gone).
        """
        return [self._open(handle) for handle in handles]

    @staticmethod
    def reached(events: Sequence[torch.cuda.Event]) -> bool:
        """Whether the work before each event's last record is done (a look, no wait)."""
        return all(event.query() for event in events)

    def wait(self, handles: Sequence[str], timeout_s: float) -> bool:
        """Wait until the events of `handles` are reached; False when they were not within
        `timeout_s` (the work may still finish later). The thread looks without sleeping
        for the first `_SPIN_S`: the events waited for are a few microseconds of GPU work
        away.

        Raises:
            ValueError: a handle cannot be opened here (see `open`).
        """
        return wait_reached(self.open(handles), timeout_s, spin_s=_SPIN_S)

    def _open(self, handle: str) -> torch.cuda.Event:
        event = self._opened.get(handle)
        if event is not None:
            self._opened.move_to_end(handle)
            return event
        try:
            raw = bytes.fromhex(handle)
            event = torch.cuda.Event.from_ipc_handle(self._device, raw)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(
                f"the IPC event handle {handle[:16]}... cannot be opened on {self._device} "
                f"({exc}): events are for processes on one host, both alive"
            ) from exc
        self._opened[handle] = event
        while len(self._opened) > _KEEP:
            self._opened.popitem(last=False)
        return event


class StreamGate:
    """Holds the work queued behind it on a CUDA stream until this process opens it.

    `close` queues on a stream a wait for a counter in pinned host memory to reach its next
    value (a CUDA stream memory operation, ``cuStreamWaitValue64``); `open` stores that
    value, a plain write to host memory, and the GPU, polling the counter, starts what
    follows within microseconds, with no CUDA call. Work can so be queued ahead of the
    moment it may start (a replica's digest of what a trainer's copies write, queued while
    they still land) and released the moment it may, without the launch's cost then. Only
    this process opens its gates: a stream held by one is never held by another process
    (a trainer that is stuck or gone), and every holder must open the gate it closed on
    every path, or the stream, and whatever waits for the device, waits for ever.

    Args:
        device: the CUDA device of the streams it holds.

    Raises:
        RuntimeError: this device or driver cannot hold a stream on host memory
            (`StreamGate.supported` says so without raising).
    """

    def __init__(self, device: torch.device) -> None:
        driver = _gate_driver()
        if driver is None:
            raise RuntimeError(
                "CUDA stream memory operations are not available here (libcuda without "
                "cuStreamWaitValue64_v2)"
            )
        self._driver = driver
        self._device = device
        self._counter = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._host = self._counter.numpy()
        pointer = ctypes.c_uint64()
        with torch.cuda.device(device):
            _check(driver.device_pointer(ctypes.byref(pointer), self._counter.data_ptr(), 0))
        self._address = pointer.value
        self._closed_at = 0  # the value the last `close` waits for

    @classmethod
    def supported(cls, device: torch.device, timeout_s: float = 5.0) -> bool:
        """Whether a gate holds a stream of `device` here and releases it when opened
        (tried once per device, on a stream of its own)."""
        key = (device.type, device.index)
        if key not in _SUPPORTED:
            _SUPPORTED[key] = _try_gate(device, timeout_s)
        return _SUPPORTED[key]

    @property
    def is_open(self) -> bool:
        """Whether work queued behind the last `close` may run."""
        return int(self._host[0]) >= self._closed_at

    def close(self, stream: torch.cuda.Stream) -> None:
        """Hold what is queued on `stream` from now until the next `open`.

        Raises:
            RuntimeError: the driver refused the wait.
        """
        self._closed_at += 1
        _check(
            self._driver.wait_value(stream.cuda_stream, self._address, self._closed_at, _WAIT_GEQ)
        )

    def open(self) -> None:
        """Let what the last `close` holds run (idempotent; safe from any thread)."""
        self._host[0] = self._closed_at


class _GateDriver:
    """The driver entry points a gate needs (each returns a ``CUresult``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        # (stream, device address, value, flags)
        memop = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
        self.wait_value = _entry(lib, "cuStreamWaitValue64_v2", memop)
        self.write_value = _entry(lib, "cuStreamWriteValue64_v2", memop)
        # (device address out, host pointer, flags)
        self.device_pointer = _entry(
            lib,
            "cuMemHostGetDevicePointer_v2",
            (ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint),
        )


def _entry(lib: ctypes.CDLL, name: str, argtypes: tuple[Any, ...]) -> Any:
    function = getattr(lib, name)
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0
_SUPPORTED: dict[tuple[str, int | None], bool] = {}


@functools.cache
def _gate_driver() -> _GateDriver | None:
    try:
        return _GateDriver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def _check(result: int) -> None:
    if result != 0:
        raise RuntimeError(f"the CUDA driver refused a stream memory operation (CUresult {result})")


def _try_gate(device: torch.device, timeout_s: float) -> bool:
    """Close a gate on a fresh stream, see that work behind it waits, open it, and see
    that the work runs."""
    driver = _gate_driver()
    if device.type != "cuda" or driver is None:
        return False
    try:
        gate = StreamGate(device)
        with torch.cuda.device(device):
            stream, other = torch.cuda.Stream(), torch.cuda.Stream()
            event = torch.cuda.Event()
            gate.close(stream)
            event.record(stream)
            time.sleep(0.01)
            held = not event.query()
            gate.open()
            released = wait_reached([event], timeout_s)
            if not released:
                # The GPU did not see the host's write: the device writes the counter itself,
                # so that the stream is not held for ever.
                _check(driver.write_value(other.cuda_stream, gate._address, gate._closed_at, 0))
                event.synchronize()
    except RuntimeError:
        return False
    return held and released
