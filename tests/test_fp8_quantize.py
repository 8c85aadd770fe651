"""The sender's block-FP8 quantiser against the plain reference: codes and scales bit-equal
for bf16 and float32 weights, edge blocks, zero blocks, stacked experts and non-contiguous
inputs; quantising a whole tensor and cutting block-aligned boxes equals quantising the boxes."""

from __future__ import annotations

import pytest
import torch

from fp8_reference import reference_quantize
from weightsync.export import Fp8Export, TensorsExport
from weightsync.export.quantize import dequantize_block_fp8, quantize_block_fp8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _weight(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 0.02
    # Outliers and a zero block exercise the scale's range and its floor.
    x.view(-1)[::997] *= 300.0
    x[..., :8, :8] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("shape", "block"),
    [((256, 384), 128), ((200, 130), 128), ((576, 300), 128), ((3, 40, 24), 8), ((7, 5), 4)],
)
def test_codes_and_scales_equal_the_reference(shape, block, dtype) -> None:
    x = _weight(shape, dtype, seed=sum(shape))
    original = x.clone()
    codes, scales = quantize_block_fp8(x, block=block)
    assert torch.equal(x, original)  # the trainer's weights are read, never written
    ref_codes, ref_scales = reference_quantize(x, block)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(_bits(codes), _bits(ref_codes))
    assert torch.equal(_bits(scales), _bits(ref_scales))
    # Dequantised, every element is within half an e4m3 step of its block's scale.
    error = (dequantize_block_fp8(codes, scales, block=block) - x.float()).abs()
    step = scales.repeat_interleave(block, -2).repeat_interleave(block, -1)
    assert bool((error <= step[..., : shape[-2], : shape[-1]] * 16).all())


def test_outputs_given_and_non_contiguous_input() -> None:
    x = _weight((256, 256), torch.bfloat16, seed=3).t()
    codes = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    scales = torch.empty(2, 2)
    got = quantize_block_fp8(x, block=128, out=codes, scale_out=scales)
    assert got[0] is codes and got[1] is scales
    ref_codes, ref_scales = reference_quantize(x, 128)
    assert torch.equal(_bits(codes), _bits(ref_codes))
    assert torch.equal(scales, ref_scales)


def test_block_aligned_boxes_quantise_like_the_whole() -> None:
    x = _weight((512, 384), torch.bfloat16, seed=5)
    codes, scales = quantize_block_fp8(x, block=128)
    part_codes, part_scales = quantize_block_fp8(x[256:512, 128:384], block=128)
    assert torch.equal(_bits(codes[256:512, 128:384]), _bits(part_codes))
    assert torch.equal(scales[2:4, 1:3], part_scales)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="2 or more dims"):
        quantize_block_fp8(torch.zeros(8))
    with pytest.raises(ValueError, match="float tensor"):
        quantize_block_fp8(torch.zeros(8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"scale_out must be a contiguous torch.float32 \(1, 1\)"):
        quantize_block_fp8(torch.zeros(8, 8), scale_out=torch.zeros(2, 2))


def test_fp8_export_quantises_views_of_fused_experts_and_passes_the_rest() -> None:
    gate_up = _weight((4, 2 * 24, 40), torch.bfloat16, seed=7)
    down = _weight((4, 40, 24), torch.bfloat16, seed=8)
    norm = torch.ones(40, dtype=torch.bfloat16)
    tensors = {"model.layers.0.input_layernorm.weight": norm}
    for e in range(4):
        prefix = f"model.layers.0.mlp.experts.{e}."
        tensors[prefix + "gate_proj.weight"] = gate_up[e, :24]
        tensors[prefix + "up_proj.weight"] = gate_up[e, 24:]
    for e in range(4):
        tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = down[e]
    export = Fp8Export(TensorsExport(tensors), block=8)
    holding = export.holding()
    assert holding["model.layers.0.mlp.experts.2.up_proj.weight"].dtype == "float8_e4m3fn"
    assert holding["model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"].shape == (3, 5)
    assert holding["model.layers.0.input_layernorm.weight"].dtype == "bfloat16"
    export.begin_push()
    stream = dict(export)
    assert list(stream) == list(export.geometry().keys)
    assert stream["model.layers.0.input_layernorm.weight"] is norm
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):
            codes, scales = reference_quantize(tensor, 8)
            assert torch.equal(_bits(stream[name]), _bits(codes)), name
            assert torch.equal(stream[name + "_scale_inv"], scales), name
    # Within a push the codes are reused; the next push quantises the new weights.
    gate_up.mul_(2)
    assert torch.equal(
        _bits(dict(export)["model.layers.0.mlp.experts.1.gate_proj.weight"]),
        _bits(reference_quantize(gate_up[1, :24] / 2, 8)[0]),
    )
    export.begin_push()
    scale = dict(export)["model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv"]
    assert torch.equal(scale, reference_quantize(gate_up[1, :24], 8)[1])
