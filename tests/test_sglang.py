"""A trainer syncing into real SGLang 0.5.23 replicas on this CPU, point to point.

A transformers Qwen3 in float32 (the replicas' checkpoint) takes real optimizer steps; after
each, `weightsync.TrainerSync` writes it into the replicas over Mooncake TCP. The first sync
must restore the weights the checker corrupted bit for bit; after every sync each replica's
greedy tokens equal the trainer's and it serves the version set. A second replica joins
between syncs. A write that fails mid-push leaves the replicas paused and says so; the next
sync recovers.
"""

from __future__ import annotations

import pytest
import torch

import weightsync as ws
from conftest import SGLANG_API_KEY
from weightsync.errors import TransferError
from weightsync.testing.reference import greedy_tokens, served_tokens, train_step
from weightsync.testing.transports import FailsAfter
from weightsync.transport import MooncakeConfig, MooncakeTransport

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

PROMPTS = ((1, 17, 42, 7), (600, 2, 31, 99, 5))
NEW_TOKENS = 6


def _served(urls: list[str]) -> dict[str, list[list[int]]]:
    import asyncio

    return asyncio.run(
        served_tokens(urls, PROMPTS, max_new_tokens=NEW_TOKENS, api_key=SGLANG_API_KEY)
    )


def test_trainer_syncs_into_real_sglang(sglang_servers, sglang_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    first, second = sglang_servers
    model = AutoModelForCausalLM.from_pretrained(sglang_checkpoint, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    transport = FailsAfter(MooncakeTransport(MooncakeConfig(protocol="tcp", timeout_s=10)))
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=256 << 10, timeout_s=10),
        control=ws.ControlConfig(api_key=SGLANG_API_KEY, check_weight_update_equal=True),
    )
    export = ws.ModelExport(model)
    try:
        with ws.TrainerSync(
            config, hf_config=model.config, replicas=[first.url], transport=transport
        ) as sync:
            versions = []
            for step in range(3):
                if step:
                    train_step(model, optimizer, seed=step)
                if step == 2:
                    sync.add_replica(second.url)
                report = sync.sync(export, version=f"s{step}")
                versions.append(report.version)
                urls = [first.url] if step < 2 else [first.url, second.url]
                assert report.replicas == tuple(urls)
                # SGLang computes in the weights' dtype: float32 here, as the trainer.
                expected = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
                assert _served(urls) == {url: expected for url in urls}, step
                for server in (first, second)[: len(urls)]:
                    assert server.get("/model_info").body["weight_version"] == f"s{step}"
                assert report.bit_exact is (True if step == 0 else None)
            assert manager_kinds(sync) == {first.url: "sglang", second.url: "sglang"}

            # A write fails part-way: the replicas stay paused, and the error says so.
            train_step(model, optimizer, seed=3)
            transport.remaining = 5
            with pytest.raises(TransferError, match="injected failure") as failed:
                sync.sync(export, version="broken")
            notes = " ".join(getattr(failed.value, "__notes__", []))
            assert "stay paused" in notes and first.url in notes, notes
            for server in (first, second):
                assert server.get("/ready").status == 503  # paused: no request starts
                assert server.get("/model_info").body["weight_version"] == "s2"

            # The next sync writes everything again and serves.
            transport.remaining = None
            report = sync.sync(export, version="s4")
            expected = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
            assert _served([first.url, second.url]) == {
                first.url: expected,
                second.url: expected,
            }
            assert versions == ["s0", "s1", "s2"] and report.version == "s4"
            for server in (first, second):
                assert server.get("/ready").status == 200
    finally:
        transport.close()


def manager_kinds(sync: ws.TrainerSync) -> dict[str, str]:
    """What the driver learned each replica is."""
    assert sync.manager is not None
    return {url: protocol.kind for url, protocol in sync.manager.protocols.items()}
