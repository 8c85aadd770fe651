"""What a replica serves, read from `/server_info`: SGLang as released and the reference
server; parallelism derived as SGLang derives it; settings that move weights refused."""

from __future__ import annotations

import json
import re

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


# SGLang 0.5.23 resolves `--dp-size N --enable-dp-attention` to `attn_dp_size = N`,
# `dp_size = 1` and reports `enable_dp_attention = attn_dp_size > 1`; older servers report
# the width as `dp_size` beside `enable_dp_attention` and no `attn_dp_size`.
def _dp_attention(spelling: str, width: int) -> dict:
    if spelling == "attn_dp_size":
        return {"attn_dp_size": width, "dp_size": 1, "enable_dp_attention": width > 1}
    return {"dp_size": width, "enable_dp_attention": True}


@pytest.mark.parametrize("spelling", ["attn_dp_size", "dp_size"])
@pytest.mark.parametrize(("tp", "width"), [(2, 2), (4, 2), (8, 2), (8, 4), (8, 8), (4, 1)])
def test_dp_attention_is_derived_as_sglang_places_its_ranks(
    spelling: str, tp: int, width: int
) -> None:
    info = {**SGLANG, "tp_size": tp, "ep_size": tp, **_dp_attention(spelling, width)}
    assert refusal(info) is None
    attn_tp = tp // width
    for rank in range(tp):
        derived = derive_parallelism(info, rank)
        # runtime_context.derive_attention_ranks: tp_rank = attn_dp_rank * attn_tp + attn_tp_rank
        assert (derived.attn_tp_size, derived.attn_dp_size) == (attn_tp, width)
        assert (derived.attn_tp_rank, derived.attn_dp_rank) == (rank % attn_tp, rank // attn_tp)
        # MoE stays over the whole TP group.
        assert (derived.ep_size, derived.ep_rank, derived.moe_tp_size) == (tp, rank, 1)


def test_dp_attention_matches_sglangs_own_derivation() -> None:
    import subprocess

    from sglang_cpu.launch import venv_if_built

    venv = venv_if_built()
    if venv is None:
        pytest.skip("SGLang's venv is not built (scripts/setup-sglang)")
    cases = [
        (tp, width) for tp in (1, 2, 4, 8, 16) for width in (1, 2, 4, 8, 16) if tp % width == 0
    ]
    script = (
        "import json, sys\n"
        "from sglang.srt.runtime_context import derive_attn_tp_size, derive_attention_ranks\n"
        "out = []\n"
        "for tp, width in json.loads(sys.argv[1]):\n"
        "    attn_tp = derive_attn_tp_size(tp_size=tp, attn_cp_size=1, attn_dp_size=width)\n"
        "    for rank in range(tp):\n"
        "        r = derive_attention_ranks(tp_rank=rank, attn_tp_size=attn_tp, attn_cp_size=1)\n"
        "        out.append([tp, width, rank, attn_tp, *r])\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    table = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(table) == sum(tp for tp, _ in cases)
    for tp, width, rank, attn_tp, attn_tp_rank, attn_dp_rank in table:
        for spelling in ("attn_dp_size", "dp_size"):
            info = {**SGLANG, "tp_size": tp, **_dp_attention(spelling, width)}
            derived = derive_parallelism(info, rank)
            assert (derived.attn_tp_size, derived.attn_tp_rank, derived.attn_dp_rank) == (
                attn_tp,
                attn_tp_rank,
                attn_dp_rank,
            ), (tp, width, rank, spelling)


@pytest.mark.parametrize(
    ("changes", "dense", "dp_lm_head"),
    [
        ({"moe_dense_tp_size": 1}, 1, False),
        ({"moe_dense_tp_size": 4}, 4, False),
        ({"attn_dp_size": 4, "enable_dp_attention": True, "moe_dense_tp_size": 1}, 1, False),
        (
            {"attn_dp_size": 2, "enable_dp_attention": True, "enable_dp_lm_head": True},
            None,
            True,
        ),
        # SGLang turns --enable-dp-lm-head off where the server has a single DP rank.
        ({"enable_dp_lm_head": True}, None, False),
    ],
)
def test_layouts_sglang_runs_are_derived_not_refused(changes, dense, dp_lm_head) -> None:
    info = {**SGLANG, "tp_size": 4, **changes}
    assert refusal(info) is None
    derived = derive_parallelism(info, 3)
    assert (derived.moe_dense_tp_size, derived.enable_dp_lm_head) == (dense, dp_lm_head)


def test_fused_shared_experts_come_from_the_published_parameters() -> None:
    # /server_info cannot say (SGLang decides by the GPU): the caller passes what the rank's
    # w13_weight holds (weightsync.plan.served_targets).
    info = {**SGLANG, "tp_size": 2}
    assert derive_parallelism(info, 1).num_fused_shared_experts == 0
    assert derive_parallelism(info, 1, num_fused_shared_experts=1).num_fused_shared_experts == 1


# Servers that report what SGLang would not run, and widths weightsync does not write: each
# refused before any write, naming the flag, and never derived into a layout.
@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"tp_size": 4, "attn_dp_size": 3, "enable_dp_attention": True}, "--attn-dp-size"),
        ({"tp_size": 4, "dp_size": 3, "enable_dp_attention": True}, "--attn-dp-size"),
        ({"tp_size": 4, "attn_dp_size": 8, "enable_dp_attention": True}, "--attn-dp-size"),
        ({"tp_size": 4, "moe_dense_tp_size": 2}, "--moe-dense-tp-size"),
        ({"tp_size": 4, "moe_dense_tp_size": 0}, "--moe-dense-tp-size"),
        ({"tp_size": 4, "moe_dense_tp_size": True}, "--moe-dense-tp-size"),
        ({"tp_size": 4, "ep_size": 3}, "--ep-size"),
        ({"tp_size": 4, "attn_dp_size": 0}, "attn_dp_size=0"),
        ({"tp_size": 4, "attn_dp_size": "2"}, "attn_dp_size='2'"),
        ({"tp_size": 4, "dp_size": 2, "enable_dp_lm_head": True}, "--enable-dp-lm-head"),
        ({"tp_size": 4, "dp_size": 2}, "--dp-size 1"),
        ({"tp_size": 4, "attn_cp_size": 2}, "--attn-cp-size 1"),
        ({"tp_size": 4, "moe_dp_size": 2}, "--moe-dp-size 1"),
        ({"tp_size": 4, "pp_size": 2}, "--pp-size 1"),
    ],
)
def test_a_server_reporting_a_layout_sglang_does_not_run_is_refused(changes, flag) -> None:
    info = {**SGLANG, **changes}
    reason = refusal(info)
    assert reason is not None and flag in reason, reason
    if "pp_size" not in changes:
        with pytest.raises(ValueError, match=re.escape(flag)):
            derive_parallelism(info, 0)


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


# The rollout's quantisation: what SGLang reports, else the checkpoint config it serves,
# else what its ranks publish; never a trainer flag.

_BF16_RANK = {"model.layers.0.mlp.down_proj.weight": [4096, 64, 2]}
_FP8_RANK = {
    "model.layers.0.mlp.down_proj.weight": [4096, 64, 1],
    "model.layers.0.mlp.down_proj.weight_scale_inv": [8192, 1, 4],
    "model.layers.0.self_attn.attn_mqa.k_scale": [8196, 1, 4],
}
_ONLINE_FP8_RANK = {
    "model.layers.0.mlp.down_proj.weight": [4096, 64, 1],
    "model.layers.0.mlp.down_proj.weight_scale": [8192, 1, 4],
}


def test_quantization_reported_by_the_server_wins() -> None:
    from weightsync.control.quantization import served_fp8_block
    from weightsync.layout.quant import fp8_quantization_config

    assert served_fp8_block(SGLANG) == 0
    assert served_fp8_block({**SGLANG, "quantization": "fp8"}) == 128
    assert served_fp8_block({**SGLANG, "quantization": "fp8", "weight_block_size": [64, 64]}) == 64
    # The block comes from the served checkpoint when the server names FP8 without one.
    config = {"model_type": "deepseek_v3", "quantization_config": fp8_quantization_config(64)}
    assert served_fp8_block({**SGLANG, "quantization": "fp8"}, checkpoint_config=config) == 64


def test_quantization_null_reads_the_checkpoint_config() -> None:
    from weightsync.control.quantization import served_fp8_block
    from weightsync.layout.quant import fp8_quantization_config

    info = {**SGLANG, "quantization": None}
    fp8 = {"model_type": "deepseek_v3", "quantization_config": fp8_quantization_config(128)}
    assert served_fp8_block(info, checkpoint_config=fp8) == 128
    assert served_fp8_block(info, checkpoint_config={"model_type": "deepseek_v3"}) == 0
    per_tensor = {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ValueError, match="weight_block_size"):
        served_fp8_block(info, checkpoint_config=per_tensor)
    awq = {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(ValueError, match="quant_method='awq'"):
        served_fp8_block(info, checkpoint_config=awq)
    with pytest.raises(ValueError, match="quantization='awq'"):
        served_fp8_block({**SGLANG, "quantization": "awq"})
    with pytest.raises(ValueError, match="not square"):
        served_fp8_block({**SGLANG, "quantization": "fp8", "weight_block_size": [128, 64]})


def test_quantization_null_reads_the_published_parameters() -> None:
    from weightsync.control.quantization import served_quantization

    info = {**SGLANG, "quantization": None}
    # SGLang detected the FP8 checkpoint itself and reports nothing; its ranks say it.
    assert served_quantization(info, weights_infos=[_FP8_RANK, _FP8_RANK]) == 128
    assert served_quantization(info, weights_infos=[_BF16_RANK]) == 0
    # A server that says FP8 while its ranks publish 2-byte weights does not lay out FP8.
    with pytest.raises(ValueError, match="disagree"):
        served_quantization({**SGLANG, "quantization": "fp8"}, weights_infos=[_BF16_RANK])
    # SGLang's online FP8 over a bf16 checkpoint: per-tensor scales, not written.
    with pytest.raises(ValueError, match="online FP8"):
        served_quantization(info, weights_infos=[_ONLINE_FP8_RANK])


def test_the_served_checkpoint_config_is_read_where_it_is_readable(tmp_path) -> None:
    from weightsync.manager.replicas import served_checkpoint_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert served_checkpoint_config({"model_path": str(tmp_path)}) == {"model_type": "deepseek_v3"}
    # A hub name, another host's path, or something unreadable: not known here.
    assert served_checkpoint_config({"model_path": "deepseek-ai/DeepSeek-V3"}) is None
    assert served_checkpoint_config({"model_path": str(tmp_path / "missing")}) is None
    assert served_checkpoint_config({}) is None
    (tmp_path / "config.json").write_text("{not json")
    assert served_checkpoint_config({"model_path": str(tmp_path)}) is None


def _fake_sglang(server_info: dict, ranks: list[dict]):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/server_info")
    async def info() -> dict:
        return server_info

    @app.get("/remote_instance_transfer_engine_info")
    async def engine_info(rank: int) -> dict:
        return {
            "rank": rank,
            "remote_instance_transfer_engine_info": [f"127.0.0.1:{1000 + rank}", ranks[rank]],
        }

    @app.get("/parallelism_config")
    async def parallelism() -> JSONResponse:
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    return app


def test_replica_targets_read_quantization_and_layout_off_an_sglang_replica(tmp_path) -> None:
    import asyncio

    from servers import app_in_thread
    from weightsync.control import RolloutClient
    from weightsync.layout.quant import fp8_quantization_config
    from weightsync.manager.replicas import replica_targets

    config = {"model_type": "deepseek_v3", "quantization_config": fp8_quantization_config(64)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = {
        **SGLANG,
        "device": "cuda",
        "tp_size": 4,
        "ep_size": 4,
        "attn_dp_size": 2,
        "enable_dp_attention": True,
        "enable_dp_lm_head": True,
        "moe_dense_tp_size": 1,
        "quantization": None,
        "model_path": str(tmp_path),
    }

    async def targets(url: str, server_info: dict) -> tuple:
        client = RolloutClient(url, api_key=None, timeout_s=10)
        try:
            return await replica_targets(client, server_info)
        finally:
            await client.aclose()

    with app_in_thread(_fake_sglang(info, [_FP8_RANK] * 4)) as url:
        ranks = asyncio.run(targets(url, info))
    # quantization null: the block is the served checkpoint's, not 128 and not a trainer's.
    assert [t.fp8_block_size for t in ranks] == [64] * 4
    assert [(t.parallelism.attn_tp_rank, t.parallelism.attn_dp_rank) for t in ranks] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
    ]
    assert all(t.parallelism.enable_dp_lm_head for t in ranks)
    assert all(t.parallelism.moe_dense_tp_size == 1 for t in ranks)
    # Without a readable checkpoint, the published parameters say FP8 (DeepSeek's block).
    remote = {**info, "model_path": "deepseek-ai/DeepSeek-V3"}
    with app_in_thread(_fake_sglang(remote, [_FP8_RANK] * 4)) as url:
        ranks = asyncio.run(targets(url, remote))
    assert [t.fp8_block_size for t in ranks] == [128] * 4
