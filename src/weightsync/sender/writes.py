"""Writes from the staging ring to the targets: flow control, waits per slot, errors by
parameter."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.errors import TransferError
from weightsync.plan.types import TargetRank
from weightsync.plan.writes import WriteRun

if TYPE_CHECKING:
    from weightsync.transport import Transport


@dataclass(slots=True, kw_only=True)
class _Batch:
    handle: Any
    target: TargetRank
    writes: Sequence[WriteRun]
    done: bool = False


@dataclass(slots=True)
class _Peer:
    batches: deque[_Batch] = field(default_factory=deque)
    outstanding: int = 0


class WriteQueue:
    """Submits writes without blocking, keeps each peer under its limit, waits per slot.

    Call protocol: `start` a push; `submit` the writes of a slot; `wait_slot` before the slot
    is refilled; `wait_all` at the end of a push; `drain` after a failure, before the memory
    is reused.

    A target whose write fails is isolated, not fatal: the failure (a `TransferError` naming
    the target and the parameters of the failed bytes) is recorded in `failed`, no more
    writes go to that target in this push and its writes still in flight are not waited for
    (a dead or frozen peer would otherwise cost a timeout per batch), and the writes to the
    other targets go on. The sender reports the failed targets when the push ends.
    """

    def __init__(
        self, transport: Transport, *, timeout_s: float, max_outstanding_per_peer: int
    ) -> None:
        """Bind the queue to a transport.

        Args:
            transport: does the writes.
            timeout_s: how long one batch may take.
            max_outstanding_per_peer: most write requests in flight to one session.
        """
        self._transport = transport
        self._timeout_s = timeout_s
        self._limit = max_outstanding_per_peer
        self._peers: dict[str, _Peer] = defaultdict(_Peer)
        self._slots: dict[int, list[_Batch]] = defaultdict(list)
        self.failed: dict[str, TransferError] = {}

    def start(self) -> None:
        """Begin a push: no target has failed yet."""
        self.failed = {}

    def submit(
        self,
        target: TargetRank,
        writes: Sequence[WriteRun],
        *,
        ring_base: int,
        slot: int,
        after_stream: int | None = None,
    ) -> None:
        """Start `writes` to `target`; they read slot `slot` until `wait_slot(slot)`.

        Args:
            target: the rollout rank written into.
            writes: the requests, in order; their sources are offsets from `ring_base`.
            ring_base: the address of the staging ring's first byte.
            slot: the staging slot they read.
            after_stream: with a transport whose capabilities say ``stream_ordered``, the
                raw CUDA stream whose queued copies fill the slot: the writes wait for them
                on the GPU. None: the slot's bytes are final already.

        A target that failed in this push gets no more writes; a refusal or failure met
        here is recorded in `failed`.
        """
        if target.session_id in self.failed:
            return
        peer = self._peers[target.session_id]
        ordering = {} if after_stream is None else {"after_stream": after_stream}
        for start in range(0, len(writes), self._limit):
            chunk = writes[start : start + self._limit]
            while peer.batches and peer.outstanding + len(chunk) > self._limit:
                self._wait(peer.batches[0])
            if target.session_id in self.failed:
                return
            try:
                handle = self._transport.write(
                    target.session_id,
                    [ring_base + w.src_offset for w in chunk],
                    [w.dst_addr for w in chunk],
                    [w.num_bytes for w in chunk],
                    **ordering,
                )
            except TransferError as exc:
                self.failed.setdefault(target.session_id, _named(exc, target, chunk))
                return
            batch = _Batch(handle=handle, target=target, writes=chunk)
            peer.batches.append(batch)
            peer.outstanding += len(chunk)
            self._slots[slot].append(batch)

    def wait_slot(self, slot: int) -> None:
        """Wait for every write that reads slot `slot` (failures go to `failed`)."""
        for batch in self._slots.pop(slot, []):
            self._wait(batch)

    def wait_all(self) -> None:
        """Wait for every write submitted so far (failures go to `failed`)."""
        for slot in list(self._slots):
            self.wait_slot(slot)

    def drain(self) -> None:
        """Wait for what is still in flight, ignoring errors, within one timeout overall.

        Used after a failure so that staging memory is not refilled while the transport may
        still read it; a write that outlives the timeout may still land later.
        """
        deadline = time.monotonic() + self._timeout_s
        for slot in list(self._slots):
            for batch in self._slots.pop(slot):
                if batch.done:
                    continue
                remaining = max(deadline - time.monotonic(), 0.01)
                with contextlib.suppress(TransferError):
                    self._transport.wait(batch.handle, remaining)
                self._finish(batch)

    def _wait(self, batch: _Batch) -> None:
        if batch.done:
            return
        session = batch.target.session_id
        if session not in self.failed:
            try:
                self._transport.wait(batch.handle, self._timeout_s)
            except TransferError as exc:
                self.failed[session] = _named(exc, batch.target, batch.writes)
        # A failed target's writes still in flight are not waited for: it is dirty anyway,
        # and its next session's digests catch whatever of them lands late.
        self._finish(batch)

    def _finish(self, batch: _Batch) -> None:
        batch.done = True
        peer = self._peers[batch.target.session_id]
        peer.outstanding -= len(batch.writes)
        while peer.batches and peer.batches[0].done:
            peer.batches.popleft()


def _named(exc: TransferError, target: TargetRank, writes: Sequence[WriteRun]) -> TransferError:
    """`exc` again, with the target and the parameters of the failed bytes in the message."""
    failed = [
        w
        for w in writes
        if not exc.byte_ranges
        or any(
            w.dst_addr < addr + num_bytes and addr < w.dst_addr + w.num_bytes
            for addr, num_bytes in exc.byte_ranges
        )
    ] or list(writes)
    params = list(dict.fromkeys(w.param_name for w in failed))
    shown = ", ".join(params[:8]) + (f" and {len(params) - 8} more" if len(params) > 8 else "")
    num_bytes = sum(w.num_bytes for w in failed)
    return TransferError(
        f"writing {num_bytes} bytes of {shown} to {target.label} failed: {exc}",
        target_session=target.session_id,
        byte_ranges=[(w.dst_addr, w.num_bytes) for w in failed[:16]],
        return_code=exc.return_code,
        param_name=params[0] if params else None,
    )
