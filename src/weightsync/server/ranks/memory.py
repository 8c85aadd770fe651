"""A rank that ran out of memory, said with the sizes: what was asked for, what was free.

Every other failure of a rank reaches the client as a bare 500 (its text, torch's or the
allocator's, stays in the server log). Running out of memory is different: the caller can do
something about it (skip parameters, free the GPU, snapshot elsewhere), so the reply says
so, with the numbers the failure carried, or that the system reports now when it carried
none.
"""

from __future__ import annotations

import contextlib
import re

import torch

from weightsync.receiver.checker import host_available_bytes

# torch's CUDA allocator: "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of
# 139.81 GiB of which 1.02 GiB is free."; its CPU allocator: "you tried to allocate N bytes".
_SIZE = r"([\d.]+ [KMGTP]?i?B)"
_CUDA_ASKED = re.compile(rf"Tried to allocate {_SIZE}")
_CUDA_FREE = re.compile(rf"total capacity of {_SIZE} of which {_SIZE} is free")
_CPU_ASKED = re.compile(r"you tried to allocate (\d+) bytes")
_CPU_ALLOCATOR = "can't allocate memory"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed for want of memory: `MemoryError`, torch's
    ``OutOfMemoryError`` (CUDA), or torch's CPU allocator refusing (a `RuntimeError`)."""
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and _CPU_ALLOCATOR in str(exc)


def describe_out_of_memory(
    exc: BaseException, *, what: str, tp_rank: int, device: torch.device
) -> str:
    """``"out of memory on tp rank R (<device>) in <what>: <asked>; <free>"``.

    Args:
        exc: the failure (`is_out_of_memory`).
        what: what the rank was doing (``"weights_checker snapshot"``).
        tp_rank: the rank.
        device: where the rank's parameters live (whose free memory is said when the
            failure does not say it).
    """
    text = str(exc)
    head = f"out of memory on tp rank {tp_rank} ({device}) in {what}"
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        asked = _CUDA_ASKED.search(text)
        free = _CUDA_FREE.search(text)
        parts = [f"asked for {asked.group(1)} of GPU memory" if asked else "a GPU allocation"]
        if free:
            parts.append(f"{free.group(2)} of {free.group(1)} was free on the GPU")
        else:
            parts.append(_gpu_free_now(device))
        return f"{head}: {'; '.join(parts)}"
    asked = _CPU_ASKED.search(text)
    if asked:
        return f"{head}: asked for {_size(int(asked.group(1)))} of host memory; {_host_now()}"
    if isinstance(exc, MemoryError) and text:
        # Python's and extensions' MemoryErrors name what they could not allocate, if anything.
        return f"{head}: {text}; {_host_now()}"
    return f"{head}: a host allocation failed; {_host_now()}"


def _gpu_free_now(device: torch.device) -> str:
    with contextlib.suppress(RuntimeError, ValueError, AssertionError):
        free, total = torch.cuda.mem_get_info(device)
        return f"{_size(free)} of {_size(total)} free on the GPU now"
    return "the GPU's free memory is unknown"


def _host_now() -> str:
    available = host_available_bytes()
    said = (
        f"the host has {_size(available)} available now (MemAvailable)"
        if available is not None
        else "the host's available memory is unknown"
    )
    limit = _address_space_limit()
    if limit is not None:
        said += f", and this process may map at most {_size(limit)} (RLIMIT_AS)"
    return said


def _address_space_limit() -> int | None:
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def _size(num_bytes: int) -> str:
    """Bytes, and in GiB or MiB for people."""
    if num_bytes >= 1 << 30:
        return f"{num_bytes} bytes ({num_bytes / (1 << 30):.2f} GiB)"
    return f"{num_bytes} bytes ({num_bytes / (1 << 20):.2f} MiB)"
