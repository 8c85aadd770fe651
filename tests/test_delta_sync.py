"""Delta syncs end to end: a trainer writing only what changed into live replicas over
Mooncake TCP, every byte compared after every sync, and the fleet events that must turn a
delta into a full write (a replica that missed a sync, one whose weights were overwritten)
or leave a replica paused (a delta that could not land), with the next sync recovering.

Real processes throughout: `weightsync serve` replicas (tp 2 and tp 1, unlike the trainer's
single process) with a delta region, a trainer with fp32 master weights and AdamW, HTTP
control. The replicas check each delta themselves (their checksums before must be the base
the driver recorded, after must be base + the pushed change); the test checks independently
that every parameter of every rank equals `shard_state_dict` of the trainer's weights and
that greedy generation equals the trainer's.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import weightsync as ws
from servers import laid_out_checksums, serve_replicas, served_checksums
from weightsync.control import RolloutClient
from weightsync.errors import PartialSyncError
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint
from weightsync.testing.reference import greedy_tokens, served_tokens

pytestmark = pytest.mark.slow

TINY = preset_config("tiny")
API_KEY = "delta-key"
PROMPTS = ((1, 17, 42, 7), (600, 2, 31, 99, 5))
NEW_TOKENS = 4


def _reset(url: str) -> None:
    """Overwrite a replica's weights with random values, outside any session."""

    async def main() -> None:
        async with RolloutClient(url, api_key=API_KEY, timeout_s=60.0) as client:
            await client.pause_generation()
            await client.weights_checker("reset_tensors")

    asyncio.run(main())


def _assert_exact(model, replicas) -> None:
    """Every byte of every rank equal to the trainer's weights; generation equal too."""
    for replica in replicas:
        assert served_checksums(replica.url, API_KEY) == laid_out_checksums(
            {n: t.detach() for n, t in model.state_dict().items()}, TINY, replica.tp
        ), replica.url
    expected = greedy_tokens(model, torch.bfloat16, PROMPTS, NEW_TOKENS)
    served = asyncio.run(
        served_tokens(
            [r.url for r in replicas], PROMPTS, max_new_tokens=NEW_TOKENS, api_key=API_KEY
        )
    )
    for url, tokens in served.items():
        assert tokens == expected, url


def _modes(report) -> dict[str, str]:
    return {url: write.mode for url, write in report.writes.items()}


def test_delta_syncs_stay_bit_exact_through_fleet_events(tmp_path) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    checkpoint = write_random_checkpoint(tmp_path / "ckpt", TINY, seed=11)
    region = ["--delta-region-mb", "4"]
    with (
        serve_replicas(
            checkpoint, tp=2, dtype="bf16", api_key=API_KEY, log_dir=tmp_path / "a",
            extra_args=region,
        ) as (a,),
        serve_replicas(
            checkpoint, tp=1, dtype="bf16", api_key=API_KEY, log_dir=tmp_path / "b",
            extra_args=region,
        ) as (b,),
        serve_replicas(
            checkpoint, tp=1, dtype="bf16", api_key=API_KEY, log_dir=tmp_path / "c",
            extra_args=["--delta-region-mb", "1"],
        ) as (c,),
    ):  # fmt: skip
        model = random_model(TINY, seed=11)  # the checkpoint the replicas load
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        generator = torch.Generator().manual_seed(3)

        def step() -> None:
            batch = torch.randint(0, TINY["vocab_size"], (2, 12), generator=generator)
            optimizer.zero_grad()
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()

        config = ws.SyncConfig(
            sender=ws.SenderConfig(bucket_bytes=64 << 10, timeout_s=10),
            # The full check after applying (the demo's delta test runs the default,
            # derived from the changes).
            control=ws.ControlConfig(
                api_key=API_KEY, check_weight_update_equal=True, delta_check="full"
            ),
            transport=ws.MooncakeConfig(protocol="tcp", timeout_s=10),
            delta=True,
        )
        export = ws.ModelExport(model)
        with ws.TrainerSync(
            config, hf_config=TINY, replicas=[a.url, b.url], dtype="bfloat16"
        ) as sync:
            # The first sync is full (no reference), checked bit-exact by the built-in check.
            first = sync.sync(export)
            assert _modes(first) == {a.url: "full", b.url: "full"}
            assert first.bit_exact is True
            _assert_exact(model, [a, b])
            for _ in range(3):
                step()
                report = sync.sync(export)
                assert _modes(report) == {a.url: "delta", b.url: "delta"}
                assert set(report.verified) == {a.url, b.url}
                for write in report.writes.values():
                    assert write.num_bytes < write.full_bytes
                    assert 0 < write.density < 0.5
                _assert_exact(model, [a, b])

            # A replica that missed a sync (removed, so its base is forgotten) takes full bytes
            # in the same update as the others' delta.
            sync.remove_replica(b.url)
            step()
            assert _modes(sync.sync(export)) == {a.url: "delta"}
            sync.add_replica(b.url)
            step()
            report = sync.sync(export)
            assert _modes(report) == {a.url: "delta", b.url: "full"}
            assert "no verified base" in report.writes[b.url].why_full
            _assert_exact(model, [a, b])

            # Weights overwritten outside a session are no base: full bytes, before any write.
            _reset(a.url)
            step()
            report = sync.sync(export)
            assert _modes(report) == {a.url: "full", b.url: "delta"}
            assert "not its verified base" in report.writes[a.url].why_full
            _assert_exact(model, [a, b])

            # A delta that cannot land (it outgrows the replica's region) leaves that replica
            # paused with its previous weights; the next sync writes it full and it serves.
            sync.add_replica(c.url)
            step()
            assert _modes(sync.sync(export))[c.url] == "full"
            step()
            assert _modes(sync.sync(export))[c.url] == "delta"
            with torch.no_grad():  # every element changes: the delta outgrows c's 1 MiB region
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.05)
            with pytest.raises(PartialSyncError) as failed:
                sync.sync(export)
            assert set(failed.value.failed) == {c.url}
            assert "does not fit" in failed.value.failed[c.url]
            assert set(failed.value.report.replicas) == {a.url, b.url}
            _assert_exact(model, [a, b])
            step()
            report = sync.sync(export)
            assert _modes(report) == {a.url: "delta", b.url: "delta", c.url: "full"}
            _assert_exact(model, [a, b, c])
