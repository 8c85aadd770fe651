"""A trainer syncing into real vLLM 0.32.0 replicas (its CPU build) on this machine, point to
point, with the same trainer code as for SGLang.

A transformers Qwen3 in float32 (the replicas' checkpoint) takes real optimizer steps; after
each, `weightsync.TrainerSync` writes it over Mooncake TCP into vLLM replicas started with
weightsync's worker extension: a tp1 replica from the start, a tp2 one joining between syncs.
The first sync restores, bit for bit, the bytes the checker corrupted; after every sync each
replica's greedy tokens equal the trainer's and it serves the version set. A write that fails
mid-push leaves vLLM paused and says so; the next sync recovers. ``weightsync push`` writes a
checkpoint into a running vLLM and reports it bit-exact.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

import weightsync as ws
from vllm_cpu.launch import VLLMServer
from weightsync.control.vllm import VLLMClient
from weightsync.errors import TransferError
from weightsync.testing.reference import greedy_tokens, train_step
from weightsync.testing.transports import FailsAfter
from weightsync.transport import MooncakeConfig, MooncakeTransport

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ((1, 17, 42, 7), (600, 2, 31, 99, 5))
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def vllm_replicas(vllm_tp1, vllm_tp2, vllm_checkpoint) -> list[VLLMServer]:
    """The session's tp1 and tp2 vLLM replicas (`vllm_cpu.fixtures`), first made to hold
    `vllm_checkpoint` whatever they held (a push without the check)."""
    result = _push(vllm_checkpoint, [vllm_tp1, vllm_tp2], "--version", "restored")
    assert result["ok"], result
    return [vllm_tp1, vllm_tp2]


def _served(servers: list[VLLMServer]) -> dict[str, list[list[int]]]:
    return {s.url: [s.greedy(list(p), NEW_TOKENS) for p in PROMPTS] for s in servers}


def _label(server: VLLMServer) -> str:
    return server.get("/weight_info").body["weight_version"]


def test_client_maps_the_lifecycle_onto_vllm(vllm_replicas) -> None:
    """`VLLMClient` against the running replica: the SGLang-shaped server info, every rank's
    published metadata and parallelism, and pausing and resuming through vLLM's routes."""
    server = vllm_replicas[1]

    async def scenario() -> None:
        async with VLLMClient(server.url, timeout_s=120.0) as client:
            info = await client.get_server_info()
            assert info["engine"] == "vllm" and info["tp_size"] == 2, info
            assert info["dtype"] == "float32" and info["pp_size"] == 1
            ranks = info["weightsync_extension"]["ranks"]
            assert [r["rank"] for r in ranks] == [0, 1]
            configs = await asyncio.gather(*(client.get_parallelism_config(r) for r in (0, 1)))
            assert [(c.tp_size, c.tp_rank) for c in configs] == [(2, 0), (2, 1)]
            reply = await client.get_transfer_engine_reply(1)
            assert reply.remote_instance_transfer_engine_info[0] == ranks[1]["session_id"]
            await client.pause_generation("abort")
            assert server.get("/is_paused").body == {"is_paused": True}
            await client.continue_generation()
            assert server.get("/is_paused").body == {"is_paused": False}

    asyncio.run(scenario())


def test_push_writes_checkpoints_into_running_vllm(
    vllm_replicas, vllm_checkpoint, tmp_path
) -> None:
    """``weightsync push CKPT --replica URL --check-weight-update-equal --json`` into a
    running vLLM (tp2) that serves CKPT: ok and bit_exact. Then a push of another checkpoint:
    the replica serves that checkpoint's greedy tokens under the version given."""
    from transformers import AutoModelForCausalLM

    from weightsync.testing.presets import preset_config, write_random_checkpoint

    server = vllm_replicas[1]
    result = _push(vllm_checkpoint, [server], "--check-weight-update-equal", "--version", "p1")
    assert result["ok"] is True and result["bit_exact"] is True, result
    assert result["bytes"] == result["full_bytes"] > 0, result

    config = preset_config("tiny", head_dim=32)
    other = write_random_checkpoint(tmp_path / "other", config, dtype=torch.float32, seed=29)
    result = _push(other, [server], "--version", "p2")
    assert result["ok"] is True and result["bit_exact"] is None, result
    model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    expected = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
    assert _served([server]) == {server.url: expected}
    assert _label(server) == "p2"


def _push(checkpoint, servers: list[VLLMServer], *args: str) -> dict:
    """``weightsync push --json`` of `checkpoint` into `servers`: its JSON line."""
    command = [sys.executable, "-m", "weightsync", "push", str(checkpoint)]
    for server in servers:
        command += ["--replica", server.url]
    command += [*args, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else {}
    assert done.returncode == 0, f"{result.get('error')}\n{done.stderr[-3000:]}"
    return result


def test_trainer_syncs_into_real_vllm(vllm_replicas, vllm_checkpoint) -> None:
    """Full syncs into a tp1 replica, a tp2 one joining; bit-exact first sync; generation
    equal to the trainer's after every sync; a failed push leaves vLLM paused; the next sync
    recovers."""
    from transformers import AutoModelForCausalLM

    first, second = vllm_replicas
    model = AutoModelForCausalLM.from_pretrained(vllm_checkpoint, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    transport = FailsAfter(MooncakeTransport(MooncakeConfig(protocol="tcp", timeout_s=10)))
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=256 << 10, timeout_s=10),
        control=ws.ControlConfig(check_weight_update_equal=True, http_timeout_s=120.0),
    )
    export = ws.ModelExport(model)
    try:
        with ws.TrainerSync(
            config, hf_config=model.config, replicas=[first.url], transport=transport
        ) as sync:
            for step in range(3):
                if step:
                    train_step(model, optimizer, seed=step)
                if step == 2:
                    sync.add_replica(second.url)
                report = sync.sync(export, version=f"s{step}")
                live = [first] if step < 2 else [first, second]
                assert report.replicas == tuple(s.url for s in live)
                expected = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
                assert _served(live) == {s.url: expected for s in live}, step
                assert [_label(s) for s in live] == [f"s{step}"] * len(live)
                assert report.bit_exact is (True if step == 0 else None)
            assert sync.manager is not None
            kinds = {url: p.kind for url, p in sync.manager.protocols.items()}
            assert kinds == {first.url: "vllm", second.url: "vllm"}

            # A write fails part-way: the replicas stay paused, and the error says so.
            train_step(model, optimizer, seed=3)
            transport.remaining = 5
            with pytest.raises(TransferError, match="injected failure") as failed:
                sync.sync(export, version="broken")
            notes = " ".join(getattr(failed.value, "__notes__", []))
            assert "stay paused" in notes and first.url in notes, notes
            for server in (first, second):
                assert server.get("/is_paused").body == {"is_paused": True}
                assert _label(server) == "s2"

            # The next sync writes everything again and serves.
            transport.remaining = None
            report = sync.sync(export, version="s4")
            expected = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
            assert _served([first, second]) == {first.url: expected, second.url: expected}
            for server in (first, second):
                assert server.get("/is_paused").body == {"is_paused": False}
                assert _label(server) == "s4"
    finally:
        transport.close()


def test_mixed_fleet_takes_the_same_sync(vllm_replicas, vllm_checkpoint, tmp_path) -> None:
    """One `TrainerSync` writes a vLLM replica and a weightsync reference replica in the same
    update, each in its own engine's layout and protocol; both serve the trainer's tokens
    under the same version."""
    from transformers import AutoModelForCausalLM

    from weightsync.testing.launcher import start_replicas
    from weightsync.testing.reference import served_tokens

    server = vllm_replicas[0]
    model = AutoModelForCausalLM.from_pretrained(vllm_checkpoint, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    (reference,) = start_replicas(vllm_checkpoint, tp=2, dtype="fp32", log_dir=tmp_path / "ref")
    transport = MooncakeTransport(MooncakeConfig(protocol="tcp", timeout_s=10))
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=256 << 10, timeout_s=10),
        control=ws.ControlConfig(http_timeout_s=120.0),
    )
    try:
        with ws.TrainerSync(
            config,
            hf_config=model.config,
            replicas=[server.url, reference.url],
            transport=transport,
        ) as sync:
            for step in range(2):
                train_step(model, optimizer, seed=10 + step)
                sync.sync(ws.ModelExport(model), version=f"m{step}")
                expected = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
                assert _served([server]) == {server.url: expected}, step
                tokens = asyncio.run(
                    served_tokens([reference.url], PROMPTS, max_new_tokens=NEW_TOKENS)
                )
                assert tokens == {reference.url: expected}, step
                assert _label(server) == f"m{step}"
            assert sync.manager is not None
            kinds = {url: p.kind for url, p in sync.manager.protocols.items()}
            assert kinds == {server.url: "vllm", reference.url: "weightsync"}
    finally:
        transport.close()
        reference.stop()


def test_delta_syncs_into_vllm(vllm_replicas, vllm_checkpoint) -> None:
    """``SyncConfig(delta=True)``: after a full first sync, each sync at an RL learning rate
    writes only what changed into the tp1 replica's delta region; the replica proves its base,
    applies in place (staged parameters then go through vLLM's processing) and verifies every
    byte it changed; greedy tokens equal the trainer's after every sync."""
    from transformers import AutoModelForCausalLM

    server = vllm_replicas[0]
    model = AutoModelForCausalLM.from_pretrained(vllm_checkpoint, dtype=torch.float32)
    master = [p.detach().clone() for p in model.parameters()]
    transport = MooncakeTransport(MooncakeConfig(protocol="tcp", timeout_s=10))
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=256 << 10, timeout_s=10),
        control=ws.ControlConfig(http_timeout_s=120.0),
        delta=True,
    )
    try:
        with ws.TrainerSync(
            config, hf_config=model.config, replicas=[server.url], transport=transport
        ) as sync:
            modes = []
            for step in range(3):
                if step:  # a sparse change, as a bf16 RL step leaves in float32 weights
                    generator = torch.Generator().manual_seed(step)
                    with torch.no_grad():
                        for param, kept in zip(model.parameters(), master, strict=True):
                            mask = torch.rand(param.shape, generator=generator) < 0.03
                            param.copy_(torch.where(mask, kept * 1.01 + 1e-3, param))
                report = sync.sync(ws.ModelExport(model), version=f"d{step}")
                write = report.writes[server.url]
                modes.append(write.mode)
                if write.mode == "delta":
                    assert write.num_bytes < write.full_bytes / 5, write
                expected = greedy_tokens(model, torch.float32, PROMPTS, NEW_TOKENS)
                assert _served([server]) == {server.url: expected}, step
                assert _label(server) == f"d{step}"
            assert modes == ["full", "delta", "delta"], modes
    finally:
        transport.close()


def test_doctor_recognises_vllm(vllm_replicas) -> None:
    """``weightsync doctor`` on a vLLM replica: vLLM 0.32.0, nothing that moves the weights,
    every rank published, its parallelism from the extension, delta regions where the
    workers registered one, and its ranks' transfer engines answering."""
    from weightsync.cli.doctor_checks import OK, DoctorOptions, run_checks

    tp1, tp2 = vllm_replicas
    options = DoctorOptions(replicas=(tp1.url, tp2.url), transport="tcp", timeout_s=60)
    rows: dict[str, dict[str, dict]] = {}
    for row in run_checks(options):
        rows.setdefault(row.subject, {})[row.name] = row.to_dict()
    for url in (tp1.url, tp2.url):
        assert all(row["status"] == OK for row in rows[url].values()), rows[url]
        assert rows[url]["protocol"]["detail"].startswith("vLLM 0.32.0 (")
    assert rows[tp2.url]["parallelism"]["detail"].startswith("tp=2 ")
    assert "delta regions of 8 MiB" in rows[tp1.url]["delta syncs"]["detail"]
    assert rows[tp2.url]["delta syncs"]["detail"].startswith("no: full bytes")
