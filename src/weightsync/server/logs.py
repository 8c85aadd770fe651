"""Logging of `weightsync serve`: one line per event, tagged with the TP rank."""

from __future__ import annotations

import asyncio
import logging
import sys


def configure_logging(level: str, *, tp_rank: int, after_replies: bool = False) -> None:
    """Send every log record of this process to stderr as
    ``<time> <LEVEL> weightsync.serve tp<rank> <logger>: <message>``.

    With `after_replies` a record logged on a running event loop is written once the loop
    has finished what it was doing (`LineAfterTurn`): the access log and the line of a
    lifecycle call go out after its reply, not before.
    """
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s weightsync.serve tp{tp_rank} %(name)s: %(message)s"
        )
    )
    if after_replies:
        handler = LineAfterTurn(handler)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The HTTP client logs every request at INFO (each rank's publish); keep its warnings.
    logging.getLogger("aiohttp").setLevel(logging.WARNING)


class LineAfterTurn(logging.Handler):
    """Hands a record logged on a running event loop to `target` at the end of the loop's
    turn (`call_soon`); other records at once, after any still waiting.

    A server answers a request in one turn of its loop, and uvicorn logs the access line
    before it writes the reply: formatted and written there, the line (a few tens of
    microseconds, a write to the log) is part of every reply's latency. Deferred in the
    same thread, it keeps its order among the loop's lines and takes no lock a thread of
    its own would contend for. The message is merged with its arguments at once. `flush`
    (which `logging.shutdown` runs at exit) writes what a loop that stopped left waiting.

    Args:
        target: the handler that formats and writes.
    """

    def __init__(self, target: logging.Handler) -> None:
        super().__init__()
        self.target = target
        self._waiting: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Write `record` through `target`, at the end of this turn of a running loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()  # what a loop logged before comes first
            self.target.handle(record)
            return
        try:
            record.msg, record.args = record.getMessage(), None
        except Exception:
            self.handleError(record)
            return
        if not self._waiting:
            loop.call_soon(self.flush)
        self._waiting.append(record)

    def flush(self) -> None:
        """Write the records waiting for their turn to end, then flush `target`."""
        with self.lock:  # type: ignore[union-attr]  # Handler.createLock made it
            waiting, self._waiting = self._waiting, []
            for record in waiting:
                self.target.handle(record)
        self.target.flush()

    def close(self) -> None:
        """Write what is waiting and close `target`."""
        self.flush()
        self.target.close()
        super().close()
