"""End to end: a two-rank, two-stage trainer syncing into live replicas over Mooncake TCP.

Real processes throughout: `weightsync serve` replicas at tp=2 (gloo inside each), trainer
ranks in a gloo group, Mooncake TransferEngines on 127.0.0.1 between them, HTTP control.
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
import torch

from process_group import run_in_process_group
from servers import serve_replicas
from weightsync.errors import LayoutMismatchError
from weightsync.testing.presets import preset_config, write_random_checkpoint

pytestmark = pytest.mark.slow

API_KEY = "e2e-key"
PROMPTS = ((1, 17, 42, 7), (600, 2, 31, 99, 5))
NEW_TOKENS = 6


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _generate(url: str, prompt) -> tuple[list[int], str]:
    body = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": NEW_TOKENS}}
    reply = httpx.post(f"{url}/generate", json=body, headers=_headers(), timeout=60).json()
    return reply["output_ids"], reply["meta_info"]["weight_version"]


def _checksums(url: str) -> dict:
    reply = httpx.post(
        f"{url}/weights_checker", json={"action": "checksum"}, headers=_headers(), timeout=60
    )
    reply.raise_for_status()
    return json.loads(reply.json()["message"])


def _shape_lie(export, bad_name: str):
    """An export that holds (and yields) one tensor with a wrong shape."""
    from weightsync.export import ModelExport

    return ModelExport(
        {name: tensor[:-1] if name == bad_name else tensor for name, tensor in export}
    )


def _scenario(
    rank: int, group, checkpoint: str, urls: list[str], spare_url: str, removed_pgid: int
) -> dict:
    """Trainer rank `rank` of 2 (pipeline stage `rank`): the whole scripted run."""
    from transformers import AutoModelForCausalLM

    import weightsync as ws
    from weightsync.testing.reference import greedy_tokens

    os.environ["MC_LOG_LEVEL"] = "ERROR"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    export = ws.ModelExport(model, pp_rank=rank, pp_size=2)
    config = ws.SyncConfig(
        # Small buckets: several per push, so the staging ring actually cycles.
        sender=ws.SenderConfig(bucket_bytes=64 << 10, timeout_s=10),
        control=ws.ControlConfig(api_key=API_KEY, check_weight_update_equal=True),
        transport=ws.MooncakeConfig(protocol="tcp", timeout_s=10),
    )
    sync = ws.TrainerSync(
        config, hf_config=model.config, group=group, replicas=urls, dtype="bfloat16"
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out: dict = {"syncs": []}

    def step(seed: int) -> None:
        # Both ranks take the same step, so both hold the same weights.
        batch = torch.randint(
            0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed)
        )
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()

    def record(report, replicas) -> None:
        if rank != 0:
            return
        expected = greedy_tokens(model, torch.bfloat16, PROMPTS, NEW_TOKENS)
        served = {url: [_generate(url, p) for p in PROMPTS] for url in replicas}
        out["syncs"].append(
            {
                "version": report.version,
                "bit_exact": report.bit_exact,
                "replicas": list(report.replicas),
                "bytes_per_replica": dict(report.push.bytes_per_replica),
                "sources": {
                    rank: stats.bytes_written for rank, stats in report.push.per_source.items()
                },
                "expected": expected,
                "served": served,
            }
        )

    try:
        record(sync.sync(export), urls)  # v1: restores the corrupted weights bit-exactly
        step(1)
        record(sync.sync(export), urls)  # v2
        sync.add_replica(spare_url)  # acts on the driver, a no-op on rank 1
        step(2)
        record(sync.sync(export), [*urls, spare_url])  # v3: the new replica too
        removed = urls[0]
        sync.remove_replica(removed)
        if rank == 0:
            # A removed replica that were still contacted would fail the next sync.
            os.killpg(removed_pgid, signal.SIGKILL)
        step(3)
        kept = [urls[1], spare_url]
        record(sync.sync(export), kept)  # v4
        before = _checksums(kept[0]) if rank == 0 else None
        bad = "model.layers.3.self_attn.q_proj.weight"  # held by stage 1 (rank 1)
        try:
            sync.sync(_shape_lie(export, bad))
        except LayoutMismatchError as exc:
            out["mismatch"] = str(exc)
        if rank == 0:
            out["unchanged"] = _checksums(kept[0]) == before
            out["after_mismatch"] = [_generate(kept[0], p) for p in PROMPTS]
            out["expected_after_mismatch"] = greedy_tokens(
                model, torch.bfloat16, PROMPTS, NEW_TOKENS
            )
    finally:
        sync.close()
    return out


def test_two_stage_trainer_syncs_into_elastic_replicas(tmp_path):
    checkpoint = write_random_checkpoint(tmp_path / "ckpt", preset_config("tiny"), seed=7)
    with serve_replicas(
        checkpoint, num_replicas=3, tp=2, dtype="bf16", api_key=API_KEY, log_dir=tmp_path
    ) as replicas:
        urls = [replicas[0].url, replicas[1].url]
        spare_url = replicas[2].url
        removed_pgid = replicas[0].process.pid
        results = run_in_process_group(
            2, _scenario, str(checkpoint), urls, spare_url, removed_pgid, timeout_s=240
        )
    driver, follower = results
    syncs = driver["syncs"]
    assert [s["version"] for s in syncs] == ["1", "2", "3", "4"]
    assert syncs[0]["bit_exact"] is True
    assert all(s["bit_exact"] is None for s in syncs[1:])
    for sync in syncs:
        for url, served in sync["served"].items():
            assert [tokens for tokens, _ in served] == sync["expected"], (sync["version"], url)
            assert {version for _, version in served} == {sync["version"]}
    # Weights changed between syncs, so the equal generations above are not vacuous.
    assert syncs[0]["expected"] != syncs[-1]["expected"]
    # The added replica took part in v3 and v4; the removed one only up to v3.
    assert spare_url in syncs[2]["replicas"] and spare_url in syncs[3]["replicas"]
    assert urls[0] not in syncs[3]["replicas"]
    assert syncs[3]["bytes_per_replica"][spare_url] > 0
    # Every sync reports both ranks' own pushes, and they add up to what was written.
    for sync in syncs:
        assert sorted(sync["sources"]) == [0, 1]
        assert sum(sync["sources"].values()) == sum(sync["bytes_per_replica"].values())
    # The shape mismatch fails on every rank before any write, naming the tensor.
    for result in (driver, follower):
        assert "model.layers.3.self_attn.q_proj.weight" in result["mismatch"]
        assert "rank 1" in result["mismatch"] or "source 1" in result["mismatch"]
    assert driver["unchanged"] is True
    assert [t for t, _ in driver["after_mismatch"]] == driver["expected_after_mismatch"]
