"""`weightsync.server.logs.LineAfterTurn`: a line logged on a running event loop is written
after the loop's turn (after the reply that turn writes), in order, with the message as it
was when logged; elsewhere at once."""

from __future__ import annotations

import asyncio
import logging

from weightsync.server.logs import LineAfterTurn


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logger(target: logging.Handler) -> logging.Logger:
    logger = logging.getLogger("test_server_logs")
    logger.handlers[:] = [LineAfterTurn(target)]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def test_lines_of_a_turn_are_written_after_it_in_order() -> None:
    lines = _Lines()
    logger = _logger(lines)
    events: list[str] = []

    async def turn() -> None:
        steps = ["a"]
        logger.info("steps: %s", steps)
        steps.append("b")  # changed after the call: the line keeps what it said
        logger.info("second")
        events.append(f"in the turn, {len(lines.lines)} written")

    async def main() -> None:
        await turn()
        await asyncio.sleep(0)
        events.append(f"after the turn, {len(lines.lines)} written")

    asyncio.run(main())
    assert events == ["in the turn, 0 written", "after the turn, 2 written"]
    assert lines.lines == ["steps: ['a']", "second"]


def test_a_line_outside_a_running_loop_is_written_at_once() -> None:
    lines = _Lines()
    logger = _logger(lines)
    logger.info("now %d", 1)
    assert lines.lines == ["now 1"]


def _log_in_a_loops_last_turn(logger: logging.Logger) -> None:
    loop = asyncio.new_event_loop()

    def last_turn() -> None:
        logger.info("left waiting")
        loop.stop()  # the loop ends with this turn: the hand-over never runs there

    try:
        loop.call_soon(last_turn)
        loop.run_forever()
    finally:
        loop.close()


def test_lines_a_stopped_loop_left_are_written_first_and_at_flush() -> None:
    lines = _Lines()
    logger = _logger(lines)
    _log_in_a_loops_last_turn(logger)
    assert lines.lines == []
    logger.info("from plain code")  # writes what waits first, then itself
    assert lines.lines == ["left waiting", "from plain code"]

    _log_in_a_loops_last_turn(logger)
    logger.handlers[0].flush()  # as logging.shutdown does at exit
    assert lines.lines == ["left waiting", "from plain code", "left waiting"]


def test_a_message_that_does_not_format_is_reported_not_raised(capsys) -> None:
    lines = _Lines()
    logger = _logger(lines)

    async def main() -> None:
        logger.info("%d", "not a number")
        await asyncio.sleep(0)

    asyncio.run(main())
    assert lines.lines == []
    assert "not a number" in capsys.readouterr().err  # logging's own report of a bad record
