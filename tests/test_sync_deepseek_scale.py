"""DeepSeek-V3 as SGLang serves it at scale, end to end: `weightsync serve` replicas with DP
attention (``--enable-dp-attention --dp-size 2``, ``--moe-dense-tp-size 1``,
``--enable-dp-lm-head``) and with fused shared experts (``--enforce-shared-experts-fusion``,
at ep 2), in bf16 and block FP8, synced by a `TrainerSync` that learns their layouts from
``/server_info`` and ``/parallelism_config``: bit-exact after the checker's reset, and
generating what transformers generates on the synced weights. Also what ``weightsync
serve`` and `ServeConfig` refuse, as SGLang refuses it."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

import weightsync as ws
from servers import serve_replicas
from weightsync.checkpoint import load_config_dict
from weightsync.cli.main import app
from weightsync.export import ModelExport
from weightsync.layout import ParallelismConfig
from weightsync.server.config import ServeConfig
from weightsync.testing.presets import preset_config, random_model, write_fp8_checkpoint
from weightsync.testing.reference import greedy_tokens

PROMPTS = ((3, 14, 15, 92, 65), (7, 1, 900))
MAX_NEW_TOKENS = 6
FP8_BLOCK = 128
# Two layouts of one replica each (tp 2): attention whole on each rank in two attention-DP
# groups, dense MLP whole, lm_head per group; the shared expert as the last expert slot of
# both EP ranks.
DP_ATTENTION = (
    "--enable-dp-attention", "--dp-size", "2", "--moe-dense-tp-size", "1", "--enable-dp-lm-head",
)  # fmt: skip
FUSED_EP2 = ("--enforce-shared-experts-fusion",)


def _model(tmp_path: Path):
    config = preset_config("tiny-deepseek")
    model = random_model(config, seed=3)
    with torch.no_grad():
        # Sharper weights: greedy choices far from ties, in bf16 too.
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(4.0)
    model.save_pretrained(tmp_path / "ckpt")
    return config, model


def _generated(url: str, prompt: tuple[int, ...]) -> list[int]:
    reply = httpx.post(
        f"{url}/generate",
        json={"input_ids": list(prompt), "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS}},
        timeout=120,
    )
    reply.raise_for_status()
    return reply.json()["output_ids"]


def _sync_twice_and_check(config, model, urls: list[str], *, fp8_block: int = 0) -> None:
    """A first sync (checked bit-exact after the checker's reset), a change, a second sync;
    every replica then generates what transformers does on the rollout's rounded weights."""
    sync_config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=4 << 20),
        control=ws.ControlConfig(check_weight_update_equal=True),
        transport=ws.MooncakeConfig(protocol="tcp", timeout_s=20),
    )
    with ws.TrainerSync(sync_config, hf_config=config, replicas=urls, dtype="bfloat16") as sync:
        export = ModelExport(model)
        first = sync.sync(export)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        second = sync.sync(export)
    assert first.bit_exact is True
    assert second.bytes_written > 0
    expected = greedy_tokens(model, torch.bfloat16, PROMPTS, MAX_NEW_TOKENS, fp8_block=fp8_block)
    for url in urls:
        assert [_generated(url, prompt) for prompt in PROMPTS] == expected, url


@pytest.mark.slow
def test_bf16_syncs_into_dp_attention_and_fused_shared_experts(tmp_path):
    config, model = _model(tmp_path)
    with ExitStack() as stack:
        dp_attention = stack.enter_context(
            serve_replicas(
                tmp_path / "ckpt",
                tp=2,
                dtype="bf16",
                log_dir=tmp_path / "dp",
                extra_args=DP_ATTENTION,
            )
        )[0]
        fused = stack.enter_context(
            serve_replicas(
                tmp_path / "ckpt",
                tp=2,
                ep=2,
                dtype="bf16",
                log_dir=tmp_path / "fused",
                extra_args=FUSED_EP2,
            )
        )[0]
        info = httpx.get(f"{dp_attention.url}/server_info", timeout=10).json()
        # SGLang 0.5.23's keys, resolved as it resolves `--dp-size 2 --enable-dp-attention`.
        assert (info["attn_dp_size"], info["dp_size"], info["enable_dp_attention"]) == (2, 1, True)
        assert (info["moe_dense_tp_size"], info["enable_dp_lm_head"]) == (1, True)
        published = [
            httpx.get(f"{url}/parallelism_config", params={"rank": r}, timeout=10).json()
            for url in (dp_attention.url, fused.url)
            for r in range(2)
        ]
        assert [(p["attn_dp_rank"], p["attn_tp_size"]) for p in published[:2]] == [(0, 1), (1, 1)]
        assert [p["num_fused_shared_experts"] for p in published] == [0, 0, 1, 1]
        assert ParallelismConfig.from_dict(published[3]) == ParallelismConfig(
            tp_size=2, tp_rank=1, ep_size=2, num_fused_shared_experts=1
        )
        _sync_twice_and_check(config, model, [dp_attention.url, fused.url])


@pytest.mark.slow
def test_fp8_syncs_into_dp_attention_with_fused_shared_experts(tmp_path):
    config, model = _model(tmp_path)
    served = write_fp8_checkpoint(tmp_path / "fp8", tmp_path / "ckpt", block=FP8_BLOCK)
    assert load_config_dict(served)["quantization_config"]["weight_block_size"] == [128, 128]
    with serve_replicas(
        served, tp=2, dtype="bf16", log_dir=tmp_path / "logs",
        extra_args=(*DP_ATTENTION, *FUSED_EP2),
    ) as replicas:  # fmt: skip
        url = replicas[0].url
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        assert (info["quantization"], info["attn_dp_size"]) == ("fp8", 2)
        _sync_twice_and_check(config, model, [url], fp8_block=FP8_BLOCK)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp_size": 4, "attn_dp_size": 3}, "attn_dp_size=3 must divide tp_size=4"),
        ({"tp_size": 2, "enable_dp_lm_head": True}, "requires attention DP"),
        ({"tp_size": 4, "moe_dense_tp_size": 2}, "None, 1 or tp_size=4"),
        (
            {"enforce_shared_experts_fusion": True, "disable_shared_experts_fusion": True},
            "exclude each other",
        ),
    ],
)
def test_serve_config_refuses_what_sglang_refuses(fields, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(model_path="ckpt", **fields)


def test_serve_config_derives_each_ranks_parallelism_as_sglang_does():
    deepseek = preset_config("tiny-deepseek")
    config = ServeConfig(
        model_path="ckpt",
        tp_size=4,
        ep_size=2,
        attn_dp_size=2,
        moe_dense_tp_size=1,
        enforce_shared_experts_fusion=True,
    )
    rank3 = config.parallelism(deepseek, 3)
    assert (rank3.attn_tp_size, rank3.attn_tp_rank, rank3.attn_dp_rank) == (2, 1, 1)
    assert (rank3.ep_rank, rank3.moe_tp_rank, rank3.num_fused_shared_experts) == (1, 1, 1)
    assert rank3.moe_dense_tp_size == 1 and not rank3.enable_dp_lm_head
    # SGLang's default: no fusion for a small test model on the CPU, nor for a non-DeepSeek.
    assert ServeConfig(model_path="ckpt").parallelism(deepseek, 0).num_fused_shared_experts == 0
    # DeepSeek-V3/R1's shape on CUDA at ep 1: fused by default, as SGLang does.
    v3 = {**deepseek, "n_routed_experts": 256}
    cuda = ServeConfig(model_path="ckpt", device="cuda")
    assert cuda.parallelism(v3, 0).num_fused_shared_experts == 1
    off = ServeConfig(model_path="ckpt", device="cuda", disable_shared_experts_fusion=True)
    assert off.parallelism(v3, 0).num_fused_shared_experts == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--dp-size", "2"), "without --enable-dp-attention"),
        (("--enable-dp-attention", "--dp-size", "2", "--attn-dp-size", "4"), "disagree"),
        (("--tp", "2", "--enable-dp-lm-head"), "requires attention DP"),
    ],
)
def test_serve_refuses_bad_layout_flags(tmp_path, args, message):
    # In this process, as tests/test_serve_lifecycle.py runs serve's other refusals: they come
    # before anything starts (and with an empty config.json, a serve that went on would fail).
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(
        app, ["serve", "--model", str(tmp_path), *args], env={"COLUMNS": "500"}
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in result.stderr, result.stderr
