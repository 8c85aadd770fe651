"""Real vLLM 0.32.0 (its CPU build, from the venv scripts/setup-vllm builds) serving a tiny
checkpoint the way weightsync's vLLM integration will drive it: started by the tests' launcher
(tests/vllm_cpu/launch.py) with its RL and development routes on, greedy tokens equal to
transformers' at tp 1 and 2, and a worker extension from tests/ that imports this checkout's
weightsync and sees weightsync's parameter names and shapes in the worker."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from vllm_cpu.fixtures import vllm_checkpoint, vllm_server, vllm_venv_or_skip
from vllm_cpu.launch import SRC_DIR, start_vllm
from weightsync.layout import rank_layout
from weightsync.testing.reference import greedy_tokens

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

__all__ = ["vllm_checkpoint", "vllm_server"]  # fixtures, used by name

PROMPTS = ((1, 2, 3, 4), (5, 6, 7), (100, 200, 300, 400, 500))
NEW_TOKENS = 8
# The linear weights vLLM's CPU post-processing repacks into oneDNN handles, leaving the
# parameter empty (tests/test_layout_vllm.py has the tables).
_REPACKED = re.compile(r"\.(qkv_proj|o_proj|gate_up_proj|down_proj)\.weight$")


def test_greedy_generation_equals_transformers(vllm_server, vllm_checkpoint) -> None:
    """vLLM's greedy tokens for token-id prompts equal transformers' on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_checkpoint, dtype=torch.float32)
    expected = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
    start = time.monotonic()
    served = [vllm_server.greedy(prompt, NEW_TOKENS) for prompt in PROMPTS]
    elapsed = time.monotonic() - start
    assert served == expected, f"vLLM served {served}, transformers {expected}"
    print(
        f"vLLM ready in {vllm_server.ready_s:.1f} s; {len(PROMPTS)} generations in {elapsed:.2f} s"
    )


def test_tp2_greedy_generation_equals_transformers(vllm_checkpoint, tmp_path) -> None:
    """Two tensor-parallel ranks (a gloo group on loopback, one core each) serve the same
    greedy tokens as transformers."""
    from transformers import AutoModelForCausalLM

    venv = vllm_venv_or_skip()
    model = AutoModelForCausalLM.from_pretrained(vllm_checkpoint, dtype=torch.float32)
    expected = greedy_tokens(model, torch.float32, PROMPTS[:2], NEW_TOKENS)
    server = start_vllm(
        venv, vllm_checkpoint, tp=2, dtype="float32", log_path=tmp_path / "vllm-tp2.log"
    )
    try:
        assert server.get("/get_world_size").body == {"world_size": 2}
        served = [server.greedy(prompt, NEW_TOKENS) for prompt in PROMPTS[:2]]
    finally:
        server.stop()
    assert served == expected, f"vLLM tp2 served {served}, transformers {expected}"


def test_rl_routes_are_served(vllm_server) -> None:
    """The routes the integration drives exist with VLLM_SERVER_DEV_MODE=1: vLLM's world size
    and pause state answer, and pausing and resuming round-trip."""
    assert vllm_server.get("/get_world_size").body == {"world_size": 1}
    assert vllm_server.get("/is_paused").body == {"is_paused": False}
    assert vllm_server.post("/pause?mode=wait").status == 200
    assert vllm_server.get("/is_paused").body == {"is_paused": True}
    assert vllm_server.post("/resume").status == 200
    assert vllm_server.get("/is_paused").body == {"is_paused": False}


def test_worker_extension_runs_the_checkout(vllm_server, vllm_checkpoint) -> None:
    """``--worker-extension-cls`` methods answer through ``/collective_rpc``; the worker
    imports this checkout's weightsync; its parameters carry weightsync's names and shapes,
    the linear weights emptied by vLLM's CPU post-processing."""
    reply = vllm_server.post("/collective_rpc", {"method": "probe_weightsync_path"})
    assert reply.body == {"results": [str(SRC_DIR / "weightsync" / "__init__.py")]}
    reply = vllm_server.post("/collective_rpc", {"method": "probe_parameters"})
    assert reply.status == 200, reply.body
    served = {name: (shape, dtype) for name, shape, dtype in reply.body["results"][0]}
    config = json.loads((vllm_checkpoint / "config.json").read_text())
    layout = rank_layout(config, {"tp_size": 1, "tp_rank": 0}, "float32")
    assert set(served) == set(layout)
    for name, param in layout.items():
        shape = [0] if _REPACKED.search(name) else list(param.shape)
        assert served[name] == (shape, "float32"), name
