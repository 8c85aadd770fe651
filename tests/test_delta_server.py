"""Delta syncs into a real reference replica (tp=2, a delta region per rank): payloads
written over real Mooncake TCP from this process into each rank's delta region, applied
with ``/weightsync/apply_delta`` and checked bit-exact; and what must be refused or must
leave the weights incomplete: a wrong checksum (the end cannot verify it, a full write
recovers), a call outside the session or from another holder, a rank missing, a payload
outside its region (nothing applied on any rank)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from delta_cases import payload
from servers import serve_replicas
from weightsync.checkpoint import load_config_dict
from weightsync.control import RolloutClient
from weightsync.control.protocol import WEIGHT_SYNC_DELTA
from weightsync.delta_codec import checksums
from weightsync.errors import RemoteReplicaError
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.receiver import WeightsChecker
from weightsync.receiver.digest import ParameterDigests
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import preset_config, write_random_checkpoint
from weightsync.transport import MooncakeConfig, MooncakeTransport

API_KEY = "delta-server-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TP = 2
REGION_MB = 1
REGION_BYTES = REGION_MB << 20
QKV = "model.layers.0.self_attn.qkv_proj.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"
NORM = "model.norm.weight"


def call(url: str, method: str, *args: Any, **kwargs: Any) -> Any:
    """One `RolloutClient` call against the replica."""

    async def run() -> Any:
        async with RolloutClient(url, api_key=API_KEY, timeout_s=60.0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run())


class Trainer:
    """This process as a trainer: what each rank of the replica holds (the checkpoint's
    shards, then what each test made of them) and a Mooncake engine that writes into it."""

    def __init__(self, url: str, checkpoint: Path) -> None:
        self.url = url
        config = load_config_dict(checkpoint)
        hf_state_dict: dict[str, torch.Tensor] = {}
        for file in sorted(checkpoint.glob("*.safetensors")):
            hf_state_dict.update(load_file(file))
        self.loaded = [
            shard_state_dict(hf_state_dict, config, ParallelismConfig(tp_size=TP, tp_rank=r))
            for r in range(TP)
        ]
        self.held = [dict(shards) for shards in self.loaded]
        self.infos = [call(url, "get_transfer_engine_reply", r) for r in range(TP)]
        self.transport = MooncakeTransport(MooncakeConfig(timeout_s=20.0))

    def write(self, rank: int, dst_addr: int, source: torch.Tensor) -> None:
        """Write `source`'s bytes to `dst_addr` of rank `rank`."""
        source = source.contiguous()
        session_id = self.infos[rank].remote_instance_transfer_engine_info[0]
        self.transport.register(source.data_ptr(), source.nbytes)
        try:
            handle = self.transport.write(
                session_id, [source.data_ptr()], [dst_addr], [source.nbytes]
            )
            self.transport.wait(handle, 20.0)
        finally:
            self.transport.unregister(source.data_ptr())

    def write_payload(self, rank: int, offset: int, encoded: torch.Tensor) -> tuple[int, int]:
        """Write a payload into rank `rank`'s delta region at `offset`; its span there."""
        addr, _ = self.infos[rank].delta_region
        self.write(rank, addr + offset, encoded)
        return offset, encoded.numel()

    def restore(self) -> None:
        """A full, verified update back to the checkpoint's weights: every parameter of
        every rank written, the end verified with the digests of what was written."""
        token = call(self.url, "begin_weight_update", lease_s=30.0).session_token
        for rank, shards in enumerate(self.loaded):
            weights_info = self.infos[rank].remote_instance_transfer_engine_info[1]
            for name, tensor in shards.items():
                self.write(rank, weights_info[name][0], tensor)
        digests = {r: ParameterDigests(s).compute() for r, s in enumerate(self.loaded)}
        call(self.url, "update_weight_version", "restored", session_token=token)
        call(self.url, "end_weight_update", session_token=token, digests=digests)
        self.held = [dict(shards) for shards in self.loaded]
        call(self.url, "continue_generation")

    def close(self) -> None:
        self.transport.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"))


@pytest.fixture(scope="module")
def replica(checkpoint, tmp_path_factory) -> Iterator[str]:
    with serve_replicas(
        checkpoint,
        tp=TP,
        api_key=API_KEY,
        delta_region_mb=REGION_MB,
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as (served,):
        yield served.url


@pytest.fixture(scope="module")
def trainer(replica, checkpoint) -> Iterator[Trainer]:
    made = Trainer(replica, checkpoint)
    yield made
    made.close()


@pytest.fixture
def http(replica) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=replica, timeout=60.0, headers=AUTH) as client:
        yield client


def weights_state(url: str) -> dict[str, Any]:
    return call(url, "get_server_info")["weightsync"]["weights"]


def generation_refusal(url: str) -> str | None:
    try:
        call(url, "generate", [1, 2, 3], max_new_tokens=2)
    except RemoteReplicaError as exc:
        assert exc.status_code == 503, exc
        return str(exc)
    return None


def sha256_checksums(url: str) -> list[dict[str, str]]:
    """Every rank's ``{param_name: sha256}`` from the replica's weights checker."""
    message = call(url, "weights_checker", "checksum").message
    return [_sha256(rank["checksums"]) for rank in json.loads(message)["ranks"]]


def expected_sha256(held: list[Mapping[str, torch.Tensor]]) -> list[dict[str, str]]:
    """``{param_name: sha256}`` of what each rank must hold."""
    return [_sha256(WeightsChecker(dict(s)).checksum().details["checksums"]) for s in held]


def _sha256(entries: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    # Random bits make NaNs, whose float sums never compare equal: the hashes do.
    return {name: entry["sha256"] for name, entry in entries.items()}


def a_delta(
    trainer: Trainer, seed: int
) -> tuple[dict[int, tuple[list, dict[str, int]]], list[dict[str, torch.Tensor]]]:
    """Payloads written into both ranks (two for rank 0, as from two trainer ranks), the
    apply request for them, and what each rank holds after it."""
    held = trainer.held
    first, after_first, _ = payload(held[0], {QKV: [0, 7, 500], NORM: [3]}, seed=seed)
    merged = {**held[0], **after_first}
    second, after_second, _ = payload(merged, {DOWN: [1, 2], QKV: [9]}, seed=seed + 1)
    after0 = {**merged, **after_second}
    only, after_only, _ = payload(held[1], {DOWN: [5]}, seed=seed + 2)
    after1 = {**held[1], **after_only}
    changed0 = {QKV, NORM, DOWN}
    ranks = {
        0: (
            [trainer.write_payload(0, 0, first), trainer.write_payload(0, 8192, second)],
            checksums({name: after0[name] for name in changed0}),
        ),
        1: ([trainer.write_payload(1, 4096, only)], checksums({DOWN: after1[DOWN]})),
    }
    return ranks, [after0, after1]


def test_the_replica_serves_deltas_and_checksums_of_its_weights(replica, trainer, http) -> None:
    info = call(replica, "get_server_info")
    assert WEIGHT_SYNC_DELTA in info["weightsync"]["capabilities"]
    for reply in trainer.infos:
        addr, num_bytes = reply.delta_region
        assert num_bytes == REGION_BYTES
        assert all(
            addr + num_bytes <= start or start + size <= addr
            for start, size in [*reply.registered_regions, reply.scratch_region]
        )
    loaded = {rank: checksums(shards) for rank, shards in enumerate(trainer.held)}
    assert call(replica, "delta_checksums", session_token=None) == loaded
    # Any time, without a body too; the JSON carries signed 64-bit integers.
    raw = http.post("/weightsync/delta_checksums")
    assert raw.status_code == 200 and raw.json()["success"] is True
    assert raw.json()["ranks"]["1"]["checksums"] == loaded[1]
    assert any(value < 0 for value in loaded[0].values())


def test_a_delta_lands_bit_exact_and_the_end_is_verified_without_digests(replica, trainer) -> None:
    for fused, seed in ((False, 10), (True, 20)):
        if fused:
            token = call(replica, "begin_weight_sync", lease_s=30.0).session_token
        else:
            call(replica, "pause_generation")
            token = call(replica, "begin_weight_update", lease_s=30.0).session_token
        base = call(replica, "delta_checksums", session_token=token)
        assert base == {rank: checksums(shards) for rank, shards in enumerate(trainer.held)}
        ranks, after = a_delta(trainer, seed)
        # The default check derives from the base read above; "full" reads every byte.
        check = "full" if fused else "changes"
        replies = call(replica, "apply_delta", session_token=token, ranks=ranks, check=check)
        assert sorted(replies) == [0, 1]
        assert [replies[r].num_elements for r in range(TP)] == [4 + 3, 1]
        for rank in range(TP):
            assert replies[rank].check == check
            assert replies[rank].verified and replies[rank].error is None
            assert replies[rank].mismatched == []
            assert replies[rank].checksums == checksums(after[rank])
        version = f"delta-{seed}"
        if fused:
            call(replica, "end_weight_sync", new_version=version, session_token=token)
        else:
            call(replica, "update_weight_version", version, session_token=token)
            call(replica, "end_weight_update", session_token=token)
            call(replica, "continue_generation")
        trainer.held = after
        assert weights_state(replica) == {
            "complete": True,
            "incomplete_reason": None,
            "verified": True,
        }
        # Every byte of every parameter, by another checksum than the one that verified.
        assert sha256_checksums(replica) == expected_sha256(after)
        assert generation_refusal(replica) is None
        assert call(replica, "get_weight_version") == version


def test_a_wrong_checksum_leaves_the_weights_incomplete_until_a_full_write(
    replica, trainer, http
) -> None:
    call(replica, "pause_generation")
    token = call(replica, "begin_weight_update", lease_s=30.0).session_token
    ranks, after = a_delta(trainer, seed=30)
    payloads, expected = ranks[1]
    ranks[1] = (payloads, {DOWN: expected[DOWN] + 1})
    body = {
        "session_token": token,
        "ranks": {str(r): {"payloads": p, "expected": e} for r, (p, e) in ranks.items()},
    }
    refused = http.post("/weightsync/apply_delta", json=body)
    assert refused.status_code == 400, refused.text
    reply = refused.json()
    assert reply["success"] is False
    assert "tp rank(s) [1]" in reply["message"] and DOWN in reply["message"]
    assert reply["ranks"]["0"]["verified"] is True
    assert reply["ranks"]["1"]["verified"] is False
    assert reply["ranks"]["1"]["mismatched"] == [DOWN]
    # Applied all the same: rank 1 holds the payload's bytes, which nobody meant.
    assert reply["ranks"]["1"]["checksums"] == checksums(after[1])
    state = weights_state(replica)
    assert not state["complete"] and "did not verify" in state["incomplete_reason"]
    assert call(replica, "get_server_info")["weightsync"]["session"]["state"] == "open"
    assert generation_refusal(replica) is not None
    # The client raises with the server's message.
    with pytest.raises(RemoteReplicaError, match=r"tp rank\(s\) \[1\]") as caught:
        call(replica, "apply_delta", session_token=token, ranks=ranks)
    assert caught.value.status_code == 400
    # Digests that match what the ranks now hold do not make the end verified.
    digests = {r: ParameterDigests(after[r]).compute() for r in range(TP)}
    with pytest.raises(RemoteReplicaError, match="did not verify"):
        call(replica, "end_weight_update", session_token=token, digests=digests)
    state = weights_state(replica)
    assert not state["complete"] and not state["verified"]
    with pytest.raises(RemoteReplicaError, match="incomplete"):
        call(replica, "continue_generation")
    assert "incomplete" in generation_refusal(replica)
    trainer.restore()
    assert weights_state(replica)["complete"] and weights_state(replica)["verified"]
    assert sha256_checksums(replica) == expected_sha256(trainer.loaded)
    assert generation_refusal(replica) is None


def test_apply_is_refused_outside_the_session_and_to_others(replica, trainer, http) -> None:
    ranks, _ = a_delta(trainer, seed=40)
    before = call(replica, "delta_checksums", session_token=None)
    with pytest.raises(RemoteReplicaError, match="no weight-update session is open") as caught:
        call(replica, "apply_delta", session_token=None, ranks=ranks)
    assert caught.value.status_code == 400
    call(replica, "pause_generation")
    token = call(replica, "begin_weight_update", lease_s=30.0).session_token
    for method, kwargs in [
        ("apply_delta", {"session_token": "not-the-token", "ranks": ranks}),
        ("apply_delta", {"session_token": None, "ranks": ranks}),
        ("delta_checksums", {"session_token": "not-the-token"}),
    ]:
        with pytest.raises(RemoteReplicaError, match="held by another client"):
            call(replica, method, **kwargs)
    # Reading needs no token.
    assert call(replica, "delta_checksums", session_token=None) == before
    with pytest.raises(RemoteReplicaError, match=r"missing \[1\]"):
        call(replica, "apply_delta", session_token=token, ranks={0: ranks[0]})
    with pytest.raises(RemoteReplicaError, match=r"unknown \[2\]"):
        call(replica, "apply_delta", session_token=token, ranks={**ranks, 2: ([], {})})
    stranger = {1: (ranks[1][0], {**ranks[1][1], "model.no_such.weight": 1})}
    with pytest.raises(RemoteReplicaError, match=r"no_such\.weight"):
        call(replica, "apply_delta", session_token=token, ranks={**ranks, **stranger})
    for bad in (
        {"0": {"payloads": [[-8, 64]]}, "1": {}},
        {"0": {"payloads": [[0, 0]]}, "1": {}},
        {"0": {"expected": {NORM: 1 << 63}}, "1": {}},
        {"0": {"expected": {NORM: 1.0}}, "1": {}},
    ):
        reply = http.post("/weightsync/apply_delta", json={"session_token": token, "ranks": bad})
        assert reply.status_code == 400, (bad, reply.text)
    # None of it changed a byte, and the untouched session ends as it began.
    assert call(replica, "delta_checksums", session_token=token) == before
    assert weights_state(replica)["complete"]
    call(replica, "end_weight_update", session_token=token)
    call(replica, "continue_generation")
    assert weights_state(replica)["complete"]


def test_a_payload_outside_its_region_applies_nothing_on_any_rank(replica, trainer) -> None:
    call(replica, "pause_generation")
    token = call(replica, "begin_weight_update", lease_s=30.0).session_token
    ranks, _ = a_delta(trainer, seed=50)
    before = call(replica, "delta_checksums", session_token=token)
    for span, message in [
        ((REGION_BYTES - 8, 64), f"not inside its delta region of {REGION_BYTES} bytes"),
        ((REGION_BYTES, 8), "not inside"),
        ((12, 64), "not a multiple of 8"),
    ]:
        # Rank 0's payloads are good: it must not apply them either.
        bad = {0: ranks[0], 1: ([*ranks[1][0], span], ranks[1][1])}
        with pytest.raises(RemoteReplicaError, match=message) as caught:
            call(replica, "apply_delta", session_token=token, ranks=bad)
        assert caught.value.status_code == 400
        assert call(replica, "delta_checksums", session_token=token) == before
    assert weights_state(replica)["complete"]
    call(replica, "end_weight_update", session_token=token)
    call(replica, "continue_generation")
    assert weights_state(replica)["complete"]
    assert generation_refusal(replica) is None
