"""Summing a program's digest samples (`weightsync.layout.digest`) as its chunks are staged."""

from __future__ import annotations

import torch

from weightsync.layout.digest import WEIGHT_MODULUS, WEIGHT_MULTIPLIER
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

    Built once per program on the ring's device (its index tensors are kept), then `reset`
    and `add_step` for every execution; `values` reads the sums back (one device sync).

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
        # By step identity: the executor hands back the program's own step objects. A
        # step's samples are read before its slot is refilled, so each has its own range.
        self._bounds = {id(step): (edges[i], edges[i + 1]) for i, step in enumerate(program.steps)}
        self._offsets = offsets.to(device)
        self._weights = weights.to(device)
        self._digests = digests.to(device)
        self._sums = torch.zeros(len(program.digests), dtype=torch.int64, device=device)

    @property
    def program(self) -> PushProgram:
        """The program the sums belong to."""
        return self._program

    def reset(self) -> None:
        """Start a new execution."""
        self._sums.zero_()

    def add_step(self, step: ChunkStep, ring_bytes: torch.Tensor) -> None:
        """Add the samples of `step` (one of the program's), read from the filled ring
        (`ring_bytes`, the ring as uint8); on a GPU ring this is enqueued on the current
        stream, behind the fill."""
        lo, hi = self._bounds[id(step)]
        if lo == hi:
            return
        values = ring_bytes[self._offsets[lo:hi]].to(torch.int64).add_(1).mul_(self._weights[lo:hi])
        self._sums.index_add_(0, self._digests[lo:hi], values)

    def values(self) -> dict[tuple[int, str], int]:
        """``{(layout_id, param_name): digest}`` of what the execution staged."""
        return dict(zip(self._program.digests, self._sums.tolist(), strict=True))
