"""Reading checkpoints: config.json, and safetensors files as zero-copy memory-mapped views."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightsync.checkpoint import load_config_dict, open_safetensors
from weightsync.testing.presets import preset_config, write_random_checkpoint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mapped_tensors_equal_what_safetensors_loads(tmp_path: Path, dtype) -> None:
    folder = write_random_checkpoint(tmp_path, preset_config("tiny"), dtype=dtype, seed=2)
    mapped = open_safetensors(folder)
    loaded = {}
    for file in sorted(folder.glob("*.safetensors")):
        loaded.update(load_file(file))
    assert list(mapped) == list(loaded)
    for name, tensor in loaded.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    assert load_config_dict(folder)["model_type"] == "qwen3"


def test_several_files_empty_tensors_and_float8(tmp_path: Path) -> None:
    save_file(
        {"a": torch.arange(6.0).reshape(2, 3), "e": torch.zeros(0, 4)}, tmp_path / "1.safetensors"
    )
    fp8 = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    save_file({"b": fp8}, tmp_path / "2.safetensors")
    mapped = open_safetensors(tmp_path)
    assert torch.equal(mapped["a"], torch.arange(6.0).reshape(2, 3))
    assert mapped["e"].shape == (0, 4)
    assert torch.equal(mapped["b"].view(torch.uint8), fp8.view(torch.uint8))


def test_bad_folders_and_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        open_safetensors(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match=r"x\.safetensors is not a safetensors file"):
        open_safetensors(tmp_path)
    header = json.dumps({"t": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(ValueError, match="dtype 'C64'"):
        open_safetensors(tmp_path)
    save_file({"t": torch.zeros(1)}, tmp_path / "x.safetensors")
    save_file({"t": torch.zeros(1)}, tmp_path / "y.safetensors")
    with pytest.raises(ValueError, match="'t' is in two files"):
        open_safetensors(tmp_path)
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_config_dict(tmp_path)
