"""Gathering full HF tensors onto trainer rank 0 and packing them into flat buckets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync.baseline.trainer.buckets import BroadcastBucket
from weightsync.torch_dtypes import torch_dtype


class BucketPacker:
    """Fills broadcast buckets on trainer rank 0 with tensors from every trainer rank.

    Rank 0 copies (and casts) the tensors it holds into the bucket's buffer and receives the
    others straight into the buffer from the rank that holds them (a pipeline stage it does
    not hold), over the trainer's group. Every other rank sends its share, bucket by bucket,
    in the same order, cast to the rollout dtype.

    Args:
        tensors: this rank's PP-local tensors by HF name.
        rank: this rank in the trainer group.
        group: the trainer's process group (None for a single process).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, rank: int, group: Any) -> None:
        self._tensors = tensors
        self._rank = rank
        self._group = group

    def fill(self, bucket: BroadcastBucket, buffer: torch.Tensor) -> None:
        """Rank 0: write `bucket`'s tensors into `buffer` (uint8, at least the bucket's size).

        Receives from other ranks are posted first, so they land while the local copies run.
        """
        received = []
        local = []
        try:
            for (name, view), owner in zip(bucket.layout.views(buffer), bucket.owners, strict=True):
                if owner == self._rank:
                    local.append((name, view))
                else:
                    received.append(dist.irecv(view, group=self._group, group_src=owner))
            for name, view in local:
                view.copy_(self._tensors[name])
        finally:
            # Posted receives complete whatever happened here, so the senders stay in step.
            for work in received:
                work.wait()

    def send_share(self, buckets: Iterable[BroadcastBucket]) -> None:
        """Ranks other than 0: send the tensors rank 0 takes from this rank, in bucket order."""
        for bucket in buckets:
            for span, owner in zip(bucket.layout.spans, bucket.owners, strict=True):
                if owner == self._rank:
                    tensor = self._tensors[span.name].to(torch_dtype(span.dtype)).contiguous()
                    dist.send(tensor, group=self._group, group_dst=0)

    def drain(self, buckets: Sequence[BroadcastBucket], device: torch.device) -> None:
        """Rank 0, after a failed push: take what other ranks still send for `buckets` (and
        drop it), so that they finish their `send_share` and the group stays in step."""
        for bucket in buckets:
            for span, owner in zip(bucket.layout.spans, bucket.owners, strict=True):
                if owner != self._rank:
                    sink = torch.empty(span.shape, dtype=torch_dtype(span.dtype), device=device)
                    dist.recv(sink, group=self._group, group_src=owner)
