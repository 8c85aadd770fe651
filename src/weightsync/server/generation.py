"""`Generation`: a reference replica's generation requests, and pausing them.

While paused (``pause_generation`` .. ``continue_generation``) no request starts: ``abort``
mode aborts the queued ones, ``retract`` and ``in_place`` hold them. Whatever else blocks
generation (a weight-update session, incomplete weights, released memory) the controller
says through `blocked`, which the queue re-reads after every `notify`.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from weightsync.control.models import GenerateRequest, GenerateResponse
from weightsync.server.fused import StepLog
from weightsync.server.limits import GenerationBounds
from weightsync.server.ranks.commands import Generate
from weightsync.server.scheduler import GenerationQueue

logger = logging.getLogger(__name__)


class Generation:
    """The queue of generation requests in front of the engine, and its pause.

    Args:
        run: runs one `Generate` on every rank and returns rank 0's value.
        bounds: how long a generation request may be.
        blocked: why no request may start now, or ``None`` (see `GenerationQueue`).
        weight_version: the replica's current weight version.
        step_log: where pause and continue log.
    """

    def __init__(
        self,
        *,
        run: Callable[[Generate], Awaitable[dict[str, Any]]],
        bounds: GenerationBounds,
        blocked: Callable[[], str | None],
        weight_version: Callable[[], str],
        step_log: StepLog,
    ) -> None:
        self.paused_mode: str | None = None
        """The mode of the pause in force, or None when not paused."""
        self._bounds = bounds
        self._log = step_log
        self.queue = GenerationQueue(run=run, blocked=blocked, weight_version=weight_version)

    @property
    def num_busy(self) -> int:
        """Requests in flight: queued or running."""
        return self.queue.num_queued + self.queue.num_running

    async def submit(self, request: GenerateRequest) -> GenerateResponse:
        """Queue `request` (the caller checked that generation may run) and return its
        tokens.

        Raises:
            ControlError: 400 for more tokens than the bounds allow; what the run raised.
        """
        params = request.sampling_params
        self._bounds.check(
            num_prompt_tokens=len(request.input_ids), max_new_tokens=params.max_new_tokens
        )
        seed = params.sampling_seed
        if seed is None and params.temperature > 0:
            # Every rank must sample with the same seed; rank 0 draws it for all.
            seed = secrets.randbits(63)
        command = Generate(
            input_ids=tuple(request.input_ids),
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            seed=seed,
        )
        return await self.queue.submit(command, rid=request.rid or uuid.uuid4().hex)

    async def pause(self, mode: str) -> str:
        """Stop starting requests; ``abort`` also aborts the queued ones. Returns the
        reply's message once none runs."""
        self.paused_mode = mode
        aborted = 0
        if mode == "abort":
            aborted = await self.queue.abort(lambda _: True, "aborted by pause_generation")
        waited = await self.queue.wait_idle()
        self._log.step("generation paused (mode=%s): %d queued request(s) aborted", mode, aborted)
        message = f"Generation paused (mode={mode}): {aborted} queued request(s) aborted"
        if self.queue.num_queued:
            message += f", {self.queue.num_queued} held until continue_generation"
        if waited:
            message += "; the running request finished first"
        return message

    async def resume(self) -> None:
        """End the pause: the held requests start as nothing else blocks them."""
        self.paused_mode = None
        await self.queue.notify()
        self._log.step("generation continued")

    async def abort(self, rid: str, abort_all: bool) -> str:
        """Abort queued request `rid`, or every queued request; the reply's message."""
        aborted = await self.queue.abort(
            lambda queued: abort_all or queued == rid, "aborted by abort_request"
        )
        logger.info("abort_request(rid=%r, abort_all=%s): %d aborted", rid, abort_all, aborted)
        message = f"{aborted} queued request(s) aborted"
        running = self.queue.running_rid
        if running is not None and (abort_all or running == rid):
            message += "; the running request finishes (generation is not interruptible)"
        return message

    def refusal(self) -> str | None:
        """Why generation may not run for the pause, or None."""
        if self.paused_mode is not None:
            return "generation is paused (pause_generation); call continue_generation"
        return None
