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

Messages travel as pickled objects over a gloo group of the trainer's ranks that weightsync
creates for itself (whatever backend the trainer's group has), with its own timeout: a rank
that dies or stops makes every other rank raise `CollectiveError` within that timeout
instead of blocking forever. Each message is a frozen dataclass, checked by type on arrival.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from weightsync.errors import CollectiveError, WeightSyncError
from weightsync.manager.report import SyncReport
from weightsync.plan import SourcePlan
from weightsync.sender import DeltaStats, Fence, PushStats

MessageT = TypeVar("MessageT")
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class PushOrder:
    """Write your share now.

    Attributes:
        new_plan: the plan changed; a scatter of every rank's `SourcePlan` follows.
        fp8_block_size: the rollout serves block-FP8 weights of this block (its published
            metadata): push the export through `weightsync.export.Fp8Export`; 0 for none.
        fences: the CUDA events writes into a target must follow (`WeightSender.push`).
        delta_token: the sync keeps a delta reference: after the full push (to the targets
            not in `delta_sessions`), every rank runs `WeightSender.push_delta` with this
            token; None: no delta push.
        delta_sessions: the session ids of the targets that take a delta.
        delta_pulls: those of them that read their payloads from the trainers' memory
            (`WeightSender.push_delta`'s ``pulls``).
        laid_out_sessions: full targets whose every parameter the ranks checksum as they
            wrote it (`weightsync.sender.base_checksums.LaidOutChecksums`), to check the replica's
            checksums after the push against.
    """

    new_plan: bool
    fp8_block_size: int = 0
    fences: tuple[Fence, ...] = ()
    delta_token: int | None = None
    delta_sessions: frozenset[str] = frozenset()
    delta_pulls: frozenset[str] = frozenset()
    laid_out_sessions: frozenset[str] = frozenset()


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
        delta: its delta push's stats, when it ran one.
        laid_out: per session id of ``PushOrder.laid_out_sessions``, ``{param_name:
            checksum}`` of what this rank wrote there.
    """

    rank: int
    stats: PushStats | None = None
    error: BaseException | None = None
    delta: DeltaStats | None = None
    laid_out: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


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

    Building it is collective over the ranks of `group` (every one of them, and no other
    rank, must build one at the same time): it creates the gloo group the messages travel on.

    Args:
        group: the trainer's torch.distributed process group (None: the default group, when
            torch.distributed is initialized; else one process).
        rank: this process's rank in `group`.
        world_size: the group's size.
        timeout_s: how long one collective call may wait for the other ranks.
    """

    def __init__(
        self, group: Any, *, rank: int, world_size: int, timeout_s: float = 1800.0
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._group: Any = None
        if world_size > 1:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            # Only the trainer's ranks take part; other ranks of the world need not call it.
            # A group of the whole world is named by the world's group count instead of by its
            # ranks, so that a later TrainerSync over the same ranks gets a group of its own
            # (two groups of one name share rendezvous keys, and the second never connects).
            self._group = dist.new_group(
                ranks,
                backend="gloo",
                timeout=timedelta(seconds=timeout_s),
                use_local_synchronization=len(ranks) < dist.get_world_size(),
            )

    @property
    def group(self) -> Any:
        """The gloo group the messages travel on (None for one process)."""
        return self._group

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
        self._guard(
            "broadcast", lambda: dist.broadcast_object_list(box, src=self._src(), group=self._group)
        )
        return _checked(box[0], expected)

    def scatter(self, messages: list[Any] | None, expected: type[MessageT]) -> MessageT:
        """Rank r's element of the driver's `messages` (the others pass None)."""
        if self.world_size == 1:
            assert messages is not None
            return _checked(messages[0], (expected,))
        import torch.distributed as dist

        box: list[Any] = [None]
        self._guard(
            "scatter of the plan",
            lambda: dist.scatter_object_list(
                box, messages if self.is_driver else None, src=self._src(), group=self._group
            ),
        )
        return _checked(box[0], (expected,))

    def gather(self, message: Any, expected: type[MessageT]) -> list[MessageT] | None:
        """Every rank's `message`, by rank, on the driver; None elsewhere."""
        if self.world_size == 1:
            return [_checked(message, (expected,))]
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * self.world_size if self.is_driver else None
        self._guard(
            "gather of the push outcomes",
            lambda: dist.gather_object(message, gathered, dst=self._src(), group=self._group),
        )
        if gathered is None:
            return None
        return [_checked(m, (expected,)) for m in gathered]

    def all_gather(self, message: Any, *, what: str = "all-gather of the holdings") -> list[Any]:
        """Every rank's `message`, by rank, on every rank (`what` names it in errors)."""
        if self.world_size == 1:
            return [message]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        self._guard(
            what,
            lambda: dist.all_gather_object(gathered, message, group=self._group),
        )
        return gathered

    def _guard(self, what: str, call: Callable[[], T]) -> T:
        """Run one collective call; its failure (a timeout, a peer gone) as `CollectiveError`."""
        try:
            return call()
        except RuntimeError as exc:
            raise CollectiveError(
                f"trainer rank {self.rank}: the {what} over the trainer group failed within "
                f"its {self.timeout_s:g} s timeout ({type(exc).__name__}: {str(exc)[:300]}); "
                "a trainer rank is dead, stopped or not calling sync(); every rank that took "
                "part raises this (SyncConfig.collective_timeout_s sets the timeout)"
            ) from exc

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
    "CollectiveError",
    "NoPush",
    "PushOrder",
    "RankOutcome",
    "SourcePlan",
    "SyncDone",
    "SyncFailed",
]
