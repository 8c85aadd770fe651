"""`ModelExport`: the PP-local HF stream equals the checkpoint that `save_pretrained` writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from weightsync.export import (
    ExportDefaults,
    Fp8Export,
    ModelExport,
    TensorsExport,
    WeightExport,
    hf_state_items,
)
from weightsync.layout import hf_tensor_shapes
from weightsync.plan import simulate_sources, stage_layers
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    return tensors


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_export_equals_saved_checkpoint(tmp_path: Path, preset: str) -> None:
    config = preset_config(preset)
    saved = _checkpoint(write_random_checkpoint(tmp_path, config, seed=3))
    model = random_model(config, seed=3)
    export = ModelExport(model)
    streamed = dict(export)
    assert sorted(streamed) == sorted(saved)
    assert {n: tuple(t.shape) for n, t in streamed.items()} == hf_tensor_shapes(config)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, saved[name]), name
    metas = export.holding()
    assert list(metas) == list(streamed)
    assert all(
        metas[n].shape == tuple(t.shape) and metas[n].dtype == "float32"
        for n, t in streamed.items()
    )


def test_fused_experts_become_per_expert_views() -> None:
    config = preset_config("tiny-moe")
    model = random_model(config)
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    down = model.model.layers[1].mlp.experts.down_proj
    streamed = dict(hf_state_items(model))
    inter = config["moe_intermediate_size"]
    for expert in range(config["num_experts"]):
        prefix = f"model.layers.1.mlp.experts.{expert}."
        gate, up = streamed[prefix + "gate_proj.weight"], streamed[prefix + "up_proj.weight"]
        assert gate.shape == (inter, config["hidden_size"])
        # Views into the fused parameters: no copy of the model is made.
        assert gate.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert torch.equal(gate, fused[expert, :inter]) and torch.equal(up, fused[expert, inter:])
        assert torch.equal(streamed[prefix + "down_proj.weight"], down[expert])
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in streamed)


@pytest.mark.parametrize("preset,pp", [("tiny", 2), ("tiny", 3), ("tiny-moe", 2)])
def test_stages_match_the_plan_simulator(preset: str, pp: int) -> None:
    config = preset_config(preset)
    model = random_model(config)
    expected = simulate_sources(config, num_sources=pp, pp=pp)
    full = dict(ModelExport(model))
    seen: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        export = ModelExport(model, pp_rank=stage, pp_size=pp)
        metas = export.holding()
        assert metas.keys() == expected[stage].tensors.keys(), f"stage {stage}"
        assert all(m.shape == expected[stage].tensors[n].shape for n, m in metas.items())
        for name, tensor in export:
            assert name not in seen
            seen[name] = tensor
    assert seen.keys() == full.keys()


def test_layer_offset_renames_a_stage_module() -> None:
    config = preset_config("tiny")  # 4 layers
    model = random_model(config)
    layers = stage_layers(config["num_hidden_layers"], 2)[1]
    pattern = re.compile(r"^model\.layers\.(\d+)\.")
    local: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        match = pattern.match(name)
        if match is None:
            local[name] = tensor
        elif int(match.group(1)) in layers:
            local[pattern.sub(f"model.layers.{int(match.group(1)) - layers.start}.", name)] = tensor
    stage = dict(
        ModelExport(local, pp_rank=1, pp_size=2, layer_offset=layers.start, hf_config=config)
    )
    reference = dict(ModelExport(model, pp_rank=1, pp_size=2))
    assert stage.keys() == reference.keys()
    assert all(torch.equal(stage[n], reference[n]) for n in stage)
    with pytest.raises(ValueError, match="outside pipeline stage 0"):
        list(ModelExport(local, pp_rank=0, pp_size=2, layer_offset=layers.start, hf_config=config))


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    config = preset_config("tiny", tie_word_embeddings=True)
    saved = _checkpoint(write_random_checkpoint(tmp_path, config))
    model = random_model(config)
    assert sorted(dict(ModelExport(model))) == sorted(saved)
    assert "lm_head.weight" not in saved
    last = ModelExport(model, pp_rank=1, pp_size=2).holding()
    assert "model.embed_tokens.weight" in last and "lm_head.weight" not in last
    assert last.keys() == simulate_sources(config, num_sources=2, pp=2)[1].tensors.keys()


def test_bad_stage_arguments() -> None:
    model = random_model(preset_config("tiny"))
    with pytest.raises(ValueError, match="pp_rank"):
        ModelExport(model, pp_rank=2, pp_size=2)
    with pytest.raises(ValueError, match="layer_offset"):
        ModelExport(model, layer_offset=-1)
    with pytest.raises(ValueError, match="config"):
        ModelExport(dict(model.state_dict()), pp_size=2)


def test_geometry_is_kept_while_the_model_stays_put() -> None:
    model = random_model(preset_config("tiny"), seed=3)
    export = ModelExport(model)
    first = export.geometry()
    with torch.no_grad():  # an optimizer step: new values, same memory
        for param in model.parameters():
            param.add_(1.0)
    assert export.geometry() is first
    assert list(first.keys) == [name for name, _ in export]
    # A parameter replaced by a tensor elsewhere (same shape): computed again, and equal.
    norm = model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    again = export.geometry()
    assert again is not first and again == first
    # One laid out otherwise: a different geometry.
    proj = model.model.layers[0].self_attn.q_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().t().contiguous().t())
    assert export.geometry() != first


def test_tensors_export_declares_slices_and_checks_their_extents() -> None:
    full = torch.arange(24.0).reshape(4, 6)
    export = TensorsExport(
        {"w": full[:, 2:5], "b": torch.zeros(3)}, slices={"w": ((4, 6), ((0, 4), (2, 5)))}
    )
    holding = export.holding()
    assert holding["w"].shape == (4, 6) and holding["w"].box == ((0, 4), (2, 5))
    assert holding["b"].box is None
    wrong = TensorsExport({"w": full[:, 2:4]}, slices={"w": ((4, 6), ((0, 4), (2, 5)))})
    with pytest.raises(ValueError, match=r"'w' has shape \(4, 2\).*expected shape \(4, 3\)"):
        wrong.holding()
    with pytest.raises(ValueError, match="not given"):
        TensorsExport({}, slices={"w": ((4, 6), ((0, 4), (2, 5)))})


def test_a_pinned_export_reads_its_memory_key_once_and_keeps_its_holding() -> None:
    from weightsync.export import TensorsExport

    class Counting(TensorsExport):
        calls = 0

        def memory_key(self) -> tuple:
            Counting.calls += 1
            return super().memory_key()

    tensors = {"a": torch.zeros(4, 4), "b": torch.ones(8)}
    export = Counting(tensors)
    first = export.holding()
    key = export.geometry_key
    assert export.holding() is first  # nothing moved: the same mapping
    before = Counting.calls
    with export.pinned():
        for _ in range(3):
            export.geometry()
            assert export.holding() is first
    assert Counting.calls == before + 1
    # Outside the block the key is checked again: a moved tensor is seen.
    tensors["b"] = torch.ones(8)
    assert export.holding() is not first
    assert export.geometry_key != key


def test_every_export_declares_the_optional_parts_of_the_protocol() -> None:
    class Bare(ExportDefaults):
        """An export of its own: the three it must give, the rest from the defaults."""

        def holding(self):
            return {}

        def geometry(self):
            return TensorsExport({}).geometry()

        def __iter__(self):
            return iter(())

    views = TensorsExport({"model.norm.weight": torch.ones(8)})
    fp8 = Fp8Export(views, block=4)
    for export in (views, fp8, Bare()):
        assert isinstance(export, WeightExport)
        export.begin_push()
        with export.pinned():
            export.geometry()
    # A stream of views of persistent memory is replayed under its memory key; one that
    # computes its tensors (FP8 codes, filled per push) never is.
    assert views.geometry_key is not None
    assert fp8.geometry_key is None and Bare().geometry_key is None
    # Without them an object is no export.
    assert not isinstance(object(), WeightExport)
