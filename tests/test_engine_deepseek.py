"""The reference engine's DeepSeek-V3 family against HF transformers' DeepseekV3 in float32:
tp 1 in-process, tp 2 with ep 1 and 2 over gloo; as SGLang serves it at scale (fused shared
experts, DP attention, ``moe_dense_tp_size`` 1, ``enable_dp_lm_head``) at tp 1, 2 and 4, in
float32 and bfloat16; MLA's derived ``w_kc`` / ``w_vc`` (SGLang's post-load derivation) and
what serving stale ones does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_cases import (
    DEEPSEEK_CASES,
    MAX_NEW_TOKENS,
    PROMPTS,
    check_against_hf,
    hf_reference,
    run_engine,
    write_checkpoint,
)
from process_group import run_in_process_group
from weightsync.checkpoint import load_config_dict
from weightsync.engine import ModelSpec, ReferenceModel, generate
from weightsync.engine.cache import LatentCache
from weightsync.engine.mla import MLAttention
from weightsync.engine.synthetic import synthetic_hf_tensors
from weightsync.layout import ParallelismConfig, rank_layout
from weightsync.receiver.loader import load_hf_tensors
from weightsync.testing.presets import preset_config

TP2_RUNS = [(name, ep_size) for name in DEEPSEEK_CASES for ep_size in (1, 2)]

# SGLang's layouts for serving DeepSeek-V3 at scale, on two ranks: DP attention (attention
# and embed_tokens whole on each rank, the MoE split over both), with expert parallelism and
# fused shared experts, with the dense MLP replicated and the LM head split per attention-DP
# group; fused shared experts at plain TP.
SCALE_TP2: dict[str, dict[str, Any]] = {
    "dp2": {"tp_size": 2, "attn_dp_size": 2},
    "dp2_ep2_fused": {"tp_size": 2, "attn_dp_size": 2, "ep_size": 2, "num_fused_shared_experts": 1},
    "dp2_dense1_dp_lm_head": {
        "tp_size": 2,
        "attn_dp_size": 2,
        "moe_dense_tp_size": 1,
        "enable_dp_lm_head": True,
    },
    "tp2_fused": {"tp_size": 2, "num_fused_shared_experts": 1},
}
SCALE_TP2_RUNS = [(name, layout) for name in DEEPSEEK_CASES for layout in SCALE_TP2]
# Four ranks in two attention-DP groups of two (attention split inside each group).
SCALE_TP4: dict[str, dict[str, Any]] = {
    "dp2_ep2_fused": {"tp_size": 4, "attn_dp_size": 2, "ep_size": 2, "num_fused_shared_experts": 1},
    "dp2_dense1_dp_lm_head": {
        "tp_size": 4,
        "attn_dp_size": 2,
        "moe_dense_tp_size": 1,
        "enable_dp_lm_head": True,
    },
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls on a shared two-core host run ~50x slower with two threads (they contend
    # with every other process); the gloo children use one thread each too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, list]]]:
    """Each case's checkpoint folder and HF reference outputs."""
    root = tmp_path_factory.mktemp("deepseek_checkpoints")
    result = {}
    for name, config in DEEPSEEK_CASES.items():
        path = root / name
        result[name] = (path, hf_reference(write_checkpoint(path, config)))
    return result


def _tp1(config: Any, dtype: torch.dtype | str = torch.float32) -> ReferenceModel:
    return ReferenceModel(config, {"tp_size": 1, "tp_rank": 0}, dtype=dtype, device="cpu")


def _param_table(model: ReferenceModel) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]


def _layout_table(config: Any, parallelism: ParallelismConfig, dtype: str) -> list[tuple]:
    layout = rank_layout(config, parallelism, dtype)
    return [(p.name, p.shape, f"torch.{p.dtype}") for p in layout.values()]


def _tp2_job(rank: int, group, checkpoints: dict[str, str]) -> dict[Any, Any]:
    """On each of two ranks: every case at ep 1 and 2 (float32), and one in bfloat16."""
    out: dict[Any, Any] = {}
    for name, ep_size in TP2_RUNS:
        path = checkpoints[name]
        parallelism = ParallelismConfig(tp_size=2, tp_rank=rank, ep_size=ep_size)
        model = ReferenceModel(
            load_config_dict(path), parallelism, dtype=torch.float32, device="cpu", group=group
        )
        model.load_checkpoint(path)
        out[(name, ep_size)] = {**run_engine(model), "params": _param_table(model)}
    bf16 = ReferenceModel(
        load_config_dict(checkpoints["deepseek"]),
        ParallelismConfig(tp_size=2, tp_rank=rank, ep_size=2),
        dtype="bfloat16",
        device="cpu",
        group=group,
    )
    bf16.load_checkpoint(checkpoints["deepseek"])
    out["bf16_tokens"] = generate(bf16, PROMPTS[2], max_new_tokens=MAX_NEW_TOKENS)
    out["bf16_params"] = _param_table(bf16)
    return out


@pytest.fixture(scope="module")
def tp2_results(checkpoints) -> list[dict[Any, Any]]:
    """One spawned two-rank gloo job that runs every tp=2 case; results by rank."""
    paths = {name: str(path) for name, (path, _) in checkpoints.items()}
    return run_in_process_group(2, _tp2_job, paths, timeout_s=240)


def _scale_job(
    rank: int, group, checkpoints: dict[str, str], runs: list[tuple[str, dict[str, Any]]]
) -> dict[Any, Any]:
    """On each rank: every (case, parallelism) of ``runs`` in float32, with its param table."""
    out: dict[Any, Any] = {}
    for name, fields in runs:
        path = checkpoints[name]
        parallelism = ParallelismConfig(tp_rank=rank, **fields)
        model = ReferenceModel(
            load_config_dict(path), parallelism, dtype=torch.float32, device="cpu", group=group
        )
        model.load_checkpoint(path)
        out[(name, str(fields))] = {**run_engine(model), "params": _param_table(model)}
    return out


@pytest.fixture(scope="module")
def scale_tp2_results(checkpoints) -> list[dict[Any, Any]]:
    """One two-rank gloo job running every `SCALE_TP2` layout of every case."""
    paths = {name: str(path) for name, (path, _) in checkpoints.items()}
    runs = [(name, SCALE_TP2[layout]) for name, layout in SCALE_TP2_RUNS]
    return run_in_process_group(2, _scale_job, paths, runs, timeout_s=300)


def _check_scale_run(
    config: Any, fields: dict[str, Any], results: list[dict[str, list]], reference
) -> None:
    """Rank 0 matches HF, every rank matches rank 0, every rank's parameters its layout."""
    rank0 = results[0]
    check_against_hf(rank0, reference)
    for rank, result in enumerate(results):
        assert result["tokens"] == rank0["tokens"]
        for logits, logits0 in zip(result["logits"], rank0["logits"], strict=True):
            assert torch.equal(logits, logits0)
        parallelism = ParallelismConfig(tp_rank=rank, **fields)
        assert result["params"] == _layout_table(config, parallelism, "float32")


@pytest.mark.parametrize(("name", "layout"), SCALE_TP2_RUNS)
def test_scale_layouts_at_tp2_match_hf(checkpoints, scale_tp2_results, name, layout):
    path, reference = checkpoints[name]
    fields = SCALE_TP2[layout]
    results = [by_run[(name, str(fields))] for by_run in scale_tp2_results]
    _check_scale_run(load_config_dict(path), fields, results, reference)


def test_scale_layouts_at_tp4_match_hf(checkpoints):
    """Two attention-DP groups of two ranks: attention heads split inside each group."""
    path, reference = checkpoints["deepseek"]
    runs = [("deepseek", fields) for fields in SCALE_TP4.values()]
    results = run_in_process_group(4, _scale_job, {"deepseek": str(path)}, runs, timeout_s=300)
    for fields in SCALE_TP4.values():
        by_rank = [by_run[("deepseek", str(fields))] for by_run in results]
        _check_scale_run(load_config_dict(path), fields, by_rank, reference)


@pytest.mark.parametrize("name", list(DEEPSEEK_CASES))
def test_fused_shared_experts_match_hf(checkpoints, name):
    """The shared expert as the experts' last slot, chosen for every token with weight 1:
    the same logits, bit for bit, as the shared MLP beside the experts (both add the shared
    output after the routed ones)."""
    path, reference = checkpoints[name]
    config = load_config_dict(path)
    fused = ReferenceModel(
        config,
        ParallelismConfig(tp_size=1, tp_rank=0, num_fused_shared_experts=1),
        dtype=torch.float32,
        device="cpu",
    )
    fused.load_checkpoint(path)
    params = dict(fused.named_parameters())
    assert params["model.layers.1.mlp.experts.w13_weight"].shape[0] == 8 + 1
    assert not any("shared_experts" in n for n in params)
    got = run_engine(fused)
    check_against_hf(got, reference)
    plain = _tp1(config)
    plain.load_checkpoint(path)
    for logits, plain_logits in zip(got["logits"], run_engine(plain)["logits"], strict=True):
        assert torch.equal(logits, plain_logits)


def _bf16_reference(path: Path) -> dict[str, list]:
    """HF in float32 on the checkpoint's weights rounded to bfloat16 (what a bf16 rollout
    stores; the router's float32 bias is a buffer and stays as it is)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    return hf_reference(hf)


def _bf16_job(rank: int, group, path: str, runs: list[dict[str, Any]]) -> list[dict]:
    out = []
    for fields in runs:
        parallelism = ParallelismConfig(tp_rank=rank, **fields)
        model = ReferenceModel(
            load_config_dict(path), parallelism, dtype="bfloat16", device="cpu", group=group
        )
        model.load_checkpoint(path)
        out.append(run_engine(model))
    return out


def test_bf16_fused_and_dp_attention_match_hf_on_bf16_weights(checkpoints):
    """bfloat16 parameters (computed in float32 on CPU) with fused shared experts at tp 1 and
    with DP attention and fused shared experts at tp 2, against HF on the same rounded
    weights."""
    path, _ = checkpoints["deepseek"]
    reference = _bf16_reference(path)
    tp1 = ReferenceModel(
        load_config_dict(path),
        ParallelismConfig(tp_size=1, tp_rank=0, num_fused_shared_experts=1),
        dtype="bfloat16",
        device="cpu",
    )
    tp1.load_checkpoint(path)
    check_against_hf(run_engine(tp1), reference)
    runs = [SCALE_TP2["dp2_ep2_fused"], SCALE_TP2["dp2_dense1_dp_lm_head"]]
    for rank_results in run_in_process_group(2, _bf16_job, str(path), runs, timeout_s=300):
        for result in rank_results:
            check_against_hf(result, reference)


@pytest.mark.parametrize("name", list(DEEPSEEK_CASES))
def test_tp1_matches_hf(checkpoints, name):
    path, reference = checkpoints[name]
    model = _tp1(load_config_dict(path))
    model.load_checkpoint(path)
    check_against_hf(run_engine(model), reference)


@pytest.mark.parametrize(("name", "ep_size"), TP2_RUNS)
def test_tp2_matches_hf(checkpoints, tp2_results, name, ep_size):
    path, reference = checkpoints[name]
    rank0, rank1 = (result[(name, ep_size)] for result in tp2_results)
    check_against_hf(rank0, reference)
    assert rank1["tokens"] == rank0["tokens"]
    for logits0, logits1 in zip(rank0["logits"], rank1["logits"], strict=True):
        assert torch.equal(logits0, logits1)
    for rank, result in enumerate((rank0, rank1)):
        parallelism = ParallelismConfig(tp_size=2, tp_rank=rank, ep_size=ep_size)
        assert result["params"] == _layout_table(load_config_dict(path), parallelism, "float32")


def test_tp2_bf16_runs_with_a_float32_router_bias(checkpoints, tp2_results):
    rank0, rank1 = tp2_results
    assert rank0["bf16_tokens"] == rank1["bf16_tokens"]
    assert len(rank0["bf16_tokens"]) == MAX_NEW_TOKENS
    dtypes = {name: dtype for name, _, dtype in rank0["bf16_params"]}
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "torch.float32"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "torch.bfloat16"


@pytest.mark.parametrize("num_fused_shared_experts", [0, 1])
def test_kimi_k2_config_runs_the_same_model(checkpoints, num_fused_shared_experts):
    """Kimi-K2's model_type, with its shared expert apart or (SGLang's
    ``--enforce-shared-experts-fusion``) fused into the experts."""
    path, reference = checkpoints["deepseek"]
    config = {**load_config_dict(path), "model_type": "kimi_k2"}
    parallelism = ParallelismConfig(
        tp_size=1, tp_rank=0, num_fused_shared_experts=num_fused_shared_experts
    )
    model = ReferenceModel(config, parallelism, dtype=torch.float32, device="cpu")
    model.load_checkpoint(path)
    check_against_hf(run_engine(model), reference)


def test_stale_w_kc_w_vc_serve_wrong_tokens_until_post_load(checkpoints):
    """New kv_b_proj bytes written straight into the parameters, as a one-sided sync writes
    them: without the post-load derivation the engine still computes with the old kv_b_proj
    (its stale w_kc / w_vc) and serves the old model's tokens, not the new one's."""
    from transformers import AutoModelForCausalLM

    path, old_reference = checkpoints["deepseek"]
    config = load_config_dict(path)
    kv_b = [f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in range(3)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name in kv_b:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    new_reference = hf_reference(hf)
    assert new_reference["tokens"] != old_reference["tokens"]

    model = _tp1(config)
    model.load_checkpoint(path)
    new_bytes = {name: tensor for name, tensor in hf.state_dict().items() if name in kv_b}
    load_hf_tensors(dict(model.named_parameters()), new_bytes, config, model.parallelism)
    stale = run_engine(model)
    assert stale["tokens"] == old_reference["tokens"] != new_reference["tokens"]
    model.post_load()
    check_against_hf(run_engine(model), new_reference)


def test_tensor_by_tensor_loading_needs_post_load():
    """Loading through the receiver's loader, as ``weightsync serve --load-format dummy`` does
    with seeded synthetic weights, writes the parameters only: after `post_load` the model is
    the one `load_hf_state_dict` of the same tensors builds."""
    config = preset_config("tiny-deepseek")
    tensors = dict(synthetic_hf_tensors(config, seed=7, dtype=torch.float32))
    loaded = _tp1(config)
    loaded.load_hf_state_dict(tensors)
    streamed = _tp1(config)
    load_hf_tensors(
        dict(streamed.named_parameters()), iter(tensors.items()), config, streamed.parallelism
    )
    prompt = torch.tensor(PROMPTS[1])
    positions = torch.arange(len(PROMPTS[1]))
    with torch.inference_mode():
        expected = loaded(prompt, positions)
        assert not torch.equal(streamed(prompt, positions), expected)  # w_kc / w_vc still zero
        streamed.post_load()
        assert torch.equal(streamed(prompt, positions), expected)


def test_post_load_derives_w_kc_w_vc_as_sglang_does():
    """w_kc / w_vc against a plain, element-by-element reading of SGLang's post_load_weights:
    w_kc[h, d, c] = W[h * (nope + v) + d, c] and w_vc[h, c, e] = W[h * (nope + v) + nope + e, c],
    with SGLang's strides, rewritten in place."""
    config = preset_config("tiny-deepseek-nolora", num_hidden_layers=1, qk_nope_head_dim=3)
    config |= {"kv_lora_rank": 5, "v_head_dim": 2, "qk_rope_head_dim": 4, "num_attention_heads": 4}
    model = ReferenceModel(
        config, ParallelismConfig(tp_size=2, tp_rank=1), dtype=torch.bfloat16, device="cpu"
    )
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, MLAttention)
    nope, v, rank, heads = 3, 2, 5, 2
    addresses = (attn.w_kc.data_ptr(), attn.w_vc.data_ptr())
    with torch.no_grad():
        attn.kv_b_proj.weight.copy_(torch.randn(attn.kv_b_proj.weight.shape))
    model.post_load()
    weight = attn.kv_b_proj.weight
    assert (attn.w_kc.data_ptr(), attn.w_vc.data_ptr()) == addresses
    assert attn.w_kc.shape == (heads, nope, rank) and attn.w_kc.stride() == (nope * rank, 1, nope)
    assert attn.w_vc.shape == (heads, rank, v) and attn.w_vc.stride() == (v * rank, 1, rank)
    assert attn.w_kc.dtype == attn.w_vc.dtype == torch.bfloat16
    for h in range(heads):
        for c in range(rank):
            for d in range(nope):
                assert attn.w_kc[h, d, c] == weight[h * (nope + v) + d, c]
            for e in range(v):
                assert attn.w_vc[h, c, e] == weight[h * (nope + v) + nope + e, c]
    # Derived state, not parameters or buffers: no sync writes them, no checker reads them.
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert not any("w_kc" in n or "w_vc" in n for n in names)


@pytest.mark.parametrize("preset", ["tiny-deepseek", "tiny-deepseek-nolora"])
def test_named_parameters_are_the_rank_layout(preset):
    config = preset_config(preset)
    for tp_size, ep_size in [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]:
        for tp_rank in range(tp_size):
            for extra in (
                {},
                {"num_fused_shared_experts": 1},
                {"attn_dp_size": 2, "moe_dense_tp_size": 1, "enable_dp_lm_head": True},
            ):
                if extra.get("attn_dp_size", 1) > tp_size:
                    continue
                parallelism = ParallelismConfig(
                    tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, **extra
                )
                model = ReferenceModel(config, parallelism, dtype="bfloat16", device="cpu")
                assert _param_table(model) == _layout_table(config, parallelism, "bfloat16")
                assert not any(p.requires_grad for p in model.parameters())


@torch.inference_mode()
def test_compressed_cache_decoding_matches_full_forward(checkpoints):
    path, _ = checkpoints["deepseek"]
    model = _tp1(load_config_dict(path))
    model.load_checkpoint(path)
    ids = torch.tensor([4, 8, 15, 16, 23, 42, 108, 815, 7, 99, 1])
    full = model(ids, torch.arange(len(ids)))
    cache = model.new_cache(len(ids))
    # One entry per token and layer: the kv latent and the rope key, shared by every head.
    assert isinstance(cache, LatentCache)
    assert tuple(cache.entries.shape) == (3, len(ids), 128 + 64)
    pieces = [model(ids[:4], torch.arange(4), cache), model(ids[4:7], torch.arange(4, 7), cache)]
    pieces += [model(ids[i : i + 1], torch.tensor([i]), cache) for i in range(7, len(ids))]
    # Logits reach ~5 here (sharpened weights): a few float32 ulps of them.
    assert (torch.cat(pieces) - full).abs().max().item() < 5e-5
    with pytest.raises(ValueError, match="KV cache"):
        model(ids[:1], torch.tensor([len(ids)]), cache)


def test_spec_reads_mla_and_yarn():
    spec = ModelSpec.from_hf_config(preset_config("tiny-deepseek"))
    assert spec.mla is not None and spec.grouped_routing is not None
    assert (spec.head_dim, spec.rotary_dim, spec.mla.cache_entry_dim) == (192, 64, 192)
    # 192 ** -0.5 * mscale(4, mscale_all_dim=1) ** 2, transformers' scaling for this config.
    assert spec.mla.softmax_scale == pytest.approx(0.09356516759751214, rel=1e-12)
    assert spec.rope.rope_type == "yarn" and spec.rope.attention_factor == 1.0
    routing = spec.grouped_routing
    assert (routing.n_group, routing.topk_group, routing.routed_scaling_factor) == (2, 1, 2.5)
    assert (spec.num_experts_per_tok, spec.norm_topk_prob) == (2, True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "SGLang runs any scaled RoPE"),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}},
            "give both mscale and mscale_all_dim",
        ),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "truncate": False}}, "truncate"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "attention_factor": 2.0}}, "leave it"),
        ({"rope_scaling": {"type": "yarn"}}, "needs a factor"),
        ({"qk_rope_head_dim": 3}, "must be even"),
        ({"n_group": 3}, "n_group=3"),
        ({"num_experts_per_tok": 5}, "top_k=5"),
    ],
)
def test_unsupported_deepseek_configs_are_refused(overrides, message):
    config = preset_config("tiny-deepseek", **overrides)
    with pytest.raises(ValueError, match=message):
        _tp1(config)


def test_yarn_is_refused_outside_mla():
    config = preset_config(
        "tiny", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    )
    with pytest.raises(ValueError, match="yarn"):
        ModelSpec.from_hf_config(config)
