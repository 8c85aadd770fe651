"""`EngineDriver`: rank 0's engine thread, which runs each command on every rank in turn."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from weightsync.errors import WeightSyncError
from weightsync.server.config import ServeConfig
from weightsync.server.ranks.commands import INTERNAL, Command, RankInfo, RankReply, Shutdown
from weightsync.server.ranks.follower import init_replica_group
from weightsync.server.ranks.runtime import RankRuntime

logger = logging.getLogger(__name__)


class EngineStoppedError(WeightSyncError):
    """The engine thread has stopped (shut down, or a rank failed); no command can run."""


class EngineDriver:
    """Serializes commands onto the replica's ranks from one thread of rank 0.

    The thread sets up rank 0 (process group, model, transport, agent), collects every rank's
    `RankInfo`, then loops: take the next command, broadcast it to ranks 1..N-1 over the
    control group, execute it locally, gather every rank's `RankReply`. Commands never
    overlap, so the collectives of one command never interleave with another's. HTTP
    handlers submit commands and await the returned future without blocking their loop.

    Args:
        config: the replica's config.
        store: the TCP store of the replica's process group (rank 0 hosts it).
        bootstrap_url: where ranks publish their transfer-engine info.
        on_failure: called (from the engine thread) when the thread dies of an error: a rank
            failed to start, or a collective broke because a rank went away.
    """

    def __init__(
        self,
        config: ServeConfig,
        *,
        store: dist.Store,
        bootstrap_url: str,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self._config = config
        self._store = store
        self._bootstrap_url = bootstrap_url
        self._on_failure = on_failure
        self._queue: queue.SimpleQueue[
            tuple[Command, concurrent.futures.Future[list[RankReply]]]
        ] = queue.SimpleQueue()
        self._ready: concurrent.futures.Future[list[RankInfo]] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name="engine-driver", daemon=True)
        self._runtime: RankRuntime | None = None
        self._control: dist.ProcessGroup | None = None
        self._stopped = threading.Event()
        # Guards "stopped?" + enqueue against the thread draining the queue when it stops,
        # so that every submitted future resolves; and the count of queued commands that
        # have not finished.
        self._lock = threading.Lock()
        self._queued = 0
        # Held while a command runs on rank 0, in the engine thread or inline.
        self._running = threading.Lock()
        self._current: str | None = None

    @property
    def current_command(self) -> str | None:
        """The name of the command running now, or ``None`` when idle."""
        return self._current

    @property
    def stopped(self) -> bool:
        """Whether the engine thread has stopped."""
        return self._stopped.is_set()

    def start(self) -> concurrent.futures.Future[list[RankInfo]]:
        """Start the engine thread; the future resolves to every rank's info once all ranks
        serve, or fails with the reason one could not start."""
        self._thread.start()
        return self._ready

    def submit(
        self, command: Command, *, inline: bool = False
    ) -> concurrent.futures.Future[list[RankReply]]:
        """Queue `command`; the future resolves to the replies of ranks 0..N-1, or fails
        with `EngineStoppedError` when the engine is gone.

        With `inline` (a command that takes well under a millisecond: a session's begin or
        end, a label), a tp=1 replica whose engine has nothing queued or running runs it in
        the calling thread and returns a done future: commands still never overlap and
        keep their order, and the command is spared the queue's two thread switches (each
        wakes a sleeping thread: 0.1-0.15 ms together on an idle host).
        """
        future: concurrent.futures.Future[list[RankReply]] = concurrent.futures.Future()
        runtime = None
        with self._lock:
            if self._stopped.is_set():
                future.set_exception(EngineStoppedError("the engine has stopped"))
            elif (
                inline
                and self._config.tp_size == 1
                and self._runtime is not None
                and self._ready.done()
                and not self._queued
                and self._running.acquire(blocking=False)
            ):
                runtime = self._runtime
            else:
                self._queued += 1
                self._queue.put((command, future))
        if runtime is not None:
            try:
                with self._device():
                    future.set_result([runtime.execute(command)])
            finally:
                self._running.release()
        return future

    def _device(self) -> contextlib.AbstractContextManager[object]:
        """Rank 0's GPU as the calling thread's current device (the engine thread's is)."""
        if self._config.device != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self._config.gpu_id(0))

    def join(self, timeout_s: float) -> bool:
        """Wait for the engine thread to end; return whether it did."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _main(self) -> None:
        try:
            self._start_ranks()
        except BaseException as exc:
            logger.error("replica failed to start: %s", exc)
            self._stop(exc)
            return
        while True:
            command, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                self._dequeued()
                continue
            self._current = type(command).__name__
            try:
                with self._running:
                    replies = self._everywhere(command)
            except BaseException as exc:
                logger.error("%s broke the replica's process group: %s", self._current, exc)
                future.set_exception(
                    EngineStoppedError(f"a rank failed during {self._current}: {exc}")
                )
                self._stop(exc)
                return
            finally:
                self._current = None
                # Counted until it ran: an inline command never overtakes a queued one.
                self._dequeued()
            future.set_result(replies)
            if isinstance(command, Shutdown):
                self._stop(None)
                return

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _start_ranks(self) -> None:
        model_group, self._control = init_replica_group(self._config, tp_rank=0, store=self._store)
        try:
            self._runtime = RankRuntime.start(
                self._config, tp_rank=0, bootstrap_url=self._bootstrap_url, group=model_group
            )
            local = RankReply(tp_rank=0, value=self._runtime.info())
        except Exception as exc:
            logger.exception("rank 0 failed to start")
            local = RankReply(tp_rank=0, error=str(exc), error_kind=INTERNAL)
        replies = self._gather(local)
        failed = [r for r in replies if not r.ok]
        if failed:
            raise EngineStoppedError(
                "; ".join(f"tp rank {r.tp_rank} failed to start: {r.error}" for r in failed)
            )
        self._ready.set_result([r.value for r in replies])

    def _everywhere(self, command: Command) -> list[RankReply]:
        if self._config.tp_size > 1:
            dist.broadcast_object_list([command], src=0, group=self._control)
        assert self._runtime is not None
        return self._gather(self._runtime.execute(command))

    def _gather(self, local: RankReply) -> list[RankReply]:
        if self._config.tp_size == 1:
            return [local]
        replies: list[RankReply | None] = [None] * self._config.tp_size
        dist.gather_object(local, replies, dst=0, group=self._control)
        return replies  # type: ignore[return-value]

    def _stop(self, error: BaseException | None) -> None:
        with self._lock:
            self._stopped.set()
            while True:
                try:
                    _, future = self._queue.get_nowait()
                except queue.Empty:
                    break
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineStoppedError("the engine has stopped"))
        if not self._ready.done():
            self._ready.set_exception(error or EngineStoppedError("stopped before it was ready"))
        if self._runtime is not None:
            try:
                self._runtime.close()
            except Exception:
                logger.exception("closing rank 0's transport failed")
            self._runtime = None
        if error is None and dist.is_initialized():
            dist.destroy_process_group()
        if error is not None:
            self._on_failure(error)
