"""Summing a program's digest samples (`weightsync.layout.digest`) as its chunks are staged."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightsync.layout.digest import WEIGHT_MODULUS, WEIGHT_MULTIPLIER
from weightsync.plan.direct import DirectStep
from weightsync.plan.program import ChunkStep, PushProgram, SampleSpan


def expand_spans(
    spans: list[SampleSpan], groups: list[int], num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples of `spans` one by one, grouped: ``(byte offsets, weights, digest indices,
    group bounds)``, where the samples of group ``g`` (``groups[i]`` is span ``i``'s, in
    ``range(num_groups)``) are ``bounds[g]:bounds[g + 1]``.

    Vectorized (a push may have hundreds of thousands of regions); host tensors.
    """
    if not spans:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty, torch.zeros(num_groups + 1, dtype=torch.int64)
    table = torch.tensor(spans, dtype=torch.int64)
    ring_offset, stride, count, first_k, tail_offset, tail_k, digest = table.unbind(1)
    group = torch.tensor(groups, dtype=torch.int64)
    # The strided samples: span i contributes count[i] of them.
    starts = torch.cumsum(count, 0) - count
    total = int(count.sum())
    span_of = torch.repeat_interleave(torch.arange(len(spans)), count, output_size=total)
    within = torch.arange(total) - starts[span_of]
    tails = tail_offset >= 0
    offsets = torch.cat([ring_offset[span_of] + within * stride[span_of], tail_offset[tails]])
    ks = torch.cat([first_k[span_of] + within, tail_k[tails]])
    digests = torch.cat([digest[span_of], digest[tails]])
    group_of = torch.cat([group[span_of], group[tails]])
    order = torch.argsort(group_of, stable=True)
    bounds = torch.zeros(num_groups + 1, dtype=torch.int64)
    bounds[1:] = torch.cumsum(torch.bincount(group_of, minlength=num_groups), 0)
    return offsets[order], _weights(ks[order]), digests[order], bounds


def _weights(ks: torch.Tensor) -> torch.Tensor:
    """`weightsync.layout.digest.weight` of every sample number (exact in int64: a sample
    number is below 2**24)."""
    return (ks * WEIGHT_MULTIPLIER) % WEIGHT_MODULUS + 1


class DigestSums:
    """The digests a program's samples add up to over one execution.

    Built once per program on the ring's device (its index tensors are kept). During an
    execution every written step is noted (`add_step`) and, before a bucket refills a slot
    and at the end, `flush` copies the noted steps' sampled bytes out of the ring in one
    gather; a direct step's samples are read from its tensors' storage as it runs
    (`add_direct`); `values` weighs and sums them all at once and reads the sums back (one
    device sync).

    Args:
        program: the program whose samples are summed.
        device: the staging ring's device.
    """

    def __init__(self, program: PushProgram, *, device: torch.device) -> None:
        self._program = program
        spans: list[SampleSpan] = []
        groups: list[int] = []
        for position, step in enumerate(program.steps):
            spans.extend(step.samples)
            groups.extend([position] * len(step.samples))
        offsets, weights, digests, bounds = expand_spans(spans, groups, len(program.steps))
        edges = bounds.tolist()
        # The direct copies' samples follow the staged ones: read from the tensors' storages.
        direct = [s for step in program.direct for s in step.samples]
        if direct:
            table = torch.tensor(direct, dtype=torch.int64)
            offsets = torch.cat([offsets, table[:, 0]])
            weights = torch.cat([weights, _weights(table[:, 1])])
            digests = torch.cat([digests, table[:, 2]])
        self._offsets = offsets.to(device)
        self._samples = torch.zeros(offsets.numel(), dtype=torch.uint8, device=device)
        # By step identity (the executor hands back the program's own step objects): the
        # step's range of the samples; steps come in order, so noted ones form one range.
        self._ranges = {id(step): (edges[i], edges[i + 1]) for i, step in enumerate(program.steps)}
        start = edges[-1]
        for step in program.direct:
            self._ranges[id(step)] = (start, start + len(step.samples))
            start += len(step.samples)
        self._pending: tuple[int, int] | None = None
        self._weights = weights.to(device)
        self._digests = digests.to(device)
        # sum((b + 1) * w) = sum(b * w) + sum(w): the second part is fixed per parameter.
        base = torch.zeros(len(program.digests), dtype=torch.int64).index_add_(0, digests, weights)
        self._base = base.to(device)

    @property
    def program(self) -> PushProgram:
        """The program the sums belong to."""
        return self._program

    def add_step(self, step: ChunkStep) -> None:
        """Note that `step` (one of the program's) is filled: its samples are in the ring
        until its slot is refilled."""
        lo, hi = self._ranges[id(step)]
        if self._pending is None:
            self._pending = (lo, hi)
        else:
            self._pending = (self._pending[0], hi)

    def add_direct(self, step: DirectStep, storage_bytes: torch.Tensor) -> None:
        """Read the samples of direct step `step` (one of the program's) from its tensor's
        storage, `storage_bytes` (the storage as uint8); enqueued on the current stream on a
        GPU."""
        lo, hi = self._ranges[id(step)]
        if hi > lo:
            torch.index_select(storage_bytes, 0, self._offsets[lo:hi], out=self._samples[lo:hi])

    def span_gather(
        self, bases: Sequence[tuple[DirectStep, int]]
    ) -> tuple[int, int, torch.Tensor, int, int] | None:
        """How to read the samples of every direct step in one gather: ``(span start
        address, span bytes, offsets from the start, first sample, end sample)``, given each
        step's storage address (`bases`, in program order); None without direct samples.

        The span runs from the lowest storage to the end of the highest sample; one uint8
        tensor over it reads every sample with one kernel instead of one per storage (the
        gaps between storages are never read).
        """
        ranges = [(self._ranges[id(step)], base) for step, base in bases]
        ranges = [((lo, hi), base) for (lo, hi), base in ranges if hi > lo]
        if not ranges:
            return None
        first, end = ranges[0][0][0], ranges[-1][0][1]
        if [lo for (lo, _), _ in ranges[1:]] != [hi for (_, hi), _ in ranges[:-1]]:
            raise ValueError("the direct steps' samples must be given in program order")
        shift = torch.cat(
            [torch.full((hi - lo,), base, dtype=torch.int64) for (lo, hi), base in ranges]
        ).to(self._offsets.device)
        absolute = self._offsets[first:end] + shift
        start = int(absolute.min())
        size = int(absolute.max()) - start + 1
        return start, size, absolute - start, first, end

    def gather_span(self, span: torch.Tensor, offsets: torch.Tensor, first: int, end: int) -> None:
        """Read samples ``first:end`` from `span` (a uint8 tensor over the span of
        `span_gather`) at `offsets`; enqueued on the current stream on a GPU."""
        torch.index_select(span, 0, offsets, out=self._samples[first:end])

    def flush(self, ring_bytes: torch.Tensor) -> None:
        """Copy the samples of the noted steps out of the ring (`ring_bytes`, the ring as
        uint8); on a GPU ring this is enqueued on the current stream, behind the fills."""
        if self._pending is None:
            return
        lo, hi = self._pending
        self._pending = None
        if hi > lo:
            torch.index_select(ring_bytes, 0, self._offsets[lo:hi], out=self._samples[lo:hi])

    def sums(self) -> torch.Tensor:
        """The digests as a tensor on the samples' device, in `PushProgram.digests` order
        (enqueued; nothing is read back)."""
        weighted = self._samples.to(torch.int64).mul_(self._weights)
        return self._base.clone().index_add_(0, self._digests, weighted)

    def values(self) -> dict[tuple[int, str], int]:
        """``{(layout_id, param_name): digest}`` of what the execution staged and wrote
        directly."""
        return dict(zip(self._program.digests, self.sums().tolist(), strict=True))
