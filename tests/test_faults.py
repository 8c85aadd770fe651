"""Fault injection: a hostile or careless environment, real processes (replicas of `weightsync
serve`, trainers, Mooncake TCP on 127.0.0.1). Every case ends in a clear error within its
deadline, no replica serves mixed or unverified weights under a version, healthy replicas
keep serving, and the next sync recovers.

The other cases of the suite carry the same marker: sessions (tests/test_sessions.py), the
data plane's listeners and key (tests/test_dataplane.py), bounded inputs
(tests/test_bounded_inputs.py), orphans (tests/test_orphans.py), a stopped trainer rank
(tests/test_trainer_sync.py). ``WEIGHTSYNC_FAULT_TABLE=path`` collects case, outcome and time
to fail as JSON lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import weightsync as ws
from faults import StallingExport, Stopwatch, call, record, rewriting_proxy, serves
from servers import app_in_thread, serve_replicas
from weightsync.errors import (
    LayoutMismatchError,
    PartialSyncError,
    RemoteReplicaError,
    WeightsRefusedError,
)
from weightsync.export import ModelExport, TensorsExport
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint
from weightsync.transport import MooncakeTransport

pytestmark = pytest.mark.faults

TINY = preset_config("tiny")
# A longer context, so that one request can keep a replica busy for seconds.
LONG = preset_config("tiny", max_position_embeddings=8192)
HERE = Path(__file__).parent


def version_of(url: str) -> str | None:
    return call(url, "served_weight_version")


def sync_config(*, check_finite: str = "first", **control: Any) -> ws.SyncConfig:
    return ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20, check_finite=check_finite, timeout_s=5.0),
        control=ws.ControlConfig(**{"lease_s": 5.0, "lifecycle_timeout_s": 3.0, **control}),
        transport=ws.MooncakeConfig(timeout_s=5.0),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY, seed=0)


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("long"), LONG, seed=0)


@pytest.fixture(scope="module")
def replica(checkpoint, tmp_path_factory) -> Iterator[str]:
    with serve_replicas(checkpoint, log_dir=tmp_path_factory.mktemp("one")) as (served,):
        yield served.url


@pytest.fixture(scope="module")
def bf16_replica(checkpoint, tmp_path_factory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("bf16")
    with serve_replicas(checkpoint, dtype="bf16", log_dir=logs) as (served,):
        yield served.url


# 1. The data plane: bytes from outside a session are caught.


def test_bytes_written_from_outside_are_caught_and_the_next_sync_restores_them(
    replica, caplog
) -> None:
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        sync.sync(ModelExport(random_model(TINY, seed=1)))
        session_id, info = call(replica, "get_transfer_engine_info", 0)
        addr, numel, size = info["model.embed_tokens.weight"]
        outsider = MooncakeTransport(ws.MooncakeConfig(timeout_s=5.0))
        garbage = torch.full((numel * size,), 0x7F, dtype=torch.uint8)
        outsider.register(garbage.data_ptr(), garbage.numel())
        outsider.wait(
            outsider.write(session_id, [garbage.data_ptr()], [addr], [garbage.numel()]), 10
        )
        outsider.close()
        clock = Stopwatch()
        with caplog.at_level("ERROR", logger="weightsync"):
            report = sync.sync(ModelExport(random_model(TINY, seed=2)))
        assert "changed outside a weight-update session" in caplog.text
        assert "model.embed_tokens.weight" in caplog.text
        assert report.verified == (replica,) and serves(replica)
    record("write from outside a session", "found at the next begin; sync restores", clock.seconds)


# 2. A trainer killed mid-push.


def test_a_trainer_killed_mid_push_leaves_the_replica_incomplete_until_a_sync(
    replica,
) -> None:
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        before = sync.sync(ModelExport(random_model(TINY, seed=3))).version
    lease_s = 2.0
    trainer = subprocess.Popen(
        [sys.executable, str(HERE / "fault_trainer.py"), replica, "4", str(lease_s)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "pushing"
        trainer.kill()
        trainer.wait(10)
        clock = Stopwatch()
        while call(replica, "get_server_info")["weightsync"]["weights"]["complete"]:
            assert clock.seconds < lease_s + 5, "the lease never expired"
            time.sleep(0.05)
        took = clock.seconds
    finally:
        trainer.kill()
    state = call(replica, "get_server_info")["weightsync"]
    assert "lease expired" in state["weights"]["incomplete_reason"]
    assert state["session"]["state"] == "closed"
    assert not serves(replica)
    with pytest.raises(RemoteReplicaError, match="incomplete"):
        call(replica, "continue_generation")
    # The next trainer (a new manager) recovers, and its label is new.
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        report = sync.sync(ModelExport(random_model(TINY, seed=5)))
    assert report.verified == (replica,) and serves(replica)
    assert int(report.version) == int(before) + 1
    record("trainer SIGKILLed mid-push", "lease expires: replica incomplete, refuses", took)


# 3. Another client cannot end or undo a session.


def test_a_second_client_can_neither_end_nor_resume_anothers_session(replica) -> None:
    resumed = threading.Event()
    held = threading.Event()

    def hold() -> None:
        held.set()
        resumed.wait(30)

    # No finite check: a stalling export would stall it, before the push.
    first = ws.TrainerSync(sync_config(check_finite="never"), hf_config=TINY, replicas=[replica])
    outcome: dict[str, Any] = {}

    def run_first() -> None:
        export = StallingExport(ModelExport(random_model(TINY, seed=6)), after=5, hook=hold)
        try:
            outcome["report"] = first.sync(export)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run_first)
    thread.start()
    try:
        assert held.wait(30)
        clock = Stopwatch()
        with (
            ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as second,
            pytest.raises(RemoteReplicaError, match="no replica could take the update"),
        ):
            second.sync(ModelExport(random_model(TINY, seed=7)))
        took = clock.seconds
        # Its best-effort clean-up changed nothing: the session is the first client's.
        state = call(replica, "get_server_info")["weightsync"]["session"]
        assert state["state"] == "open" and state["leased"]
        with pytest.raises(RemoteReplicaError, match="held by another client"):
            call(replica, "end_weight_update")
        with pytest.raises(RemoteReplicaError, match="session is open"):
            call(replica, "continue_generation")
        assert not serves(replica)
    finally:
        resumed.set()
        thread.join(60)
        first.close()
    report = outcome.get("report")
    assert report is not None, outcome
    assert report.verified == (replica,) and serves(replica)
    assert version_of(replica) == report.version
    record("second client begins / ends / resumes", "refused (400); first sync completes", took)


# 4. One sick replica does not take the healthy ones offline.


@pytest.mark.serial  # wall-clock bounds: not beside another test
def test_dead_frozen_and_busy_replicas_are_dropped_and_the_healthy_one_updated(
    long_checkpoint, tmp_path
) -> None:
    with serve_replicas(long_checkpoint, num_replicas=4, log_dir=tmp_path) as replicas:
        healthy, dead, frozen, busy = replicas
        urls = [r.url for r in replicas]
        with ws.TrainerSync(sync_config(), hf_config=LONG, replicas=urls) as sync:
            sync.sync(ModelExport(random_model(LONG, seed=1)))
            old = {url: version_of(url) for url in urls}
            dead.process.kill()
            os.killpg(frozen.process.pid, signal.SIGSTOP)
            generation = threading.Thread(
                target=lambda: call(busy.url, "generate", [1], max_new_tokens=8000, timeout_s=120)
            )
            generation.start()
            time.sleep(0.5)  # the long request is running
            try:
                clock = Stopwatch()
                report = sync.sync(ModelExport(random_model(LONG, seed=2)))
                took = clock.seconds
                assert set(report.dropped) == {dead.url, frozen.url, busy.url}, report.dropped
                assert "got no reply" in report.dropped[dead.url]
                assert "timed out" in report.dropped[frozen.url]
                assert report.replicas == (healthy.url,) and report.verified == (healthy.url,)
                assert serves(healthy.url) and version_of(healthy.url) == report.version
                assert took < 3 * 3.0 + 5, took  # a few lifecycle deadlines, not minutes
            finally:
                os.killpg(frozen.process.pid, signal.SIGCONT)
                generation.join(120)
            # The frozen and busy replicas serve their previous weights and label.
            for sick in (frozen, busy):
                assert version_of(sick.url) == old[sick.url]
                deadline = time.monotonic() + 10
                while not serves(sick.url):
                    assert time.monotonic() < deadline, f"{sick.url} does not serve again"
                    time.sleep(0.1)
            # The next sync updates them too; the dead one is dropped again.
            report = sync.sync(ModelExport(random_model(LONG, seed=3)))
            assert set(report.replicas) == {healthy.url, frozen.url, busy.url}
            assert set(report.dropped) == {dead.url}
    record("dead + frozen + busy replica at pause", "dropped; healthy one updated", took)


def test_a_replica_frozen_mid_push_fails_alone(replica, checkpoint, tmp_path) -> None:
    # The module's replica is the healthy one; the one frozen is this test's own.
    healthy = replica
    with serve_replicas(checkpoint, log_dir=tmp_path) as (frozen,):
        urls = [healthy, frozen.url]
        config = sync_config(check_finite="never")
        with ws.TrainerSync(config, hf_config=TINY, replicas=urls) as sync:
            sync.sync(ModelExport(random_model(TINY, seed=1)))

            def freeze() -> None:
                os.killpg(frozen.process.pid, signal.SIGSTOP)

            export = StallingExport(ModelExport(random_model(TINY, seed=2)), after=3, hook=freeze)
            clock = Stopwatch()
            try:
                with pytest.raises(PartialSyncError) as caught:
                    sync.sync(export)
                took = clock.seconds
            finally:
                os.killpg(frozen.process.pid, signal.SIGCONT)
            error = caught.value
            assert set(error.failed) == {frozen.url}
            assert error.report.replicas == (healthy,)
            assert error.report.verified == (healthy,)
            assert serves(healthy) and version_of(healthy) == error.report.version
            assert sync.manager is not None and frozen.url in sync.manager.dirty_replicas
            assert took < 5.0 + 3 * 3.0, took  # one write timeout, a few lifecycle calls
            # Never serving what it half received: its lease ran out while it was stopped.
            assert not serves(frozen.url)
            report = sync.sync(ModelExport(random_model(TINY, seed=3)))
            assert set(report.verified) == set(urls) and serves(frozen.url)
    record("replica SIGSTOPped mid-push", "it alone fails (PartialSyncError)", took)


# 5. "Successful" syncs that would publish bad weights are refused before any write.


def _nan(state: dict) -> None:
    state["model.norm.weight"][3] = float("nan")


def _huge(state: dict) -> None:
    # The largest float32, finite in float32 and infinite in bfloat16.
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = torch.finfo(torch.float32).max


def _int(state: dict) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"
    state[name] = state[name].to(torch.int32)


def _misspelled(state: dict) -> None:
    state["model.layers.0.mlp.up_proj.weigth"] = state.pop("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize(
    ("case", "corrupt", "error", "match"),
    [
        ("a NaN weight", _nan, WeightsRefusedError, "not finite"),
        ("a weight infinite in bf16", _huge, WeightsRefusedError, "not finite"),
        ("an int32 tensor", _int, LayoutMismatchError, "int32"),
        ("a misspelled name", _misspelled, LayoutMismatchError, "weigth"),
    ],
)
def test_bad_weights_are_refused_before_any_write(
    bf16_replica, case, corrupt, error, match
) -> None:
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[bf16_replica]) as sync:
        good = sync.sync(ModelExport(random_model(TINY, seed=8)))
    # A new trainer: its first sync is checked for values that are not finite (later ones
    # with SenderConfig(check_finite="always")).
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[bf16_replica]) as sync:
        state = {n: t.clone() for n, t in ModelExport(random_model(TINY, seed=9))}
        corrupt(state)
        clock = Stopwatch()
        with pytest.raises(error, match=match):
            sync.sync(TensorsExport(state))
        took = clock.seconds
        # Nothing was written: it serves the last good weights under their label.
        assert serves(bf16_replica) and version_of(bf16_replica) == good.version
        assert sync.sync(ModelExport(random_model(TINY, seed=10))).verified == (bf16_replica,)
    record(case, f"refused before any write ({error.__name__})", took)


def _alias(data: dict) -> None:
    info = data["remote_instance_transfer_engine_info"][1]
    norm, qkv = "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight"
    info[norm][0] = info[qkv][0] + 64


def _past_region(data: dict) -> None:
    info = data["remote_instance_transfer_engine_info"][1]
    end = max(addr + numel * size for addr, numel, size in info.values())
    info["model.norm.weight"][0] = end + 4096


@pytest.mark.parametrize(
    ("case", "rewrite", "match"),
    [
        ("an address aliasing another parameter", _alias, "overlaps parameter"),
        ("an address past the registered region", _past_region, "outside every memory region"),
    ],
)
def test_wrong_published_addresses_are_refused_before_any_write(
    replica, case, rewrite, match
) -> None:
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        good = sync.sync(ModelExport(random_model(TINY, seed=11)))
    with (
        app_in_thread(rewriting_proxy(replica, rewrite)) as proxy,
        ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[proxy]) as sync,
    ):
        clock = Stopwatch()
        with pytest.raises(LayoutMismatchError, match=match):
            sync.sync(ModelExport(random_model(TINY, seed=12)))
        took = clock.seconds
    assert serves(replica) and version_of(replica) == good.version
    record(case, "refused before any write (LayoutMismatchError)", took)


# 6. Versions: one label never names two weight sets.


def test_versions_are_monotonic_across_managers_and_a_served_label_is_refused(replica) -> None:
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        first = int(sync.sync(ModelExport(random_model(TINY, seed=13))).version)
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        assert int(sync.sync(ModelExport(random_model(TINY, seed=14))).version) == first + 1
        with pytest.raises(ValueError, match="never reused"):
            sync.sync(ModelExport(random_model(TINY, seed=15)), version=str(first + 1))
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        clock = Stopwatch()
        with pytest.raises(ValueError, match="already names the weights"):
            sync.sync(ModelExport(random_model(TINY, seed=15)), version=str(first + 1))
        took = clock.seconds
        assert serves(replica)
    record("a version label reused", "refused before pause (ValueError)", took)
