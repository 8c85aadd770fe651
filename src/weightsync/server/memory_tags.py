"""`ReleasedMemory`: the memory-saver tags a reference replica has released.

Tags are SGLang's (``kv_cache``, ``cuda_graph``, ``weights``). Parameter memory is registered
with the transfer engine and must never move, so ``weights`` cannot be released here; the
others are only recorded (the reference engine keeps no KV cache between requests), and
generation is refused while any is released.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.server.fused import StepLog
from weightsync.server.http import ControlError

RELEASABLE_TAGS = frozenset({"kv_cache", "cuda_graph"})
KNOWN_TAGS = RELEASABLE_TAGS | {"weights"}


class ReleasedMemory:
    """Which tags are released now.

    Args:
        step_log: where releasing and resuming log.
    """

    def __init__(self, step_log: StepLog) -> None:
        self._released: set[str] = set()
        self._log = step_log

    @property
    def tags(self) -> list[str]:
        """The released tags, sorted."""
        return sorted(self._released)

    def refusal(self) -> str | None:
        """Why generation may not run for released memory, or None."""
        if self._released:
            return f"memory {self.tags} is released; call resume_memory_occupation"
        return None

    def release(self, tags: Sequence[str] | None, *, num_busy: int, paused: bool) -> str:
        """Release `tags` (None: every releasable one); the reply's message.

        Args:
            tags: the tags to release.
            num_busy: the requests in flight (queued or running).
            paused: generation is paused.

        Raises:
            ControlError: 400 for the ``weights`` tag (parameters never move), unknown tags,
                and requests in flight while generation is not paused.
        """
        wanted = _tags(tags, default=RELEASABLE_TAGS)
        if "weights" in wanted:
            raise ControlError(
                "releasing 'weights' is not supported: parameter memory is registered with "
                "the transfer engine and never moves (no memory saver / weight offload); "
                "release ['kv_cache'] instead",
                status_code=400,
            )
        if not paused and num_busy:
            raise ControlError(
                f"release_memory_occupation refused: the server is not idle ({num_busy} "
                "request(s) in flight); call pause_generation first",
                status_code=400,
            )
        self._released |= wanted
        self._log.step("released memory %s; generation refused until resumed", sorted(wanted))
        return (
            f"Released {sorted(wanted)}; the reference engine keeps no KV cache between "
            "requests and its parameters stay registered in place"
        )

    def resume(self, tags: Sequence[str] | None) -> str:
        """Take back `tags` (None: every known one); the reply's message.

        Raises:
            ControlError: 400 for unknown tags.
        """
        wanted = _tags(tags, default=KNOWN_TAGS)
        self._released -= wanted
        self._log.step("resumed memory %s", sorted(wanted))
        return f"Resumed {sorted(wanted)}"


def _tags(tags: Sequence[str] | None, *, default: frozenset[str]) -> set[str]:
    wanted = set(default if tags is None else tags)
    unknown = wanted - KNOWN_TAGS
    if unknown:
        raise ControlError(
            f"unknown memory tags {sorted(unknown)}; known: {sorted(KNOWN_TAGS)}",
            status_code=400,
        )
    return wanted
