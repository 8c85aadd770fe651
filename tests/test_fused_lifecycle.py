"""The update lifecycle in two calls: ``/begin_weight_sync`` and ``/end_weight_sync`` on a
reference replica that advertises ``weight_sync_fused``, each step answering as its own route
would; and the manager, which takes them where advertised and the eight standard calls where
not (a replica started with ``--no-fused-lifecycle``), in one sync of both."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import weightsync as ws
from servers import start_replicas
from weightsync.control.base import AsyncHttpClient
from weightsync.control.protocol import WEIGHT_SYNC_EVENTS, WEIGHT_SYNC_FENCE, WEIGHT_SYNC_FUSED
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint

TINY = preset_config("tiny")
API_KEY = "fused-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BEGIN = ["/pause_generation", "/release_memory_occupation", "/begin_weight_update"]
END = [
    "/update_weight_version",
    "/end_weight_update",
    "/resume_memory_occupation",
    "/flush_cache",
    "/continue_generation",
]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two tp1 replicas of the tiny model: the first advertises the fused calls, the second
    was started with them off."""
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY, seed=3)
    logs = tmp_path_factory.mktemp("logs")
    started = []
    try:
        started += start_replicas(checkpoint, log_dir=logs / "fused", api_key=API_KEY)
        started += start_replicas(
            checkpoint,
            log_dir=logs / "plain",
            api_key=API_KEY,
            extra_args=["--no-fused-lifecycle"],
        )
        yield started
    finally:
        for replica in started:
            replica.stop()


def _state(http: httpx.Client) -> dict:
    return http.get("/server_info").json()["state"]


def _complete_update(http: httpx.Client, version: str) -> dict:
    """A fused begin and a labelled end (a complete update, unverified: this client computed
    no digests and says so): the replica serves again. Returns the begin's reply."""
    begun = http.post("/begin_weight_sync", json={"lease_s": 30.0}).json()
    assert begun["success"], begun
    end = {"new_version": version, "session_token": begun["session_token"], "unverified": True}
    ended = http.post("/end_weight_sync", json=end)
    assert ended.status_code == 200 and not _state(http)["paused"]
    return begun


def test_fused_calls_run_each_step_and_answer_a_refusal_as_the_step_would(replicas) -> None:
    fused, plain = replicas
    with httpx.Client(base_url=fused.url, headers=AUTH, timeout=60.0) as http:
        info = http.get("/server_info").json()
        assert WEIGHT_SYNC_FUSED in info["weightsync"]["capabilities"]
        begun = http.post("/begin_weight_sync", json={"lease_s": 30.0})
        assert begun.status_code == 200 and begun.json()["completed"] == BEGIN
        token = begun.json()["session_token"]
        state = _state(http)
        assert state["paused"] and state["memory_released"] == ["kv_cache"]
        assert state["weight_update_session"] == "open"

        # A second begin: pause and release run again (both allowed while paused), then the
        # begin refuses exactly as /begin_weight_update alone does.
        again = http.post("/begin_weight_sync", json={})
        alone = http.post("/begin_weight_update", json={"selector": "target"})
        assert again.status_code == alone.status_code == 400
        assert again.json()["route"] == "/begin_weight_update"
        assert again.json()["completed"] == BEGIN[:2]
        assert again.json()["message"] == alone.json()["message"]

        # Digests that do not match: labelled, then the end refuses; nothing resumes.
        wrong = {"0": {"model.norm.weight": 1}}
        ended = http.post(
            "/end_weight_sync",
            json={"new_version": "5", "session_token": token, "digests": wrong},
        )
        assert ended.status_code == 400 and ended.json()["route"] == "/end_weight_update"
        assert ended.json()["completed"] == END[:1]
        assert _state(http)["paused"]

        # A labelled end of a leased session with neither digests nor `unverified`: nothing
        # checked what arrived, so it is not complete; the replica stays paused.
        begun = http.post("/begin_weight_sync", json={"lease_s": 30.0}).json()
        assert begun["instance"] == info["weightsync"]["instance"]
        assert begun["weight_version"] == "5"
        ended = http.post(
            "/end_weight_sync", json={"new_version": "6", "session_token": begun["session_token"]}
        )
        assert ended.status_code == 400 and "without digests" in ended.json()["message"]
        assert _state(http)["paused"]

        # A complete round: every step runs, and the replica serves again.
        begun = http.post("/begin_weight_sync", json={"lease_s": 30.0}).json()
        ended = http.post(
            "/end_weight_sync",
            json={"new_version": "6", "session_token": begun["session_token"], "unverified": True},
        )
        assert ended.status_code == 200 and ended.json()["completed"] == END
        state = _state(http)
        assert not state["paused"] and state["memory_released"] == []
        assert http.get("/get_weight_version").json()["weight_version"] == "6"
    with httpx.Client(base_url=plain.url, headers=AUTH, timeout=60.0) as http:
        info = http.get("/server_info").json()
        assert WEIGHT_SYNC_FUSED not in info["weightsync"]["capabilities"]
        assert http.post("/begin_weight_sync", json={}).status_code == 404


def test_the_manager_fuses_where_advertised_and_makes_eight_calls_elsewhere(
    replicas, monkeypatch
) -> None:
    fused, plain = replicas
    calls: list[tuple[str, str]] = []
    original = AsyncHttpClient._call

    quick = AsyncHttpClient._post_quick

    async def recorded(self, method, route, **kwargs):
        calls.append((self.base_url, route))
        return await original(self, method, route, **kwargs)

    async def recorded_quick(self, route, body, **kwargs):
        calls.append((self.base_url, route))
        return await quick(self, route, body, **kwargs)

    # The fused calls go over the client's keep-alive connection, the others over aiohttp.
    monkeypatch.setattr(AsyncHttpClient, "_call", recorded)
    monkeypatch.setattr(AsyncHttpClient, "_post_quick", recorded_quick)
    config = ws.SyncConfig(
        # Polling for the fused calls' replies, whatever this host's CPUs.
        control=ws.ControlConfig(
            api_key=API_KEY, check_weight_update_equal=True, poll_replies_s=0.002
        ),
        sender=ws.SenderConfig(bucket_bytes=1 << 20),
        transport=ws.MooncakeConfig(timeout_s=30.0),
    )
    lifecycle = set(BEGIN + END + ["/begin_weight_sync", "/end_weight_sync"])
    with ws.TrainerSync(
        config, hf_config=TINY, replicas=[fused.url, plain.url], dtype="float32"
    ) as sync:
        export = ws.ModelExport(random_model(TINY, seed=3))
        per_sync, reports = [], []
        for _ in range(2):
            calls.clear()
            reports.append(report := sync.sync(export))
            assert set(report.verified) == {fused.url, plain.url}
            per_sync.append(
                {
                    url: [r for u, r in calls if u == url and r in lifecycle]
                    for url in (fused.url, plain.url)
                }
            )
    # The first sync compares against the snapshot before anything serves again, so its end
    # is the separate calls; the second is fused throughout.
    first, second = per_sync
    assert first[fused.url] == ["/begin_weight_sync", *END]
    assert second[fused.url] == ["/begin_weight_sync", "/end_weight_sync"]
    for lifecycle_calls in (first[plain.url], second[plain.url]):
        assert lifecycle_calls == BEGIN + END
    assert [r.bit_exact for r in reports] == [True, None]


def test_a_replica_off_the_gpu_refuses_events_to_wait_for_and_stays_paused(replicas) -> None:
    # after_events is for a replica on a GPU (weight_sync_events); one on the CPU cannot
    # know when copies named that way land, so it closes the session (labelled, as after a
    # failed verification) and its weights are incomplete until a complete update. A
    # handle that is not one is a 400 before any step.
    fused, _ = replicas
    with httpx.Client(base_url=fused.url, headers=AUTH, timeout=60.0) as http:
        info = http.get("/server_info").json()
        assert WEIGHT_SYNC_EVENTS not in info["weightsync"]["capabilities"]
        begun = http.post("/begin_weight_sync", json={"lease_s": 30.0}).json()
        token = begun["session_token"]
        bad = http.post("/end_weight_sync", json={"session_token": token, "after_events": ["xyz"]})
        assert bad.status_code == 400 and "after_events" in bad.text
        assert _state(http)["weight_update_session"] == "open"

        ended = http.post(
            "/end_weight_sync",
            json={"new_version": "70", "session_token": token, "after_events": ["ab" * 64]},
        )
        assert ended.status_code == 400 and ended.json()["route"] == "/end_weight_update"
        assert "weight_sync_events" in ended.json()["message"]
        state = _state(http)
        assert state["paused"] and state["weight_update_session"] == "closed"
        assert ended.json()["completed"] == END[:1]
        assert http.get("/get_weight_version").json()["weight_version"] == "70"
        assert http.post("/continue_generation", json={}).status_code == 400

        # A complete update serves again.
        _complete_update(http, "71")


def test_a_replica_off_the_gpu_refuses_a_fence_and_opens_no_session(replicas) -> None:
    # A fence is an event a writer on the replica's host waits for (weight_sync_fence): a
    # replica on the CPU has none to give. Its begin refuses at its own step, after the
    # pause and the release ran, with no session open.
    fused, _ = replicas
    with httpx.Client(base_url=fused.url, headers=AUTH, timeout=60.0) as http:
        info = http.get("/server_info").json()
        assert WEIGHT_SYNC_FENCE not in info["weightsync"]["capabilities"]
        refused = http.post("/begin_weight_sync", json={"lease_s": 30.0, "fence": True})
        assert refused.status_code == 400 and refused.json()["route"] == "/begin_weight_update"
        assert "weight_sync_fence" in refused.json()["message"]
        assert refused.json()["completed"] == BEGIN[:2]
        assert _state(http)["weight_update_session"] == "closed"
        assert "fences" not in _complete_update(http, "72")


def test_a_pause_past_the_calls_budget_answers_504_and_has_taken_effect(replicas) -> None:
    # The pause waits for the running request; past the call's budget the begin stops there
    # (the pause stands, as a pause whose caller gave up) and opens no session.
    fused, _ = replicas
    with httpx.Client(base_url=fused.url, headers=AUTH, timeout=120.0) as http:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 500}}
        generated: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: generated.append(http.post("/generate", json=body))
        )
        worker.start()
        deadline = time.monotonic() + 30.0
        while _state(http)["num_running_requests"] != 1:
            assert time.monotonic() < deadline, "the generation did not start"
            time.sleep(0.005)
        late = http.post("/begin_weight_sync", json={"lease_s": 30.0, "budget_s": 0.01})
        assert late.status_code == 504 and late.json()["route"] == "/pause_generation"
        assert "did not finish within budget_s=0.01 (it has taken effect)" in late.json()["message"]
        assert late.json()["completed"] == []
        state = _state(http)
        assert state["paused"] and state["weight_update_session"] == "closed"
        worker.join(120.0)
        assert generated and generated[0].status_code == 200
        assert http.post("/continue_generation", json={}).status_code == 200
