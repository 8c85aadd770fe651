"""`RankProcesses`: TP ranks 1..N-1 of a replica, as child processes of rank 0."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys

from weightsync.server.config import ServeConfig
from weightsync.server.lifetime import PARENT_PID_ENV

logger = logging.getLogger(__name__)


class RankProcesses:
    """Starts and stops the processes of TP ranks 1..N-1.

    Each child runs `weightsync.server.ranks.follower` and reads the replica's config from its
    stdin, which rank 0 keeps open: if rank 0 dies, the children see end of file and exit, and
    the kernel kills them besides (their parent-death signal; `start` must therefore run on a
    thread that lives as long as the replica, rank 0's main thread). The config travels on
    stdin, never in the command line, which every user of the machine can read. The children
    ignore SIGINT and SIGTERM (a Ctrl-C or a ``kill`` of the process group reaches them too);
    rank 0 stops them, in order, through its command loop.

    Args:
        config: the replica's config.
        store_port: port of rank 0's TCP store (the process group's rendezvous).
        bootstrap_url: where ranks publish their transfer-engine info.
    """

    def __init__(self, config: ServeConfig, *, store_port: int, bootstrap_url: str) -> None:
        self._config = config
        self._store_port = store_port
        self._bootstrap_url = bootstrap_url
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        """Start ranks 1..N-1 (returns at once; they join the process group when ready)."""
        line = (json.dumps(self._config.to_dict()) + "\n").encode()
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        for tp_rank in range(1, self._config.tp_size):
            cmd = [
                sys.executable,
                "-m",
                "weightsync.server.ranks.follower",
                "--tp-rank",
                str(tp_rank),
                "--store-port",
                str(self._store_port),
                "--bootstrap-url",
                self._bootstrap_url,
            ]
            process = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            assert process.stdin is not None
            process.stdin.write(line)
            process.stdin.flush()
            self.processes[tp_rank] = process
            logger.info("started tp rank %d (pid %d)", tp_rank, process.pid)

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the children to exit, then make them: closing their
        stdin makes a child exit at once; what is still alive after that is killed."""
        for tp_rank, process in self.processes.items():
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tp rank %d did not stop in %.0f s; closing it", tp_rank, timeout_s)
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                logger.warning("killing tp rank %d (pid %d)", tp_rank, process.pid)
                process.kill()
                process.wait()
