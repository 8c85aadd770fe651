"""The reference replica owns its dirty state: leased, fenced sessions, digests verified at
the end, and weights marked incomplete whatever a client does (real replica, tp=2, real
Mooncake TCP writes on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from servers import serve_replicas
from weightsync import SyncConfig, TrainerSync
from weightsync.control import RolloutClient
from weightsync.errors import RemoteReplicaError
from weightsync.export import ModelExport
from weightsync.manager.config import ControlConfig
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint
from weightsync.transport import MooncakeConfig, MooncakeTransport

pytestmark = pytest.mark.faults

TINY = preset_config("tiny")


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Iterator[str]:
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY)
    with serve_replicas(checkpoint, tp=2, log_dir=tmp_path_factory.mktemp("logs")) as (served,):
        yield served.url


@pytest.fixture(scope="module")
def trainer(replica) -> Iterator[TrainerSync]:
    config = SyncConfig(control=ControlConfig(lease_s=5.0, lifecycle_timeout_s=10.0))
    with TrainerSync(config, hf_config=TINY, replicas=[replica]) as sync:
        yield sync


@pytest.fixture(scope="module")
def outsider() -> Iterator[MooncakeTransport]:
    """Another process's view: a transfer engine that knows the published addresses."""
    engine = MooncakeTransport(MooncakeConfig(timeout_s=5.0))
    yield engine
    engine.close()


def call(replica: str, method: str, *args: Any, **kwargs: Any) -> Any:
    async def run() -> Any:
        async with RolloutClient(replica, timeout_s=30.0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run())


def weights_state(replica: str) -> dict[str, Any]:
    return call(replica, "get_server_info")["weightsync"]["weights"]


def generate_refusal(replica: str) -> str | None:
    try:
        call(replica, "generate", [1, 2, 3], max_new_tokens=2)
    except RemoteReplicaError as exc:
        assert exc.status_code == 503, exc
        return str(exc)
    return None


def overwrite(
    outsider: MooncakeTransport, replica: str, name: str, *, rank: int = 0, value: int = 0x5A
) -> None:
    """Write garbage over parameter `name` of `rank`, as any peer of the data plane can."""
    session_id, weights_info = call(replica, "get_transfer_engine_info", rank)
    addr, numel, size = weights_info[name]
    garbage = torch.full((numel * size,), value, dtype=torch.uint8)
    outsider.register(garbage.data_ptr(), garbage.numel())
    try:
        outsider.wait(
            outsider.write(session_id, [garbage.data_ptr()], [addr], [garbage.numel()]), 10.0
        )
    finally:
        outsider.unregister(garbage.data_ptr())


def serve_again(trainer: TrainerSync, seed: int) -> None:
    report = trainer.sync(ModelExport(random_model(TINY, seed=seed)))
    assert report.verified == report.replicas
    assert generate_refusal(report.replicas[0]) is None


def test_a_leased_session_answers_only_its_holder(replica, trainer) -> None:
    serve_again(trainer, seed=1)
    call(replica, "pause_generation")
    grant = call(replica, "begin_weight_update", lease_s=30.0)
    token = grant.session_token
    assert token and grant.lease_s == 30.0
    for method, kwargs in [
        ("update_weight_version", {"new_version": "x"}),
        ("end_weight_update", {}),
        ("end_weight_update", {"session_token": "not-the-token"}),
        ("renew_weight_update", {"session_token": "not-the-token", "lease_s": 5.0}),
    ]:
        args = (kwargs.pop("new_version"),) if "new_version" in kwargs else ()
        with pytest.raises(RemoteReplicaError, match="held by another client"):
            call(replica, method, *args, **kwargs)
    # Nobody may serve half-written weights: not even a resume from the holder.
    with pytest.raises(RemoteReplicaError, match="session is open"):
        call(replica, "continue_generation")
    assert "session is open" in generate_refusal(replica)
    call(replica, "renew_weight_update", token, 30.0)
    call(replica, "end_weight_update", session_token=token)
    call(replica, "continue_generation")
    assert weights_state(replica)["complete"]
    assert generate_refusal(replica) is None


def test_an_expired_lease_after_writes_leaves_the_replica_incomplete(
    replica, trainer, outsider
) -> None:
    serve_again(trainer, seed=2)
    call(replica, "pause_generation")
    call(replica, "begin_weight_update", lease_s=1.0)
    overwrite(outsider, replica, "model.embed_tokens.weight")  # a push cut short
    deadline = time.monotonic() + 10
    while weights_state(replica)["complete"]:
        assert time.monotonic() < deadline, "the lease did not expire"
        time.sleep(0.1)
    state = weights_state(replica)
    assert "lease expired" in state["incomplete_reason"]
    assert "embed_tokens" in state["incomplete_reason"]
    assert call(replica, "get_server_info")["weightsync"]["session"]["state"] == "closed"
    with pytest.raises(RemoteReplicaError, match="incomplete"):
        call(replica, "continue_generation")
    with pytest.raises(RemoteReplicaError, match="incomplete"):
        call(replica, "update_weight_version", "9")
    assert "incomplete" in generate_refusal(replica)
    serve_again(trainer, seed=3)  # the next sync recovers
    assert weights_state(replica) == {"complete": True, "incomplete_reason": None, "verified": True}


def test_an_expired_lease_leaves_the_weights_incomplete_before_any_write_lands(
    replica, trainer, outsider
) -> None:
    # A holder that lost its lease may be stuck, not dead: what it wrote may land after the
    # lease expired. Nothing had landed when it did, yet the weights are incomplete, and
    # stay so once the late write lands.
    serve_again(trainer, seed=4)
    call(replica, "pause_generation")
    call(replica, "begin_weight_update", lease_s=0.5)
    time.sleep(1.5)
    assert call(replica, "get_server_info")["weightsync"]["session"]["state"] == "closed"
    state = weights_state(replica)
    assert not state["complete"] and "lease expired" in state["incomplete_reason"]
    overwrite(outsider, replica, "model.norm.weight")  # the stuck holder's write lands
    with pytest.raises(RemoteReplicaError, match="incomplete"):
        call(replica, "continue_generation")
    assert "incomplete" in generate_refusal(replica)
    serve_again(trainer, seed=10)  # the next sync recovers
    assert weights_state(replica)["complete"]


def test_an_abandoned_session_leaves_the_weights_incomplete_whatever_arrived(
    replica, trainer
) -> None:
    # Nothing landed by the end, yet the holder's writes may still: the end is no error,
    # but the weights stay incomplete until a complete update, and the reply says so.
    serve_again(trainer, seed=8)
    call(replica, "pause_generation")
    token = call(replica, "begin_weight_update", lease_s=30.0).session_token
    overlong = httpx.post(
        f"{replica}/end_weight_update",
        json={"session_token": token, "abandoned": "x" * 1001},
        timeout=30.0,
    )
    assert overlong.status_code == 400 and "abandoned" in overlong.text, overlong.text
    assert call(replica, "get_server_info")["weightsync"]["session"]["state"] == "open"
    reply = call(
        replica, "end_weight_update", session_token=token, abandoned="a write to rank 1 failed"
    )
    assert "abandoned" in reply.message and "incomplete" in reply.message
    state = weights_state(replica)
    assert not state["complete"] and not state["verified"]
    assert "a write to rank 1 failed" in state["incomplete_reason"]
    assert call(replica, "get_server_info")["weightsync"]["session"]["state"] == "closed"
    with pytest.raises(RemoteReplicaError, match="incomplete"):
        call(replica, "continue_generation")
    serve_again(trainer, seed=9)  # the next sync recovers
    assert weights_state(replica) == {"complete": True, "incomplete_reason": None, "verified": True}


def test_digests_that_do_not_match_fail_the_end_and_name_the_parameters(replica, trainer) -> None:
    serve_again(trainer, seed=5)
    held = call(replica, "get_transfer_engine_info", 0)[1]
    call(replica, "pause_generation")
    token = call(replica, "begin_weight_update", lease_s=30.0).session_token
    wrong = {rank: {name: 12345 for name in held} for rank in range(2)}
    with pytest.raises(RemoteReplicaError, match="digest mismatch") as caught:
        call(replica, "end_weight_update", session_token=token, digests=wrong)
    assert "tp rank 0" in str(caught.value) and "tp rank 1" in str(caught.value)
    assert not weights_state(replica)["complete"]
    assert "incomplete" in generate_refusal(replica)
    serve_again(trainer, seed=6)


def test_bytes_written_outside_a_session_are_found_at_the_next_begin(
    replica, trainer, outsider
) -> None:
    serve_again(trainer, seed=7)
    overwrite(outsider, replica, "model.norm.weight", rank=1)
    call(replica, "pause_generation")
    token = call(replica, "begin_weight_update", lease_s=30.0).session_token
    reason = weights_state(replica)["incomplete_reason"]
    assert "changed outside a weight-update session" in reason and "tp rank 1" in reason
    call(replica, "end_weight_update", session_token=token)
    with pytest.raises(RemoteReplicaError, match="incomplete"):
        call(replica, "continue_generation")
    serve_again(trainer, seed=8)


def test_reset_tensors_never_randomises_a_serving_replica(replica, trainer) -> None:
    serve_again(trainer, seed=9)
    with pytest.raises(RemoteReplicaError, match="pause_generation"):
        call(replica, "weights_checker", "reset_tensors")
    assert generate_refusal(replica) is None
    call(replica, "pause_generation")
    call(replica, "weights_checker", "reset_tensors")
    assert "reset_tensors" in weights_state(replica)["incomplete_reason"]
    with pytest.raises(RemoteReplicaError, match="incomplete"):
        call(replica, "continue_generation")
    serve_again(trainer, seed=10)


def test_sglang_style_sessions_still_work_but_are_not_verified(replica, trainer, outsider) -> None:
    serve_again(trainer, seed=11)
    call(replica, "pause_generation")
    call(replica, "begin_weight_update")
    overwrite(outsider, replica, "model.norm.weight")
    call(replica, "update_weight_version", "sglang-style")
    call(replica, "end_weight_update")
    assert weights_state(replica) == {
        "complete": True,
        "incomplete_reason": None,
        "verified": False,
    }
    call(replica, "continue_generation")
    # Without a version the written session is an abandoned update.
    call(replica, "pause_generation")
    call(replica, "begin_weight_update")
    overwrite(outsider, replica, "model.norm.weight", value=0x3C)
    with pytest.raises(RemoteReplicaError, match="without a complete update"):
        call(replica, "end_weight_update")
    assert "without a complete update" in weights_state(replica)["incomplete_reason"]
    serve_again(trainer, seed=12)


def test_the_manager_renews_the_lease_through_a_push_longer_than_it(replica) -> None:
    # Last in the module: the push writes nothing, so the update it ends is unverified.
    from weightsync.manager import PushResult, SyncManager

    lease_s = 1.0

    async def run():
        config = ControlConfig(lease_s=lease_s, lifecycle_timeout_s=10.0)
        async with SyncManager([replica], config) as manager:
            update = await manager.open_update()
            await asyncio.sleep(2.5 * lease_s)  # the push: the lease would lapse twice over
            return await manager.finish_update(update, PushResult.empty())

    report = asyncio.run(run())
    assert report.replicas == (replica,)
    assert report.phases.push >= 2.5 * lease_s
    assert weights_state(replica)["complete"] is True
    assert call(replica, "get_server_info")["state"]["weight_update_session"] == "closed"


def _landing_push(landed_after_s: float, error: BaseException | None = None):
    """A push that writes nothing and leaves "copies in flight": its summary names an event
    and lands `landed_after_s` later (or fails with `error`)."""
    from weightsync.manager import Landing, PushResult

    async def push(update) -> PushResult:
        loop = asyncio.get_running_loop()
        landed: asyncio.Future[float] = loop.create_future()

        def land() -> None:
            if error is not None:
                landed.set_exception(error)
            else:
                landed.set_result(time.perf_counter())

        loop.call_later(landed_after_s, land)
        return dataclasses.replace(
            PushResult.empty(), landing=Landing(events=("ab" * 64,), seen=landed)
        )

    return push


def test_an_end_waits_for_copies_in_flight_where_the_replica_cannot(replica) -> None:
    # The replica is on the CPU: it does not take after_events, so the manager waits for the
    # push's copies to land before it ends the session (the push phase runs until then).
    from weightsync.control.protocol import WEIGHT_SYNC_EVENTS
    from weightsync.manager import SyncManager

    info = call(replica, "get_server_info")
    assert WEIGHT_SYNC_EVENTS not in info["weightsync"]["capabilities"]

    async def run():
        async with SyncManager([replica], ControlConfig(lifecycle_timeout_s=10.0)) as manager:
            return await _pushed(manager, _landing_push(0.4))

    report = asyncio.run(run())
    assert report.replicas == (replica,)
    assert report.phases.push >= 0.4
    assert weights_state(replica)["complete"] is True


def test_copies_that_never_land_leave_the_replica_paused(replica) -> None:
    from weightsync.errors import PartialPushError
    from weightsync.manager import SyncManager

    failure = PartialPushError(
        "the copies did not finish within 0.1 s",
        failed={"any": "timed out"},
        result=None,
        target_session="any",
    )

    async def run():
        async with SyncManager([replica], ControlConfig(lifecycle_timeout_s=10.0)) as manager:
            with pytest.raises(PartialPushError, match="did not finish"):
                await _pushed(manager, _landing_push(0.1, failure))
            return manager.dirty_replicas

    assert asyncio.run(run()) == frozenset({replica})
    state = call(replica, "get_server_info")["state"]
    assert state["paused"] and state["weight_update_session"] == "closed"
    # A later update that lands serves again.
    asyncio.run(_update(replica, _landing_push(0.0)))
    assert not call(replica, "get_server_info")["state"]["paused"]


async def _update(replica: str, push) -> None:
    from weightsync.manager import SyncManager

    async with SyncManager([replica], ControlConfig(lifecycle_timeout_s=10.0)) as manager:
        await _pushed(manager, push)


async def _pushed(manager, push):
    """One update of `manager` around `push` (which takes the open update)."""
    update = await manager.open_update()
    try:
        result = await push(update)
    except BaseException as exc:
        return await manager.finish_update(update, exc)
    return await manager.finish_update(update, result)
