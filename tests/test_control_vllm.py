"""What the control plane makes of a vLLM replica, from vLLM 0.32.0's own ``/server_info``
(``vllm_cpu/server_info.json``: its configuration sections as a CPU server of the tiny Qwen3
reported them): the SGLang-shaped server info the manager reads, the protocol it learns, and
the settings it refuses before any write, each naming the flag to change. The calls
themselves run against real vLLM in tests/test_vllm_sync.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from weightsync.control.protocol import (
    PARALLELISM_CONFIG,
    POST_LOAD_AT_UPDATE_END,
    WEIGHT_SYNC_DELTA,
    WEIGHT_UPDATE_DIGEST,
    ReplicaProtocol,
    num_ranks,
    refusal,
    served_dtype,
)
from weightsync.control.vllm import is_vllm_server_info, server_info
from weightsync.manager.replicas import replica_instance

SERVED = json.loads((Path(__file__).parent / "vllm_cpu" / "server_info.json").read_text())


def _rank(rank: int, **extra: Any) -> dict[str, Any]:
    return {"success": True, "rank": rank, "instance": f"i{rank}", **extra}


def _info(
    ranks: list[dict[str, Any]] | None = None, *, error: str | None = None, **sections: Any
) -> dict[str, Any]:
    """`server_info` of the stored reply, with ``{section: {key: value}}`` changed."""
    served = copy.deepcopy(SERVED)
    for section, values in sections.items():
        served["vllm_config"][section].update(values)
    extension = {"error": error} if error else {"ranks": [_rank(0)] if ranks is None else ranks}
    return server_info(served, "0.32.0", extension)


def test_vllm_server_info_in_sglangs_shape() -> None:
    """vLLM's configuration read into the keys the manager reads for SGLang."""
    assert is_vllm_server_info(SERVED)
    info = _info()
    assert is_vllm_server_info(info) and not is_vllm_server_info({"tp_size": 1})
    assert info["engine"] == "vllm" and info["version"] == "0.32.0"
    assert (info["tp_size"], info["pp_size"], info["dp_size"]) == (1, 1, 1)
    assert info["model_path"] == SERVED["vllm_config"]["model_config"]["model"]
    assert served_dtype(info) == "float32"  # vLLM says "torch.float32"
    assert info["quantization"] is None and info["enable_sleep_mode"] is False
    assert info["cpu_offload_gb"] == 0 and info["offload_group_size"] == 0
    assert num_ranks(_info(parallel_config={"tensor_parallel_size": 2})) == 2
    assert refusal(info) is None


def test_the_protocol_is_what_the_extension_serves() -> None:
    """kind ``vllm``; digests, parallelism and post-load processing when the extension
    publishes ranks, delta syncs only where every rank has a delta region; its process
    identity is its workers'."""
    protocol = ReplicaProtocol.from_server_info(_info())
    assert protocol.kind == "vllm" and protocol.version == "0.32.0"
    assert protocol.capabilities == {
        PARALLELISM_CONFIG,
        WEIGHT_UPDATE_DIGEST,
        POST_LOAD_AT_UPDATE_END,
    }
    assert protocol.runs_post_load() and protocol.describe().startswith("vLLM 0.32.0 (")
    delta = [_rank(0, delta_region=[4096, 1024]), _rank(1, delta_region=[8192, 1024])]
    assert ReplicaProtocol.from_server_info(_info(delta)).serves(WEIGHT_SYNC_DELTA)
    half = [_rank(0, delta_region=[4096, 1024]), _rank(1)]
    assert not ReplicaProtocol.from_server_info(_info(half)).serves(WEIGHT_SYNC_DELTA)
    assert ReplicaProtocol.from_server_info(_info(error="500")).capabilities == frozenset()
    assert replica_instance(_info([_rank(0), _rank(1)])) == "i0+i1"
    assert replica_instance(_info(error="500")) is None


@pytest.mark.parametrize(
    ("sections", "error", "flag"),
    [
        ({"model_config": {"enable_sleep_mode": True}}, None, "--enable-sleep-mode"),
        ({"offload_config": {"uva": {"cpu_offload_gb": 4.0}}}, None, "--cpu-offload-gb 0"),
        (
            {"offload_config": {"prefetch": {"offload_group_size": 2}}},
            None,
            "--offload-group-size 0",
        ),
        ({"parallel_config": {"pipeline_parallel_size": 2}}, None, "--pipeline-parallel-size 1"),
        ({"parallel_config": {"data_parallel_size": 2}}, None, "--data-parallel-size 1"),
        ({"model_config": {"quantization": "fp8"}}, None, "unquantised checkpoint"),
        ({}, "'CPUWorker' object has no attribute 'weightsync_init'", "--worker-extension-cls"),
    ],
)
def test_what_cannot_be_written_is_refused_naming_the_flag(sections, error, flag) -> None:
    """Settings that move or free the weights, layouts not written, and a vLLM without the
    worker extension: refused before any write, with what to change."""
    reason = refusal(_info(error=error, **sections))
    assert reason is not None and flag in reason, reason
    if error:
        assert error in reason and "VLLM_SERVER_DEV_MODE=1" in reason
