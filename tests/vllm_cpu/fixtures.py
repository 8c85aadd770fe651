"""pytest fixtures for the tests against real vLLM 0.32.0 on the CPU; a test module imports the
ones it uses (``from vllm_cpu.fixtures import vllm_checkpoint, vllm_tp1, vllm_tp2``).

The two servers are the session's: started once, together (each takes most of a minute on
this machine), and shared by every vLLM test module, each with weightsync's worker extension
in its workers (imported from this checkout's src/). A module must not assume what a shared
server holds when it starts: it writes what it needs first. Tests that use them skip, with the
reason, when vLLM's venv is not built (``scripts/setup --tests`` builds it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_cpu.launch import SRC_DIR, VLLMServer, start_vllm, vllm_venv_if_built

# vLLM's CPU attention takes head_dim 32 and up (it refuses the "tiny" preset's 16 when the
# first request runs); the rest is the preset.
TINY_HEAD_DIM = 32
EXTENSION = "weightsync.integrations.vllm.WorkerExtension"
# Every rank of the shared tp1 server registers a delta region of this size (the
# extension reads it from vLLM's environment when its first caller names none).
DELTA_REGION_MB = 8


def vllm_venv_or_skip() -> Path:
    """vLLM's venv, or skip the test with the reason when it is not built."""
    venv = vllm_venv_if_built()
    if venv is None:
        pytest.skip("real vLLM's venv is not built here: run scripts/setup --tests")
    return venv


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3 in float32 (the "tiny" preset, head_dim 32): vLLM computes in the
    weights' dtype, so greedy tokens equal transformers' float32 ones only in float32."""
    import torch

    from weightsync.testing.presets import preset_config, write_random_checkpoint

    path = tmp_path_factory.mktemp("vllm-qwen3")
    config = preset_config("tiny", head_dim=TINY_HEAD_DIM)
    return write_random_checkpoint(path, config, dtype=torch.float32, seed=11)


def _launch(venv: Path, checkpoint: Path, log_dir: Path, tp: int, **env: str) -> VLLMServer:
    # Launched from the main thread, which outlives it (its parent-death signal follows the
    # thread that started it); not waited for, so that both servers come up at once.
    return start_vllm(
        venv,
        checkpoint,
        tp=tp,
        dtype="float32",
        log_path=log_dir / f"vllm-tp{tp}.log",
        worker_extension_cls=EXTENSION,
        extra_env={"PYTHONPATH": str(SRC_DIR), **env},  # the checkout's weightsync
        wait=False,
    )


@pytest.fixture(scope="session")
def vllm_servers(request, tmp_path_factory) -> Iterator[dict[int, VLLMServer]]:
    """Both of the session's servers by tp, launched together: every vLLM test module uses
    both, and each takes most of a minute to start, largely waiting on its own workers."""
    venv = vllm_venv_or_skip()
    checkpoint = request.getfixturevalue("vllm_checkpoint")  # only once vLLM can run
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    servers: dict[int, VLLMServer] = {}
    try:
        servers[1] = _launch(
            venv, checkpoint, log_dir, 1, WEIGHTSYNC_DELTA_REGION_MB=str(DELTA_REGION_MB)
        )
        servers[2] = _launch(venv, checkpoint, log_dir, 2)
        for server in servers.values():
            server.wait_ready(600.0)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="session")
def vllm_tp1(vllm_servers) -> VLLMServer:
    """A real vLLM 0.32.0 server (tp 1, float32, its RL and dev routes on, weightsync's
    worker extension with a `DELTA_REGION_MB` delta region) serving `vllm_checkpoint`."""
    return vllm_servers[1]


@pytest.fixture(scope="session")
def vllm_tp2(vllm_servers) -> VLLMServer:
    """The same at tp 2 (two workers in a gloo group on loopback), without a delta region."""
    return vllm_servers[2]
