"""A transport that fails on demand, or holds writes back to land late, for tests of writes
failing mid-push."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from weightsync.errors import TransferError
from weightsync.transport.base import HOST_ONLY, Transport, TransportCapabilities, WriteCost


class FailsAfter:
    """Wraps a transport; once `remaining` writes went out, every further write raises
    `TransferError`, as a dead NIC or a killed peer would make it fail. Between `hold` and
    `release` the writes that go through are held back, as on a congested network.

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
        self._gate: threading.Event | None = None
        self._held: list[_HeldWrite] = []

    def hold(self) -> None:
        """Hold back the writes that go through from now on until `release`, as a congested
        network would: their bytes land after their sender has moved on (or given up on
        the target)."""
        self._gate = threading.Event()

    def release(self, timeout_s: float = 30.0) -> None:
        """Let the held writes start, and wait until every one landed.

        Raises:
            TransferError: a held write failed, or did not land within `timeout_s`.
        """
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()
        held, self._held = self._held, []
        for write in held:
            write.wait(timeout_s)

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
        """Write through the wrapped transport (once released, while `hold` is on), or
        raise once `remaining` reached 0."""
        if self.remaining is not None:
            if self.remaining <= 0:
                raise TransferError(self.message, target_session=target_session, return_code=-1)
            self.remaining -= 1
        if self._gate is None:
            return self.inner.write(target_session, src_addrs, dst_addrs, lengths)
        args = (target_session, list(src_addrs), list(dst_addrs), list(lengths))
        held = _HeldWrite(self.inner, args, self._gate)
        self._held.append(held)
        return held

    def wait(self, handle: Any, timeout_s: float) -> None:
        """Wait through the wrapped transport (for a held write: until it landed)."""
        if isinstance(handle, _HeldWrite):
            handle.wait(timeout_s)
        else:
            self.inner.wait(handle, timeout_s)

    def close(self) -> None:
        """Close the wrapped transport."""
        self.inner.close()


class _HeldWrite:
    """A write that starts once `gate` is set, on a thread of its own."""

    def __init__(
        self,
        inner: Transport,
        args: tuple[str, list[int], list[int], list[int]],
        gate: threading.Event,
    ) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            gate.wait()
            try:
                inner.wait(inner.write(*args), 30.0)
            except BaseException as exc:  # handed to whoever waits
                self._error = exc

        self._thread = threading.Thread(target=run, name="held-write", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TransferError(f"a held write did not land within {timeout_s:g} s")
        if self._error is not None:
            raise self._error
