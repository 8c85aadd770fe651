"""Captured pushes: a push that wrote every byte directly, replayed without reading the stream.

A push whose program is all direct (`PushProgram.all_direct`) reads nothing but the trainer's
tensors, at addresses that stay put between optimizer steps. So once it ran, what it did can
be kept bound to those addresses and done again on the next sync with no per-tensor work:

- `GraphPush`: the copies into mapped receiver memory (`weightsync.sender.direct.MappedDirect`)
  and the digest samples, captured once as two CUDA graphs and replayed with two launches;
- `WritePush`: the writes of a transport that takes lists (Mooncake), bound to absolute
  source addresses: one submission per target and a gather per storage.

A captured push is valid for one program (so one plan and stream geometry) and one memory
key of the export (`weightsync.export.WeightExport.geometry_key`: where its tensors lie). The
sender compares the key before the push starts and captures again when it changed (a
parameter moved). A captured push holds the tensors it reads, so their memory cannot be
reused under it, and names one per version counter (``pinned``, `weightsync.sender.pins`):
a replay reads those counters before it writes and checks them once its writes landed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from weightsync.cuda_events import wait_reached
from weightsync.errors import TransferError
from weightsync.plan.program import PushProgram
from weightsync.plan.writes import WriteRun
from weightsync.sender.digest import DigestSums
from weightsync.sender.direct import (
    DIRECT_SLOT,
    BoundStep,
    SourceMemory,
    copy_all,
    device_tensor,
)
from weightsync.sender.pins import counted

if TYPE_CHECKING:
    from weightsync.plan.types import TargetRank
    from weightsync.sender.writes import WriteQueue


class WritePush:
    """A direct push over a list-taking transport, bound to absolute addresses.

    Args:
        program: the all-direct program that ran.
        key: the export's memory key it ran under.
        bound: what each direct step read (`TransportDirect.bound`).

    Attributes:
        pinned: the names and tensors whose version counters a replay checks
            (`weightsync.sender.pins.counted`).
    """

    def __init__(self, program: PushProgram, key: Any, bound: list[BoundStep]) -> None:
        self.program = program
        self.key = key
        self._bound = bound
        writes: dict[str, tuple[TargetRank, list[WriteRun]]] = {}
        for item in bound:
            for target_writes in item.step.writes:
                entry = writes.setdefault(
                    target_writes.target.session_id, (target_writes.target, [])
                )
                entry[1].extend(
                    w._replace(src_offset=item.base + w.src_offset) for w in target_writes.writes
                )
        self._writes = list(writes.values())
        self._regions = [(item.base, item.storage.numel()) for item in bound]
        self.pinned = _pinned(program, bound)

    def replay(self, queue: WriteQueue, sources: SourceMemory, sums: DigestSums | None) -> None:
        """Submit every write again (the queue's waits cover them) and read the digest
        samples from the storages."""
        for base, num_bytes in self._regions:
            sources.ensure(base, num_bytes)
        for target, writes in self._writes:
            queue.submit(target, writes, ring_base=0, slot=DIRECT_SLOT)
        if sums is not None:
            for item in self._bound:
                sums.add_direct(item.step, item.storage)

    def digests(self, sums: DigestSums | None) -> dict[tuple[int, str], int]:
        """The digests of the last replay."""
        return sums.values() if sums is not None else {}


class GraphPush:
    """A direct push into mapped receiver memory, captured as CUDA graphs.

    Capturing records the copies (dealt over two branches of one graph) and, as a second
    graph, the digest samples (one gather over the span of the trainer's storages) and the
    copy of their sums into pinned memory, without running them; the push they come from
    already ran them. A replay runs the digest graph on a stream of its own beside the
    copies, so the digests are known long before the copies finish (`digests` waits for
    them alone) and a caller may announce them while the bytes are still moving.

    Args:
        program: the all-direct program that ran.
        key: the export's memory key it ran under.
        bound: what each direct step read (`MappedDirect.bound`).
        copies: every ``(dst, src)`` pair it copied (`MappedDirect.copies`).
        sums: the program's digest sums, or None without digests.
        device: the CUDA device the copies ran on.
        timeout_s: how long `digests` waits for the digest graph.

    Attributes:
        pinned: the names and tensors whose version counters a replay checks
            (`weightsync.sender.pins.counted`).
    """

    def __init__(
        self,
        program: PushProgram,
        key: Any,
        bound: list[BoundStep],
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        sums: DigestSums | None,
        *,
        device: torch.device,
        timeout_s: float = 60.0,
    ) -> None:
        self.program = program
        self.key = key
        # Held for the graphs' lifetime: they read and write the memory of these tensors
        # (the trainer's, the copies' views, the digest buffers) by address.
        self._bound = bound
        self.pinned = _pinned(program, bound)
        self._copies = copies
        self._sums = sums
        self._device = device
        self._timeout_s = timeout_s
        self._graph = torch.cuda.CUDAGraph()
        self._digest_graph: torch.cuda.CUDAGraph | None = None
        self._side = torch.cuda.Stream(device)
        self._digested = torch.cuda.Event()
        # The digest graph copies the sums here (pinned): read back without a copy call.
        self._digests = (
            torch.empty(len(program.digests), dtype=torch.int64, pin_memory=True)
            if sums is not None
            else None
        )
        # Every sample read by one gather over the span of the trainer's storages (one
        # kernel, not one per storage: a dense 8B model has 399, a per-expert MoE thousands).
        plan = (
            sums.span_gather([(item.step, item.base) for item in bound])
            if sums is not None
            else None
        )
        self._span = device_tensor(plan[0], plan[1]) if plan is not None else None
        capture = torch.cuda.Stream(device)
        capture.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.device(device):
            if sums is not None and self._digests is not None:
                self._digest_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    self._digest_graph, stream=capture, capture_error_mode="thread_local"
                ):
                    if plan is not None and self._span is not None:
                        sums.gather_span(self._span, plan[2], plan[3], plan[4])
                    self._digests.copy_(sums.sums(), non_blocking=True)
            dsts = [dst for dst, _ in copies]
            srcs = [src for _, src in copies]
            with torch.cuda.graph(self._graph, stream=capture, capture_error_mode="thread_local"):
                branches = _branches(dsts, srcs, _BRANCHES)
                streams = [capture] + [torch.cuda.Stream(device) for _ in branches[1:]]
                for stream in streams[1:]:
                    stream.wait_stream(capture)
                for stream, (branch_dsts, branch_srcs) in zip(streams, branches, strict=True):
                    with torch.cuda.stream(stream):
                        copy_all(branch_dsts, branch_srcs)
                for stream in streams[1:]:
                    capture.wait_stream(stream)
        torch.cuda.current_stream(device).wait_stream(capture)

    def replay(self, queue: WriteQueue, sources: SourceMemory, sums: DigestSums | None) -> None:
        """Launch the copies on the current stream and the digests beside them; work queued
        on the current stream later waits for both."""
        with torch.cuda.device(self._device):
            current = torch.cuda.current_stream(self._device)
            if self._digest_graph is not None:
                # The samples are read from the trainer's tensors, which the copies do not
                # change, once what was queued before (the optimizer's step) wrote them.
                self._side.wait_stream(current)
                with torch.cuda.stream(self._side):
                    self._digest_graph.replay()
                self._digested.record(self._side)
            self._graph.replay()
            if self._digest_graph is not None:
                current.wait_stream(self._side)

    def digests(self, sums: DigestSums | None) -> dict[tuple[int, str], int]:
        """The digests of the last replay, once its digest graph finished (the copies may
        still run).

        Raises:
            TransferError: the digest graph did not finish within the timeout.
        """
        if self._digests is None or sums is None:
            return {}
        if not wait_reached((self._digested,), self._timeout_s):
            raise TransferError(
                f"the digests of a replayed push did not finish within {self._timeout_s:g} s "
                "(the GPU is stuck or far behind)"
            )
        return dict(zip(self.program.digests, self._digests.tolist(), strict=True))


def _pinned(program: PushProgram, bound: list[BoundStep]) -> tuple[list[str], list[torch.Tensor]]:
    """The names and tensors whose version counters a replay of `bound` checks."""
    return counted(
        (program.keys[index], tensor) for item in bound for index, tensor in item.tensors.items()
    )


# Branches of the graph the copies are dealt over: a graph runs a branch's copies one after
# the other, with a gap between two that a second branch fills (on an H200, dense 8B: 8.7 ms
# against 9.0 with one branch; four were no better than two).
_BRANCHES = 2


def _branches(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], parts: int
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The copies dealt into at most `parts` branches of about equal bytes, in order."""
    total = sum(d.numel() * d.element_size() for d in dsts)
    share = max(1, -(-total // parts))
    out: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], [])]
    filled = 0
    for dst, src in zip(dsts, srcs, strict=True):
        if filled >= share and len(out) < parts:
            out.append(([], []))
            filled = 0
        out[-1][0].append(dst)
        out[-1][1].append(src)
        filled += dst.numel() * dst.element_size()
    return out


CapturedPush = WritePush | GraphPush
"""Either kind of captured push."""
