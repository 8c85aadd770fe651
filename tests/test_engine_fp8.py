"""The reference engine serving a block-FP8 DeepSeek-V3: e4m3 weights and float32 block
scales in SGLang's layout, dequantised per block where used, against HF transformers'
DeepseekV3 run on the same dequantised weights (float32: greedy tokens equal, logits within
1e-4), also with the shared expert fused into the experts' FP8 slots and under DP attention
over gloo; the post-load derivation of MLA's ``w_kc`` / ``w_vc`` from an FP8 ``kv_b_proj``, and
the wrong tokens served while it is skipped."""

from __future__ import annotations

import pytest
import torch

from engine_cases import check_against_hf, hf_reference, run_engine
from fp8_reference import reference_quantize
from process_group import run_in_process_group
from weightsync.engine import ReferenceModel
from weightsync.export import ModelExport
from weightsync.layout import ParallelismConfig
from weightsync.layout.quant import is_quantized_hf_name
from weightsync.receiver.loader import load_hf_tensors
from weightsync.testing.presets import preset_config, random_model

BLOCK = 128
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK] * 2}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fp8_checkpoint(hf) -> dict[str, torch.Tensor]:
    """`hf`'s tensors with every linear weight quantised by the reference quantiser; `hf`'s
    own weights are replaced by their dequantised values (HF then runs what FP8 holds)."""
    out = {}
    with torch.no_grad():
        for name, tensor in ModelExport(hf):
            if not is_quantized_hf_name(name):
                out[name] = tensor.clone()
                continue
            codes, scales = reference_quantize(tensor, BLOCK)
            expanded = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            tensor.copy_(codes.float() * expanded[: tensor.shape[0], : tensor.shape[1]])
            out[name], out[name + "_scale_inv"] = codes, scales
    return out


@pytest.fixture(scope="module")
def case() -> tuple[dict, dict[str, torch.Tensor], dict]:
    config = preset_config("tiny-deepseek")
    hf = random_model(config, seed=1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(4.0)
    checkpoint = _fp8_checkpoint(hf)
    return {**config, "quantization_config": FP8}, checkpoint, hf_reference(hf)


def _engine(config: dict) -> ReferenceModel:
    return ReferenceModel(config, {"tp_size": 1, "tp_rank": 0}, dtype=torch.float32, device="cpu")


def test_fp8_engine_matches_hf_on_the_dequantised_weights(case) -> None:
    config, checkpoint, reference = case
    model = _engine(config)
    params = dict(model.named_parameters())
    assert params["model.layers.1.mlp.experts.w13_weight"].dtype == torch.float8_e4m3fn
    assert params["model.layers.1.mlp.experts.w13_weight_scale_inv"].dtype == torch.float32
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    model.load_hf_state_dict(checkpoint)
    check_against_hf(run_engine(model), reference)


def test_fp8_fused_shared_experts_match_hf(case) -> None:
    """The shared expert's e4m3 codes and block scales as the experts' last slot."""
    config, checkpoint, reference = case
    model = ReferenceModel(
        config,
        ParallelismConfig(tp_size=1, tp_rank=0, num_fused_shared_experts=1),
        dtype=torch.float32,
        device="cpu",
    )
    params = dict(model.named_parameters())
    assert params["model.layers.1.mlp.experts.w13_weight"].shape[0] == 9
    assert params["model.layers.1.mlp.experts.w13_weight_scale_inv"].shape[0] == 9
    model.load_hf_state_dict(checkpoint)
    check_against_hf(run_engine(model), reference)


# DP attention on two ranks (attention whole per rank, MoE split), with expert parallelism
# and fused shared experts, and with the dense MLP whole and fused shared experts at moe-TP 2.
_FP8_TP2 = (
    {"tp_size": 2, "attn_dp_size": 2, "ep_size": 2, "num_fused_shared_experts": 1},
    {"tp_size": 2, "attn_dp_size": 2, "moe_dense_tp_size": 1, "num_fused_shared_experts": 1},
)


def _fp8_tp2_job(rank: int, group, config: dict, checkpoint: dict) -> list[dict]:
    out = []
    for fields in _FP8_TP2:
        parallelism = ParallelismConfig(tp_rank=rank, **fields)
        model = ReferenceModel(config, parallelism, dtype=torch.float32, device="cpu", group=group)
        model.load_hf_state_dict(checkpoint)
        out.append(run_engine(model))
    return out


def test_fp8_dp_attention_matches_hf(case) -> None:
    config, checkpoint, reference = case
    for rank_results in run_in_process_group(2, _fp8_tp2_job, config, checkpoint, timeout_s=300):
        for result in rank_results:
            check_against_hf(result, reference)


def test_skipping_post_load_after_new_fp8_kv_b_serves_wrong_tokens(case) -> None:
    """New FP8 kv_b_proj codes and scales written straight into the parameters, as a sync
    writes them: until `post_load` dequantises them into w_kc / w_vc the engine serves the
    old model's tokens."""
    config, checkpoint, reference = case
    model = _engine(config)
    model.load_hf_state_dict(checkpoint)
    generator = torch.Generator().manual_seed(9)
    new = {}
    for layer in range(3):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        weight = torch.randn(checkpoint[name].shape, generator=generator) * 0.4
        new[name], new[name + "_scale_inv"] = reference_quantize(weight, BLOCK)
    load_hf_tensors(dict(model.named_parameters()), new, config, model.parallelism)
    stale = run_engine(model)
    assert stale["tokens"] == reference["tokens"]
    model.post_load()
    fresh = run_engine(model)
    assert fresh["tokens"] != reference["tokens"]
    updated = _engine(config)
    updated.load_hf_state_dict({**checkpoint, **new})
    assert run_engine(updated)["tokens"] == fresh["tokens"]
    attn = model.model.layers[0].self_attn
    assert attn.w_kc.dtype == torch.float32  # dequantised, in the model dtype
