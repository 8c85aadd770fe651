"""The reference engine's model in one process: parameter table, loading, KV cache, requests."""

from __future__ import annotations

import pytest
import torch

from weightsync.checkpoint import load_config_dict
from weightsync.engine import ModelSpec, ReferenceModel, generate
from weightsync.layout import ParallelismConfig, rank_layout
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint

CONFIGS = {
    "llama": preset_config("tiny", model_type="llama"),
    "mistral": preset_config("tiny", model_type="mistral", sliding_window=5),
    "qwen2": preset_config("tiny", model_type="qwen2", num_key_value_heads=1, vocab_size=1003),
    "qwen3": preset_config("tiny", model_type="qwen3", tie_word_embeddings=True),
    "qwen3_moe": preset_config("tiny-moe", tie_word_embeddings=True),
}
TP_EP = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


def _tp1(config, dtype=torch.float32) -> ReferenceModel:
    return ReferenceModel(
        config, ParallelismConfig(tp_size=1, tp_rank=0), dtype=dtype, device="cpu"
    )


@pytest.fixture(scope="module")
def mistral_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("mistral"), CONFIGS["mistral"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_named_parameters_are_the_rank_layout(name):
    config = CONFIGS[name]
    for tp_size, ep_size in TP_EP:
        if ep_size > 1 and name != "qwen3_moe":
            continue
        for tp_rank in range(tp_size):
            parallelism = ParallelismConfig(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size)
            # No group: a tp>1 model can be built (to publish its parameters), not run.
            model = ReferenceModel(config, parallelism, dtype="bfloat16", device="cpu")
            layout = rank_layout(config, parallelism, "bfloat16")
            got = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
            want = [(p.name, p.shape, torch.bfloat16) for p in layout.values()]
            assert got == want, (tp_size, tp_rank, ep_size)
            assert not any(p.requires_grad for p in model.parameters())


def test_forward_without_group_at_tp2_is_refused():
    model = ReferenceModel(
        CONFIGS["qwen2"], ParallelismConfig(tp_size=2, tp_rank=1), dtype="float32", device="cpu"
    )
    with pytest.raises(ValueError, match="process group"):
        model(torch.tensor([1, 2]), torch.arange(2))


def test_loading_copies_into_the_same_memory(mistral_checkpoint):
    config = load_config_dict(mistral_checkpoint)
    model = _tp1(config)
    addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
    model.load_checkpoint(mistral_checkpoint)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == addresses
    from safetensors.torch import load_file

    hf_state_dict = load_file(next(mistral_checkpoint.glob("*.safetensors")))
    expected = shard_state_dict(hf_state_dict, config, ParallelismConfig(tp_size=1, tp_rank=0))
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name
    # A second load of other values still writes in place.
    model.load_hf_state_dict({k: torch.zeros_like(v) for k, v in hf_state_dict.items()})
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == addresses
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_load_reports_a_missing_tensor(mistral_checkpoint):
    model = _tp1(load_config_dict(mistral_checkpoint))
    from safetensors.torch import load_file

    hf_state_dict = load_file(next(mistral_checkpoint.glob("*.safetensors")))
    del hf_state_dict["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        model.load_hf_state_dict(hf_state_dict)
    with pytest.raises(ValueError, match="safetensors"):
        model.load_checkpoint(mistral_checkpoint.parent)


@torch.inference_mode()
def test_cached_decoding_matches_full_forward(mistral_checkpoint):
    # The sliding window (5) is shorter than the sequence, so the cache path must apply it.
    model = _tp1(load_config_dict(mistral_checkpoint))
    model.load_checkpoint(mistral_checkpoint)
    ids = torch.tensor([4, 8, 15, 16, 23, 42, 108, 815, 7, 99, 1])
    full = model(ids, torch.arange(len(ids)))
    cache = model.new_cache(len(ids))
    pieces = [model(ids[:4], torch.arange(4), cache), model(ids[4:7], torch.arange(4, 7), cache)]
    pieces += [model(ids[i : i + 1], torch.tensor([i]), cache) for i in range(7, len(ids))]
    incremental = torch.cat(pieces)
    assert (incremental - full).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="KV cache"):
        model(ids[:1], torch.tensor([len(ids)]), cache)


def test_generate_checks_its_request():
    model = _tp1(CONFIGS["qwen2"])
    vocab_size = CONFIGS["qwen2"]["vocab_size"]
    assert generate(model, [1, 2], max_new_tokens=0) == []
    assert len(generate(model, [vocab_size - 1], max_new_tokens=3)) == 3
    for bad in (
        {"input_ids": [], "max_new_tokens": 1},
        {"input_ids": [vocab_size], "max_new_tokens": 1},
        {"input_ids": [-1], "max_new_tokens": 1},
        {"input_ids": [1], "max_new_tokens": -1},
        {"input_ids": [1], "max_new_tokens": 1, "temperature": -0.5},
        {"input_ids": [1], "max_new_tokens": 1, "temperature": float("nan")},
    ):
        with pytest.raises(ValueError):
            generate(model, **bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
    ],
)
def test_unsupported_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(preset_config("tiny", **{"model_type": "llama", **overrides}))


def test_spec_reads_both_rope_spellings():
    new = ModelSpec.from_hf_config(
        preset_config("tiny", rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    )
    old = ModelSpec.from_hf_config(
        preset_config("tiny", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    )
    assert (new.rope.theta, new.rope.rope_type) == (5e5, "default")
    assert (old.rope.theta, old.rope.rope_type, old.rope.factor) == (5e5, "linear", 2.0)


def test_bf16_weights_compute_in_float32_on_cpu():
    """bf16 parameters on CPU compute in float32: the engine's logits and greedy tokens are an
    HF float32 model's over the same bf16-rounded weights (what the demo's check relies on)."""
    config = preset_config("tiny")
    hf = random_model(config, seed=3)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    model = ReferenceModel(
        config, ParallelismConfig(tp_size=1, tp_rank=0), dtype=torch.bfloat16, device="cpu"
    )
    model.load_hf_state_dict(hf.state_dict())
    assert model.compute_dtype == torch.float32
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = [5, 17, 300, 42, 7]
    with torch.inference_mode():
        ours = model(torch.tensor(prompt), torch.arange(len(prompt)))
        theirs = hf(input_ids=torch.tensor([prompt])).logits[0]
    assert ours.dtype == torch.float32
    assert (ours - theirs).abs().max() < 1e-4
    tokens = generate(model, prompt, max_new_tokens=6)
    ids = torch.tensor([prompt])
    expected = []
    with torch.inference_mode():
        for _ in range(6):
            token = int(hf(input_ids=ids).logits[0, -1].argmax())
            expected.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert tokens == expected
