"""What a replica serves, read from `/server_info`: SGLang as released and the reference
server; parallelism derived as SGLang derives it; settings that move weights refused."""

from __future__ import annotations

import json

import pytest

from weightsync.control.protocol import (
    PARALLELISM_CONFIG,
    POST_LOAD_AT_UPDATE_END,
    ReplicaProtocol,
    derive_parallelism,
    num_ranks,
    refusal,
)
from weightsync.layout import ParallelismConfig

# The keys SGLang 0.5.23's /server_info holds for these (of its 556), as it answers at tp2.
SGLANG = {
    "version": "0.5.23",
    "tp_size": 2,
    "pp_size": 1,
    "ep_size": 1,
    "dp_size": 1,
    "enable_dp_attention": False,
    "moe_dense_tp_size": None,
    "device": "cpu",
    "dtype": "float32",
    "enable_memory_saver": False,
    "enable_weights_cpu_backup": False,
    "cpu_offload_gb": 0,
    "offload_group_size": -1,
}


def test_the_kind_of_server_is_read_off_server_info() -> None:
    sglang = ReplicaProtocol.from_server_info(SGLANG)
    assert (sglang.kind, sglang.version, sglang.capabilities) == ("sglang", "0.5.23", frozenset())
    assert sglang.describe() == "SGLang 0.5.23"
    ours = ReplicaProtocol.from_server_info(
        {**SGLANG, "weightsync": {"version": "0.1.0", "capabilities": [PARALLELISM_CONFIG]}}
    )
    assert ours.kind == "weightsync" and ours.serves(PARALLELISM_CONFIG)
    assert ours.describe() == "weightsync 0.1.0 (parallelism_config)"


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (4, 2), (8, 8)])
def test_derived_parallelism_is_sglangs(tp: int, ep: int) -> None:
    info = {**SGLANG, "tp_size": tp, "ep_size": ep}
    assert num_ranks(info) == tp
    for rank in range(tp):
        derived = derive_parallelism(info, rank)
        assert derived == ParallelismConfig(tp_size=tp, tp_rank=rank, ep_size=ep)
        assert derived.moe_tp_size == tp // ep and derived.ep_rank == rank // (tp // ep)
    with pytest.raises(ValueError, match="outside a replica"):
        derive_parallelism(info, tp)


def test_dp_attention_is_derived_and_refused() -> None:
    info = {**SGLANG, "tp_size": 4, "enable_dp_attention": True, "dp_size": 2}
    derived = derive_parallelism(info, 3)
    assert (derived.attn_tp_size, derived.attn_tp_rank, derived.attn_dp_rank) == (2, 1, 1)
    assert "attention data parallelism" in refusal(info)


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"enable_memory_saver": True}, "--enable-memory-saver"),
        ({"enable_weights_cpu_backup": True}, "--enable-weights-cpu-backup"),
        ({"cpu_offload_gb": 4}, "--cpu-offload-gb 0"),
        ({"offload_group_size": 2}, "--offload-group-size -1"),
        ({"dtype": "bfloat16"}, "--dtype float32"),
        ({"dtype": "auto"}, "--dtype float32"),
        ({"pp_size": 2}, "pipeline-parallel"),
        ({"moe_dense_tp_size": 1}, "--moe-dense-tp-size"),
    ],
)
def test_settings_that_move_weights_are_refused_with_the_flag(changes, flag) -> None:
    assert refusal(SGLANG) is None
    reason = refusal({**SGLANG, **changes})
    assert reason is not None and flag in reason


def test_cpu_half_precision_is_fine_on_gpu_and_on_the_reference_server() -> None:
    assert refusal({**SGLANG, "device": "cuda", "dtype": "bfloat16"}) is None
    ours = {**SGLANG, "dtype": "bfloat16", "weightsync": {"version": "0.1.0"}}
    assert refusal(ours) is None


def test_a_recorded_sglang_server_info_parses() -> None:
    # The shape SGLang 0.5.23 answers with (a flat dict of its arguments), trimmed.
    info = json.loads(json.dumps({**SGLANG, "internal_states": [{"weight_version": "7"}]}))
    assert ReplicaProtocol.from_server_info(info).kind == "sglang"
    assert [derive_parallelism(info, r).tp_rank for r in range(num_ranks(info))] == [0, 1]


def test_a_replica_that_moves_its_weights_is_refused_before_any_write() -> None:
    import asyncio

    from fastapi import FastAPI

    from servers import app_in_thread
    from weightsync.errors import RemoteReplicaError
    from weightsync.manager import SyncManager

    calls: list[str] = []
    app = FastAPI()

    @app.get("/server_info")
    async def server_info() -> dict:
        calls.append("/server_info")
        return {**SGLANG, "tp_size": 1, "enable_memory_saver": True}

    @app.api_route("/{route:path}", methods=["GET", "POST"])
    async def anything(route: str) -> dict:
        calls.append(f"/{route}")
        return {"status": "ok", "success": True, "message": ""}

    async def update(url: str) -> None:
        async with SyncManager([url]) as manager:
            await manager.open_update()
            raise AssertionError("nothing may be written into a refused replica")

    with (
        app_in_thread(app) as url,
        pytest.raises(RemoteReplicaError, match="--enable-memory-saver") as refused,
    ):
        asyncio.run(update(url))
    assert refused.value.replica == url
    # Refused from /server_info alone, before anything: no rank's addresses were asked for
    # and generation was never paused.
    assert not any("transfer_engine_info" in call for call in calls)
    assert "/pause_generation" not in calls


@pytest.mark.parametrize(
    ("info", "runs"),
    [
        (SGLANG, True),
        ({**SGLANG, "version": "0.5.22"}, False),
        ({**SGLANG, "version": "0.6.0rc1"}, True),
        ({**SGLANG, "version": "unknown"}, False),
        ({**SGLANG, "weightsync": {"version": "0.1.0", "capabilities": []}}, False),
        (
            {
                **SGLANG,
                "weightsync": {"version": "0.1.0", "capabilities": [POST_LOAD_AT_UPDATE_END]},
            },
            True,
        ),
    ],
)
def test_which_replicas_run_post_load_at_end_weight_update(info: dict, runs: bool) -> None:
    # A one-sided write of an MLA model needs it: w_kc / w_vc follow kv_b_proj only then.
    assert ReplicaProtocol.from_server_info(info).runs_post_load() is runs
