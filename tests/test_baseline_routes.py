"""The broadcast baseline's routes on `weightsync serve` (tp=2): request and response shapes,
refusals, and a group with this process as the trainer (group rank 0, gloo)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist

from servers import serve_replicas
from weightsync.baseline.flat_bucket import FlatBucketLayout
from weightsync.baseline.update_group import (
    create_store,
    destroy_custom_process_group,
    init_custom_process_group,
)
from weightsync.control import RolloutClient
from weightsync.errors import RemoteReplicaError
from weightsync.testing.presets import preset_config, write_random_checkpoint

API_KEY = "routes-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TP = 2
HIDDEN = preset_config("tiny")["hidden_size"]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"))
    with serve_replicas(
        checkpoint, tp=TP, api_key=API_KEY, log_dir=tmp_path_factory.mktemp("logs")
    ) as (served,):
        yield served


@pytest.fixture
def http(replica):
    with httpx.Client(base_url=replica.url, timeout=60.0, headers=AUTH) as client:
        yield client


def _init_body(**overrides: Any) -> dict[str, Any]:
    body = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 1 + TP,
        "group_name": "g",
        "backend": "gloo",
    }
    return {**body, **overrides}


def _refused(reply: httpx.Response, status: int, *words: str) -> None:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["success"] is False
    for word in words:
        assert word in body["message"], body["message"]


def test_routes_need_the_api_key(replica):
    for route in (
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
    ):
        assert httpx.post(f"{replica.url}{route}", json={}).status_code == 401


def test_bad_requests_are_refused_before_any_rendezvous(http):
    _refused(http.post("/init_weights_update_group", json=_init_body(backend="nccl")), 400, "gloo")
    # tp rank 1 would be rank 2 of a group of 2.
    _refused(http.post("/init_weights_update_group", json=_init_body(world_size=2)), 400, "1..2")
    for bad in ({"rank_offset": 0}, {"backend": "mpi"}):
        assert http.post("/init_weights_update_group", json=_init_body(**bad)).status_code == 400
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[HIDDEN]]}
    _refused(
        http.post("/update_weights_from_distributed", json={**update, "group_name": "none"}),
        400,
        "'none'",
        "init_weights_update_group",
    )
    mismatched = {**update, "dtypes": []}
    assert http.post("/update_weights_from_distributed", json=mismatched).status_code == 400
    bad_format = {**update, "load_format": "direct"}
    assert http.post("/update_weights_from_distributed", json=bad_format).status_code == 400
    _refused(http.post("/destroy_weights_update_group", json={"group_name": "none"}), 400, "none")
    # Nothing of this left the server in a state other than serving.
    state = http.get("/server_info").json()["state"]
    assert state["weight_update_session"] == "closed" and state["engine_command"] is None


class Trainer:
    """This process as group rank 0 of a weights update group with the replica."""

    def __init__(self, replica, group_name: str) -> None:
        self.url = replica.url
        self.group_name = group_name
        self.store = create_store("127.0.0.1", 0, world_size=1 + TP, rank=0, timeout_s=60.0)
        self.group: dist.ProcessGroup | None = None

    def _call(self, method: str, **kwargs: Any) -> Any:
        async def main() -> Any:
            async with RolloutClient(self.url, api_key=API_KEY, timeout_s=60.0) as client:
                return await getattr(client, method)(**kwargs)

        return asyncio.run(main())

    def _while(self, local, method: str, **kwargs: Any) -> Any:
        """Run `local` in a thread while the replica serves `method`; both must finish."""
        errors: list[BaseException] = []

        def target() -> None:
            try:
                local()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=target)
        thread.start()
        try:
            return self._call(method, **kwargs)
        finally:
            thread.join(60.0)
            assert not thread.is_alive()
            if errors:
                raise errors[0]

    def join(self) -> Any:
        def local() -> None:
            self.group = init_custom_process_group(
                backend="gloo",
                store=self.store,
                world_size=1 + TP,
                rank=0,
                group_name=self.group_name,
                timeout_s=60.0,
            )

        return self._while(
            local,
            "init_weights_update_group",
            master_address="127.0.0.1",
            master_port=self.store.port,
            rank_offset=1,
            world_size=1 + TP,
            group_name=self.group_name,
            backend="gloo",
        )

    def send(self, tensors: dict[str, torch.Tensor], *, load_format: str | None) -> Any:
        names = list(tensors)
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
        shapes = [list(t.shape) for t in tensors.values()]

        def local() -> None:
            if load_format == "flattened_bucket":
                layout = FlatBucketLayout.from_metadata(names, dtypes, shapes)
                buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8)
                for (_, view), tensor in zip(layout.views(buffer), tensors.values(), strict=True):
                    view.copy_(tensor)
                dist.broadcast(buffer, group=self.group, group_src=0)
            else:
                for tensor in tensors.values():
                    dist.broadcast(tensor, group=self.group, group_src=0)

        return self._while(
            local,
            "update_weights_from_distributed",
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=self.group_name,
            load_format=load_format,
            weight_version="bcast-1",
        )

    def checksums(self) -> list[dict[str, dict[str, Any]]]:
        reply = self._call("weights_checker", action="checksum")
        return [rank["checksums"] for rank in json.loads(reply.message)["ranks"]]

    def leave(self) -> None:
        if self.group is not None:
            destroy_custom_process_group(self.group)
            self.group = None


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def test_group_receives_both_formats_and_loads_them(replica, http):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    trainer = Trainer(replica, "routes_group")
    try:
        joined = trainer.join()
        assert joined.success and "ranks [1, 2]" in joined.message
        again = http.post(
            "/init_weights_update_group",
            json=_init_body(master_port=trainer.store.port, group_name="routes_group"),
        )
        _refused(again, 400, "already exists")

        gen = torch.Generator().manual_seed(7)
        norm = torch.randn(HIDDEN, generator=gen).to(torch.bfloat16)
        embed = torch.randn(1000, HIDDEN, generator=gen)
        reply = trainer.send(
            {"model.norm.weight": norm, "model.embed_tokens.weight": embed},
            load_format="flattened_bucket",
        )
        assert reply.success and "Updated 2 tensors" in reply.message
        assert http.get("/get_weight_version").json() == {"weight_version": "bcast-1"}
        sums = trainer.checksums()
        # Replicated on both ranks, cast from bf16 to the float32 parameter.
        for rank in range(TP):
            assert sums[rank]["model.norm.weight"]["sha256"] == _sha256(norm.float())
        # Vocabulary-parallel: each rank holds its half of the rows (1000 rows split 512/512,
        # the last 24 rows of rank 1 are zero padding).
        assert sums[0]["model.embed_tokens.weight"]["sha256"] == _sha256(embed[:512])
        padded = torch.cat([embed[512:], torch.zeros(24, HIDDEN)])
        assert sums[1]["model.embed_tokens.weight"]["sha256"] == _sha256(padded)

        layer_norm = torch.randn(HIDDEN, generator=gen)
        reply = trainer.send(
            {"model.layers.0.input_layernorm.weight": layer_norm}, load_format=None
        )
        assert reply.success
        sums = trainer.checksums()
        assert sums[1]["model.layers.0.input_layernorm.weight"]["sha256"] == _sha256(layer_norm)

        # A tensor that is not the model's arrives (the broadcast completes) but loads nothing.
        with pytest.raises(RemoteReplicaError, match="not a tensor of this model"):
            trainer.send({"model.bogus.weight": torch.zeros(4)}, load_format="flattened_bucket")
        # The replica still generates (no session was opened by these calls).
        assert http.post("/generate", json={"input_ids": [1, 2, 3]}).status_code == 200

        done = http.post("/destroy_weights_update_group", json={"group_name": "routes_group"})
        assert done.status_code == 200 and done.json()["success"] is True
        _refused(
            http.post("/destroy_weights_update_group", json={"group_name": "routes_group"}),
            400,
            "routes_group",
        )
    finally:
        trainer.leave()
