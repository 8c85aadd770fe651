"""Mooncake's native log lines, taken off the process's stderr and into Python logging.

Mooncake logs through glog straight to file descriptor 2, from its own threads, at any time:
a failed write logs a few ``E...`` lines from Mooncake's I/O thread while (or after) the
caller learns of the failure from the write's status, which `TransferError` already reports.
Nothing but the descriptor can catch them, and redirecting it around each write would miss
the lines that come later and hide other threads' output while it lasts.

So `capture_native_logs` points descriptor 2 at a pipe once per process, when the first
engine is created, and keeps it there: a reader thread passes every line that is not glog's
on to the original stderr unchanged, at once (a partial line too, once nothing more came for
`PARTIAL_LINE_S`), and hands glog's lines to a second thread that logs them on
``weightsync.transport.mooncake.native``: ``I``, ``W`` and ``E`` lines at DEBUG (a failure
worth knowing is raised to the caller), ``F`` lines, which precede an abort, at ERROR. The
logging thread is separate so that a handler writing to stderr, which is this pipe, never
blocks the one thread that drains it. A glog line the reader already logged and reads again
(a handler that prints bare messages to stderr) is passed on, not logged a second time.

What this costs: stderr's bytes take one thread hop (microseconds), so their order against
stdout may change; at exit (`atexit`) the descriptor is restored and the pipe drained, but a
process killed outright (a signal, ``abort`` after a glog ``F`` line) loses what was still in
the pipe; child processes started afterwards inherit the pipe as their stderr, so their
lines pass through this process while it lives. A child made by ``fork`` points its own
descriptor 2 back at the original stderr, having no reader thread. Something else pointing
descriptor 2 elsewhere (a test runner capturing output) ends the capture; the next engine
starts a new one.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import queue
import re
import select
import sys
import threading

NATIVE_LOGGER = "weightsync.transport.mooncake.native"
_NATIVE_LOG = logging.getLogger(NATIVE_LOGGER)
# glog's lines: severity, date, time, thread, file:line]; and its note before InitGoogleLogging.
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
GLOG_NOTE = "WARNING: Logging before InitGoogleLogging()"
_GLOG_NOTE_BYTES = GLOG_NOTE.encode()
PARTIAL_LINE_S = 0.05
"""How long the reader holds a line without its newline that may be the start of a glog
line before passing it on as it is."""
_LEVELS = {"F": logging.ERROR}
_RECENT_LINES = 256
_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031  # Linux's fcntl command; the default pipe holds 64 KiB

_lock = threading.Lock()
_capture: _Capture | None = None
_hooked = False  # the exit and fork hooks are registered


def is_native_line(line: str) -> bool:
    """Whether `line` is one of glog's (Mooncake's native log)."""
    return bool(GLOG_LINE.match(line)) or line.startswith(GLOG_NOTE)


def native_level(line: str) -> int:
    """The logging level a glog line is logged at: ERROR for ``F`` (fatal), else DEBUG."""
    return _LEVELS.get(line[:1], logging.DEBUG)


def capture_native_logs() -> bool:
    """Take glog's lines off file descriptor 2 for the rest of the process (see the module
    docstring); idempotent. Returns whether they are captured (False where descriptor 2 is
    closed or cannot be replaced)."""
    global _capture, _hooked
    with _lock:
        if _capture is not None and _capture.installed():
            return True
        if _capture is not None:
            _capture.detach()
        if not _hooked:
            atexit.register(_detach_at_exit)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
            _hooked = True
        _capture = _Capture.install()
        return _capture is not None


def _detach_at_exit() -> None:
    with _lock:
        capture = _capture
    if capture is not None:
        capture.detach()


def _after_fork_in_child() -> None:
    # The child has none of the capture's threads: its stderr goes where the parent's went,
    # and its first engine starts a capture of its own.
    global _capture, _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _capture is not None:
        _capture.forget_in_child()
    _capture = None


def flush_native_logs(timeout_s: float = 5.0) -> bool:
    """Wait until every byte written to descriptor 2 before this call is passed on or
    logged; returns False if that took longer than `timeout_s` (or nothing is captured)."""
    with _lock:
        capture = _capture
    return capture is not None and capture.flush(timeout_s)


class _Capture:
    """Descriptor 2 pointed at a pipe, its reader thread and its logging thread.

    The capture keeps a writer of its own on the pipe (never inherited), so the pipe does
    not end when descriptor 2 is pointed elsewhere or a child holds it: markers written
    through it order `flush` and `detach` after every byte already in the pipe.
    """

    def __init__(self, *, read_fd: int, control_fd: int, original_fd: int) -> None:
        self._read_fd = read_fd
        self._control_fd = control_fd
        self._original_fd = original_fd
        stat = os.fstat(control_fd)
        self._pipe_id = (stat.st_dev, stat.st_ino)
        self._records: queue.SimpleQueue[str | threading.Event | None] = queue.SimpleQueue()
        self._recent: collections.deque[str] = collections.deque(maxlen=_RECENT_LINES)
        self._markers: dict[bytes, threading.Event] = {}
        self._markers_lock = threading.Lock()
        self._stop = f"\0weightsync-native-log-stop-{os.urandom(8).hex()}\0".encode()
        self._detached = False
        self._reader = threading.Thread(
            target=self._read, name="mooncake-native-log-reader", daemon=True
        )
        self._logger = threading.Thread(target=self._log, name="mooncake-native-log", daemon=True)

    @classmethod
    def install(cls) -> _Capture | None:
        """Point descriptor 2 at a new pipe and start the threads; None where it cannot."""
        with contextlib.suppress(AttributeError, OSError, ValueError):
            sys.stderr.flush()
        try:
            original_fd = os.dup(2)
        except OSError:
            return None
        read_fd, write_fd = os.pipe()
        with contextlib.suppress(OSError, ImportError):
            import fcntl

            fcntl.fcntl(write_fd, _F_SETPIPE_SZ, _PIPE_BYTES)
        capture = cls(read_fd=read_fd, control_fd=os.dup(write_fd), original_fd=original_fd)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        capture._reader.start()
        capture._logger.start()
        return capture

    def installed(self) -> bool:
        """Whether descriptor 2 is still this capture's pipe."""
        if self._detached:
            return False
        try:
            stat = os.fstat(2)
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == self._pipe_id

    def flush(self, timeout_s: float) -> bool:
        """Pass a marker through the pipe and the logging thread and wait for it."""
        if self._detached:
            return False
        marker = f"\0weightsync-native-log-flush-{os.urandom(8).hex()}\0".encode()
        read = threading.Event()
        with self._markers_lock:
            self._markers[marker] = read
        try:
            _write_all(self._control_fd, marker + b"\n")
        except OSError:
            return False
        if not read.wait(timeout_s):
            return False
        logged = threading.Event()
        self._records.put(logged)
        return logged.wait(timeout_s)

    def detach(self) -> None:
        """Point descriptor 2 back at the original stderr (if it is still the pipe), let the
        reader pass on what the pipe holds, and stop both threads; idempotent."""
        if self._detached:
            return
        if self.installed():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            with contextlib.suppress(OSError):
                os.dup2(self._original_fd, 2)
        self._detached = True
        with contextlib.suppress(OSError):
            _write_all(self._control_fd, self._stop + b"\n")
        self._reader.join(timeout=5.0)
        self._logger.join(timeout=5.0)

    def forget_in_child(self) -> None:
        """In a child made by ``fork`` (which has none of the threads): point descriptor 2
        back at the original stderr and close the child's copies of the pipe."""
        if self._detached:
            return  # its descriptors are closed, their numbers maybe reused
        if self.installed():
            with contextlib.suppress(OSError):
                os.dup2(self._original_fd, 2)
        self._detached = True
        for fd in (self._read_fd, self._control_fd, self._original_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read(self) -> None:
        pending = b""
        try:
            while True:
                wait = PARTIAL_LINE_S if pending else None
                ready, _, _ = select.select([self._read_fd], [], [], wait)
                if not ready:
                    self._forward(pending)  # a partial line that waited long enough
                    pending = b""
                    continue
                chunk = os.read(self._read_fd, 1 << 16)
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                if any(line == self._stop for line in lines):
                    for line in lines[: lines.index(self._stop)]:
                        self._line(line)
                    pending = b""
                    break
                for line in lines:
                    self._line(line)
                if pending and not _may_be_native(pending):
                    self._forward(pending)
                    pending = b""
            self._forward(pending)
        finally:
            self._records.put(None)
            for fd in (self._read_fd, self._control_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _line(self, raw: bytes) -> None:
        with self._markers_lock:
            marker = self._markers.pop(raw, None)
        if marker is not None:
            marker.set()
            return
        text = raw.decode(errors="replace").rstrip("\r")
        if is_native_line(text) and text not in self._recent:
            self._recent.append(text)
            self._records.put(text)
        else:
            self._forward(raw + b"\n")

    def _forward(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the original stderr is gone: nothing shows them
            _write_all(self._original_fd, data)

    def _log(self) -> None:
        while True:
            item = self._records.get()
            if item is None:
                break
            if isinstance(item, threading.Event):
                item.set()
                continue
            level = native_level(item)
            if _NATIVE_LOG.isEnabledFor(level):
                _NATIVE_LOG.log(level, "%s", item)
        with contextlib.suppress(OSError):
            os.close(self._original_fd)


def _may_be_native(start: bytes) -> bool:
    """Whether a line that began with `start` (no newline yet) may be one of glog's."""
    if _GLOG_NOTE_BYTES.startswith(start[: len(_GLOG_NOTE_BYTES)]):
        return True
    return start[:1] in (b"I", b"W", b"E", b"F") and (len(start) == 1 or start[1:2].isdigit())


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]
