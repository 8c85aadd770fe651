"""Start and stop a real SGLang 0.5.23 server on a CPU-only machine, for interop tests.

The server runs from its own virtualenv (built by scripts/setup-sglang, see `ensure_venv`) with
the import stubs and CPU patches of `stubs/` on its PYTHONPATH. This module is plain Python (the
standard library only), so the tests import it from the project's own venv:

    venv = ensure_venv()
    server = start_sglang(venv, model_dir, tp=1, log_path=tmp_path / "sglang.log")
    try:
        reply = server.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {...}})
    finally:
        server.stop()

A server is in a process session of its own (`stop` signals the whole group), and its launcher is
SIGKILLed by the kernel when the thread that started it dies (PR_SET_PDEATHSIG; SGLang's own
scheduler and detokenizer processes die with the launcher the same way), so a crashed or killed
test leaves no server behind. Start servers from a thread that outlives them (pytest's main
thread does).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
STUBS_DIR = HERE / "stubs"
SETUP_SCRIPT = HERE.parents[1] / "scripts" / "setup-sglang"
HOST = "127.0.0.1"
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy

# Sets the launcher's parent-death signal, then becomes the launcher (the signal survives exec).
_TRAMPOLINE = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(os.environ.pop("WEIGHTSYNC_SGLANG_PARENT")):
    sys.exit("sglang launcher: the test process died before the server started")
os.execv(sys.executable, [sys.executable, "-m", "sglang.launch_server", *sys.argv[1:]])
"""


class SGLangStartError(RuntimeError):
    """The server exited, or did not serve before the deadline; the message has its log tail."""


class Reply(NamedTuple):
    status: int
    body: Any  # the parsed JSON, or the text when the body is not JSON
    headers: Mapping[str, str]


def ensure_venv(*, env: Mapping[str, str] | None = None) -> Path:
    """Build (once; it is cached) SGLang's venv with scripts/setup-sglang and return its path."""
    out = subprocess.run(
        [str(SETUP_SCRIPT)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    ).stdout
    return Path(out.strip().splitlines()[-1])


def venv_if_built() -> Path | None:
    """The SGLang venv when scripts/setup-sglang has built it for the current pins, else None
    (nothing is built)."""
    out = subprocess.run(
        [str(SETUP_SCRIPT), "--print-path"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    path = Path(out)
    return path if (path / ".weightsync-complete").is_file() else None


def free_port() -> int:
    """A port free on loopback now, below the ephemeral range.

    The server binds it some seconds later; an ephemeral port could be taken in between by any
    outgoing connection on the machine (SGLang picks its own later-bound ports the same way).
    """
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for port in random.sample(range(20000, ephemeral_low), 200):
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def threads_bind(tp: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `tp` ranks: this process's CPUs split into tp groups.

    SGLang asserts tp <= NUMA nodes unless this is set. Without AMX (and always with the
    sgl_kernel stub) SGLang never pins threads with it: it is only checked and logged.
    """
    cpus = sorted(os.sched_getaffinity(0))
    groups = [
        cpus[i * len(cpus) // tp : (i + 1) * len(cpus) // tp] or [cpus[i % len(cpus)]]
        for i in range(tp)
    ]
    return "|".join(",".join(map(str, group)) for group in groups)


@dataclass
class SGLangServer:
    process: subprocess.Popen
    port: int
    bootstrap_port: int
    log_path: Path
    api_key: str | None = None
    tp: int = 1
    started_at: float = 0.0  # time.monotonic() at launch
    ready_s: float | None = None  # seconds from launch to ready

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def bootstrap_url(self) -> str:
        """The engine-info bootstrap server (a thread of the launcher; it has no auth)."""
        return f"http://{HOST}:{self.bootstrap_port}"

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        base: str | None = None,
        auth: bool = True,
        timeout: float = 60.0,
    ) -> Reply:
        """One HTTP request; any status comes back as a Reply (no exception for 4xx/5xx).

        `body` is sent as JSON unless it is None (then no body). `auth` adds the bearer api key.
        """
        headers = {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth and self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            (base or self.url) + path, data=data, headers=headers, method=method
        )
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                status, raw, resp_headers = resp.status, resp.read(), resp.headers
        except urllib.error.HTTPError as err:
            status, raw, resp_headers = err.code, err.read(), err.headers
        text = raw.decode(errors="replace")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        return Reply(status, parsed, dict(resp_headers.items()))

    def get(self, path: str, **kwargs: Any) -> Reply:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Reply:
        return self.request("POST", path, body, **kwargs)

    def log_tail(self, lines: int = 60) -> str:
        """The last `lines` lines of the server's log."""
        return log_tail(self.log_path, lines)

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Wait until the server serves and has finished its warmup; returns seconds since launch.

        Polls GET /model_info until 200, then GET /ready until 200; neither runs a generation
        (/health does). /ready turns 200 once SGLang's own warmup request (a /generate it sends
        itself about a second after /model_info answers) has succeeded. A /pause_generation
        before that holds the warmup until /continue_generation; one that aborts the warmup
        makes SGLang kill itself (http_server.py _execute_server_warmup).
        """
        deadline = time.monotonic() + timeout
        path = "/model_info"
        while True:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise SGLangStartError(
                    f"SGLang exited with {code} before it served; {self.log_path}:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(OSError):  # refused, reset, timed out: not up yet
                if self.get(path, timeout=5).status == 200:
                    if path == "/ready":
                        self.ready_s = time.monotonic() - self.started_at
                        return self.ready_s
                    path = "/ready"
                    continue
            if time.monotonic() > deadline:
                self.stop()
                raise SGLangStartError(
                    f"SGLang did not answer {path} with 200 within {timeout:.0f} s; "
                    f"{self.log_path}:\n" + self.log_tail()
                )
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> float:
        """SIGTERM the server's process group, SIGKILL what is left after `timeout` s.

        Returns the seconds it took. Safe to call more than once.
        """
        start = time.monotonic()
        pids = stop_group(self.process, timeout)
        # SGLang names some /dev/shm segments after the creating pid (sgl_shm_<kind>_<pid>_<rand>,
        # 24 MiB sparse for tp > 1) and leaves them when its processes are killed.
        for pid in pids:
            for segment in Path("/dev/shm").glob(f"sgl_shm_*_{pid}_*"):
                segment.unlink(missing_ok=True)
        return time.monotonic() - start

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def log_tail(path: Path, lines: int = 60) -> str:
    """The last `lines` lines of the log at `path` (or why there is none)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"(no log: {err})"


def stop_group(process: subprocess.Popen, timeout: float) -> set[int]:
    """SIGTERM the process group `process` leads (it started a session of its own), SIGKILL
    what is left after `timeout` s, and wait until the group is gone (10 s more at most).

    Returns the pids the group held before the signal (for what they leave behind).
    """
    pgid = process.pid  # its own session: the group id is the launcher's pid
    pids = {pgid, *_group_pids(pgid)}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()
        if not _group_pids(pgid):
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    process.wait()
    while _group_pids(pgid) and time.monotonic() < deadline + 10:
        time.sleep(0.2)
    return pids


def _group_pids(pgid: int) -> list[int]:
    """The processes of the group that are not zombies."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            pids.append(int(stat.parent.name))
    return pids


def start_sglang(
    venv: Path,
    model_path: Path,
    *,
    tp: int = 1,
    dtype: str = "float32",
    api_key: str | None = None,
    log_path: Path,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    stubs: Path = STUBS_DIR,
    wait: bool = True,
    timeout: float = 600.0,
) -> SGLangServer:
    """Launch `python -m sglang.launch_server` from `venv` on free loopback ports.

    With `wait` (the default) it returns once the server is ready (see `SGLangServer.wait_ready`)
    and raises SGLangStartError, the log tail included, if it exits or is not ready in
    `timeout` s. The server's stdout and stderr go to `log_path`.
    """
    port = free_port()
    bootstrap_port = free_port()
    while bootstrap_port == port:
        bootstrap_port = free_port()

    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", *_PROXY_VARS)
    }  # the server talks to loopback only (its warmup, its bootstrap server): no proxies
    env.update(
        PYTHONPATH=str(stubs),  # sgl_kernel/torchvision stubs, sitecustomize's CPU patches
        SGLANG_USE_CPU_ENGINE="1",  # SGLang's CPU device path
        SGLANG_HOST_IP=HOST,  # the TransferEngine session id on loopback, not a NIC address
        MOONCAKE_PROTOCOL="tcp",
        MC_FORCE_TCP="1",  # else Mooncake installs RDMA where a device exists, whatever protocol
        MC_LOG_LEVEL=env.get("MC_LOG_LEVEL", "ERROR"),
        HF_HUB_OFFLINE="1",  # a local checkpoint; no hub to reach here
        WEIGHTSYNC_SGLANG_PARENT=str(os.getpid()),
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # tp > 1 forms a gloo group on loopback
    if tp > 1:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", threads_bind(tp))
    env.update(extra_env or {})

    args = [
        "--model-path", str(model_path),
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        "--skip-tokenizer-init",
        "--remote-instance-weight-loader-start-seed-via-transfer-engine",
        "--engine-info-bootstrap-port", str(bootstrap_port),
        "--host", HOST,
        "--port", str(port),
        "--max-total-tokens", "2048",
        "--dtype", dtype,
        "--tp-size", str(tp),
    ]  # fmt: skip
    if api_key is not None:
        args += ["--api-key", api_key]
    args += list(extra_args)

    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [str(Path(venv) / "bin" / "python"), "-c", _TRAMPOLINE, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    server = SGLangServer(
        process=process,
        port=port,
        bootstrap_port=bootstrap_port,
        log_path=log_path,
        api_key=api_key,
        tp=tp,
        started_at=time.monotonic(),
    )
    if wait:
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
    return server


if __name__ == "__main__":  # manual use: python tests/sglang_cpu/launch.py MODEL_DIR [TP]
    model = Path(sys.argv[1])
    tp_arg = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    srv = start_sglang(ensure_venv(), model, tp=tp_arg, log_path=Path("sglang-cpu.log"))
    print(f"ready in {srv.ready_s:.1f} s: {srv.url} (bootstrap {srv.bootstrap_url}); Ctrl-C stops")
    try:
        srv.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print(f"stopped in {srv.stop():.1f} s")
