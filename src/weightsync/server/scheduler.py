"""`GenerationQueue`: generation requests waiting for the engine, handed over one at a time.

The engine runs one generation at a time (in rank 0's engine thread, on every rank). The
requests behind it wait here, on rank 0's event loop, so that pausing, aborting and
weight-update sessions act on requests that have not started. The one request that runs
finishes its tokens: generation is not interruptible between tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from weightsync.control.models import FinishReason, GenerateMetaInfo, GenerateResponse
from weightsync.server.http import ControlError
from weightsync.server.ranks.commands import Generate

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class _Ticket:
    rid: str
    command: Generate
    future: asyncio.Future[GenerateResponse]


class GenerationQueue:
    """A FIFO of generation requests in front of the engine.

    Args:
        run: runs one `Generate` on every rank and returns rank 0's value
            (``{"output_ids", "weight_version"}``); raises `ControlError` on failure.
        blocked: why no request may start now (paused, weight-update session, memory
            released), or ``None``; the queue re-reads it after every `notify`.
        weight_version: the replica's current weight version (reported in aborted replies).
    """

    def __init__(
        self,
        *,
        run: Callable[[Generate], Awaitable[dict[str, Any]]],
        blocked: Callable[[], str | None],
        weight_version: Callable[[], str],
    ) -> None:
        self._run = run
        self._blocked = blocked
        self._weight_version = weight_version
        self._cond = asyncio.Condition()
        self._queue: deque[_Ticket] = deque()
        self._running: _Ticket | None = None
        self._worker: asyncio.Task[None] | None = None

    @property
    def num_queued(self) -> int:
        """Requests waiting to start."""
        return len(self._queue)

    @property
    def num_running(self) -> int:
        """Requests the engine runs now (0 or 1)."""
        return int(self._running is not None)

    @property
    def running_rid(self) -> str | None:
        """The id of the request the engine runs now."""
        return self._running.rid if self._running is not None else None

    def start(self) -> None:
        """Start handing requests to the engine (on the running event loop)."""
        self._worker = asyncio.create_task(self._loop(), name="generation-queue")

    async def stop(self, reason: str) -> None:
        """Abort every waiting request and stop handing requests over."""
        await self.abort(lambda _: True, reason)
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def submit(self, command: Generate, *, rid: str) -> GenerateResponse:
        """Queue `command` and return its reply once it ran or was aborted.

        Raises:
            ControlError: the engine refused or failed the request.
        """
        ticket = _Ticket(
            rid=rid, command=command, future=asyncio.get_running_loop().create_future()
        )
        async with self._cond:
            self._queue.append(ticket)
            self._cond.notify_all()
        return await ticket.future

    async def abort(self, match: Callable[[str], bool], reason: str) -> int:
        """Answer every waiting request whose rid matches with an empty ``abort`` reply;
        return how many there were."""
        async with self._cond:
            kept: deque[_Ticket] = deque()
            aborted = 0
            for ticket in self._queue:
                if not match(ticket.rid):
                    kept.append(ticket)
                elif not ticket.future.done():
                    aborted += 1
                    ticket.future.set_result(self._aborted(ticket, reason))
            self._queue = kept
        return aborted

    async def wait_idle(self) -> bool:
        """Return once no request runs; whether one was running."""
        async with self._cond:
            waited = self._running is not None
            await self._cond.wait_for(lambda: self._running is None)
        return waited

    async def notify(self) -> None:
        """Re-read `blocked` (call after changing what it reads)."""
        async with self._cond:
            self._cond.notify_all()

    async def _loop(self) -> None:
        while True:
            async with self._cond:
                await self._cond.wait_for(lambda: bool(self._queue) and self._blocked() is None)
                ticket = self._queue.popleft()
                if ticket.future.done():  # its client went away
                    continue
                self._running = ticket
            try:
                value = await self._run(ticket.command)
                reply = GenerateResponse(
                    output_ids=value["output_ids"],
                    meta_info=GenerateMetaInfo(
                        weight_version=value["weight_version"],
                        prompt_tokens=len(ticket.command.input_ids),
                        completion_tokens=len(value["output_ids"]),
                        finish_reason=FinishReason(type="length"),
                    ),
                )
                if not ticket.future.done():
                    ticket.future.set_result(reply)
            except ControlError as exc:
                if not ticket.future.done():
                    ticket.future.set_exception(exc)
            except Exception as exc:
                # Never let one request end the loop: every later request would hang.
                logger.exception("generation request %s failed", ticket.rid)
                if not ticket.future.done():
                    ticket.future.set_exception(
                        ControlError(f"generation failed: {exc}", status_code=500)
                    )
            finally:
                async with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _aborted(self, ticket: _Ticket, reason: str) -> GenerateResponse:
        return GenerateResponse(
            output_ids=[],
            meta_info=GenerateMetaInfo(
                weight_version=self._weight_version(),
                prompt_tokens=len(ticket.command.input_ids),
                finish_reason=FinishReason(type="abort", message=reason),
            ),
        )
