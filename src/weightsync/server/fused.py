"""The fused lifecycle calls: ``begin_weight_sync`` and ``end_weight_sync``, the plain calls
in order, each with its own semantics, in one round trip.

A step that refuses stops the call (`StepRefusedError` answers with the step's own status
and message, and names the steps before it), so a fused call answers a refusal as the
refusing call would. A call may carry a budget: past it the pause stops waiting (it has
taken effect), a step that cannot be interrupted safely is let finish, and the next one is
not started (504).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from weightsync.server.http import ControlError
from weightsync.server.landing import LANDING_TIMEOUT_S
from weightsync.server.session import ReplicaSession, SessionEnd, SessionGrant

logger = logging.getLogger(__name__)

Step = tuple[str, Callable[[], Awaitable[Any]]]
"""A step of a fused call: its route, and the plain call that runs it."""


class StepRefusedError(ControlError):
    """A step of a fused lifecycle call refused: the status and message are the step's own.

    Attributes:
        route: the step's route (``/pause_generation``, ...).
        completed: the routes of the steps that ran before it, in order.
    """

    def __init__(self, cause: ControlError, *, route: str, completed: Sequence[str]) -> None:
        super().__init__(str(cause), status_code=cause.status_code)
        self.route = route
        self.completed = tuple(completed)


class StepLog:
    """Logs what a lifecycle step did: at info, or at debug inside a fused call, which
    logs one info line of all its steps and their times.

    Args:
        log: where the lines go.
    """

    def __init__(self, log: logging.Logger) -> None:
        self._logger = log
        self._fused = False

    def step(self, message: str, *args: Any) -> None:
        """Log one step's `message` (``%``-formatted with `args`)."""
        self._logger.log(logging.DEBUG if self._fused else logging.INFO, message, *args)

    async def run_fused(
        self, name: str, steps: Sequence[Step], completed: list[str], budget_s: float | None
    ) -> Any:
        """`run_steps` for the fused call `name`, logged as one line of its steps."""
        took: list[str] = []
        self._fused = True
        try:
            return await run_steps(steps, completed, budget_s, took)
        finally:
            self._fused = False
            self._logger.info("%s: %s", name, ", ".join(took) or "no step ran")


class PlainLifecycle(Protocol):
    """The plain calls a fused call runs (`ReplicaController`'s)."""

    @property
    def session(self) -> ReplicaSession | None:
        """The session not yet closed, or None."""
        ...

    @property
    def step_log(self) -> StepLog:
        """Where the steps log."""
        ...

    async def pause_generation(self, mode: str) -> str:
        """``/pause_generation``."""
        ...

    async def release_memory_occupation(self, tags: Sequence[str] | None) -> str:
        """``/release_memory_occupation``."""
        ...

    async def begin_weight_update(
        self, selector: str, *, lease_s: float | None = None, fence: bool = False
    ) -> SessionGrant:
        """``/begin_weight_update``."""
        ...

    async def update_weight_version(
        self,
        new_version: str,
        abort_all_requests: bool,
        *,
        token: str | None = None,
        with_end: bool = False,
    ) -> str:
        """``/update_weight_version``."""
        ...

    async def end_weight_update(
        self,
        *,
        token: str | None = None,
        digests: Mapping[int, Mapping[str, int]] | None = None,
        unverified: bool = False,
        after_events: Sequence[str] = (),
        landing_timeout_s: float = LANDING_TIMEOUT_S,
    ) -> SessionEnd:
        """``/end_weight_update``."""
        ...

    async def resume_memory_occupation(self, tags: Sequence[str] | None) -> str:
        """``/resume_memory_occupation``."""
        ...

    async def flush_cache(self) -> str:
        """``/flush_cache``."""
        ...

    async def continue_generation(self, torch_empty_cache: bool) -> str:
        """``/continue_generation``."""
        ...


async def begin_weight_sync(
    replica: PlainLifecycle,
    *,
    pause_mode: str | None,
    release_kv_cache: bool,
    selector: str,
    lease_s: float | None = None,
    budget_s: float | None = None,
    fence: bool = False,
) -> tuple[SessionGrant, tuple[str, ...]]:
    """`replica`'s `pause_generation` (unless `pause_mode` is None),
    `release_memory_occupation` of the KV cache (when `release_kv_cache`) and
    `begin_weight_update` (with `fence`), in that order, within `budget_s`.

    Returns:
        The session's grant and the routes of the steps that ran.

    Raises:
        StepRefusedError: a step refused (later ones did not run).
    """
    completed: list[str] = []
    steps: list[Step] = []
    if pause_mode is not None:
        steps.append(("/pause_generation", lambda: replica.pause_generation(pause_mode)))
    if release_kv_cache:
        steps.append(
            ("/release_memory_occupation", lambda: replica.release_memory_occupation(["kv_cache"]))
        )
    steps.append(
        (
            "/begin_weight_update",
            lambda: replica.begin_weight_update(selector, lease_s=lease_s, fence=fence),
        )
    )
    grant = await replica.step_log.run_fused("begin_weight_sync", steps, completed, budget_s)
    return grant, tuple(completed)


async def end_weight_sync(
    replica: PlainLifecycle,
    *,
    new_version: str | None,
    token: str | None = None,
    digests: Mapping[int, Mapping[str, int]] | None = None,
    unverified: bool = False,
    resume: bool = True,
    resume_kv_cache: bool = True,
    torch_empty_cache: bool = False,
    after_events: Sequence[str] = (),
    budget_s: float | None = None,
) -> tuple[SessionEnd, tuple[str, ...]]:
    """`replica`'s `update_weight_version` (unless `new_version` is None; the ranks take
    the label with the session's end), `end_weight_update` (with `digests` or
    `unverified`, after waiting for `after_events`, within the budget), then, with
    `resume`, `resume_memory_occupation` of the KV cache (when `resume_kv_cache`),
    `flush_cache` and `continue_generation`, in that order, within `budget_s`.

    Returns:
        The last step's message with what `end_weight_update` reported, and the routes of
        the steps that ran.

    Raises:
        StepRefusedError: a step refused (later ones did not run).
    """
    completed: list[str] = []
    steps: list[Step] = []
    session = replica.session
    if new_version is not None:
        steps.append(
            (
                "/update_weight_version",
                lambda: replica.update_weight_version(
                    new_version, False, token=token, with_end=True
                ),
            )
        )
    landing_timeout_s = budget_s if budget_s is not None else LANDING_TIMEOUT_S
    ended: list[SessionEnd] = []

    async def end() -> str:
        ended.append(
            await replica.end_weight_update(
                token=token,
                digests=digests,
                unverified=unverified,
                after_events=after_events,
                landing_timeout_s=landing_timeout_s,
            )
        )
        return ended[0].message

    steps.append(("/end_weight_update", end))
    if resume:
        if resume_kv_cache:
            steps.append(
                (
                    "/resume_memory_occupation",
                    lambda: replica.resume_memory_occupation(["kv_cache"]),
                )
            )
        steps.append(("/flush_cache", replica.flush_cache))
        steps.append(
            ("/continue_generation", lambda: replica.continue_generation(torch_empty_cache))
        )
    try:
        message = await replica.step_log.run_fused("end_weight_sync", steps, completed, budget_s)
    finally:
        if session is not None:
            # The end refused before it reached the ranks: they take the label alone, as
            # after a separate update_weight_version; the step's own answer stands.
            await session.send_label()
    return SessionEnd(message=message, changed_outside=ended[0].changed_outside), tuple(completed)


async def run_steps(
    steps: Sequence[Step], completed: list[str], budget_s: float | None, took: list[str]
) -> Any:
    """Run `steps` in order, appending each finished one's route to `completed` (and its
    route and time to `took`); the last step's value.

    Raises:
        StepRefusedError: a step refused, or (504) the call ran past `budget_s`: the pause,
            which waits on generation, is cut short; a step that cannot be interrupted
            safely is let finish, and the next one not started.
    """
    deadline = None if budget_s is None else time.monotonic() + budget_s
    value: Any = None
    for index, (route, step) in enumerate(steps):
        started = time.perf_counter()
        if deadline is not None and index and time.monotonic() > deadline:
            late = ControlError(
                f"the call ran past budget_s={budget_s:g} before {route}; it and the steps "
                "after it were not run",
                status_code=504,
            )
            raise StepRefusedError(late, route=route, completed=completed)
        try:
            if route == "/pause_generation" and deadline is not None:
                # A deadline on the running task, not a task of its own: no loop turn.
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    value = await step()
            else:
                value = await step()
        except TimeoutError:
            late = ControlError(
                f"{route} did not finish within budget_s={budget_s:g} (it has taken effect); "
                "the steps after it were not run",
                status_code=504,
            )
            raise StepRefusedError(late, route=route, completed=completed) from None
        except ControlError as exc:
            raise StepRefusedError(exc, route=route, completed=completed) from exc
        completed.append(route)
        took.append(f"{route} {(time.perf_counter() - started) * 1e3:.2f} ms")
    return value
