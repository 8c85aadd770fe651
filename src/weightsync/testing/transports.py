"""A transport that fails on demand, for tests of writes failing mid-push."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync.errors import TransferError
from weightsync.transport.base import HOST_ONLY, Transport, TransportCapabilities, WriteCost


class FailsAfter:
    """Wraps a transport; once `remaining` writes went out, every further write raises
    `TransferError`, as a dead NIC or a killed peer would make it fail.

    It writes from host memory only, whatever the wrapped transport offers: every write then
    passes through its `write`, where a failure is injected.

    Args:
        inner: the transport that does the real writes.
        message: the error's text.

    Attributes:
        remaining: writes still allowed; None (the start) lets every write through.
    """

    def __init__(self, inner: Transport, *, message: str = "injected failure") -> None:
        self.inner = inner
        self.message = message
        self.remaining: int | None = None

    @property
    def session_id(self) -> str:
        """The wrapped transport's session id."""
        return self.inner.session_id

    @property
    def write_cost(self) -> WriteCost:
        """The wrapped transport's cost of a write."""
        return self.inner.write_cost

    @property
    def capabilities(self) -> TransportCapabilities:
        """Host memory only (see the class docstring)."""
        return HOST_ONLY

    def register(self, addr: int, num_bytes: int) -> None:
        """Register with the wrapped transport."""
        self.inner.register(addr, num_bytes)

    def unregister(self, addr: int) -> None:
        """Unregister with the wrapped transport."""
        self.inner.unregister(addr)

    def write(
        self,
        target_session: str,
        src_addrs: Sequence[int],
        dst_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> Any:
        """Write through the wrapped transport, or raise once `remaining` reached 0."""
        if self.remaining is not None:
            if self.remaining <= 0:
                raise TransferError(self.message, target_session=target_session, return_code=-1)
            self.remaining -= 1
        return self.inner.write(target_session, src_addrs, dst_addrs, lengths)

    def wait(self, handle: Any, timeout_s: float) -> None:
        """Wait through the wrapped transport."""
        self.inner.wait(handle, timeout_s)

    def close(self) -> None:
        """Close the wrapped transport."""
        self.inner.close()
