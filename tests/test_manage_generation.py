"""`ControlConfig(manage_generation=False)`: weightsync runs only its part of the lifecycle
(begin, metadata, push, version, end) while the host pauses, releases and resumes (real
reference replica, tp=1, real Mooncake TCP writes on 127.0.0.1)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from servers import serve_replicas
from weightsync import SenderConfig, SyncConfig, TrainerSync
from weightsync.control import RolloutClient
from weightsync.errors import RemoteReplicaError, TransferError
from weightsync.export import ModelExport
from weightsync.manager.config import ControlConfig
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint
from weightsync.testing.reference import greedy_tokens
from weightsync.testing.transports import FailsAfter
from weightsync.transport import MooncakeConfig, MooncakeTransport

TINY = preset_config("tiny")
PROMPT = (3, 14, 15, 92)


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Iterator[str]:
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY)
    with serve_replicas(checkpoint, log_dir=tmp_path_factory.mktemp("logs")) as (served,):
        yield served.url


def call(replica: str, method: str, *args: Any, **kwargs: Any) -> Any:
    async def run() -> Any:
        async with RolloutClient(replica, timeout_s=30.0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run())


def state(replica: str) -> dict[str, Any]:
    return call(replica, "get_server_info")["state"]


def host_pauses(replica: str) -> None:
    call(replica, "pause_generation", mode="abort")
    call(replica, "release_memory_occupation", tags=["kv_cache"])


def host_resumes(replica: str) -> None:
    call(replica, "resume_memory_occupation", tags=["kv_cache"])
    call(replica, "flush_cache")
    call(replica, "continue_generation")


def test_only_weightsyncs_part_of_the_lifecycle_runs(replica: str) -> None:
    model = random_model(TINY, seed=5)
    transport = FailsAfter(MooncakeTransport(MooncakeConfig(timeout_s=10)))
    config = SyncConfig(
        sender=SenderConfig(bucket_bytes=64 << 10),
        control=ControlConfig(manage_generation=False),
    )
    try:
        with TrainerSync(config, hf_config=TINY, replicas=[replica], transport=transport) as sync:
            host_pauses(replica)
            report = sync.sync(ModelExport(model), version="7")
            # The manager neither resumed the KV cache nor generation: the host's to do.
            after = state(replica)
            assert after["paused"] and after["memory_released"] == ["kv_cache"], after
            assert after["weight_update_session"] == "closed"
            assert call(replica, "get_model_info")["weight_version"] == "7"
            assert report.phases.pause < 5 and report.version == "7"
            host_resumes(replica)
            reply = call(replica, "generate", list(PROMPT), max_new_tokens=4, temperature=0.0)
            expected = greedy_tokens(model, torch.float32, (PROMPT,), 4)[0]
            assert list(reply.output_ids) == expected

            # A write fails part-way while the two before it are still on their way: the
            # session is ended before they land, the weights are marked incomplete all the
            # same, and nothing resumes the replica; it refuses to continue or serve until a
            # complete update lands, whatever the host asks, before and after they land.
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.01)
            host_pauses(replica)
            transport.remaining = 2
            transport.hold()
            with pytest.raises(TransferError, match="injected failure") as failed:
                sync.sync(ModelExport(model), version="8")
            assert "stay paused" in " ".join(getattr(failed.value, "__notes__", []))
            assert sync.manager is not None and sync.manager.dirty_replicas == {replica}
            after = state(replica)
            assert after["paused"] and after["weight_update_session"] == "closed", after
            weights = call(replica, "get_server_info")["weightsync"]["weights"]
            assert weights["complete"] is False, weights
            call(replica, "resume_memory_occupation", tags=["kv_cache"])
            with pytest.raises(RemoteReplicaError, match="incomplete"):
                call(replica, "continue_generation")
            with pytest.raises(RemoteReplicaError, match="incomplete"):
                call(replica, "generate", list(PROMPT), max_new_tokens=2)
            transport.release()  # the late bytes land
            with pytest.raises(RemoteReplicaError, match="incomplete"):
                call(replica, "continue_generation")

            transport.remaining = None
            host_pauses(replica)
            sync.sync(ModelExport(model), version="9")
            host_resumes(replica)
            reply = call(replica, "generate", list(PROMPT), max_new_tokens=4, temperature=0.0)
            assert list(reply.output_ids) == greedy_tokens(model, torch.float32, (PROMPT,), 4)[0]
    finally:
        transport.close()


def test_manage_generation_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="manage_generation"):
        ControlConfig(manage_generation="no")  # type: ignore[arg-type]
