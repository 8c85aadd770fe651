"""A 128-expert MoE synced into a replica with expert parallelism: bit-exact, few writes."""

from __future__ import annotations

import httpx
import pytest
import torch

import weightsync as ws
from servers import serve_replicas
from weightsync.layout import rank_layout
from weightsync.testing.presets import preset_config, random_model
from weightsync.testing.reference import greedy_tokens

pytestmark = pytest.mark.slow

CONFIG = preset_config(
    "tiny-moe", num_experts=128, num_experts_per_tok=4, moe_intermediate_size=16, mlp_only_layers=[]
)


def test_128_expert_sync_is_bit_exact_with_few_writes(tmp_path):
    model = random_model(CONFIG, seed=5)
    model.save_pretrained(tmp_path / "ckpt")
    with serve_replicas(
        tmp_path / "ckpt", num_replicas=1, tp=2, ep=2, dtype="fp32", log_dir=tmp_path
    ) as replicas:
        url = replicas[0].url
        config = ws.SyncConfig(
            sender=ws.SenderConfig(bucket_bytes=4 << 20),
            control=ws.ControlConfig(check_weight_update_equal=True),
            transport=ws.MooncakeConfig(protocol="tcp", timeout_s=10),
        )
        with ws.TrainerSync(config, hf_config=CONFIG, replicas=[url], dtype="float32") as sync:
            export = ws.ModelExport(model)
            num_hf_tensors = len(export.holding())
            first = sync.sync(export)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
            second = sync.sync(export)
        prompt = [3, 14, 15, 92, 65]
        reply = httpx.post(
            f"{url}/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}},
            timeout=60,
        ).json()
    assert first.bit_exact is True
    assert reply["output_ids"] == greedy_tokens(model, torch.float32, (tuple(prompt),), 6)[0]
    num_params = sum(
        len(rank_layout(CONFIG, {"tp_size": 2, "tp_rank": r, "ep_size": 2})) for r in range(2)
    )
    # Thousands of per-expert HF tensors, yet writes stay near one per target parameter.
    assert num_hf_tensors > 128 * 3 * 4
    for report in (first, second):
        assert report.num_writes <= 2 * num_params, (report.num_writes, num_params)
        assert report.push.num_regions >= report.num_writes
    # The second sync runs the first one's cached program (the generation above ran on its
    # weights), and the report carries the rank's own stats.
    assert not first.push.cached_program
    assert second.push.cached_program and second.to_dict()["cached_program"]
    assert second.push.per_source[0].bytes_written == second.bytes_written
