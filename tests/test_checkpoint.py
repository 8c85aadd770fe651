"""Reading checkpoints: config.json, and safetensors files checked like a format validator
(every kind of lying header is refused, naming the file and the tensor) and read with file
reads into memory of their own (a file truncated while it is read is an error, not SIGBUS)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightsync.checkpoint import (
    MAX_HEADER_BYTES,
    check_safetensors_header,
    load_config_dict,
    open_safetensors,
    read_safetensors_header,
)
from weightsync.export import CheckpointExport
from weightsync.export.geometry import stream_geometry
from weightsync.testing.presets import preset_config, write_random_checkpoint


def _write(path: Path, header: Any, data: bytes = b"", *, header_bytes: int | None = None) -> Path:
    """A safetensors file with exactly this header and data (nothing checked)."""
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    length = len(text) if header_bytes is None else header_bytes
    path.write_bytes(struct.pack("<Q", length) + text + data)
    return path


def _f32(shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def _entry(dtype: Any, shape: Any, offsets: Any) -> dict[str, Any]:
    """A header entry with whatever values, None leaving that key out."""
    entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    return {key: value for key, value in entry.items() if value is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_read_equal_what_safetensors_loads(tmp_path: Path, dtype) -> None:
    folder = write_random_checkpoint(tmp_path, preset_config("tiny"), dtype=dtype, seed=2)
    loaded = {}
    for file in sorted(folder.glob("*.safetensors")):
        loaded.update(load_file(file))
    with open_safetensors(folder) as files:
        assert {e.name for e in files.entries} == set(loaded)
        assert files.num_bytes == sum(t.numel() * t.element_size() for t in loaded.values())
        streamed = dict(files.stream())
        for name, tensor in loaded.items():
            assert streamed[name].dtype == tensor.dtype, name
            assert torch.equal(streamed[name], tensor), name
            assert torch.equal(files.read(name), tensor), name
    assert load_config_dict(folder)["model_type"] == "qwen3"


def test_several_files_empty_tensors_metadata_and_float8(tmp_path: Path) -> None:
    save_file(
        {"a": torch.arange(6.0).reshape(2, 3), "e": torch.zeros(0, 4), "s": torch.tensor(2.0)},
        tmp_path / "1.safetensors",
        metadata={"format": "pt"},
    )
    fp8 = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    save_file({"b": fp8}, tmp_path / "2.safetensors")
    with open_safetensors(tmp_path) as files:
        streamed = dict(files.stream())
    assert torch.equal(streamed["a"], torch.arange(6.0).reshape(2, 3))
    assert streamed["e"].shape == (0, 4) and streamed["s"].shape == ()
    assert torch.equal(streamed["b"].view(torch.uint8), fp8.view(torch.uint8))
    assert list(streamed)[-1] == "b"  # files in name order


def test_a_pass_gives_every_tensor_an_address_of_its_own_while_freeing_them(
    tmp_path: Path,
) -> None:
    # A consumer tells tensors apart by address: memory freed and reused within a pass would
    # make two tensors look like one storage.
    tensors = {f"t{i}": torch.full((3000,), float(i)) for i in range(40)}
    save_file(tensors, tmp_path / "m.safetensors")
    with open_safetensors(tmp_path) as files:
        addresses = []
        for name, tensor in files.stream():
            assert tensor.data_ptr() % 4096 == 0
            assert float(tensor[0]) == float(name[1:])
            addresses.append(tensor.data_ptr())
            del tensor  # dropped at once, as a consumer that staged it does
    assert len(set(addresses)) == len(addresses)


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_a_pass_holds_what_its_consumer_holds_not_the_checkpoint(tmp_path: Path) -> None:
    tensor_bytes = 64 << 20  # a pass that kept its tensors would grow by 4 of them
    tensors = {f"t{i}": torch.full((tensor_bytes // 4,), 1.0) for i in range(4)}
    save_file(tensors, tmp_path / "m.safetensors")
    del tensors
    with open_safetensors(tmp_path) as files:
        before = _resident_bytes()
        peak = before
        for _, tensor in files.stream():
            assert tensor.is_inference() and float(tensor[-1]) == 1.0
            peak = max(peak, _resident_bytes())
            del tensor
    assert before + tensor_bytes // 2 < peak < before + tensor_bytes * 3 // 2


def test_the_export_declares_the_geometry_its_stream_has(tmp_path: Path) -> None:
    save_file(
        {"w": torch.ones(4, 8), "e": torch.zeros(0, 2), "f": torch.zeros(0), "b": torch.ones(3)},
        tmp_path / "1.safetensors",
    )
    save_file({"x": torch.ones(2, 2, dtype=torch.bfloat16)}, tmp_path / "2.safetensors")
    with open_safetensors(tmp_path) as files:
        export = CheckpointExport(files)
        assert export.geometry() == stream_geometry(iter(export))
        assert export.holding()["x"].dtype == "bfloat16"
        assert export.holding()["w"].shape == (4, 8)


# Every kind of lying header: (case, header, data bytes, what the error says).
_LIES = [
    (
        "empty offsets with a full shape",
        {"a": _f32([2], 0, 8), "lm_head.weight": _f32([4, 4], 8, 8)},
        8,
        "lm_head.weight",
        r"shape \[4, 4\] of F32 needs 64 bytes, but its data_offsets \[8, 8\] hold 0",
    ),
    (
        "overlapping offsets",
        {"a": _f32([4], 0, 16), "b": _f32([4], 8, 24)},
        24,
        "b",
        r"bytes \[8, 24\) of the data section overlap those of tensor 'a' \[0, 16\)",
    ),
    (
        "one tensor inside another",
        {"a": _f32([8], 0, 32), "b": _f32([2], 8, 16), "c": _f32([2], 32, 40)},
        40,
        "b",
        "overlap those of tensor 'a'",
    ),
    (
        "offsets past the end of the file",
        {"a": _f32([4], 0, 16), "b": _f32([4], 16, 32)},
        24,
        "b",
        r"bytes \[16, 32\) end past the data section, which has 24 bytes.*truncated",
    ),
    (
        "a size that disagrees with the shape",
        {"a": _f32([3], 0, 16)},
        16,
        "a",
        r"shape \[3\] of F32 needs 12 bytes, but its data_offsets \[0, 16\] hold 16",
    ),
    ("an unknown dtype", {"t": _entry("C64", [1], [0, 8])}, 8, "t", "dtype 'C64'"),
    ("a dtype missing", {"t": _entry(None, [1], [0, 4])}, 4, "t", "dtype None"),
    ("begin after end", {"t": _f32([0], 8, 4)}, 8, "t", r"need 0 <= begin <= end"),
    ("a negative begin", {"t": _f32([1], -4, 0)}, 8, "t", r"need 0 <= begin <= end"),
    ("one offset", {"t": _entry("F32", [1], [4])}, 4, "t", "not a pair of ints"),
    ("float offsets", {"t": _entry("F32", [1], [0.0, 4.0])}, 4, "t", "not a pair of ints"),
    ("bool offsets", {"t": _entry("U8", [1], [False, True])}, 4, "t", "not a pair of ints"),
    ("no offsets", {"t": _entry("F32", [1], None)}, 4, "t", "data_offsets are None"),
    ("a negative dim", {"t": _f32([-1], 0, 0)}, 4, "t", "not a list of non-negative ints"),
    ("a shape that is no list", {"t": _entry("F32", 4, [0, 16])}, 16, "t", "not a list"),
    ("an entry that is no object", {"t": [0, 4]}, 4, "t", "not an object"),
    ("metadata not strings", {"__metadata__": {"step": 3}}, 0, None, "not an object of strings"),
    ("a header that is no object", [1, 2], 0, None, "a JSON list, not an object"),
]


@pytest.mark.parametrize(
    ("header", "data_bytes", "tensor", "match"),
    [case[1:] for case in _LIES],
    ids=[case[0] for case in _LIES],
)
def test_every_lying_header_is_refused_naming_file_and_tensor(
    tmp_path: Path, header: Any, data_bytes: int, tensor: str | None, match: str
) -> None:
    file = _write(tmp_path / "model.safetensors", header, bytes(data_bytes))
    with pytest.raises(ValueError, match=match) as caught:
        open_safetensors(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{file}: ")
    if tensor is not None:
        assert f"tensor {tensor!r}" in message
    assert "\n" not in message
    # The checks are a pure function of the parsed header and the sizes.
    with pytest.raises(ValueError, match=match):
        start = 8 + len(json.dumps(header))
        check_safetensors_header(header, file=file, data_start=start, file_bytes=start + data_bytes)


def test_a_header_without_lies_passes_in_byte_order(tmp_path: Path) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "b": _f32([2], 8, 16),
        "a": _f32([2], 0, 8),
        "empty_inside_a": _f32([0], 4, 4),  # no bytes, so it shares none
        "gap_before_c": _f32([1], 20, 24),  # unreferenced bytes [16, 20) are allowed
    }
    file = _write(tmp_path / "m.safetensors", header, bytes(24))
    entries = read_safetensors_header(file)
    assert [e.name for e in entries] == ["a", "empty_inside_a", "b", "gap_before_c"]
    start = 8 + len(json.dumps(header))
    assert [(e.offset - start, e.num_bytes) for e in entries] == [(0, 8), (4, 0), (8, 8), (20, 4)]


def test_lengths_and_encodings_that_lie_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x01")
    with pytest.raises(ValueError, match=r"x\.safetensors: it is 1 bytes, shorter than the 8"):
        read_safetensors_header(path)
    _write(path, {"a": _f32([1], 0, 4)}, bytes(4), header_bytes=10**6)
    with pytest.raises(ValueError, match=r"header length says 1000000 bytes, but only \d+ follow"):
        read_safetensors_header(path)
    _write(path, {}, header_bytes=MAX_HEADER_BYTES + 1)
    with pytest.raises(ValueError, match="more than the 100000000 safetensors allows"):
        read_safetensors_header(path)
    _write(path, b'{"a": ')
    with pytest.raises(ValueError, match="its header is not valid JSON"):
        read_safetensors_header(path)
    _write(path, b"\xff\xfe{}")
    with pytest.raises(ValueError, match="its header is not valid JSON"):
        read_safetensors_header(path)
    # A tensor listed twice: a parser keeps one, another reader may keep the other.
    _write(path, b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {}}', b"1")
    with pytest.raises(ValueError, match="its header names 'a' twice"):
        read_safetensors_header(path)


def test_a_truncated_file_is_refused_naming_its_last_tensors(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64), "z": torch.ones(64)}, file)
    os.truncate(file, file.stat().st_size - 10)
    with pytest.raises(ValueError, match=r"'z': its bytes \[256, 512\) end past .*truncated"):
        open_safetensors(tmp_path)


def test_a_file_truncated_after_its_check_is_an_error_not_sigbus(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4096), "b": torch.ones(4096), "c": torch.ones(4096)}, file)
    with open_safetensors(tmp_path) as files:
        stream = files.stream()
        name, first = next(stream)
        os.truncate(file, files.entries[1].offset + 100)
        with pytest.raises(ValueError, match="changed while it was read") as caught:
            next(stream)
        message = str(caught.value)
        assert message.startswith(f"{file}: tensor 'b': ") and "\n" not in message
        assert "truncated or rewritten while being read" in message
        assert name == "a" and float(first.sum()) == 4096.0  # what was read stays valid
        with pytest.raises(ValueError, match="tensor 'c'"):
            files.read("c")


def test_a_file_rewritten_in_place_after_its_check_is_an_error(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(16)}, file)
    with open_safetensors(tmp_path) as files:
        status = file.stat()
        os.utime(file, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
        with pytest.raises(ValueError, match="tensor 'a': the file changed while it was read"):
            files.read("a")


def test_bad_folders_and_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        open_safetensors(tmp_path)
    save_file({"t": torch.zeros(1)}, tmp_path / "x.safetensors")
    save_file({"t": torch.zeros(1)}, tmp_path / "y.safetensors")
    with pytest.raises(ValueError, match=r"y\.safetensors: tensor 't': it is in x\.safetensors"):
        open_safetensors(tmp_path)
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_config_dict(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_config_dict(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="has no 'model_type'"):
        load_config_dict(tmp_path)
