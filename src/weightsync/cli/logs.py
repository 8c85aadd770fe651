"""How the commands log: the ``weightsync`` logger to stderr, native libraries kept quiet.

The library logs through ``logging.getLogger("weightsync...")`` and configures nothing; the
commands call `configure_logging` once per process. By default only warnings and errors of
weightsync reach the terminal, and Mooncake is told to log errors only (``MC_LOG_LEVEL``,
read by its engine in this process and in the processes a command starts); what Mooncake
prints (while an engine starts, and after: a failed write's error lines) is logged at DEBUG
on ``weightsync.transport.mooncake.native`` instead of reaching stderr (see
`weightsync.transport.mooncake.native_log`). ``--verbose`` shows all of it: weightsync at
DEBUG and Mooncake at INFO.
"""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "weightsync"


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever ``sys.stderr`` is when a record comes, so that a
    command run in-process (under a test runner that swaps stderr) never writes to a stream
    that has since been closed."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        """The current ``sys.stderr``."""
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(*, verbose: bool, prefix: str = "", quiet_warnings: bool = False) -> None:
    """Send the ``weightsync`` logger's records to stderr as ``weightsync: <level>: <msg>``.

    Args:
        verbose: DEBUG for weightsync and INFO for Mooncake; otherwise WARNING and ERROR.
        prefix: put before every line (``"trainer rank 1 "``), to tell processes apart.
        quiet_warnings: show errors only unless verbose (for the second and later of a
            group of processes that would each log the same warnings).
    """
    native_level = "INFO" if verbose else "ERROR"
    if verbose:
        os.environ["MC_LOG_LEVEL"] = native_level
    else:
        os.environ.setdefault("MC_LOG_LEVEL", native_level)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(f"{prefix}%(name)s: %(levelname)s: %(message)s"))
    logger = logging.getLogger(_ROOT)
    logger.handlers[:] = [handler]
    logger.propagate = False
    if verbose:
        logger.setLevel(logging.DEBUG)
    else:
        logger.setLevel(logging.ERROR if quiet_warnings else logging.WARNING)
