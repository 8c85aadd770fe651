"""Pinned tensors: a trainer tensor that changes while a push reads it fails the push.

A push reads each trainer tensor from when it takes it (the stream yields it, or a replayed
push starts) until the push's last write that reads it landed: its bytes are copied into
the staging ring, or read from its memory by direct writes while they are in flight. A
change in that window (an optimizer step on another thread) would leave the replicas with
part old, part new values, which a sampled digest catches only sometimes. So the push reads
every tensor's version counter when it takes it and once more after its last write landed,
and fails naming the first tensor whose counter moved (`TensorChangedError`). Checking every
tensor at the end, not each one once its own copies are done, also catches a change to a
tensor already copied while later ones are still to be taken: the replicas would get the
first one old and the later ones new. So the push keeps every tensor it took until then:
free for views of the trainer's memory and for an export's persistent buffers, while an
export that yields a fresh copy per tensor has them all kept until the push's end.

torch bumps a tensor's counter at every in-place op on it, and a view shares the counter of
the tensor it views, so reading it costs a few tens of nanoseconds and no pass over memory.
What it does not see: memory written through an alias that keeps a counter of its own
(``tensor.data``, a flat buffer a parameter was rebound to with ``param.data = ...``, a raw
pointer or a collective writing into the storage); the digests the replicas verify are the
check of those. An export that yields tensors it computed (casts, `weightsync.export.Fp8Export`'s
codes, buffers assembled from pieces) is checked on what it yields: those are its own, and
the trainer's tensors they were computed from were read before the push took them.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

import torch

from weightsync.errors import TensorChangedError

_VERSION = operator.attrgetter("_version")

UNCOUNTED = torch.empty(0)
"""Pinned in place of a tensor that counts no versions (an inference tensor, which can only
change inside ``torch.inference_mode``): a tensor nothing writes, whose counter stays 0."""


def pinned(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What a stream keeps of `tensor` (`PushPins.stream`) and its version counter now:
    `UNCOUNTED` and 0 for a tensor that counts no versions (an inference tensor)."""
    if tensor.is_inference():
        return UNCOUNTED, 0
    return tensor, tensor._version


class PushPins:
    """The tensors one push (or one part of it) took, with their version counters then.

    Call protocol: the push registers what it takes, either with `stream` (the executor
    appends each tensor as it arrives) or with `take` (a replay takes its bound tensors at
    once), and calls `check` after the last write reading them landed.

    Args:
        rank: the trainer rank pushing, for the error.
    """

    __slots__ = ("_groups", "rank")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._groups: list[tuple[Sequence[str], Sequence[torch.Tensor], list[int]]] = []

    def stream(self, names: Sequence[str]) -> tuple[list[torch.Tensor], list[int]]:
        """Two empty lists, registered here, that the caller appends each tensor it takes to
        and its ``_version`` (`UNCOUNTED` and 0 for a tensor that counts none); the i-th
        tensor is named ``names[i]``."""
        tensors: list[torch.Tensor] = []
        versions: list[int] = []
        self._groups.append((names, tensors, versions))
        return tensors, versions

    def take(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Take `tensors` (named `names`, as `counted` gives them) now: read their counters."""
        self._groups.append((names, tensors, list(map(_VERSION, tensors))))

    def check(self, *, until: str = "its last write landing") -> None:
        """Raise if a taken tensor's counter moved since it was taken.

        Args:
            until: what the push waited for before this check, for the message (as in
                "between the push taking it and its last write landing").

        Raises:
            TensorChangedError: naming the first such tensor (in the order taken).
        """
        for names, tensors, taken in self._groups:
            now = list(map(_VERSION, tensors))
            if now == taken:
                continue
            index = next(i for i, (a, b) in enumerate(zip(now, taken, strict=True)) if a != b)
            name = names[index]
            raise TensorChangedError(
                f"trainer rank {self.rank}: HF tensor {name!r} changed while a push read it "
                f"(its version counter went from {taken[index]} to {now[index]} between the "
                f"push taking it and {until}): an in-place op on it or on a tensor sharing its "
                "counter (the trainer tensor it views, or another view of that), such as an "
                "optimizer step on another thread. The replicas it was written to "
                "may hold a mix of old and new values, so the sync fails and leaves them "
                "paused until a sync succeeds; sync between optimizer steps, not during one",
                hf_name=name,
                rank=self.rank,
            )


def counted(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[torch.Tensor]]:
    """What a replay reads the counters of, for the tensors `named` it reads: one tensor per
    counter (views share the counter of the tensor they view, so a fused expert tensor's
    hundreds of per-expert views are read once), named by the first of them; tensors that
    count no versions are left out."""
    seen: set[int] = set()
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for name, tensor in named:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) in seen or base.is_inference():
            continue
        seen.add(id(base))
        names.append(name)
        tensors.append(base)
    return names, tensors
