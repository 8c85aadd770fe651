"""Fault injection: a trainer tensor changed while a sync pushes it.

Real `weightsync serve` replicas (bf16, tp=1), a real `ws.TrainerSync`, Mooncake TCP on
127.0.0.1. A change to a tensor between the push taking it and its writes landing (an
optimizer step on another thread) fails the sync with an error naming the tensor, before the
sessions end: the replica stays paused and incomplete, does not serve under the new label,
and the next sync recovers it bit-exactly. Optimizer steps between syncs are no fault.
``WEIGHTSYNC_FAULT_TABLE=path`` collects case, outcome and time to fail as JSON lines.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import weightsync as ws
from faults import HookedTransport, StallingExport, Stopwatch, call, record, serves
from servers import serve_replicas
from weightsync.errors import TensorChangedError
from weightsync.export import ModelExport
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint
from weightsync.transport import MooncakeTransport

pytestmark = pytest.mark.faults

# A vocabulary the rollout does not pad (a multiple of 64): in bf16 at tp=1, with
# ``SenderConfig(direct="always")``, every byte then goes direct and pushes from the second
# on are replayed (with "auto", the tiny model's small pieces would share staged writes).
TINY = preset_config("tiny", vocab_size=1024)
# Each case's syncs, failed one included, end well within this.
CASE_S = 60.0


def sync_config(**sender: Any) -> ws.SyncConfig:
    return ws.SyncConfig(
        sender=ws.SenderConfig(**{"bucket_bytes": 1 << 20, "timeout_s": 5.0, **sender}),
        control=ws.ControlConfig(lease_s=5.0, lifecycle_timeout_s=3.0),
        transport=ws.MooncakeConfig(timeout_s=5.0),
    )


def load(model: torch.nn.Module, seed: int) -> None:
    """Give `model` the weights of `seed` in place."""
    fresh = random_model(TINY, seed=seed)
    with torch.no_grad():
        for param, new in zip(
            model.state_dict().values(), fresh.state_dict().values(), strict=True
        ):
            param.copy_(new)


def held(url: str) -> dict[str, str]:
    """The SHA-256 of each parameter the replica holds."""
    ranks = json.loads(call(url, "weights_checker", "checksum").message)["ranks"]
    return {name: entry["sha256"] for rank in ranks for name, entry in rank["checksums"].items()}


def expected(model: torch.nn.Module) -> dict[str, str]:
    """The SHA-256 of each parameter a bf16 tp=1 replica of `model` holds."""
    params = shard_state_dict(
        dict(ModelExport(model)), TINY, {"tp_size": 1, "tp_rank": 0}, dtype="bfloat16"
    )
    return {
        name: hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        for name, t in params.items()
    }


def assert_paused_under_the_old_label(sync: ws.TrainerSync, url: str, old: str) -> None:
    """The failed sync left the replica paused and incomplete, serving nothing, its label
    not the new one."""
    assert sync.manager is not None and url in sync.manager.dirty_replicas
    assert call(url, "served_weight_version") == old
    assert not call(url, "get_server_info")["weightsync"]["weights"]["complete"]
    assert not serves(url)


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Iterator[str]:
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY, seed=0)
    logs = tmp_path_factory.mktemp("pinning")
    with serve_replicas(checkpoint, dtype="bf16", log_dir=logs) as (served,):
        yield served.url


class CountingExport(ModelExport):
    """A model's export that counts how often its stream is read (a replay reads none)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        return super().__iter__()


@pytest.mark.timeout(2 * CASE_S)
@pytest.mark.parametrize(
    ("dtype", "path"), [(torch.float32, "staged"), (torch.bfloat16, "direct")], ids=str
)
def test_a_tensor_changed_mid_push_fails_the_sync_and_the_next_one_recovers(
    replica: str, dtype: torch.dtype, path: str
) -> None:
    # fp32 trainer tensors are cast into the staging ring; bf16 ones are written straight
    # from the trainer's memory (tp=1). No finite check: it would read the stream first.
    model = random_model(TINY, seed=1).to(dtype)
    clock = Stopwatch()
    config = sync_config(check_finite="never", direct="always" if path == "direct" else "auto")
    with ws.TrainerSync(config, hf_config=TINY, replicas=[replica]) as sync:
        good = sync.sync(ModelExport(model))
        load(model, 2)
        stream = dict(ModelExport(model))
        name = list(stream)[3]

        def step() -> None:  # tensor 3 updated in place once tensor 8 was yielded
            with torch.no_grad():
                stream[name].mul_(0.5)

        failed_at = clock.seconds
        with pytest.raises(TensorChangedError, match=f"'{name}' changed while a push read it"):
            sync.sync(StallingExport(ModelExport(model), after=9, hook=step))
        took = clock.seconds - failed_at
        assert_paused_under_the_old_label(sync, replica, good.version)

        report = sync.sync(ModelExport(model))
        assert report.verified == (replica,) and serves(replica)
        assert call(replica, "served_weight_version") == report.version != good.version
        assert held(replica) == expected(model)
        stats = report.push.per_source[0]
        assert (stats.bytes_staged, stats.bytes_direct)[path == "staged"] == 0
    assert clock.seconds < CASE_S
    record(f"tensor changed mid-push ({path})", "sync fails naming it; replica paused", took)


@pytest.mark.timeout(2 * CASE_S)
def test_a_tensor_changed_on_another_thread_during_a_replayed_push_fails_the_sync(
    replica: str,
) -> None:
    # bf16 at tp=1, every byte direct: from the second sync on the push is replayed from
    # Mooncake write lists bound to the parameters' addresses, the stream not read.
    model = random_model(TINY, seed=3).to(torch.bfloat16)
    engine = MooncakeTransport(ws.MooncakeConfig(timeout_s=5.0))
    hooked = HookedTransport(engine)
    clock = Stopwatch()
    config = sync_config(direct="always")
    try:
        with ws.TrainerSync(config, hf_config=TINY, replicas=[replica], transport=hooked) as sync:
            export = CountingExport(model)
            sync.sync(export)
            load(model, 4)
            good = sync.sync(export)
            assert good.push.per_source[0].replayed

            name = "model.layers.1.self_attn.o_proj.weight"
            tensor = model.get_parameter(name)

            def optimizer_thread() -> None:  # a step on another thread, mid-replay
                def step() -> None:
                    with torch.no_grad():
                        tensor.add_(1.0)

                thread = threading.Thread(target=step)
                thread.start()
                thread.join()

            load(model, 5)
            hooked.arm(optimizer_thread)
            reads = export.iterations
            failed_at = clock.seconds
            with pytest.raises(TensorChangedError, match=f"'{name}' changed") as caught:
                sync.sync(export)
            took = clock.seconds - failed_at
            assert hooked.fired == 1 and export.iterations == reads  # a replay
            assert caught.value.hf_name == name
            assert_paused_under_the_old_label(sync, replica, good.version)

            report = sync.sync(export)
            assert report.verified == (replica,) and serves(replica)
            assert held(replica) == expected(model)
            load(model, 6)
            assert sync.sync(export).push.per_source[0].replayed
            assert held(replica) == expected(model)
    finally:
        engine.close()
    assert clock.seconds < CASE_S
    record("tensor changed on another thread mid-replay", "sync fails naming it", took)


@pytest.mark.timeout(2 * CASE_S)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_optimizer_steps_between_syncs_are_no_fault(replica: str, dtype: torch.dtype) -> None:
    model = random_model(TINY, seed=7).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(7)
    export = ModelExport(model)
    clock = Stopwatch()
    config = sync_config(direct="always")
    with ws.TrainerSync(config, hf_config=TINY, replicas=[replica]) as sync:
        reports = []
        for step in range(4):
            if step:
                for param in model.parameters():
                    param.grad = torch.randn(param.shape, generator=generator).to(dtype)
                optimizer.step()
                optimizer.zero_grad()
            reports.append(sync.sync(export))
        assert all(r.verified == (replica,) for r in reports)
        replayed = [r.push.per_source[0].replayed for r in reports]
        # bf16 goes direct and replays; fp32 is cast through the ring each time.
        assert replayed == ([False, True, True, True] if dtype == torch.bfloat16 else [False] * 4)
        assert held(replica) == expected(model)
    assert clock.seconds < CASE_S
    record(f"optimizer steps between syncs ({dtype})", "every sync verified", clock.seconds)
