"""The exceptions weightsync raises at run time.

`ValueError` (and its subclass `LayoutMismatchError`) is for bad input that the caller can fix;
`WeightSyncError` subclasses are for failures while a sync runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class WeightSyncError(RuntimeError):
    """Base class of every run-time failure weightsync reports.

    Errors travel between trainer ranks pickled, and the default exception pickling drops
    keyword-only arguments: a subclass that takes them names them in `_keywords` (the
    attributes of the same names), and `__reduce__` passes them back.
    """

    _keywords: tuple[str, ...] = ()

    def __reduce__(self):
        if not self._keywords:
            return super().__reduce__()
        keywords = {name: getattr(self, name) for name in self._keywords}
        return (_rebuild, (type(self), str(self), keywords))


class LayoutMismatchError(WeightSyncError, ValueError):
    """What the trainer would write does not match what a rollout rank published.

    Raised while a plan is built, before any byte is written. The message names the parameter,
    the rank and the expected and actual sizes.
    """


class CollectiveError(WeightSyncError):
    """A collective call over the trainer group failed or timed out: a trainer rank is dead,
    stopped, or not calling ``sync``. Every rank that took part raises it."""


class WeightsRefusedError(WeightSyncError, ValueError):
    """The trainer's weights were refused before any byte was written: values that are not
    finite in the rollout's dtype (NaN, or beyond its range once cast), or copies of one box
    that differ between the trainer ranks holding it (`SyncConfig.check_replicas`). The
    message names the tensor and the trainer rank."""


class TransferError(WeightSyncError):
    """A write over a transport failed or timed out.

    Attributes:
        target_session: the session id of the peer the write went to.
        byte_ranges: ``(dst_addr, num_bytes)`` of the regions the failed write covered (may be
            a summary of the first few when the batch was large).
        return_code: the native return code, or ``None`` when there was none (a timeout).
        param_name: the parameter the failed bytes belonged to, when the caller knows it.
    """

    _keywords = ("target_session", "byte_ranges", "return_code", "param_name")

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


class PartialPushError(TransferError):
    """Writes to some targets failed (the first failure is the message); every write to the
    other targets landed.

    Attributes:
        failed: ``{session_id: why}`` of every target a write to failed; no more writes went
            to a target once one failed.
        result: what the push wrote (a `PushStats` from one sender, a `PushResult` from a
            sync's push), digests included, so that the targets that got everything can be
            finished.
    """

    _keywords = (*TransferError._keywords, "failed", "result")

    def __init__(
        self,
        message: str,
        *,
        failed: Mapping[str, str],
        result: Any = None,
        **transfer: Any,
    ) -> None:
        super().__init__(message, **transfer)
        self.failed = dict(failed)
        self.result = result


class TensorChangedError(WeightSyncError):
    """A trainer tensor changed while a push read it: an in-place op on it (or on a tensor
    that shares its memory and version counter) between the push taking it and the push's
    last write that reads it landing, such as an optimizer step on another thread.

    The push's writes went out, so every replica it wrote to may hold a mix of old and new
    values: a sync fails as a whole and leaves them paused and dirty until a later sync
    succeeds. Not a `PartialPushError`: no target got a consistent copy.

    Attributes:
        hf_name: the HF name of the first tensor (in stream order) whose version counter
            moved.
        rank: the trainer rank that pushed it.
    """

    _keywords = ("hf_name", "rank")

    def __init__(self, message: str, *, hf_name: str, rank: int) -> None:
        super().__init__(message)
        self.hf_name = hf_name
        self.rank = rank


class PartialSyncError(WeightSyncError):
    """A sync updated some replicas and failed on others after writing to them: those stay
    paused (and dirty) until a later sync to them succeeds; the updated ones serve.

    Attributes:
        report: the sync's report over the replicas that were updated.
        failed: ``{replica_url: why}`` of the replicas it failed on.
    """

    _keywords = ("report", "failed")

    def __init__(self, message: str, *, report: Any, failed: Mapping[str, str]) -> None:
        super().__init__(message)
        self.report = report
        self.failed = dict(failed)


class RemoteReplicaError(WeightSyncError):
    """A rollout replica refused or failed a control-plane call.

    Attributes:
        replica: the replica's base URL (or name).
        route: the HTTP route that failed.
        status_code: the HTTP status, or ``None`` when the replica could not be reached.
    """

    _keywords = ("replica", "route", "status_code")

    def __init__(
        self, message: str, *, replica: str, route: str, status_code: int | None = None
    ) -> None:
        super().__init__(message)
        self.replica = replica
        self.route = route
        self.status_code = status_code


class LifecycleStepError(RemoteReplicaError):
    """A step of a fused lifecycle call (``/begin_weight_sync``, ``/end_weight_sync``)
    refused; `route` names the step, as if it had been called alone.

    Attributes:
        completed: the routes of the steps that ran before it, in order.
    """

    _keywords = (*RemoteReplicaError._keywords, "completed")

    def __init__(
        self,
        message: str,
        *,
        replica: str,
        route: str,
        status_code: int | None = None,
        completed: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message, replica=replica, route=route, status_code=status_code)
        self.completed = tuple(completed)


def _rebuild(cls: type, message: str, kwargs: dict) -> BaseException:
    return cls(message, **kwargs)
