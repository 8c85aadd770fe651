"""Filling the staging ring: a program's copy recipes run on worker threads or CUDA streams.

The recipes (`weightsync.plan.copies`) name their source tensors by stream index; the filler
takes the tensors that arrived and runs the copies (and the zero runs) into the ring.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightsync.plan.copies import CopyRecipe

# Below this many bytes per slot, handing copies to threads costs more than it saves.
_MIN_PARALLEL_BYTES = 4 << 20


class SlotFiller:
    """Runs the copies and zero fills of a bucket, or of one chunk of it, into a slot."""

    def __init__(self, *, num_workers: int) -> None:
        """Create the filler; threads start on the first large host fill.

        Args:
            num_workers: threads that share a slot's copies (1 = the calling thread).
        """
        self._num_workers = num_workers
        self._pool: ThreadPoolExecutor | None = None

    def run(
        self,
        copies: Sequence[CopyRecipe],
        held: Sequence[Any],
        zeros: Sequence[tuple[int, int]],
        *,
        staging_bytes: torch.Tensor,
        staging_typed: torch.Tensor,
    ) -> None:
        """Run `copies` from the `held` tensors and zero the byte ranges `zeros` (offsets
        into the whole ring).

        Host copies run on up to `num_workers` threads when there are enough bytes; CUDA
        copies are only enqueued, on the current stream, as few launches as possible (the
        caller waits for them before the ring is read).

        Args:
            copies: the step's copies.
            held: the stream's tensors by program index (``copy.source`` indexes it).
            zeros: ``(ring byte offset, num_bytes)`` runs to zero.
            staging_bytes: the ring as a 1-D uint8 tensor.
            staging_typed: the same memory as a 1-D tensor of the program's dtype.
        """
        with torch.no_grad():
            for offset, num_bytes in zeros:
                staging_bytes[offset : offset + num_bytes].zero_()
            if not copies:
                return
            on_host = staging_typed.is_cpu and all(held[c.source].is_cpu for c in copies)
            if not on_host:
                _run_on_device(copies, held, staging_typed)
                return
            num_bytes = sum(c.numel for c in copies) * staging_typed.element_size()
            if self._num_workers == 1 or num_bytes < _MIN_PARALLEL_BYTES:
                _run_all(copies, held, staging_typed)
                return
            chunks = _balance(copies, self._num_workers)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._num_workers, thread_name_prefix="weightsync-fill"
                )
            futures = [
                self._pool.submit(_run_all, chunk, held, staging_typed) for chunk in chunks[1:]
            ]
            _run_all(chunks[0], held, staging_typed)
            for future in futures:
                future.result()

    def close(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _run_all(
    copies: Sequence[CopyRecipe], held: Sequence[Any], staging_typed: torch.Tensor
) -> None:
    """Host copies (blocking): a push runs one per fused run of boxes."""
    with torch.no_grad():
        view = staging_typed.as_strided
        for source, size, src_stride, src_offset, dst_stride, dst_offset, whole in copies:
            base = held[source]
            src = base if whole else base.as_strided(size, src_stride, src_offset)
            view(size, dst_stride, dst_offset).copy_(src)


def _run_on_device(
    copies: Sequence[CopyRecipe], held: Sequence[Any], staging_typed: torch.Tensor
) -> None:
    """Enqueue copies into a GPU ring (or from GPU tensors into a host ring).

    Copies between tensors of one dtype on the ring's device go out as multi-tensor
    launches (``torch._foreach_copy_``): a MoE layer's thousands of per-expert tensors would
    otherwise cost one kernel launch, ~10 us of host time, each. The rest (casts, other
    devices, strided sources the fused kernel does not take) run one by one.
    """
    device, dtype = staging_typed.device, staging_typed.dtype
    view = staging_typed.as_strided
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for source, size, src_stride, src_offset, dst_stride, dst_offset, whole in copies:
        base = held[source]
        src = base if whole else base.as_strided(size, src_stride, src_offset)
        dst = view(size, dst_stride, dst_offset)
        if base.device == device and base.dtype == dtype and src.is_contiguous():
            dsts.append(dst)
            srcs.append(src)
        else:
            dst.copy_(src, non_blocking=src.device != device)
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def record_events(devices: Sequence[str]) -> list[torch.cuda.Event]:
    """An event after the copies queued so far on each device's current CUDA stream: a
    transport that cannot wait for them on the GPU may read the slot once they completed."""
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def _balance(ops: Sequence[CopyRecipe], parts: int) -> list[list[CopyRecipe]]:
    """Split `ops` into `parts` lists of about equal elements, cutting large copies."""
    total = sum(op.numel for op in ops)
    share = -(-total // parts)
    pieces: list[CopyRecipe] = []
    for op in ops:
        if op.numel > share and op.size[0] > 1:
            pieces.extend(op.split(min(op.size[0], -(-op.numel // share))))
        else:
            pieces.append(op)
    chunks: list[list[CopyRecipe]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for piece in pieces:
        index = loads.index(min(loads))
        chunks[index].append(piece)
        loads[index] += piece.numel
    return [chunk for chunk in chunks if chunk]
