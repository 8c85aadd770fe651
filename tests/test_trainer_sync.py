"""`TrainerSync`, the front door: what it owns, its typed messages, and an event loop that
never blocks on a collective."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

import weightsync as ws
from faults import record
from process_group import run_in_process_group
from servers import serve_replicas
from weightsync.errors import WeightSyncError
from weightsync.manager.collective import Collective, NoPush, PushOrder, SyncFailed
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint

TINY = preset_config("tiny")


@pytest.fixture(scope="module")
def replica_url(tmp_path_factory) -> Iterator[str]:
    """One tp-1 replica for the tests that sync into one (each from a manager of its own)."""
    folder = tmp_path_factory.mktemp("replica")
    checkpoint = write_random_checkpoint(folder / "ckpt", TINY, seed=1)
    with serve_replicas(checkpoint, tp=1, log_dir=folder) as (replica,):
        yield replica.url


def test_the_front_door_names_resolve_lazily() -> None:
    for name in ws.__all__:
        assert getattr(ws, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ws.Nope  # noqa: B018


def test_sync_config_is_one_nested_config() -> None:
    config = ws.SyncConfig(transport=ws.CudaIpcConfig(device=1, num_streams=2))
    assert isinstance(config.sender, ws.SenderConfig)
    assert isinstance(config.control, ws.ControlConfig)
    with pytest.raises(ValueError, match="MooncakeConfig or a CudaIpcConfig"):
        ws.SyncConfig(transport={"protocol": "tcp"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ControlConfig"):
        ws.SyncConfig(control=ws.SenderConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pause_mode"):
        ws.ControlConfig(pause_mode="stop")
    with pytest.raises(ValueError, match="delta_check='every other byte': choose one of"):
        ws.ControlConfig(delta_check="every other byte")
    with pytest.raises(ValueError, match="num_streams"):
        ws.CudaIpcConfig(num_streams=0)


def test_trainer_sync_owns_and_closes_its_transport() -> None:
    with ws.TrainerSync(hf_config=TINY) as sync:
        transport = sync.transport
        assert sync.is_driver and sync.manager is not None and sync.manager.replicas == ()
        assert transport.session_id.startswith("127.0.0.1:")
    with pytest.raises(ValueError, match="closed"):
        sync.sync(ws.ModelExport(random_model(TINY)))
    with ws.TrainerSync(hf_config=TINY) as empty, pytest.raises(ValueError, match="no rollout"):
        empty.sync(ws.ModelExport(random_model(TINY)))


def test_messages_out_of_step_are_refused() -> None:
    collective = Collective(None, rank=0, world_size=1)
    assert isinstance(collective.broadcast(NoPush(), (PushOrder, NoPush)), NoPush)
    with pytest.raises(WeightSyncError, match="expected a PushOrder message, got SyncFailed"):
        collective.broadcast(SyncFailed(error=ValueError("x")), (PushOrder,))


def _slow_follower(rank: int, group, url: str) -> float | None:
    """Rank 1 joins the broadcast that orders the push 1.5 s late; rank 0 measures the
    longest stall of its manager's event loop meanwhile."""
    import weightsync as ws
    from weightsync.testing.presets import random_model

    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20), transport=ws.MooncakeConfig(timeout_s=10)
    )
    model = random_model(TINY, seed=2)
    with ws.TrainerSync(config, hf_config=TINY, group=group, replicas=[url]) as sync:
        if rank == 1:
            broadcast = sync._collective.broadcast

            def late(message, expected):
                if PushOrder in expected:
                    time.sleep(1.5)
                return broadcast(message, expected)

            sync._collective.broadcast = late  # type: ignore[method-assign]
            sync.sync(ws.ModelExport(model))
            return None
        stop = threading.Event()

        async def heartbeat() -> float:
            worst, last = 0.0, time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                if stop.is_set():  # the loop stopped with the sync: that gap is no stall
                    return worst
                now = time.perf_counter()
                worst, last = max(worst, now - last), now

        # The manager's loop runs while the sync does, and the heartbeat with it.
        loop = sync._loop
        assert loop is not None
        beat = loop.create_task(heartbeat())
        try:
            report = sync.sync(ws.ModelExport(model))
        finally:
            stop.set()
        stall = [loop.run_until_complete(beat)]
        assert report.seconds > 1.4  # the late follower really held the sync up
        return stall[0]


@pytest.mark.slow
def test_the_driver_loop_never_blocks_on_a_collective(replica_url) -> None:
    stall, _ = run_in_process_group(2, _slow_follower, replica_url, timeout_s=180)
    # A collective run on the loop would have stalled it for the follower's 1.5 s.
    assert stall < 1.0, stall


def _stopped_follower(rank: int, group) -> dict:
    """Rank 2 stops itself (SIGSTOP) before a sync; ranks 0 and 1 must fail within the
    collective timeout with the same error, and rank 2, continued, fails too."""
    import os
    import signal

    import torch.distributed as dist

    import weightsync as ws
    from weightsync.errors import CollectiveError
    from weightsync.testing.presets import random_model

    config = ws.SyncConfig(collective_timeout_s=2.0, transport=ws.MooncakeConfig(timeout_s=5))
    pids: list = [None] * 3
    with ws.TrainerSync(
        config, hf_config=TINY, group=group, replicas=["http://127.0.0.1:9"]
    ) as sync:
        dist.all_gather_object(pids, os.getpid(), group=group)
        if rank == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        export = ws.ModelExport(random_model(TINY, seed=1))
        start = time.monotonic()
        try:
            sync.sync(export)
        except CollectiveError as exc:
            outcome = {"seconds": time.monotonic() - start, "error": str(exc)}
        else:
            outcome = {"seconds": time.monotonic() - start, "error": None}
        if rank == 0:
            os.kill(pids[2], signal.SIGCONT)
    return outcome


@pytest.mark.faults
def test_a_stopped_rank_makes_every_other_rank_raise_within_the_timeout() -> None:
    outcomes = run_in_process_group(3, _stopped_follower, timeout_s=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None, (rank, outcome)
        assert "all-gather of the holdings" in outcome["error"]
        assert "2 s timeout" in outcome["error"]
    # Bounded by the 2 s timeout, not the 1800 s default; the slack is for a loaded CI host.
    assert outcomes[0]["seconds"] < 20 and outcomes[1]["seconds"] < 20, outcomes
    record(
        "a trainer rank SIGSTOPped (timeout 2 s)",
        "every rank raises CollectiveError",
        max(outcomes[0]["seconds"], outcomes[1]["seconds"]),
    )


def test_a_sync_runs_from_plain_code_and_from_inside_an_event_loop(replica_url) -> None:
    # The manager's loop runs in the calling thread while a call lasts; a caller that is
    # itself async code (its own loop running in this thread) gets it run in a thread.
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20), transport=ws.MooncakeConfig(timeout_s=10)
    )
    export = ws.ModelExport(random_model(TINY, seed=4))
    with ws.TrainerSync(config, hf_config=TINY, replicas=[replica_url]) as sync:
        assert sync.sync(export).verified == (replica_url,)

        async def from_async_code() -> tuple[str, ...]:
            report = sync.sync(export)
            assert sync.manager is not None
            assert len(sync.run(sync.manager.targets())) == 1
            return report.verified

        assert asyncio.run(from_async_code()) == (replica_url,)
        assert sync.sync(export).verified == (replica_url,)
