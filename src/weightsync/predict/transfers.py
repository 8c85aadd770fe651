"""The unit a network schedule is made of: one source's writes into one target, and queues."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from weightsync.plan.assign import UnitKey


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One source's writes into one target for one layer window.

    Attributes:
        source: the trainer GPU rank that sends.
        target: the index of the rollout rank written (its rollout GPU).
        window: the layer window.
        num_bytes: bytes moved.
        num_writes: contiguous destination runs, after coalescing neighbours.
        units: the work units whose bytes it carries, in position order.
    """

    source: int
    target: int
    window: int
    num_bytes: int
    num_writes: int
    units: tuple[UnitKey, ...] = field(hash=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """Every source's transfers, in the order it sends them.

    Attributes:
        name: what built it (``"network"``, ``"round-robin"``).
        num_targets: rollout ranks (GPUs) written.
        queues: ``{source rank: transfers in order}``, sorted by rank; sources with nothing to
            send are absent.
    """

    name: str
    num_targets: int
    queues: Mapping[int, tuple[Transfer, ...]] = field(hash=False)

    def transfers(self) -> Iterator[Transfer]:
        """Every transfer, source by source, in order."""
        for queue in self.queues.values():
            yield from queue

    @property
    def num_bytes(self) -> int:
        """Bytes moved over all transfers."""
        return sum(t.num_bytes for t in self.transfers())

    @property
    def num_transfers(self) -> int:
        """Transfers over all sources."""
        return sum(len(queue) for queue in self.queues.values())
