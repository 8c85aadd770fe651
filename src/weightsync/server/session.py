"""`ReplicaSession`: one weight-update session of a replica, from begin to end.

A session is opened by ``begin_weight_update`` and closed by ``end_weight_update``, or by the
replica itself when its lease expires. It owns its state (`ReplicaSessionState`), its lease
(timer and deadline), its fencing token, the label to send with its end, and, once closed,
its verdict. While it is not closed the replica refuses to generate, so no token comes
from half-written weights.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from weightsync.cuda_events import IpcEvents
from weightsync.receiver.agent import SessionCheck
from weightsync.receiver.delta import DeltaResult
from weightsync.server.delta import delta_problem
from weightsync.server.engine_calls import RunOnRanks
from weightsync.server.http import ControlError
from weightsync.server.integrity import WeightIntegrity, by_rank
from weightsync.server.landing import LANDING_TIMEOUT_S, NotLandedError, await_landing
from weightsync.server.ranks.commands import (
    ApplyDelta,
    BeginUpdate,
    EndUpdate,
    SetWeightVersion,
)

logger = logging.getLogger(__name__)

MAX_LEASE_S = 3600.0


class ReplicaSessionState(enum.Enum):
    """Where a replica's weight-update session stands: ``opening`` (the ranks begin it),
    ``open``, ``closing`` (the ranks end it), ``closed``."""

    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionGrant:
    """What `ReplicaController.begin_weight_update` grants.

    Attributes:
        message: the reply's message.
        token: the session token its holder sends with the session's calls (leased only).
        lease_s: the lease, in seconds (leased only).
        changed_outside: ``"tp rank r: name"`` of the parameters whose bytes changed since
            the last session ended (written from outside any session); a fenced begin's are
            known at the end (`SessionEnd`).
        fences: a fenced begin's IPC handles (hex) of the CUDA events each tp rank's begin
            digest completes at, by tp rank: writes into a rank must follow its event.
        weight_version: the label of the weights the replica holds as the session begins.
        instance: the replica process's identity (`ReplicaController.instance`).
        highest_version: the largest numeric label (`weightsync.control.labels`) this
            process has held, or None.
    """

    message: str
    token: str | None = None
    lease_s: float | None = None
    changed_outside: tuple[str, ...] = ()
    fences: tuple[str, ...] = ()
    weight_version: str | None = None
    instance: str | None = None
    highest_version: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionEnd:
    """What `ReplicaController.end_weight_update` reports.

    Attributes:
        message: the reply's message.
        changed_outside: after a fenced begin, ``"tp rank r: name"`` of the parameters whose
            bytes had changed outside any session before it (the begin could not say).
    """

    message: str
    changed_outside: tuple[str, ...] = ()


def check_lease(lease_s: float | None) -> None:
    """Refuse a lease out of ``(0, MAX_LEASE_S]``.

    Raises:
        ControlError: 400 for a lease out of range.
    """
    if lease_s is not None and not (0 < lease_s <= MAX_LEASE_S):
        raise ControlError(
            f"lease_s must be in (0, {MAX_LEASE_S:g}] seconds, got {lease_s!r}", status_code=400
        )


class ReplicaSession:
    """One weight-update session: `begin` on every rank, then `close` (by its holder's end,
    or by the replica when the lease expires); each at most once.

    Args:
        selector: the weights it updates.
        lease_s: the lease, in seconds, or None for a session without one (and no token).
        run: runs a command on every rank.
        integrity: the replica's verdict on its weights, which the session's checks decide.
        events: opens the CUDA events an end may wait for (a replica on a GPU), or None.
        num_ranks: the replica's tp size.
        on_closed: awaited once the session is closed (or its begin failed), before its
            verdict is taken.
    """

    def __init__(
        self,
        *,
        selector: str,
        lease_s: float | None,
        run: RunOnRanks,
        integrity: WeightIntegrity,
        events: IpcEvents | None,
        num_ranks: int,
        on_closed: Callable[[ReplicaSession], Awaitable[None]],
    ) -> None:
        self.selector = selector
        self.lease_s = lease_s
        self.state = ReplicaSessionState.OPENING
        self.token: str | None = None
        """What its holder's calls carry (a leased session's), from `begin`."""
        self.deadline: float | None = None
        """``time.monotonic()`` when the lease expires."""
        self.versioned = False
        """Its holder labelled the weights inside it."""
        self.label: str | None = None
        """A label the ranks take with the session's end (one round trip), not yet sent."""
        self.verdict: str | None = None
        """Once closed: why the update it carried is not complete, or None."""
        self._run = run
        self._integrity = integrity
        self._events = events
        self._num_ranks = num_ranks
        self._on_closed = on_closed
        self._timer: asyncio.TimerHandle | None = None

    async def begin(self, *, fence: bool) -> list[SessionCheck]:
        """Open the session on every rank (`fence`: see `RolloutAgent.begin_update`) and
        start its lease; each rank's check, by tp rank.

        Raises:
            ControlError: a rank refused or failed (the session is then closed).
        """
        try:
            checks = await self._run(BeginUpdate(selector=self.selector, fence=fence), inline=True)
        except BaseException:
            self.state = ReplicaSessionState.CLOSED
            await self._on_closed(self)
            raise
        self._integrity.digest_s = max(c.seconds for c in checks)
        self._integrity.found_changed_outside(by_rank(checks, "changed"))
        self.token = secrets.token_urlsafe(24) if self.lease_s is not None else None
        self.state = ReplicaSessionState.OPEN
        if self.lease_s is not None:
            self._arm(self.lease_s)
        return checks

    def check_holder(self, token: str | None, route: str) -> None:
        """Refuse `route` unless the session is open and `token` may act on it.

        Raises:
            ControlError: 400 when it is not open, or for another holder's token.
        """
        if self.state is not ReplicaSessionState.OPEN:
            raise ControlError(
                f"{route}: no weight-update session is open (session {self.state.value})",
                status_code=400,
            )
        if self.token is not None and (
            token is None or not secrets.compare_digest(token.encode(), self.token.encode())
        ):
            raise ControlError(
                f"{route} refused: the open weight-update session is held by another client "
                "(its calls carry the session_token begin_weight_update returned); wait for "
                "it to end or for its lease to expire",
                status_code=400,
            )

    async def apply_delta(self, command: ApplyDelta) -> tuple[str | None, list[DeltaResult]]:
        """Apply the trainers' delta payloads on every rank, inside this session (`command`,
        checked against the ranks' regions by `weightsync.server.delta.delta_command`).
        A delta that does not verify on some rank leaves the weights incomplete until a
        complete update lands; the ranks remember it, so the session's end cannot verify.

        Returns:
            The problem (None when every rank verified) and each rank's result, by tp rank.

        Raises:
            ControlError: a rank refused or failed: the weights are then incomplete (the
                other ranks may have applied theirs).
        """
        try:
            results = await self._run(command)
        except ControlError as exc:
            self._integrity.mark_incomplete(
                f"apply_delta failed on a rank ({exc}); the other ranks may have applied theirs"
            )
            raise
        problem = delta_problem(results)
        if problem is not None:
            self._integrity.mark_incomplete(problem)
        return problem, results

    def renew(self, lease_s: float) -> None:
        """Extend the lease by `lease_s` from now.

        Raises:
            ControlError: 400 when the session has no lease.
        """
        if self.token is None:
            raise ControlError(
                "the open weight-update session has no lease (it was begun without lease_s)",
                status_code=400,
            )
        self._arm(lease_s)

    def expires_in_s(self) -> float | None:
        """Seconds until the lease expires (0 once past), or None without a lease."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    async def close(
        self,
        expected: tuple[dict[str, int] | None, ...],
        *,
        reason: str,
        unverified: bool = False,
        abandoned: str | None = None,
        after_events: Sequence[str] = (),
        landing_timeout_s: float = LANDING_TIMEOUT_S,
    ) -> tuple[str | None, tuple[str, ...]]:
        """Close the session on every rank and decide what the weights now are
        (`WeightIntegrity.judge_end`; `expected`: per tp rank the trainers' digests, `reason`
        the closing call, `unverified` and `abandoned` as ``end_weight_update`` takes them). With
        `after_events` (the IPC handles of the trainers' events), the ranks end it once the
        events are reached, waiting up to `landing_timeout_s`.

        Returns:
            The problem found (None when the update is complete or nothing changed) and,
            after a fenced begin, the parameters it found changed outside a session.

        Raises:
            ControlError: the ranks failed, or the events were not reached: the weights
                are then incomplete.
        """
        if self._timer is not None:
            self._timer.cancel()
        self.state = ReplicaSessionState.CLOSING
        label, self.label = self.label, None
        end = EndUpdate(version=label, expected=expected, gated=self._num_ranks == 1)
        try:
            if after_events:
                await self._prepare_end(end, after_events, landing_timeout_s)
            checks = await self._run(end, inline=True)
        except NotLandedError as exc:
            why = f"{exc}; nothing was verified, and bytes may still be on their way"
            self._integrity.mark_incomplete(why)
            # The ranks end their sessions unverified.
            await self._run(EndUpdate(version=label), inline=True)
            raise ControlError(
                f"{why}: the session is closed and the weights are incomplete until a "
                "complete update",
                status_code=exc.status_code,
            ) from None
        except BaseException:
            self._integrity.mark_incomplete(f"end of the weight-update session failed ({reason})")
            raise
        finally:
            self.state = ReplicaSessionState.CLOSED
            await self._on_closed(self)
        self._integrity.digest_s += max(c.seconds for c in checks)
        problem, outside = self._integrity.judge_end(
            checks,
            reason=reason,
            verifying=bool(expected),
            versioned=self.versioned,
            leased=self.token is not None,
            unverified=unverified,
            abandoned=abandoned,
        )
        self.verdict = problem
        return problem, outside

    async def send_label(self) -> None:
        """Label the ranks with the label meant for the session's end, if the end did not
        take it (it refused before it reached the ranks); a failure to label them is
        logged."""
        label, self.label = self.label, None
        if label is None:
            return
        try:
            await self._run(SetWeightVersion(version=label), inline=True)
        except ControlError as exc:
            logger.warning("labelling the ranks %s failed: %s", label, exc)

    async def _prepare_end(
        self, end: EndUpdate, after_events: Sequence[str], timeout_s: float
    ) -> None:
        """While the copies land: each rank reads a fenced begin's digest (done long ago)
        and puts the trainers' digests in its order and, at tp 1 (where rank 0's reply,
        the gate, stays in this process), queues the end's digest behind a gate opened the
        moment they land.

        Raises:
            NotLandedError: the events cannot be waited for, or were not reached in time.
        """
        prepared = await self._run(
            EndUpdate(expected=end.expected, gated=end.gated, landed=False), inline=True
        )
        gates = [g for g in prepared if g is not None]
        try:
            await await_landing(self._events, after_events, timeout_s)
        finally:
            for gate in gates:
                gate.open()

    def _arm(self, lease_s: float) -> None:
        """(Re)start the lease timer."""
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self.deadline = time.monotonic() + lease_s
        self._timer = loop.call_later(lease_s, lambda: loop.create_task(self._expire()))

    async def _expire(self) -> None:
        if self.state is not ReplicaSessionState.OPEN:
            return
        logger.error(
            "the lease of the weight-update session expired (%g s without a renewal: its "
            "holder is gone or stuck); closing it",
            self.lease_s,
        )
        # Its holder is gone or stuck, and writes it started may land after this end: the
        # weights are incomplete whatever the ranks see now.
        expired = f"its lease expired after {self.lease_s:g} s"
        await self.close((), reason=expired, abandoned=f"{expired} without a renewal")
