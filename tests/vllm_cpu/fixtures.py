"""pytest fixtures for the tests against real vLLM 0.32.0 on the CPU; a test module imports the
ones it uses (``from vllm_cpu.fixtures import vllm_checkpoint, vllm_server``).

Tests that use them skip, with the reason, when vLLM's venv is not built (``scripts/setup
--tests`` builds it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_cpu.launch import SRC_DIR, VLLMServer, start_vllm, vllm_venv_if_built

# vLLM's CPU attention takes head_dim 32 and up (it refuses the "tiny" preset's 16 when the
# first request runs); the rest is the preset.
TINY_HEAD_DIM = 32
PROBE_EXTENSION = "vllm_cpu.probe_extension.ProbeExtension"
TESTS_DIR = SRC_DIR.parent / "tests"


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


@pytest.fixture(scope="module")
def vllm_server(request, tmp_path_factory) -> Iterator[VLLMServer]:
    """One real vLLM 0.32.0 server (tp 1, float32, its RL and dev routes on, the tests'
    `PROBE_EXTENSION` in its workers) serving `vllm_checkpoint`; ready in about a minute
    here."""
    venv = vllm_venv_or_skip()
    checkpoint = request.getfixturevalue("vllm_checkpoint")  # only once vLLM can run
    log = tmp_path_factory.mktemp("vllm-logs") / "vllm.log"
    # Started from the main thread, which outlives it (its parent-death signal follows the
    # thread that started it).
    server = start_vllm(
        venv,
        checkpoint,
        dtype="float32",
        log_path=log,
        worker_extension_cls=PROBE_EXTENSION,
        extra_env={"PYTHONPATH": f"{SRC_DIR}:{TESTS_DIR}"},  # the checkout's, then the probe
        timeout=600.0,
    )
    try:
        yield server
    finally:
        server.stop()
