"""The layout rules against real transformers checkpoints and config objects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from reference_loader import reference_shard
from weightsync.checkpoint import load_config_dict
from weightsync.layout import (
    SUPPORTED_MODEL_TYPES,
    ParallelismConfig,
    hf_tensor_shapes,
    model_dtype,
    normalize_hf_config,
    rank_layout,
)
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import (
    build_hf_config,
    preset_config,
    random_model,
    write_random_checkpoint,
)

CHECKPOINTS = [("tiny", False), ("tiny", True), ("tiny-moe", False), ("tiny-moe", True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        (preset, tied): write_random_checkpoint(
            root / f"{preset}-{tied}", preset_config(preset, tie_word_embeddings=tied), seed=3
        )
        for preset, tied in CHECKPOINTS
    }


def _file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(("preset", "tied"), CHECKPOINTS)
def test_hf_tensor_shapes_match_the_saved_checkpoint(
    checkpoints: dict[tuple[str, bool], Path], preset: str, tied: bool
) -> None:
    path = checkpoints[(preset, tied)]
    on_disk = _file_shapes(path)
    config = load_config_dict(path)
    assert hf_tensor_shapes(config) == on_disk
    assert hf_tensor_shapes(build_hf_config(config)) == on_disk
    assert ("lm_head.weight" in on_disk) is not tied


SHARD_CASES = [
    (preset, tied, tp_size, ep_size)
    for preset, tied in CHECKPOINTS
    for tp_size, ep_size in [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4)]
    if ep_size == 1 or preset == "tiny-moe"
]


@pytest.mark.parametrize(("preset", "tied", "tp_size", "ep_size"), SHARD_CASES)
def test_checkpoint_shards_match_reference(
    checkpoints: dict[tuple[str, bool], Path], preset: str, tied: bool, tp_size: int, ep_size: int
) -> None:
    path = checkpoints[(preset, tied)]
    config = load_config_dict(path)
    hf = load_file(str(path / "model.safetensors"))
    ref_cfg = normalize_hf_config(config)
    for tp_rank in range(tp_size):
        shards = shard_state_dict(
            hf, config, {"tp_size": tp_size, "tp_rank": tp_rank, "ep_size": ep_size}
        )
        reference = reference_shard(hf, ref_cfg, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size)
        assert list(shards) == list(reference)
        for name, tensor in shards.items():
            assert torch.equal(tensor, reference[name]), (name, tp_rank)


def test_in_memory_moe_state_dict_loads_like_the_saved_one(
    checkpoints: dict[tuple[str, bool], Path],
) -> None:
    # transformers 5 holds experts stacked in memory and saves them per expert.
    path = checkpoints[("tiny-moe", False)]
    config = load_config_dict(path)
    in_memory = random_model(preset_config("tiny-moe", tie_word_embeddings=False), seed=3)
    memory_sd = in_memory.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in memory_sd
    saved_sd = load_file(str(path / "model.safetensors"))
    for tp_rank in range(4):
        parallelism = ParallelismConfig(tp_size=4, tp_rank=tp_rank, ep_size=2)
        from_memory = shard_state_dict(memory_sd, config, parallelism, torch.bfloat16)
        from_file = shard_state_dict(saved_sd, config, parallelism, torch.bfloat16)
        assert list(from_memory) == list(from_file)
        for name, tensor in from_file.items():
            assert torch.equal(from_memory[name], tensor), name


def test_tied_moe_lm_head_comes_from_embed_tokens(
    checkpoints: dict[tuple[str, bool], Path],
) -> None:
    path = checkpoints[("tiny-moe", True)]
    config = load_config_dict(path)
    hf = load_file(str(path / "model.safetensors"))
    shards = shard_state_dict(hf, config, {"tp_size": 2, "tp_rank": 1})
    assert torch.equal(shards["lm_head.weight"], shards["model.embed_tokens.weight"])
    layout = rank_layout(config, {"tp_size": 2, "tp_rank": 1})["lm_head.weight"]
    assert {s.hf_name for s in layout.segments} == {"model.embed_tokens.weight", None}


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_config_defaults_agree_with_transformers(model_type: str) -> None:
    # A config.json that leaves keys out must read as transformers reads it.
    sparse = {"model_type": model_type}
    assert normalize_hf_config(sparse) == normalize_hf_config(build_hf_config(sparse))
    if model_type in ("deepseek_v3", "kimi_k2"):
        # MLA reads no num_key_value_heads / head_dim (tests/test_layout_deepseek.py).
        return
    partial = {"model_type": model_type, "hidden_size": 128, "num_attention_heads": 8}
    if model_type != "llama":
        # The other config classes default num_key_value_heads to a fixed number.
        partial["num_key_value_heads"] = 2
    from_object = normalize_hf_config(build_hf_config(partial))
    assert normalize_hf_config(partial) == from_object
    assert from_object["num_key_value_heads"] == (8 if model_type == "llama" else 2)
    # Qwen3Config defaults head_dim to 128; the others derive hidden_size // heads.
    assert from_object["head_dim"] == (128 if model_type == "qwen3" else 16)


def test_config_object_and_dict_read_the_same() -> None:
    config = preset_config("tiny-moe", dtype="bfloat16")
    obj = build_hf_config(config)
    normalized = normalize_hf_config(obj)
    assert normalized == normalize_hf_config(config)
    assert normalized["num_experts"] == 8 and normalized["mlp_only_layers"] == [0]
    assert normalized["dtype"] == "bfloat16"
    assert normalize_hf_config(normalized) == normalized
    parallelism = ParallelismConfig(tp_size=2, tp_rank=0, ep_size=2)
    assert rank_layout(obj, parallelism) == rank_layout(config, parallelism)
    # config.json as transformers 5 writes it names the expert count num_local_experts.
    saved = obj.to_dict()
    assert "num_experts" not in saved and saved["num_local_experts"] == 8
    assert normalize_hf_config(saved) == normalized


def test_model_dtype_reads_each_spelling() -> None:
    tiny = preset_config("tiny")
    assert model_dtype(tiny) == "float32"
    assert model_dtype({**tiny, "torch_dtype": "bfloat16"}) == "bfloat16"
    assert model_dtype({**tiny, "dtype": "float16"}) == "float16"
    assert model_dtype({**tiny, "dtype": torch.bfloat16}) == "bfloat16"
    assert model_dtype(build_hf_config({**tiny, "dtype": "bfloat16"})) == "bfloat16"
    layout = rank_layout({**tiny, "dtype": "bfloat16"}, {"tp_size": 1, "tp_rank": 0})
    assert {p.dtype for p in layout.values()} == {"bfloat16"}
