"""`weightsync serve` at tp=2 in subprocesses: every route of PROTOCOL.md, its request and
response shapes, auth, the serving-state rules and the weights checker with a Mooncake
restore from this process. One replica serves the whole module."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from servers import serve_replicas
from weightsync import __version__
from weightsync.checkpoint import load_config_dict
from weightsync.control import RolloutClient
from weightsync.control.models import ServerInfo
from weightsync.control.protocol import WEIGHT_SYNC_DELTA
from weightsync.errors import RemoteReplicaError
from weightsync.layout import rank_layout
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import preset_config, write_random_checkpoint
from weightsync.transport import MooncakeConfig, MooncakeTransport

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [3, 14, 15, 92, 65, 35]
TP = 2
OPENAPI_FILE = Path(__file__).with_name("openapi_main.json")
UPDATE_OPENAPI_ENV = "WEIGHTSYNC_UPDATE_OPENAPI"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"))


@pytest.fixture(scope="module")
def replica(checkpoint, tmp_path_factory):
    with serve_replicas(
        checkpoint, tp=TP, api_key=API_KEY, log_dir=tmp_path_factory.mktemp("logs")
    ) as (served,):
        yield served


@pytest.fixture
def http(replica):
    with httpx.Client(base_url=replica.url, timeout=60.0, headers=AUTH) as client:
        yield client


def _call(replica, method: str, *args, api_key: str | None = API_KEY, **kwargs):
    """One RolloutClient call against the replica."""

    async def main():
        async with RolloutClient(replica.url, api_key=api_key, timeout_s=60.0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(main())


def _state(http) -> dict:
    return http.get("/server_info").json()["state"]


def _wait_state(http, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = _state(http)
        if predicate(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"server state never matched; last: {state}")
        time.sleep(0.01)


def test_health_and_server_info(replica, http):
    health = http.get("/health")
    assert health.status_code == 200 and health.text == "OK"
    info = http.get("/server_info").json()
    alias = http.get("/get_server_info").json()
    assert info == alias
    ServerInfo.model_validate(info)
    assert info["tp_size"] == TP and info["pp_size"] == 1 and info["ep_size"] == 1
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["port"] == replica.port
    assert info["engine_info_bootstrap_port"] == replica.bootstrap_port
    assert info["host"] == "127.0.0.1"
    assert info["version"] == __version__
    assert _call(replica, "get_server_info") == info


def test_transfer_engine_info_both_spellings(replica, http, checkpoint):
    config = load_config_dict(checkpoint)
    for rank in range(TP):
        body = http.get("/remote_instance_transfer_engine_info", params={"rank": rank}).json()
        assert (
            body
            == http.get("/get_remote_instance_transfer_engine_info", params={"rank": rank}).json()
        )
        boot = httpx.get(
            f"{replica.bootstrap_url}/get_transfer_engine_info?rank={rank}", headers=AUTH
        ).json()
        # SGLang's fields agree; the main server adds the regions the rank registered and
        # its scratch region, which lies outside every parameter's, and its delta region
        # (none without --delta-region-mb).
        added = ("registered_regions", "scratch_region", "delta_region")
        assert {k: v for k, v in body.items() if k not in added} == boot
        assert body["delta_region"] is None
        assert all(size > 0 for _, size in body["registered_regions"])
        scratch_addr, scratch_bytes = body["scratch_region"]
        assert scratch_bytes > 0
        assert all(
            scratch_addr + scratch_bytes <= addr or addr + size <= scratch_addr
            for addr, size in body["registered_regions"]
        )
        assert body["rank"] == rank
        session_id, weights_info = body["remote_instance_transfer_engine_info"]
        host, port = session_id.split(":")
        assert host == "127.0.0.1" and int(port) > 0
        layout = rank_layout(config, ParallelismConfig(tp_size=TP, tp_rank=rank))
        assert list(weights_info) == list(layout)
        for name, param in layout.items():
            _, numel, element_size = weights_info[name]
            assert (numel, element_size) == (param.numel, param.element_size)
        assert _call(replica, "get_transfer_engine_info", rank) == (
            session_id,
            {k: tuple(v) for k, v in weights_info.items()},
        )
    for params in ({"rank": TP}, {"rank": -1}, {}):
        refused = http.get("/remote_instance_transfer_engine_info", params=params)
        assert refused.status_code == 400
        assert "rank" in refused.json()["error"]["message"]
    boot_404 = httpx.get(
        f"{replica.bootstrap_url}/get_transfer_engine_info?rank={TP}", headers=AUTH
    )
    assert boot_404.status_code == 404
    assert boot_404.json() == {"detail": f"No transfer engine info for rank {TP}"}
    boot_400 = httpx.get(f"{replica.bootstrap_url}/get_transfer_engine_info?rank=-1", headers=AUTH)
    assert boot_400.status_code == 400
    assert httpx.get(f"{replica.bootstrap_url}/health").text == "OK"


def test_a_replica_without_a_delta_region_takes_no_deltas(replica, http):
    info = http.get("/server_info").json()
    assert WEIGHT_SYNC_DELTA not in info["weightsync"]["capabilities"]
    # Checksums answer all the same (a full sync may read them as the next base).
    sums = _call(replica, "delta_checksums", session_token=None)
    assert sorted(sums) == list(range(TP)) and all(sums.values())
    with pytest.raises(RemoteReplicaError, match="no delta region") as refused:
        _call(replica, "apply_delta", session_token=None, ranks={0: ([], {}), 1: ([], {})})
    assert refused.value.status_code == 400


def test_parallelism_config(replica, http):
    for rank in range(TP):
        expected = ParallelismConfig(tp_size=TP, tp_rank=rank)
        body = http.get("/parallelism_config", params={"rank": rank}).json()
        assert body == expected.to_dict()
        boot = httpx.get(
            f"{replica.bootstrap_url}/get_parallelism_config?rank={rank}", headers=AUTH
        ).json()
        assert boot == body
        assert _call(replica, "get_parallelism_config", rank) == expected
    assert http.get("/parallelism_config", params={"rank": TP}).status_code == 404
    assert http.get("/parallelism_config", params={"rank": -1}).status_code == 400
    boot_404 = httpx.get(f"{replica.bootstrap_url}/get_parallelism_config?rank=9", headers=AUTH)
    assert boot_404.status_code == 404


def _hf_greedy(checkpoint: Path, prompt: list[int], num_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_generate_matches_hf_greedy(replica, http, checkpoint):
    response = http.post(
        "/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        headers=AUTH,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"output_ids", "meta_info"}
    assert body["output_ids"] == _hf_greedy(checkpoint, PROMPT, 8)
    meta = body["meta_info"]
    assert meta["weight_version"] == http.get("/get_weight_version").json()["weight_version"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 8

    sampled = [
        _call(replica, "generate", PROMPT, max_new_tokens=6, temperature=1.0, sampling_seed=7)
        for _ in range(2)
    ]
    assert sampled[0].output_ids == sampled[1].output_ids and len(sampled[0].output_ids) == 6

    with pytest.raises(RemoteReplicaError, match="input_ids must be ints in") as bad:
        _call(replica, "generate", [10**6], max_new_tokens=2)
    assert bad.value.status_code == 400


POST_ROUTES = {
    "/pause_generation": {"mode": "abort"},
    "/continue_generation": {"torch_empty_cache": True},
    "/abort_request": {"rid": "", "abort_all": True},
    "/release_memory_occupation": {"tags": ["kv_cache"]},
    "/resume_memory_occupation": {"tags": ["kv_cache"]},
    "/flush_cache": None,
    "/begin_weight_update": {"selector": "target"},
    "/end_weight_update": {},
    "/update_weight_version": {"new_version": "7", "abort_all_requests": False},
    "/weights_checker": {"action": "checksum"},
    "/generate": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
}


def test_auth_on_every_route_but_health(replica, http):
    # As SGLang: every route but /health and /ready needs the key, reads included (they
    # reveal the parameters' addresses and the transfer-engine sessions).
    gets = ("/server_info", "/get_server_info", "/model_info", "/get_weight_version")
    gets += ("/remote_instance_transfer_engine_info?rank=0", "/parallelism_config?rank=0")
    with httpx.Client(base_url=replica.url, timeout=60.0) as bare:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            for route, body in POST_ROUTES.items():
                response = bare.post(route, json=body, headers=headers)
                assert response.status_code == 401, (route, headers, response.text)
                assert "message" in response.json()["error"]
                assert response.headers["WWW-Authenticate"] == "Bearer"
            for route in gets:
                assert bare.get(route, headers=headers).status_code == 401, (route, headers)
        for route in ("/health", "/ready", "/openapi.json"):
            assert bare.get(route).status_code == 200, route
    for route in ("/register_transfer_engine_info", "/register_parallelism_config"):
        refused = httpx.put(f"{replica.bootstrap_url}{route}", json={"tp_rank": 0})
        assert refused.status_code == 401
    for route in gets:
        assert http.get(route).status_code == 200, route
    with pytest.raises(RemoteReplicaError) as refused:
        _call(replica, "flush_cache", api_key=None)
    assert refused.value.status_code == 401


def test_weight_update_session(replica, http):
    begun = http.post("/begin_weight_update", json={"selector": "target"}, headers=AUTH)
    assert begun.status_code == 200 and begun.json()["success"] is True
    try:
        again = http.post("/begin_weight_update", json={"selector": "target"}, headers=AUTH)
        assert again.status_code == 400
        assert again.json()["success"] is False and "already open" in again.json()["message"]
        with pytest.raises(RemoteReplicaError, match="already open") as raised:
            _call(replica, "begin_weight_update")
        assert raised.value.status_code == 400 and raised.value.route == "/begin_weight_update"

        refused = http.post("/generate", json={"input_ids": PROMPT}, headers=AUTH)
        assert refused.status_code == 503
        assert "weight-update session is open" in refused.json()["error"]["message"]
        assert _state(http)["weight_update_session"] == "open"
    finally:
        ended = http.post("/end_weight_update", json={}, headers=AUTH)
    assert ended.status_code == 200 and ended.json() == {
        "success": True,
        "message": "Weight update session ended",
    }
    again = http.post("/end_weight_update", json={}, headers=AUTH)
    assert again.status_code == 400 and "no weight-update session" in again.json()["message"]
    with pytest.raises(RemoteReplicaError, match="no weight-update session") as raised:
        _call(replica, "end_weight_update")
    assert raised.value.status_code == 400
    draft = http.post("/begin_weight_update", json={"selector": "draft"}, headers=AUTH)
    assert draft.status_code == 400 and "no draft model" in draft.json()["message"]
    assert _call(replica, "generate", PROMPT, max_new_tokens=2).output_ids


def test_weight_version(replica, http):
    reply = http.post(
        "/update_weight_version",
        json={"new_version": "7", "abort_all_requests": False},
        headers=AUTH,
    )
    assert reply.status_code == 200
    assert reply.json() == {
        "success": True,
        "message": "Weight version updated to 7",
        "new_version": "7",
    }
    assert http.get("/get_weight_version").json() == {"weight_version": "7"}
    assert _call(replica, "generate", PROMPT, max_new_tokens=1).meta_info.weight_version == "7"
    assert _call(replica, "update_weight_version", "8", abort_all_requests=True).new_version == "8"
    assert _call(replica, "get_weight_version") == "8"
    assert http.get("/server_info").json()["weight_version"] == "8"


def test_pause_release_resume_continue(replica, http):
    paused = http.post("/pause_generation", json={"mode": "abort"}, headers=AUTH)
    assert paused.status_code == 200 and paused.json()["status"] == "ok"
    refused = http.post("/generate", json={"input_ids": PROMPT}, headers=AUTH)
    assert refused.status_code == 503 and "paused" in refused.json()["error"]["message"]

    weights = http.post("/release_memory_occupation", json={"tags": ["weights"]}, headers=AUTH)
    assert weights.status_code == 400 and "never moves" in weights.json()["error"]["message"]
    unknown = http.post("/release_memory_occupation", json={"tags": ["bogus"]}, headers=AUTH)
    assert unknown.status_code == 400
    released = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}, headers=AUTH)
    assert released.status_code == 200 and released.json() is None  # SGLang answers null
    assert _state(http)["memory_released"] == ["kv_cache"]
    # While generation is refused, /health and /ready say so (SGLang's /health generates).
    assert http.get("/health").status_code == 503 and http.get("/ready").status_code == 503
    no_body = http.post("/resume_memory_occupation", headers=AUTH)
    assert no_body.status_code == 400 and no_body.json()["type"] == "Bad Request"
    resumed = http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}, headers=AUTH)
    assert resumed.status_code == 200

    flushed = http.post("/flush_cache", headers=AUTH)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    aborted = http.post("/abort_request", json={"rid": "", "abort_all": True}, headers=AUTH)
    assert aborted.status_code == 200
    continued = http.post("/continue_generation", json={"torch_empty_cache": True}, headers=AUTH)
    assert continued.status_code == 200 and continued.json()["status"] == "ok"
    assert _state(http)["paused"] is False

    # The same lifecycle through the client.
    assert _call(replica, "pause_generation", mode="retract").status == "ok"
    _call(replica, "release_memory_occupation", ["kv_cache"])
    with pytest.raises(RemoteReplicaError, match="paused") as raised:
        _call(replica, "generate", PROMPT, max_new_tokens=1)
    assert raised.value.status_code == 503
    _call(replica, "resume_memory_occupation", ["kv_cache"])
    _call(replica, "flush_cache")
    _call(replica, "abort_request", rid="nobody", abort_all=False)
    assert _call(replica, "continue_generation").status == "ok"
    assert "mode=in_place" in _call(replica, "pause_generation", mode="in_place").message
    _call(replica, "continue_generation")
    assert len(_call(replica, "generate", PROMPT, max_new_tokens=2).output_ids) == 2


def test_busy_server_health_abort_and_idle_rule(replica, http):
    async def scenario():
        async with RolloutClient(replica.url, api_key=API_KEY, timeout_s=120.0) as client:
            long_call = asyncio.create_task(client.generate(PROMPT, max_new_tokens=300))
            await asyncio.to_thread(_wait_state, http, lambda s: s["num_running_requests"] == 1)

            # The engine is busy for seconds; the event loop is not.
            start = time.monotonic()
            await client.health(timeout_s=5.0)
            health_s = time.monotonic() - start
            assert not long_call.done()
            with pytest.raises(RemoteReplicaError, match="not idle") as refused:
                await client.release_memory_occupation(["kv_cache"])
            assert refused.value.status_code == 400

            queued = asyncio.create_task(client.generate(PROMPT, max_new_tokens=5, rid="q1"))
            await asyncio.to_thread(_wait_state, http, lambda s: s["num_queued_requests"] == 1)
            await client.abort_request(rid="q1", abort_all=False)
            aborted = await queued
            assert not long_call.done()

            # pause waits for the running request, after which the server is idle.
            await client.pause_generation(mode="abort")
            await client.release_memory_occupation(["kv_cache"])
            await client.resume_memory_occupation(["kv_cache"])
            await client.continue_generation()
            return health_s, aborted, await long_call

    health_s, aborted, finished = asyncio.run(scenario())
    assert health_s < 2.0
    assert aborted.output_ids == [] and aborted.meta_info.finish_reason.type == "abort"
    assert len(finished.output_ids) == 300
    assert finished.meta_info.finish_reason.type == "length"


class _MooncakeWriter:
    """Writes the checkpoint's own shards into every rank of the replica, from this process."""

    def __init__(self, replica, checkpoint: Path) -> None:
        self.replica = replica
        config = load_config_dict(checkpoint)
        hf_state_dict = {}
        for file in sorted(checkpoint.glob("*.safetensors")):
            hf_state_dict.update(load_file(file))
        self.shards = [
            shard_state_dict(hf_state_dict, config, ParallelismConfig(tp_size=TP, tp_rank=rank))
            for rank in range(TP)
        ]
        self.transport = MooncakeTransport(MooncakeConfig(timeout_s=20.0))
        for shards in self.shards:
            for tensor in shards.values():
                self.transport.register(tensor.data_ptr(), tensor.nbytes)

    def write_all(self) -> None:
        handles = []
        for rank, shards in enumerate(self.shards):
            session_id, weights_info = _call(self.replica, "get_transfer_engine_info", rank)
            src, dst, lengths = [], [], []
            for name, (addr, numel, element_size) in weights_info.items():
                tensor = shards[name].contiguous()
                assert tensor.nbytes == numel * element_size, name
                src.append(tensor.data_ptr())
                dst.append(addr)
                lengths.append(tensor.nbytes)
            handles.append(self.transport.write(session_id, src, dst, lengths))
        for handle in handles:
            self.transport.wait(handle, 20.0)

    def close(self) -> None:
        for shards in self.shards:
            for tensor in shards.values():
                self.transport.unregister(tensor.data_ptr())
        self.transport.close()


def _checksums(replica) -> list[dict]:
    message = _call(replica, "weights_checker", "checksum").message
    return json.loads(message)["ranks"]


def test_weights_checker_and_restore_over_mooncake(replica, http, checkpoint):
    writer = _MooncakeWriter(replica, checkpoint)
    try:
        before = _checksums(replica)
        assert [r["tp_rank"] for r in before] == list(range(TP))
        tokens = _call(replica, "generate", PROMPT, max_new_tokens=8).output_ids

        no_snapshot = http.post("/weights_checker", json={"action": "compare"}, headers=AUTH)
        assert no_snapshot.status_code == 400 and no_snapshot.json()["success"] is False

        # Corrupt (a paused replica: a serving one refuses), see compare fail naming the
        # parameters on every rank.
        _call(replica, "pause_generation")
        for action in ("snapshot", "reset_tensors"):
            body = {"action": action, "allow_quant_error": False, "selector": "target"}
            reply = http.post(
                "/weights_checker", json={**body, "skip_tensor_list": []}, headers=AUTH
            )
            assert reply.status_code == 200 and reply.json()["success"] is True
        assert _checksums(replica) != before
        with pytest.raises(RemoteReplicaError) as failed:
            _call(replica, "weights_checker", "compare")
        message = str(failed.value)
        assert failed.value.status_code == 400
        for rank in range(TP):
            assert f"tp rank {rank}: 35 of 35 parameters differ" in message
        assert "model.layers.0.self_attn.qkv_proj.weight" in message and "max abs error" in message
        # The snapshot was freed by compare.
        with pytest.raises(RemoteReplicaError, match="no snapshot"):
            _call(replica, "weights_checker", "compare")

        # Rewrite the original bytes over Mooncake inside a session.
        _call(replica, "begin_weight_update")
        writer.write_all()
        _call(replica, "update_weight_version", "restored")
        _call(replica, "end_weight_update")
        assert _checksums(replica) == before

        # The bit-exact check as a sync runs it: snapshot, corrupt, write, compare.
        _call(replica, "weights_checker", "snapshot")
        _call(replica, "weights_checker", "reset_tensors", skip_tensor_list=["model.norm."])
        _call(replica, "begin_weight_update")
        writer.write_all()
        _call(replica, "update_weight_version", "restored")
        _call(replica, "end_weight_update")
        passed = _call(replica, "weights_checker", "compare", allow_quant_error=False)
        assert passed.success and "35 parameters equal the snapshot (bitwise)" in passed.message
        assert _checksums(replica) == before
        _call(replica, "continue_generation")
        restored = _call(replica, "generate", PROMPT, max_new_tokens=8)
        assert restored.output_ids == tokens
        assert restored.meta_info.weight_version == "restored"

        unknown = http.post(
            "/weights_checker",
            json={"action": "snapshot", "skip_tensor_list": ["no.such.param"]},
            headers=AUTH,
        )
        assert unknown.status_code == 400 and "match no parameter" in unknown.json()["message"]
    finally:
        writer.close()


def test_openapi_schema_is_frozen(http):
    schema = http.get("/openapi.json").json()
    if os.environ.get(UPDATE_OPENAPI_ENV) == "1":
        OPENAPI_FILE.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    frozen = json.loads(OPENAPI_FILE.read_text())
    assert schema == frozen, (
        "the main server's HTTP surface changed. If the change is deliberate, regenerate the "
        f"frozen schema with `{UPDATE_OPENAPI_ENV}=1 .venv/bin/pytest tests/test_serve.py -k "
        "openapi` and review the diff of tests/openapi_main.json"
    )
