"""The broadcast baseline end to end: two trainer ranks (gloo) broadcast into two `weightsync
serve` replicas at tp=2 over SGLang's ``update_weights_from_distributed``.

The trainer is pipeline-parallel (PP=2), so rank 0 gathers the second stage's tensors from
rank 1 before it broadcasts. The first sync runs the bit-exact check (snapshot, reset,
compare); later syncs follow perturbed trainer weights, and each replica's greedy generation
must equal the trainer model's. A second `BroadcastSync` with one broadcast per tensor makes a
new group after the first one is destroyed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from process_group import run_in_process_group
from servers import serve_replicas
from weightsync.testing.presets import preset_config, write_random_checkpoint
from weightsync.testing.reference import greedy_tokens

API_KEY = "baseline-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROLLOUT_DTYPE = torch.bfloat16
PROMPTS = ((1, 17, 42, 7), (600, 2, 2, 31))
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"), seed=3)


@pytest.fixture(scope="module")
def replicas(checkpoint, tmp_path_factory):
    with serve_replicas(
        checkpoint,
        num_replicas=2,
        tp=2,
        dtype="bf16",
        api_key=API_KEY,
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as served:
        yield served


def _greedy(model: Any) -> list[list[int]]:
    """The trainer model's greedy tokens over weights rounded to the rollout dtype."""
    return greedy_tokens(model, ROLLOUT_DTYPE, PROMPTS, MAX_NEW_TOKENS)


def _generate(urls: list[str]) -> dict[str, list[list[int]]]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    result = {}
    for url in urls:
        outputs = []
        for prompt in PROMPTS:
            body = {
                "input_ids": list(prompt),
                "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0},
            }
            reply = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=60.0)
            reply.raise_for_status()
            outputs.append(reply.json()["output_ids"])
        result[url] = outputs
    return result


def _perturb(model: Any, step: int) -> None:
    """The same deterministic change on every rank (stands in for an optimizer step)."""
    gen = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.02)


def _trainer(rank: int, group: Any, checkpoint: str, urls: list[str]) -> dict[str, Any]:
    import os

    from transformers import AutoModelForCausalLM

    from weightsync.baseline import BroadcastConfig, BroadcastSync
    from weightsync.checkpoint import load_config_dict
    from weightsync.export import ModelExport
    from weightsync.manager import ControlConfig, SyncManager

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    hf_config = load_config_dict(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    export = ModelExport(model, pp_rank=rank, pp_size=2)
    result: dict[str, Any] = {"syncs": []}

    def run(config: BroadcastConfig, steps: range, check: bool) -> None:
        manager = None
        if rank == 0:
            manager = SyncManager(
                urls, ControlConfig(api_key=API_KEY, check_weight_update_equal=check)
            )
        sync = BroadcastSync(
            hf_config=hf_config, config=config, group=group, manager=manager, dtype="bfloat16"
        )
        try:
            for step in steps:
                if step:
                    _perturb(model, step)
                report = sync.sync(export)
                if rank == 0:
                    result["syncs"].append(
                        {
                            "report": report.to_dict(),
                            "expected": _greedy(model),
                            "actual": _generate(urls),
                            "num_buckets": len(sync.buckets),
                        }
                    )
        finally:
            sync.close()

    # Small buckets: several per sync, so packing overlaps broadcasting.
    run(BroadcastConfig(bucket_bytes=64 << 10), range(0, 2), check=True)
    run(BroadcastConfig(bucket_bytes=256 << 10, load_format=None), range(2, 3), check=False)
    return result


def test_broadcast_baseline_is_bit_exact_and_serves_the_new_weights(checkpoint, replicas):
    urls = [r.url for r in replicas]
    results = run_in_process_group(2, _trainer, str(checkpoint), urls, timeout_s=240.0)
    syncs = results[0]["syncs"]
    assert len(syncs) == 3
    first = syncs[0]["report"]
    assert first["bit_exact"] is True
    assert syncs[0]["num_buckets"] > 2
    for entry in syncs:
        report = entry["report"]
        # What the replicas hold: every rank's parameters, written once per sync.
        assert set(report["bytes_per_replica"]) == set(urls)
        assert report["bytes"] == sum(report["bytes_per_replica"].values()) > 0
        for url in urls:
            assert entry["actual"][url] == entry["expected"], (report["version"], url)
    # The third sync's manager is new: its version follows what the replicas serve.
    assert [s["report"]["version"] for s in syncs] == ["1", "2", "3"]
    # The weights changed between syncs, so equal generation is not an accident.
    assert (
        syncs[0]["expected"] != syncs[1]["expected"] or syncs[1]["expected"] != syncs[2]["expected"]
    )
    # Every parameter of every rank equals what the engine's own loader makes of the
    # trainer's final weights (per-tensor broadcasts, after the group was made anew).
    for replica in replicas:
        assert _checksums(replica.url) == _expected_checksums(checkpoint)


def _checksums(url: str) -> list[dict[str, Any]]:
    import json

    from weightsync.control import RolloutClient

    async def main() -> list[dict[str, Any]]:
        async with RolloutClient(url, api_key=API_KEY, timeout_s=60.0) as client:
            reply = await client.weights_checker("checksum")
        return [rank["checksums"] for rank in json.loads(reply.message)["ranks"]]

    return asyncio.run(main())


def _expected_checksums(checkpoint: Path) -> list[dict[str, Any]]:
    """Checksums of `shard_state_dict` of the trainer's weights after the last sync."""
    from transformers import AutoModelForCausalLM

    from weightsync.checkpoint import load_config_dict
    from weightsync.layout import ParallelismConfig
    from weightsync.receiver.checker import WeightsChecker
    from weightsync.receiver.loader import shard_state_dict

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    for step in (1, 2):
        _perturb(model, step)
    hf_config = load_config_dict(checkpoint)
    state = model.state_dict()
    return [
        WeightsChecker(
            shard_state_dict(
                state, hf_config, ParallelismConfig(tp_size=2, tp_rank=rank), "bfloat16"
            )
        )
        .checksum()
        .details["checksums"]
        for rank in range(2)
    ]


def test_a_misshapen_trainer_tensor_fails_before_any_replica_is_paused(checkpoint, replicas):
    from weightsync.baseline import BroadcastSync
    from weightsync.checkpoint import load_config_dict
    from weightsync.errors import LayoutMismatchError
    from weightsync.layout import hf_tensor_shapes
    from weightsync.manager import ControlConfig, SyncManager

    hf_config = load_config_dict(checkpoint)
    tensors = {name: torch.zeros(shape) for name, shape in hf_tensor_shapes(hf_config).items()}
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    manager = SyncManager([r.url for r in replicas], ControlConfig(api_key=API_KEY))
    sync = BroadcastSync(hf_config=hf_config, manager=manager)
    try:
        with pytest.raises(LayoutMismatchError, match=r"up_proj.weight' with shape \(3, 3\)"):
            sync.sync(tensors)
    finally:
        sync.close()
    for replica in replicas:
        state = httpx.get(f"{replica.url}/server_info", headers=AUTH).json()["state"]
        assert not state["paused"] and state["weight_update_session"] == "closed"
