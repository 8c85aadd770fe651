"""The exceptions weightsync raises at run time.

`ValueError` (and its subclass `LayoutMismatchError`) is for bad input that the caller can fix;
`WeightSyncError` subclasses are for failures while a sync runs.
"""

from __future__ import annotations

from collections.abc import Sequence


class WeightSyncError(RuntimeError):
    """Base class of every run-time failure weightsync reports."""


class LayoutMismatchError(WeightSyncError, ValueError):
    """What the trainer would write does not match what a rollout rank published.

    Raised while a plan is built, before any byte is written. The message names the parameter,
    the rank and the expected and actual sizes.
    """


class TransferError(WeightSyncError):
    """A write over a transport failed or timed out.

    Attributes:
        target_session: the session id of the peer the write went to.
        byte_ranges: ``(dst_addr, num_bytes)`` of the regions the failed write covered (may be
            a summary of the first few when the batch was large).
        return_code: the native return code, or ``None`` when there was none (a timeout).
        param_name: the parameter the failed bytes belonged to, when the caller knows it.
    """

    def __init__(
        self,
        message: str,
        *,
        target_session: str,
        byte_ranges: Sequence[tuple[int, int]] = (),
        return_code: int | None = None,
        param_name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.target_session = target_session
        self.byte_ranges = tuple(byte_ranges)
        self.return_code = return_code
        self.param_name = param_name

    def __reduce__(self):
        # Keyword-only arguments do not survive the default exception pickling, and errors
        # travel between trainer ranks as pickled objects.
        return (
            _rebuild,
            (
                type(self),
                str(self),
                {
                    "target_session": self.target_session,
                    "byte_ranges": self.byte_ranges,
                    "return_code": self.return_code,
                    "param_name": self.param_name,
                },
            ),
        )


class RemoteReplicaError(WeightSyncError):
    """A rollout replica refused or failed a control-plane call.

    Attributes:
        replica: the replica's base URL (or name).
        route: the HTTP route that failed.
        status_code: the HTTP status, or ``None`` when the replica could not be reached.
    """

    def __init__(
        self, message: str, *, replica: str, route: str, status_code: int | None = None
    ) -> None:
        super().__init__(message)
        self.replica = replica
        self.route = route
        self.status_code = status_code

    def __reduce__(self):
        return (
            _rebuild,
            (
                type(self),
                str(self),
                {
                    "replica": self.replica,
                    "route": self.route,
                    "status_code": self.status_code,
                },
            ),
        )


def _rebuild(cls: type, message: str, kwargs: dict) -> BaseException:
    return cls(message, **kwargs)
