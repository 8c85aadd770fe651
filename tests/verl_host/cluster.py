"""The verl venv (scripts/setup-verl) and a Ray cluster on 127.0.0.1 for the verl tests.

Plain Python (the standard library only): tests/test_verl.py imports it from the project's
own venv and runs everything verl in the verl venv's interpreter.

The cluster is one head node started with the venv's ``ray start --block``, bound to
127.0.0.1 (``--node-ip-address``, with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` so that Ray's
workers report 127.0.0.1 too, and gloo on ``lo``), every port it listens on picked free, its
session files in a short private folder (Unix socket paths are limited to 107 bytes), and
Ray's token authentication on with a token of its own in that folder (`RayCluster.env`: the
drivers' environment), so nothing else on the machine joins it.
Logical resources: 16 CPUs and 8 GPUs, since verl's resource pools ask for GPU bundles; the
processes run on this machine's CPUs. ``stop`` SIGTERMs ``ray start``, which stops what it
started, then SIGKILLs its process group.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SETUP_SCRIPT = ROOT / "scripts" / "setup-verl"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}


def venv_if_built() -> Path | None:
    """The verl venv when scripts/setup-verl has built it for the current pins, else None."""
    out = subprocess.run(
        [str(SETUP_SCRIPT), "--print-path"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    path = Path(out)
    return path if (path / ".weightsync-complete").is_file() else None


def verl_env(venv: Path, *, patched: bool) -> dict[str, str]:
    """The environment of a process in the verl venv: this checkout's src, the test host
    modules and, for ``patched``, the patched copy of verl ahead of the installed one."""
    paths = [str(ROOT / "src"), str(HERE)]
    if patched:
        paths.insert(0, str(venv / "verl-patched"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(LOOPBACK_ENV)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass(slots=True, kw_only=True)
class RayCluster:
    """A running head node: ``address`` is what ``ray.init(address=...)`` takes."""

    address: str
    process: subprocess.Popen[bytes]
    temp_dir: Path
    log_path: Path
    env: dict[str, str]

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Wait until the head node accepts drivers.

        Raises:
            RuntimeError: ``ray start`` exited or did not come up in time (its log tail).
        """
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log_path.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"ray start did not come up (exit {self.process.poll()}):\n{tail}"
                )
            time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the head node and everything it started."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_ray(venv: Path) -> RayCluster:
    """Start a head node from the verl venv; `RayCluster.wait_ready` waits until it is up."""
    temp_dir = Path(tempfile.mkdtemp(prefix="wsray", dir="/tmp"))
    log_path = temp_dir / "ray-start.log"
    token_path = temp_dir / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    gcs, agent, metrics, runtime_env, client = _free_ports(5)
    cmd = [
        str(venv / "bin" / "ray"), "start", "--head", "--block",
        "--node-ip-address=127.0.0.1", f"--port={gcs}",
        f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}", f"--ray-client-server-port={client}",
        "--include-dashboard=false", "--disable-usage-stats",
        "--num-cpus=16", "--num-gpus=8", f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    env = {**verl_env(venv, patched=False), **auth}
    env.pop("PYTHONPATH")
    # No idle workers started ahead of need: each one imports Ray on these few cores.
    env.update({"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"})
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return RayCluster(
        address=f"127.0.0.1:{gcs}",
        process=process,
        temp_dir=temp_dir,
        log_path=log_path,
        env=auth,
    )
