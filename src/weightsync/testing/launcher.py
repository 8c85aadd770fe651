"""Start `weightsync serve` replicas as local subprocesses and stop them.

    with serve_replicas(checkpoint, num_replicas=2, tp=2, log_dir=tmp_path) as replicas:
        url = replicas[0].url

Each replica runs in its own process group (rank 0 and its TP ranks), binds free ports
(``--port 0 --bootstrap-port 0``) and reports them through ``--ready-file``; the helper waits
until ``/health`` answers, with a deadline, and on teardown sends SIGTERM to the whole
group, then SIGKILL to whatever is left.

The API key reaches a replica through its environment (``$WEIGHTSYNC_API_KEY``), never its
command line, which every user of the machine can read. A replica stops (as on SIGTERM) when
the thread that started it dies (``$WEIGHTSYNC_PARENT_PID``, `weightsync.server.lifetime`),
so a launcher killed with SIGKILL leaves none behind: start replicas from a thread that
outlives them, such as the main thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from weightsync.server.lifetime import PARENT_PID_ENV

API_KEY_ENV = "WEIGHTSYNC_API_KEY"

READY_TIMEOUT_S = 180.0


@dataclass(slots=True, kw_only=True)
class ServedReplica:
    """One running `weightsync serve` (rank 0 leads a process group with every TP rank).

    Attributes:
        url: base URL of the main server.
        bootstrap_url: base URL of the engine-info bootstrap server.
        port: main server port.
        bootstrap_port: bootstrap server port.
        tp: tensor-parallel size.
        process: rank 0's process.
        log_path: the replica's combined stdout/stderr.
    """

    url: str
    bootstrap_url: str
    port: int
    bootstrap_port: int
    tp: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, num_lines: int = 40) -> str:
        """The last lines of the replica's log."""
        return _tail(self.log_path, num_lines)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the process group, wait up to `timeout_s`, SIGKILL what is left; return
        rank 0's exit code (negative: killed by that signal)."""
        return _stop(self.process, timeout_s)


def start_replicas(
    model_path: str | Path,
    *,
    num_replicas: int = 1,
    tp: int = 1,
    ep: int = 1,
    log_dir: str | Path,
    api_key: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = READY_TIMEOUT_S,
    delta_region_mb: int = 0,
) -> list[ServedReplica]:
    """Start `num_replicas` replicas in parallel and wait until each serves.

    Args:
        model_path: the HF checkpoint folder every replica loads.
        num_replicas: how many replicas.
        tp: tensor-parallel size of each replica (one process per rank).
        ep: expert-parallel size (MoE models).
        log_dir: where each replica's log and ready file go.
        api_key: the replicas' API key (passed in their environment), or None for none.
        dtype: parameter dtype (``bf16``, ``fp16``, ``fp32``), or None for the checkpoint's.
        device: ``cpu`` or ``cuda``.
        extra_args: more `weightsync serve` options.
        ready_timeout_s: how long to wait for all replicas together.
        delta_region_mb: MiB of each rank's delta region (``--delta-region-mb``); 0: none.

    Raises:
        RuntimeError: a replica exited or was not ready within `ready_timeout_s` (the message
            holds the tail of its log); every replica started is stopped first.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    env[PARENT_PID_ENV] = str(os.getpid())
    if api_key:
        env[API_KEY_ENV] = api_key
    launched: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    try:
        for index in range(num_replicas):
            ready_file = log_dir / f"replica{index}.ready.json"
            ready_file.unlink(missing_ok=True)
            log_path = log_dir / f"replica{index}.log"
            cmd = [
                sys.executable, "-m", "weightsync", "serve",
                "--model", str(model_path), "--tp", str(tp), "--ep", str(ep), "--device", device,
                "--port", "0", "--bootstrap-port", "0", "--ready-file", str(ready_file),
                *(["--dtype", dtype] if dtype else []),
                *(["--delta-region-mb", str(delta_region_mb)] if delta_region_mb else []),
                *extra_args,
            ]  # fmt: skip
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
                )
            launched.append((process, ready_file, log_path))
        deadline = time.monotonic() + ready_timeout_s
        replicas = []
        for process, ready_file, log_path in launched:
            info = _wait_ready(process, ready_file, log_path, deadline)
            replicas.append(
                ServedReplica(
                    url=info["url"],
                    bootstrap_url=info["bootstrap_url"],
                    port=info["port"],
                    bootstrap_port=info["bootstrap_port"],
                    tp=tp,
                    process=process,
                    log_path=log_path,
                )
            )
        return replicas
    except BaseException:
        for process, _, _ in launched:
            _stop(process, 10.0)
        raise


@contextlib.contextmanager
def serve_replicas(model_path: str | Path, **kwargs) -> Iterator[list[ServedReplica]]:
    """`start_replicas` as a context manager that stops every replica on exit."""
    replicas = start_replicas(model_path, **kwargs)
    try:
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


def wait_healthy(url: str, process: subprocess.Popen[bytes], deadline: float) -> None:
    """Poll ``url/health`` until it answers 200, the process exits or the deadline passes.

    Raises:
        RuntimeError: the process exited or the deadline passed.
    """
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        if _answers_ok(f"{url}/health"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 in time")
        time.sleep(0.1)


def _answers_ok(url: str) -> bool:
    """Whether a GET of `url` answers 200 (no proxy: replicas are on this host)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5.0) as reply:
            return reply.status == 200
    except OSError:
        return False


def _wait_ready(
    process: subprocess.Popen[bytes], ready_file: Path, log_path: Path, deadline: float
) -> dict:
    # The ready file appears once the replica serves (written atomically by rank 0).
    while not ready_file.exists():
        if process.poll() is not None:
            raise RuntimeError(
                f"weightsync serve exited with code {process.returncode} before it was ready; "
                f"log {log_path}:\n{_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"weightsync serve was not ready in time:\n{_tail(log_path)}")
        time.sleep(0.1)
    info = json.loads(ready_file.read_text())
    try:
        wait_healthy(info["url"], process, deadline)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; log {log_path}:\n{_tail(log_path)}") from exc
    return info


def _stop(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
    # Whatever is left of the group (a stuck TP rank) goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def _tail(path: Path, num_lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"
