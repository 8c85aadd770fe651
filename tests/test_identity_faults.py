"""Fault injection: ordinary fleet events that must never get a replica to serve weights under
a label it did not verify. Real `weightsync serve` replicas, real trainers (`ws.TrainerSync`),
Mooncake TCP on 127.0.0.1, ``weightsync push`` as a subprocess.

- a replica restarted on its URL between two syncs (a new process: new sessions, new
  addresses) gets its metadata fetched again and a full, verified write;
- labels are read from the replicas at every begin: two managers interleaved, a push between
  two trainer syncs, a label another manager gave, a number below what a replica holds, odd
  labels (``"²"``, 5,000 digits) and a new manager after a non-numeric label;
- a membership change asked while a sync runs (another thread) waits for it: no
  ``KeyError``, no lease lost, and the next sync runs without the removed replica;
- a labelled leased session ended without digests is not complete unless its holder says
  it computed none, and a sync without digests is reported unverified.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import weightsync as ws
from faults import StallingExport, Stopwatch, record
from servers import serve_replicas
from weightsync.control import RolloutClient
from weightsync.errors import RemoteReplicaError
from weightsync.export import ModelExport
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint
from weightsync.testing.reference import greedy_tokens

pytestmark = pytest.mark.faults

TINY = preset_config("tiny")
PROMPT = (1, 2, 3, 4)


def call(url: str, method: str, *args: Any, **kwargs: Any) -> Any:
    async def run() -> Any:
        async with RolloutClient(url, timeout_s=30.0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run())


def label_of(url: str) -> str | None:
    return call(url, "served_weight_version")


def tokens_of(url: str) -> list[int] | None:
    try:
        reply = call(url, "generate", list(PROMPT), max_new_tokens=6, timeout_s=10.0)
        return list(reply.output_ids)
    except RemoteReplicaError:
        return None


def expected_tokens(model: Any) -> list[int]:
    return greedy_tokens(model, torch.float32, (PROMPT,), 6)[0]


def sync_config(**sender: Any) -> ws.SyncConfig:
    return ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20, timeout_s=5.0, **sender),
        control=ws.ControlConfig(lease_s=5.0, lifecycle_timeout_s=3.0),
        transport=ws.MooncakeConfig(timeout_s=5.0),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY, seed=0)


@pytest.fixture(scope="module")
def replica(checkpoint, tmp_path_factory) -> Any:
    with serve_replicas(checkpoint, log_dir=tmp_path_factory.mktemp("one")) as (served,):
        yield served.url


# 1. A replica restarted behind its URL.


def test_a_replica_restarted_on_its_url_gets_its_metadata_again_and_a_verified_write(
    checkpoint, tmp_path
) -> None:
    with serve_replicas(checkpoint, log_dir=tmp_path / "a") as (first,):
        url, ports = first.url, (first.port, first.bootstrap_port)
        sync = ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[url])
        try:
            one = sync.sync(ModelExport(random_model(TINY, seed=1)))
            assert one.verified == (url,)
            first.stop()
            restart = ["--port", str(ports[0]), "--bootstrap-port", str(ports[1])]
            with serve_replicas(checkpoint, log_dir=tmp_path / "b", extra_args=restart) as (again,):
                assert again.url == url
                # The new process serves the checkpoint it loaded, under its own label.
                assert tokens_of(url) != expected_tokens(random_model(TINY, seed=2))
                model = random_model(TINY, seed=2)
                clock = Stopwatch()
                two = sync.sync(ModelExport(model))
                took = clock.seconds
                assert two.replicas == (url,) and two.verified == (url,)
                assert two.metadata_refreshed
                assert int(two.version) > int(one.version)
                assert label_of(url) == two.version
                assert tokens_of(url) == expected_tokens(model)
                # And it keeps being written: the next sync lands too.
                model3 = random_model(TINY, seed=3)
                three = sync.sync(ModelExport(model3))
                assert three.verified == (url,) and tokens_of(url) == expected_tokens(model3)
        finally:
            sync.close()
    record(
        "a replica restarted on its URL between two syncs",
        "new process noticed at begin: metadata fetched again, full verified write",
        took,
    )


# 2. Labels are facts of the replicas.


def test_two_managers_interleaved_never_reuse_a_label(replica) -> None:
    with (
        ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as a,
        ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as b,
    ):
        first = int(a.sync(ModelExport(random_model(TINY, seed=4))).version)
        assert int(b.sync(ModelExport(random_model(TINY, seed=5))).version) == first + 1
        assert int(b.sync(ModelExport(random_model(TINY, seed=6))).version) == first + 2
        clock = Stopwatch()
        # A's next label comes from what the replica holds at its begin, not from A's count.
        assert int(a.sync(ModelExport(random_model(TINY, seed=7))).version) == first + 3
        took = clock.seconds
        # A label B gave, which the replica no longer holds: B refuses to give it again.
        with pytest.raises(ValueError, match="never reused"):
            b.sync(ModelExport(random_model(TINY, seed=8)), version=str(first + 2))
        assert label_of(replica) == str(first + 3) and tokens_of(replica) is not None
    record("two managers interleaved", f"labels {first}..{first + 3}, none reused", took)


def test_a_number_at_or_below_what_a_replica_holds_is_refused_unless_rolling_back(
    replica,
) -> None:
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        held = int(sync.sync(ModelExport(random_model(TINY, seed=9))).version)
        clock = Stopwatch()
        with pytest.raises(ValueError, match=rf"not above '{held}', which replica"):
            sync.sync(ModelExport(random_model(TINY, seed=10)), version=str(held - 1))
        took = clock.seconds
        assert label_of(replica) == str(held) and tokens_of(replica) is not None
        model = random_model(TINY, seed=10)
        back = sync.sync(ModelExport(model), version=str(held - 1), rollback=True)
        assert back.version == str(held - 1) and tokens_of(replica) == expected_tokens(model)
        # The next default label still goes above everything the replica has held.
        assert int(sync.sync(ModelExport(random_model(TINY, seed=11))).version) == held + 1
    record("a numeric label below the served one", "refused naming it (ValueError)", took)


def test_a_push_between_two_trainer_syncs_is_not_relabelled(replica, checkpoint) -> None:
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        before = int(sync.sync(ModelExport(random_model(TINY, seed=12))).version)
        pushed = subprocess.run(
            [
                *(sys.executable, "-m", "weightsync", "push", str(checkpoint)),
                *("--replica", replica, "--transport", "tcp", "--json"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert pushed.returncode == 0, pushed.stderr[-2000:]
        push_label = json.loads(pushed.stdout.strip().splitlines()[-1])["version"]
        assert int(push_label) == before + 1
        after = sync.sync(ModelExport(random_model(TINY, seed=13))).version
        assert int(after) == before + 2
    record("trainer, push (a rollback), trainer", "each label new", 0.0)


def test_odd_labels_neither_crash_a_manager_nor_restart_the_count(replica) -> None:
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        top = int(sync.sync(ModelExport(random_model(TINY, seed=14))).version)
        clock = Stopwatch()
        with pytest.raises(ValueError, match="at most 256 characters, got 5000"):
            sync.sync(ModelExport(random_model(TINY, seed=15)), version="9" * 5000)
        took = clock.seconds
        with pytest.raises(ValueError, match="at most 18 digits, got 100"):
            sync.sync(ModelExport(random_model(TINY, seed=15)), version="9" * 100)
        assert label_of(replica) == str(top)
        # Not numbers: legal labels, never read as numbers.
        assert sync.sync(ModelExport(random_model(TINY, seed=16)), version="²").version == "²"
    # A new manager, the replica holding a label that is not a number, counts on from the
    # largest number the replica has held.
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        assert sync.sync(ModelExport(random_model(TINY, seed=17))).version == str(top + 1)
    # A label set by someone else that no rule here would give (a 300-digit number) is read
    # as a label, not a number: a new manager neither crashes on it nor counts from it.
    call(replica, "update_weight_version", "9" * 300, abort_all_requests=False)
    with ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[replica]) as sync:
        assert sync.sync(ModelExport(random_model(TINY, seed=18))).version == str(top + 2)
    record("odd labels ('²', 5,000 digits)", "refused or kept as labels; the count goes on", took)


# 3. Membership changes while a sync runs.


def test_removing_a_replica_during_a_sync_waits_for_it(checkpoint, tmp_path) -> None:
    with serve_replicas(checkpoint, num_replicas=2, log_dir=tmp_path) as replicas:
        keep, gone = (r.url for r in replicas)
        sync = ws.TrainerSync(sync_config(), hf_config=TINY, replicas=[keep, gone])
        try:
            sync.sync(ModelExport(random_model(TINY, seed=18)))
            removals: list[threading.Thread] = []

            def remove_now() -> None:
                # From another thread, while the push runs: the documented entry point...
                removals.append(threading.Thread(target=sync.remove_replica, args=(gone,)))
                removals[-1].start()

            model = random_model(TINY, seed=19)
            export = StallingExport(ModelExport(model), after=3, hook=remove_now)
            clock = Stopwatch()
            report = sync.sync(export)
            removals[0].join(30)
            took = clock.seconds
            assert not removals[0].is_alive()
            # ...waited for the sync: both replicas were updated and serve it.
            assert set(report.replicas) == {keep, gone} and set(report.verified) == {keep, gone}
            assert sync.manager.replicas == (keep,)
            assert sync.manager.dirty_replicas == frozenset()
            assert tokens_of(keep) == tokens_of(gone) == expected_tokens(model)
            # The next sync runs without it; the removed one keeps what it had.
            model2 = random_model(TINY, seed=20)
            nxt = sync.sync(ModelExport(model2))
            assert nxt.replicas == (keep,) and tokens_of(keep) == expected_tokens(model2)
            assert label_of(gone) == report.version and tokens_of(gone) is not None

            # The manager's own coroutine, put on the sync's loop from another thread.
            assert sync._loop is not None
            loop = sync._loop
            futures = []

            def remove_on_loop() -> None:
                coro = sync.manager.add_replica(gone)
                futures.append(asyncio.run_coroutine_threadsafe(coro, loop))

            hooked = StallingExport(ModelExport(model), after=3, hook=remove_on_loop)
            again = sync.sync(hooked)
            # Applied as the sync ended; the coroutine returns when the loop next runs.
            assert again.replicas == (keep,) and sync.manager.replicas == (keep, gone)
            assert sync.sync(ModelExport(model2)).replicas == (keep, gone)
            futures[0].result(30)
        finally:
            sync.close()
    record("remove_replica while a sync runs (another thread)", "waits for the sync", took)


# 4. What ends a session complete.


def test_a_labelled_leased_end_without_digests_is_not_complete(replica) -> None:
    async def run() -> tuple[dict, dict]:
        async with RolloutClient(replica, timeout_s=30.0) as client:
            await client.pause_generation(mode="abort")
            grant = await client.begin_weight_update("target", lease_s=30.0)
            token = grant.session_token
            assert grant.instance and grant.weight_version is not None
            await client.update_weight_version(
                "no-digests", abort_all_requests=False, session_token=token
            )
            with pytest.raises(RemoteReplicaError, match="ended without digests"):
                await client.end_weight_update(session_token=token)
            with pytest.raises(RemoteReplicaError, match="weights are incomplete"):
                await client.continue_generation()
            broken = await client.get_server_info()
            # The same, saying it computed none: complete, unverified.
            grant = await client.begin_weight_update("target", lease_s=30.0)
            token = grant.session_token
            await client.update_weight_version(
                "said-unverified", abort_all_requests=False, session_token=token
            )
            await client.end_weight_update(session_token=token, unverified=True)
            await client.continue_generation()
            return broken, await client.get_server_info()

    broken, said = run_checked(run)
    weights = broken["weightsync"]["weights"]
    assert weights["complete"] is False and "without digests" in weights["incomplete_reason"]
    assert said["weightsync"]["weights"] == {
        "complete": True,
        "incomplete_reason": None,
        "verified": False,
    }
    assert tokens_of(replica) is not None
    # A sync without digests says so: the replica is reported unverified, not verified.
    config = sync_config(digest=False)
    with ws.TrainerSync(config, hf_config=TINY, replicas=[replica]) as sync:
        report = sync.sync(ModelExport(random_model(TINY, seed=21)))
    assert report.verified == () and report.unverified == (replica,)
    assert report.to_dict()["unverified"] == [replica]
    record("a labelled end without digests", "incomplete unless said unverified", 0.0)


def run_checked(run: Any) -> Any:
    return asyncio.run(run())
