"""Do the ranks that hold the same box of an HF tensor hold the same bytes?

A sharded trainer keeps copies of some boxes on several ranks (data-parallel replicas, norms
replicated over tensor parallel, the tied output layer on the last pipeline stage) and the
plan reads each box from any one of them. If a bug in the trainer lets the copies drift
(a gradient not reduced over one axis, say), the rollout would get whichever copy the plan
picked. `box_digests` fingerprints what a rank holds, locally; `replica_mismatches` compares
the fingerprints of all ranks (gathered by the caller: that is the collective, which is why
`weightsync.SyncConfig.check_replicas` makes it opt-in).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from weightsync.export.base import WeightExport

Box = tuple[tuple[int, int], ...]


def box_digests(export: WeightExport) -> dict[str, tuple[Box, str]]:
    """``{hf_name: (held box, digest of its bytes)}`` of one rank's stream (a copy to host
    memory per tensor: a debugging aid, not for every sync)."""
    holding = export.holding()
    digests: dict[str, tuple[Box, str]] = {}
    with torch.no_grad():
        for name, tensor in export:
            data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            digest = hashlib.blake2b(memoryview(data.numpy()), digest_size=16).hexdigest()
            digests[name] = (holding[name].held_box, digest)
    return digests


def replica_mismatches(digests: Sequence[Mapping[str, tuple[Box, str]]]) -> list[str]:
    """One sentence per box whose holders hold different bytes.

    Args:
        digests: `box_digests` of every rank, indexed by rank.
    """
    holders: dict[tuple[str, Box], dict[str, list[int]]] = {}
    for rank, mine in enumerate(digests):
        for name, (box, digest) in mine.items():
            key = (name, tuple(map(tuple, box)))
            holders.setdefault(key, {}).setdefault(digest, []).append(rank)
    return [
        f"trainer ranks hold different bytes in box {list(box)} of HF tensor {name!r}: "
        f"{' vs '.join(f'ranks {ranks}' for ranks in by_digest.values())}; the copies a "
        "trainer replicates (data parallel, norms over tensor parallel) must stay equal"
        for (name, box), by_digest in sorted(holders.items())
        if len(by_digest) > 1
    ]
