"""`EngineCalls`: rank 0's event loop running commands on every rank, failures as HTTP answers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from weightsync.server.http import ControlError
from weightsync.server.ranks.commands import (
    CONFLICT,
    INTERNAL,
    INVALID,
    OUT_OF_MEMORY,
    REFUSED,
    Command,
)
from weightsync.server.ranks.driver import EngineDriver, EngineStoppedError

logger = logging.getLogger(__name__)

# 507 Insufficient Storage: a rank ran out of memory; unlike a 500, its reply carries the
# sizes (`weightsync.server.ranks.memory`).
_STATUS_OF_KIND = {REFUSED: 503, CONFLICT: 400, INVALID: 400, INTERNAL: 500, OUT_OF_MEMORY: 507}


class RunOnRanks(Protocol):
    """Runs a command on every rank (`EngineCalls.run`)."""

    async def __call__(self, command: Command, *, inline: bool = False) -> list[Any]:
        """Each rank's value for `command`, by tp rank; raises `ControlError` on a failure."""
        ...


class EngineCalls:
    """The controller's side of an `EngineDriver`: one awaitable call per command.

    Args:
        driver: rank 0's engine thread, started and ready.
    """

    def __init__(self, driver: EngineDriver) -> None:
        self._driver = driver

    @property
    def stopped(self) -> bool:
        """Whether the engine thread has stopped."""
        return self._driver.stopped

    @property
    def current_command(self) -> str | None:
        """The name of the command running now, or ``None`` when idle."""
        return self._driver.current_command

    async def run(self, command: Command, *, inline: bool = False) -> list[Any]:
        """Run `command` on every rank; return each rank's value, or raise the failure.
        `inline`: a short command, which the driver may run in this thread (see
        `EngineDriver.submit`).

        Raises:
            ControlError: 503 when the engine is not running; a rank's refusal (503),
                conflict or bad input (400), failure (500) or lack of memory (507).
        """
        try:
            future = self._driver.submit(command, inline=inline)
            replies = future.result() if future.done() else await asyncio.wrap_future(future)
        except EngineStoppedError as exc:
            logger.error("the engine is not running: %s", exc)
            raise ControlError(
                "the engine is not running (a rank stopped); see the server log", status_code=503
            ) from exc
        failed = [r for r in replies if not r.ok]
        if not failed:
            return [r.value for r in replies]
        if len({r.error for r in failed}) == 1 and len(failed) == len(replies):
            message = failed[0].error or ""
        else:
            message = "; ".join(f"tp rank {r.tp_rank}: {r.error}" for r in failed)
        kinds = [r.error_kind for r in failed]
        kind = OUT_OF_MEMORY if OUT_OF_MEMORY in kinds else kinds[0]
        raise ControlError(message, status_code=_STATUS_OF_KIND.get(kind, 500))
