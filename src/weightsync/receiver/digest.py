"""The digest of what a rank's parameters hold (`weightsync.layout.digest`), in a few kernels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from weightsync.cuda_events import StreamGate
from weightsync.layout.digest import WEIGHT_MODULUS, WEIGHT_MULTIPLIER, sample_stride
from weightsync.torch_dtypes import storage_bytes


class ParameterDigests:
    """Computes every parameter's digest at once, grouped by storage.

    The sample positions are fixed by each parameter's size and its place in its storage,
    and parameters never move, so the index tensors are built once; each `compute` is one
    gather, one multiply and one segmented sum per storage (a single storage when the engine
    carves its parameters out of one buffer). On a GPU those kernels and the copy of the
    sums to the host are captured once as a CUDA graph and replayed: a session computes the
    digests twice while generation waits, and one graph launch costs less than launching
    each kernel.

    `compute` computes them now. `launch` and `collect` split that in two on a GPU: the
    graph is queued and an interprocess event recorded after it (its IPC handle returned,
    so that a writer on this host can wait for it), and `collect` reads the sums later.
    One launch is pending at a time: `launch` and `compute` collect a pending one first.
    A launch may be held behind a `StreamGate` (on a stream of its own): queued before the
    bytes it reads are all in, and run the moment its holder opens the gate.
    `compute_values` and `collect_values` give the digests as one int64 array in the
    order of `names`, which `order` puts other digests in: a session compares them as
    bytes, in a microsecond, while generation waits, instead of building and comparing
    dicts (or calling into torch, ten times that).

    Args:
        params: the rank's parameters by name (each contiguous, none empty).
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._names = tuple(params)
        groups: dict[int, list[int]] = {}
        tensors = list(params.values())
        for index, tensor in enumerate(tensors):
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(index)
        self._device = tensors[0].device if tensors else torch.device("cpu")
        base = torch.zeros(len(tensors), dtype=torch.int64)
        self._groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for members in groups.values():
            view = storage_bytes(tensors[members[0]])
            starts = [tensors[i].data_ptr() - view.data_ptr() for i in members]
            offsets, weights, slots = sample_table(
                [tensors[i].nbytes for i in members], starts, members
            )
            base.index_add_(0, slots, weights)
            self._groups.append(
                (view, offsets.to(self._device), weights.to(self._device), slots.to(self._device))
            )
        # sum((b + 1) * w) = sum(b * w) + sum(w): the second part is fixed per parameter.
        self._base = base.to(self._device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._host = torch.zeros(0, dtype=torch.int64)
        self._host_values = self._host.numpy()  # the same memory
        self._done: torch.cuda.Event | None = None  # recorded after each replay
        self._done_handle = ""
        self._launched: torch.Tensor | None = None  # computed by a launch on the CPU
        self._pending = False
        self._gate: StreamGate | None = None  # the gate the pending launch is held behind
        self._gated_stream: torch.cuda.Stream | None = None  # where gated launches run

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters' names, in the order of the value tensors."""
        return self._names

    @property
    def pending(self) -> bool:
        """Whether a `launch` waits to be collected."""
        return self._pending

    @property
    def on_gpu(self) -> bool:
        """Whether the digests run as GPU work (`launch` returns an event's handle)."""
        return self._device.type == "cuda" and bool(self._names)

    def compute(self) -> dict[str, int]:
        """``{param_name: digest}`` of what every parameter holds now (one device sync)."""
        self.launch()
        return self.collect()

    def compute_values(self) -> np.ndarray:
        """The digests of what every parameter holds now, in the order of `names` (an int64
        array of their own; one device sync)."""
        self.launch()
        return self.collect_values()

    def order(self, digests: Mapping[str, int]) -> np.ndarray:
        """`digests` (``{param_name: digest}``, from elsewhere) as an int64 array in the
        order of `names`, to compare with `compute_values`: -1, which no digest is, where a
        parameter has none, or one no int64 holds."""
        values = [digests.get(name, -1) for name in self._names]
        try:
            return np.array(values, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            return np.array(
                [v if type(v) is int and 0 <= v < 1 << 63 else -1 for v in values],
                dtype=np.int64,
            )

    def launch(self, gate: StreamGate | None = None) -> str | None:
        """Start the digests of what every parameter holds now, on the current stream; with
        `gate` (on a GPU), on a stream of their own behind it: they read the parameters once
        the gate is opened (`collect` opens it if nobody did).

        Returns:
            On a GPU, the IPC handle (hex) of the interprocess event they complete at;
            elsewhere None (they were computed now).
        """
        if self._pending:
            self.collect()
        self._pending = True
        if not self.on_gpu:
            self._launched = self._sums()
            return None
        graph = self._graph or self._capture()
        assert self._done is not None  # made by `_capture`
        stream = torch.cuda.current_stream(self._device)
        if gate is None:
            graph.replay()
        else:
            held = self._gated_stream or torch.cuda.Stream(self._device)
            self._gated_stream = held
            held.wait_stream(stream)
            gate.close(held)
            self._gate, stream = gate, held
            with torch.cuda.stream(held):
                graph.replay()
        self._done.record(stream)
        return self._done_handle

    def collect(self) -> dict[str, int]:
        """``{param_name: digest}`` as the pending `launch` found them (waits for it).

        Raises:
            RuntimeError: nothing was launched since the last collect.
        """
        return dict(zip(self._names, self.collect_values().tolist(), strict=True))

    def collect_values(self) -> np.ndarray:
        """`collect`'s digests in the order of `names` (an int64 array of their own).

        Raises:
            RuntimeError: nothing was launched since the last collect.
        """
        if not self._pending:
            raise RuntimeError("ParameterDigests.collect without a launch")
        self._pending = False
        if not self.on_gpu:
            launched, self._launched = self._launched, None
            assert launched is not None  # set by every launch on the CPU
            return launched.numpy()
        assert self._done is not None  # made by `_capture`
        if self._gate is not None:
            self._gate.open()
            self._gate = None
        self._done.synchronize()
        # The graph writes the next digests into the same pinned buffer.
        return self._host_values.copy()

    def _sums(self) -> torch.Tensor:
        sums = self._base.clone()
        for view, offsets, weights, slots in self._groups:
            sums.index_add_(0, slots, view.index_select(0, offsets).to(torch.int64).mul_(weights))
        return sums

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Capture `_sums` and the copy of its result into pinned host memory."""
        with torch.cuda.device(self._device):
            # Warm up off the capture (kernels load, the allocator grows) on a side stream.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._sums()
            torch.cuda.current_stream().wait_stream(side)
            self._host = torch.empty(len(self._names), dtype=torch.int64, pin_memory=True)
            self._host_values = self._host.numpy()
            graph = torch.cuda.CUDAGraph()
            # Thread-local: only the capturing thread (the engine's, or a handler's running
            # an inline command) is captured; other threads' work is not affected.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._host.copy_(self._sums(), non_blocking=True)
            # Interprocess: a writer on this host may wait for it (a session's fence).
            self._done = torch.cuda.Event(interprocess=True)
            self._done.record()
            self._done_handle = self._done.ipc_handle().hex()
        self._graph = graph
        return graph


def sample_table(
    sizes: Sequence[int], starts: Sequence[int], slots: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every digest sample of parameters of `sizes` bytes that start at byte `starts` of one
    buffer: ``(byte offsets, weights, slot of each sample's parameter)`` (host tensors,
    built without a Python loop over samples)."""
    strides, counts, tails, tail_ks = [], [], [], []
    for size in sizes:
        stride = sample_stride(size)
        strided = -(-size // stride)
        strides.append(stride)
        counts.append(strided)
        last_strided = (size - 1) % stride == 0
        tails.append(-1 if last_strided else size - 1)
        tail_ks.append(strided)
    count = torch.tensor(counts, dtype=torch.int64)
    total = int(count.sum())
    param_of = torch.repeat_interleave(torch.arange(len(sizes)), count, output_size=total)
    k = torch.arange(total) - (torch.cumsum(count, 0) - count)[param_of]
    start = torch.tensor(starts, dtype=torch.int64)
    offsets = start[param_of] + k * torch.tensor(strides, dtype=torch.int64)[param_of]
    tail = torch.tensor(tails, dtype=torch.int64)
    has_tail = tail >= 0
    offsets = torch.cat([offsets, start[has_tail] + tail[has_tail]])
    ks = torch.cat([k, torch.tensor(tail_ks, dtype=torch.int64)[has_tail]])
    slot = torch.tensor(slots, dtype=torch.int64)
    slot_of = torch.cat([slot[param_of], slot[has_tail]])
    weights = (ks * WEIGHT_MULTIPLIER) % WEIGHT_MODULUS + 1
    return offsets, weights, slot_of
