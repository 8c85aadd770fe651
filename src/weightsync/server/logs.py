"""Logging of `weightsync serve`: one line per event, tagged with the TP rank."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str, *, tp_rank: int) -> None:
    """Send every log record of this process to stderr as
    ``<time> <LEVEL> weightsync.serve tp<rank> <logger>: <message>``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s weightsync.serve tp{tp_rank} %(name)s: %(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The HTTP client logs every request at INFO (each rank's publish); keep its warnings.
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
