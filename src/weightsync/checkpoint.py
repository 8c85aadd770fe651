"""Reading an HF checkpoint folder: its config.json, and its safetensors as zero-copy views.

`open_safetensors` maps every ``*.safetensors`` file of a folder read-only and returns each
tensor as a view into the mapping: nothing is read until a byte is used, and pages the kernel
evicts are read again from the file, so pushing a checkpoint larger than memory works.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path
from typing import Any

import torch

from weightsync.layout.dtypes import canonical_dtype_name

# The safetensors dtype codes, by torch name.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I8": "int8",
    "U8": "uint8",
}


def load_config_dict(path: str | Path) -> dict[str, Any]:
    """Read a config.json, given the file or the checkpoint folder that holds it.

    Raises:
        ValueError: no config.json there, or it has no `model_type`.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json at {path}: pass a config.json or a checkpoint folder")
    data = json.loads(file.read_text())
    if "model_type" not in data:
        raise ValueError(f"{file} has no 'model_type'; is it a Hugging Face config.json?")
    return data


def open_safetensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in `folder`, as read-only views of the
    files mapped into memory (by HF name, in file order).

    Raises:
        ValueError: no safetensors file, a file that is not safetensors, a dtype weightsync
            does not move, or a tensor name found in two files.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}: pass an HF checkpoint folder")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in _open_file(file).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in two files of {folder} (again in {file})")
            tensors[name] = tensor
    return tensors


def _open_file(file: Path) -> dict[str, torch.Tensor]:
    with open(file, "rb") as handle:
        size = file.stat().st_size
        if size < 8:
            raise ValueError(f"{file} is not a safetensors file (too short)")
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    (header_bytes,) = struct.unpack("<Q", mapping[:8])
    if 8 + header_bytes > size:
        raise ValueError(f"{file} is not a safetensors file (header past the end)")
    try:
        header = json.loads(mapping[8 : 8 + header_bytes])
    except ValueError as exc:
        raise ValueError(f"{file} is not a safetensors file: {exc}") from exc
    base = 8 + header_bytes
    buffer = memoryview(mapping)
    tensors: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # The mapping is read-only by design; torch warns that it cannot write through it.
        warnings.simplefilter("ignore", UserWarning)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            code = entry.get("dtype")
            if code not in _SAFETENSORS_DTYPES:
                raise ValueError(
                    f"{file}: tensor {name!r} has dtype {code!r}, which weightsync does not move"
                )
            dtype = getattr(torch, canonical_dtype_name(_SAFETENSORS_DTYPES[code]))
            start, stop = entry["data_offsets"]
            shape = tuple(entry["shape"])
            if stop == start:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            flat = torch.frombuffer(buffer[base + start : base + stop], dtype=dtype)
            tensors[name] = flat.view(shape)
    return tensors
