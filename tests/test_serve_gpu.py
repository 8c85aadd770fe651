"""`weightsync serve --device cuda --transport cuda_ipc` end to end on GPUs.

One replica (tp=1) on the last GPU with seeded synthetic weights; this process is the
trainer on GPU 0 holding the same synthetic weights. A P2P sync (`TrainerSync` +
`WeightSender`, direct copies, CUDA IPC) must restore the replica's weights bit-exactly after
the checker overwrote them, and so must the broadcast baseline over a stand-alone NCCL group
(the replica binds its GPU to its default group, which would otherwise make torch split the
weights update group from it).

Run on a GPU machine with ``pytest -m gpu tests/test_serve_gpu.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from servers import logged, serve_replicas
from weightsync.testing.presets import preset_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

API_KEY = "gpu-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SEED = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_moe")
    # A vocabulary of whole padding blocks (no zero rows, which are staged): every byte of
    # a sync goes direct, so syncs after the first replay a CUDA graph.
    config = preset_config("tiny-moe", torch_dtype="bfloat16", vocab_size=1024)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def replica(model_dir, tmp_path_factory):
    gpu = torch.cuda.device_count() - 1
    extra = ["--transport", "cuda_ipc", "--base-gpu-id", str(gpu)]
    extra += ["--load-format", "dummy", "--seed", str(SEED)]
    with serve_replicas(
        model_dir,
        tp=1,
        device="cuda",
        dtype="bf16",
        api_key=API_KEY,
        extra_args=extra,
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as (served,):
        yield served


def _checker(url: str, action: str) -> None:
    from weightsync.control import RolloutClient

    async def main() -> None:
        async with RolloutClient(url, api_key=API_KEY, timeout_s=120.0) as client:
            if action == "reset_tensors":
                await client.pause_generation()  # a serving replica refuses it
            await client.weights_checker(action)

    asyncio.run(main())


def _trainer_tensors(model_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from weightsync.checkpoint import load_config_dict
    from weightsync.engine.synthetic import synthetic_hf_tensors

    config = load_config_dict(model_dir)
    tensors = dict(synthetic_hf_tensors(config, seed=SEED, dtype="bfloat16", device="cuda:0"))
    return config, tensors


def test_replica_publishes_cuda_ipc_sessions_on_its_gpu(replica):
    info = httpx.get(f"{replica.url}/server_info", headers=AUTH, timeout=30.0).json()
    assert info["transport"] == "cuda_ipc" and info["device"] == "cuda"
    engine = httpx.get(
        f"{replica.url}/remote_instance_transfer_engine_info",
        params={"rank": 0},
        headers=AUTH,
        timeout=30.0,
    ).json()
    session_id, weights_info = engine["remote_instance_transfer_engine_info"]
    assert session_id.startswith("ipc:127.0.0.1:")
    assert any(name.endswith("mlp.experts.w13_weight") for name in weights_info)
    log = replica.log_path.read_text()
    assert f"on cuda:{torch.cuda.device_count() - 1}" in log
    assert f"synthetic weights (seed {SEED})" in log


def test_p2p_sync_over_cuda_ipc_is_bit_exact(replica, model_dir):
    import weightsync as ws

    config, tensors = _trainer_tensors(model_dir)
    sync_config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20, timeout_s=30.0),
        control=ws.ControlConfig(api_key=API_KEY, check_weight_update_equal=True),
        transport=ws.CudaIpcConfig(device=0),
    )
    sync = ws.TrainerSync(sync_config, hf_config=config, replicas=[replica.url], dtype="bfloat16")
    sender = sync.sender
    try:
        # The manager snapshots the replica (its own synthetic copy), overwrites it with
        # random values, syncs and requires the snapshot back bit for bit.
        report = sync.sync(ws.ModelExport(tensors, hf_config=config))
        # Every byte goes straight from the trainer's GPU tensors, unstaged.
        assert report.push.bytes_staged == 0 and sender.staging_bytes == 0
        assert report.bit_exact is True
        assert report.push.bytes_written > 0 and report.push.num_writes > 0
        # A later sync restores an overwritten replica too.
        _checker(replica.url, "snapshot")
        _checker(replica.url, "reset_tensors")
        sync.sync(ws.ModelExport(tensors, hf_config=config))
        _checker(replica.url, "compare")
    finally:
        sync.close()


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL takes no two ranks on one GPU: the trainer and the replica need their own",
)
def test_nccl_baseline_into_a_cuda_replica_is_bit_exact(replica, model_dir):
    from weightsync.baseline import BroadcastConfig, BroadcastSync
    from weightsync.manager import ControlConfig, SyncManager

    config, tensors = _trainer_tensors(model_dir)
    manager = SyncManager([replica.url], ControlConfig(api_key=API_KEY))
    sync = BroadcastSync(
        hf_config=config,
        config=BroadcastConfig(bucket_bytes=1 << 20, timeout_s=120.0),
        manager=manager,
        dtype="bfloat16",
    )
    try:
        for _ in range(2):
            _checker(replica.url, "snapshot")
            _checker(replica.url, "reset_tensors")
            sync.sync(tensors)
            _checker(replica.url, "compare")
    finally:
        sync.close()
    assert logged(replica, "joined weights update group")


def test_update_weights_from_tensor_over_cuda_ipc_is_bit_exact(replica, model_dir):
    """The colocated baseline (verl's ``naive``): buckets shared as CUDA IPC handles, each
    rank rebuilding and loading them; on one GPU the trainer and the replica share it."""
    from weightsync.baseline import BroadcastConfig, TensorSync
    from weightsync.manager import ControlConfig, SyncManager

    config, tensors = _trainer_tensors(model_dir)
    manager = SyncManager([replica.url], ControlConfig(api_key=API_KEY))
    sync = TensorSync(
        hf_config=config,
        config=BroadcastConfig(bucket_bytes=64 << 10, timeout_s=120.0),
        manager=manager,
        dtype="bfloat16",
    )
    try:
        for _ in range(2):
            _checker(replica.url, "snapshot")
            _checker(replica.url, "reset_tensors")
            report = sync.sync(tensors)
            _checker(replica.url, "compare")
        assert len(sync.buckets) > 2 and report.push.bytes_staged > 0
    finally:
        sync.close()
    assert logged(replica, "update_weights_from_tensor")


def _sleep_kernel(seconds: float) -> None:
    """Queue a kernel that spins about `seconds` on the current stream (calibrated here)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(10**7)
    torch.cuda.synchronize()
    per_second = 10**7 / (time.perf_counter() - started)
    torch.cuda._sleep(int(seconds * per_second))


def test_an_end_waits_for_the_events_it_names_and_refuses_past_its_budget(replica):
    from weightsync.control.protocol import WEIGHT_SYNC_EVENTS

    with httpx.Client(base_url=replica.url, headers=AUTH, timeout=60.0) as http:
        info = http.get("/server_info").json()
        assert WEIGHT_SYNC_EVENTS in info["weightsync"]["capabilities"]
        event = torch.cuda.Event(interprocess=True)
        handle = event.ipc_handle().hex()

        # Work still running on this process's GPU stream when the end is sent: the reply
        # comes only once the event was reached.
        token = http.post("/begin_weight_sync", json={"lease_s": 30.0}).json()["session_token"]
        _sleep_kernel(1.0)
        event.record()
        assert not event.query()
        ended = http.post(
            "/end_weight_sync", json={"session_token": token, "after_events": [handle]}
        )
        assert ended.status_code == 200, ended.text
        assert event.query()

        # Past the call's budget: the session is closed and the weights are incomplete
        # (bytes may still be coming), so the replica stays paused.
        token = http.post("/begin_weight_sync", json={"lease_s": 30.0}).json()["session_token"]
        _sleep_kernel(3.0)
        event.record()
        late = http.post(
            "/end_weight_sync",
            json={"session_token": token, "after_events": [handle], "budget_s": 0.3},
        )
        assert late.status_code == 504 and late.json()["route"] == "/end_weight_update"
        assert "did not finish within 0.3 s" in late.json()["message"]
        state = http.get("/server_info").json()["state"]
        assert state["paused"] and state["weight_update_session"] == "closed"
        assert http.post("/continue_generation", json={}).status_code == 400
        torch.cuda.synchronize()

        # A handle of no event this replica can open: refused, and again incomplete.
        token = http.post("/begin_weight_sync", json={"lease_s": 30.0}).json()["session_token"]
        bogus = http.post(
            "/end_weight_sync", json={"session_token": token, "after_events": ["ab" * 64]}
        )
        assert bogus.status_code == 400 and "cannot be opened" in bogus.json()["message"]
        assert http.get("/server_info").json()["state"]["weight_update_session"] == "closed"
        assert http.post("/continue_generation", json={}).status_code == 400

        # A complete update serves again.
        token = http.post("/begin_weight_sync", json={"lease_s": 30.0}).json()["session_token"]
        ended = http.post("/end_weight_sync", json={"new_version": "40", "session_token": token})
        assert ended.status_code == 200 and not http.get("/server_info").json()["state"]["paused"]


def test_a_sync_ends_while_its_copies_run_and_the_replica_verifies_them(replica, model_dir):
    # The trainer's copies are replayed as a CUDA graph from the second sync on; its end goes
    # out as soon as they are queued, and the replica waits for their event before it
    # verifies the digests.
    import weightsync as ws

    config, tensors = _trainer_tensors(model_dir)
    sync_config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20, timeout_s=30.0),
        control=ws.ControlConfig(api_key=API_KEY),
        transport=ws.CudaIpcConfig(device=0),
    )
    export = ws.ModelExport(tensors, hf_config=config)
    with ws.TrainerSync(
        sync_config, hf_config=config, replicas=[replica.url], dtype="bfloat16"
    ) as sync:
        reports = []
        for step in range(4):
            with torch.no_grad():
                for tensor in tensors.values():
                    tensor.add_(1.0 if step % 2 else -1.0)  # new weights, same addresses
            reports.append(sync.sync(export))
    first, *later = reports
    assert not first.push.per_source[0].in_flight and first.push.landing is None
    for report in later:
        stats = report.push.per_source[0]
        landing = report.push.landing
        assert stats.replayed and stats.in_flight and len(landing.events) == 1
        assert report.verified == (replica.url,)
        assert report.phases.push > 0 and report.phases.finalize >= 0


def test_a_fenced_begin_answers_first_and_its_end_says_what_changed_outside(replica):
    # Bytes written into the replica outside any session; a fenced begin answers before its
    # digest ran (the event it hands out is what writers wait for) and cannot tell them yet;
    # its end can.
    from weightsync.control.protocol import WEIGHT_SYNC_FENCE
    from weightsync.cuda_events import IpcEvents
    from weightsync.transport import CudaIpcConfig, open_transport

    with httpx.Client(base_url=replica.url, headers=AUTH, timeout=60.0) as http:
        info = http.get("/server_info").json()
        assert WEIGHT_SYNC_FENCE in info["weightsync"]["capabilities"]
        engine = http.get("/remote_instance_transfer_engine_info", params={"rank": 0}).json()
        session_id, weights_info = engine["remote_instance_transfer_engine_info"]
        name = next(n for n in sorted(weights_info) if n.endswith("input_layernorm.weight"))
        addr, numel, element_size = weights_info[name]
        transport = open_transport(CudaIpcConfig(device=0))
        try:
            source = torch.full((numel * element_size,), 7, dtype=torch.uint8, device="cuda:0")
            transport.register(source.data_ptr(), source.numel())
            written = transport.write(session_id, [source.data_ptr()], [addr], [source.numel()])
            transport.wait(written, 30.0)
        finally:
            transport.close()

        begun = http.post("/begin_weight_sync", json={"lease_s": 30.0, "fence": True}).json()
        assert begun["success"] and begun.get("changed_outside", []) == []
        (fence,) = begun["fences"]
        assert IpcEvents(torch.device("cuda", 0)).wait([fence], 10.0)
        ended = http.post(
            "/end_weight_sync",
            json={"new_version": "fenced", "session_token": begun["session_token"]},
        ).json()
        assert ended["success"] and ended["changed_outside"] == [f"tp rank 0: {name}"]
        assert logged(replica, "changed outside a weight-update session")
        # The session's versioned end is a complete update again: the replica serves.
        info = http.get("/server_info").json()
        assert info["weightsync"]["weights"]["complete"] and not info["state"]["paused"]
