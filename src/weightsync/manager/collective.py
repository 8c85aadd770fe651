"""The messages between the driver rank and the other trainer ranks of one sync, and the
collective calls that carry them.

One sync, as the ranks see it (group rank 0 is the driver):

1. every rank: all-gather of `SourceHolding`s (`WeightSender.gather_holdings`);
2. driver → every rank, broadcast: `PushOrder` when it is time to write, or `NoPush` when the
   update ended before any write (a replica refused to pause, say);
3. after a `PushOrder` with ``new_plan``: driver → every rank, scatter: each rank's
   `SourcePlan`;
4. every rank → driver, gather: a `RankOutcome` (its `PushStats`, or the error it raised);
5. driver → every rank, broadcast: `SyncDone` with the report, or `SyncFailed` with the
   error every rank then raises.

Messages travel as pickled objects over the trainer's own process group (gloo or NCCL's
object collectives); each is a frozen dataclass, checked by type on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from weightsync.errors import WeightSyncError
from weightsync.manager.report import SyncReport
from weightsync.plan import SourcePlan
from weightsync.sender import PushStats

MessageT = TypeVar("MessageT")


@dataclass(frozen=True, slots=True, kw_only=True)
class PushOrder:
    """Write your share now.

    Attributes:
        new_plan: the plan changed; a scatter of every rank's `SourcePlan` follows.
    """

    new_plan: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class NoPush:
    """The update ended before anything was written; wait for its outcome."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankOutcome:
    """What one rank's push did.

    Attributes:
        rank: the rank (in the trainer group).
        stats: its push's stats, when it succeeded.
        error: what it raised, when it failed.
    """

    rank: int
    stats: PushStats | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncDone:
    """The sync succeeded.

    Attributes:
        report: what it did (the same on every rank).
    """

    report: SyncReport


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncFailed:
    """The sync failed.

    Attributes:
        error: the error every rank raises.
    """

    error: BaseException


class Collective:
    """The driver↔rank message calls over the trainer group (a single process needs none).

    Args:
        group: the trainer's torch.distributed process group, or None for one process.
        rank: this process's rank in `group`.
        world_size: the group's size.
    """

    def __init__(self, group: Any, *, rank: int, world_size: int) -> None:
        self._group = group
        self.rank = rank
        self.world_size = world_size

    @property
    def is_driver(self) -> bool:
        """Whether this is group rank 0."""
        return self.rank == 0

    def broadcast(self, message: Any, expected: tuple[type, ...]) -> Any:
        """The driver's `message` on every rank (the driver passes it, the others None).

        Raises:
            WeightSyncError: a message of another type arrived (the ranks are out of step).
        """
        if self.world_size == 1:
            return _checked(message, expected)
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=self._src(), group=self._group)
        return _checked(box[0], expected)

    def scatter(self, messages: list[Any] | None, expected: type[MessageT]) -> MessageT:
        """Rank r's element of the driver's `messages` (the others pass None)."""
        if self.world_size == 1:
            assert messages is not None
            return _checked(messages[0], (expected,))
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(
            box, messages if self.is_driver else None, src=self._src(), group=self._group
        )
        return _checked(box[0], (expected,))

    def gather(self, message: Any, expected: type[MessageT]) -> list[MessageT] | None:
        """Every rank's `message`, by rank, on the driver; None elsewhere."""
        if self.world_size == 1:
            return [_checked(message, (expected,))]
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * self.world_size if self.is_driver else None
        dist.gather_object(message, gathered, dst=self._src(), group=self._group)
        if gathered is None:
            return None
        return [_checked(m, (expected,)) for m in gathered]

    def _src(self) -> int:
        import torch.distributed as dist

        return 0 if self._group is None else dist.get_global_rank(self._group, 0)


def _checked(message: Any, expected: tuple[type, ...]) -> Any:
    if not isinstance(message, expected):
        names = " or ".join(t.__name__ for t in expected)
        raise WeightSyncError(
            f"trainer ranks out of step: expected a {names} message, got "
            f"{type(message).__name__}; every rank must call TrainerSync.sync the same number "
            "of times"
        )
    return message


__all__ = [
    "Collective",
    "NoPush",
    "PushOrder",
    "RankOutcome",
    "SourcePlan",
    "SyncDone",
    "SyncFailed",
]
