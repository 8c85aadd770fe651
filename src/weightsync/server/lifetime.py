"""Processes that end with their parent: no replica or rank outlives what started it.

Linux's ``prctl(PR_SET_PDEATHSIG, sig)`` asks the kernel to send `sig` to the calling process
when its parent dies. The parent is the *thread* that forked the process, so a process set up
this way must be started from a thread that lives as long as the process should (a main
thread). The request only covers deaths after the call: a parent that died before it is
caught by comparing ``os.getppid()`` with the pid the parent announced.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "WEIGHTSYNC_PARENT_PID"
"""The environment variable through which a launcher tells a child the launcher's pid."""

_PR_SET_PDEATHSIG = 1


class ParentGoneError(RuntimeError):
    """The process's parent died before it could ask to be signalled when that happens."""


def exit_with_parent(parent_pid: int, *, sig: signal.Signals = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when its parent dies.

    Call it first thing in the child. Returns whether the death signal is set (``False``
    off Linux, where there is no such request; a warning is logged).

    Args:
        parent_pid: the pid of the process that started this one, as that process said.
        sig: the signal to receive (SIGTERM lets the process stop in order; SIGKILL for a
            process that ignores SIGTERM).

    Raises:
        ParentGoneError: the parent is already gone (this process was re-parented).
        OSError: ``prctl`` refused.
    """
    if not sys.platform.startswith("linux"):
        logger.warning(
            "this platform cannot signal a process when its parent dies; pid %d may outlive pid %d",
            os.getpid(),
            parent_pid,
        )
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    # The parent may have died between fork and prctl: then nothing would ever signal us.
    if os.getppid() != parent_pid:
        raise ParentGoneError(
            f"the parent process {parent_pid} exited before pid {os.getpid()} started"
        )
    return True


def parent_pid_from_env(value: str | None) -> int | None:
    """The parent pid a launcher put in ``$WEIGHTSYNC_PARENT_PID`` (pass its value), or
    ``None`` when it is unset or empty.

    Raises:
        ValueError: the value is not a positive integer.
    """
    if not value:
        return None
    try:
        pid = int(value)
    except ValueError:
        pid = 0
    if pid <= 0:
        raise ValueError(f"${PARENT_PID_ENV} must be a process id, got {value!r}")
    return pid
