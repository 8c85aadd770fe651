"""Dtype names: weightsync passes dtypes as torch names without the ``torch.`` prefix."""

from __future__ import annotations

import torch

from weightsync.layout.types import DTYPE_SIZES

# Spellings users type on command lines and in configs, mapped to the canonical names.
_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


def canonical_dtype_name(name: str) -> str:
    """The canonical name of a dtype spelling (``"torch.bfloat16"``, ``"bf16"`` -> ``"bfloat16"``).

    Raises:
        ValueError: the name is not a dtype weightsync moves.
    """
    if not isinstance(name, str):
        raise ValueError(f"dtype name must be a string, got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPE_SIZES)}")
    return key


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name (``"bfloat16"`` -> ``torch.bfloat16``).

    Args:
        name: a canonical name, a ``torch.``-prefixed name or an alias such as ``"bf16"``.

    Raises:
        ValueError: the name is not a dtype weightsync moves.
    """
    return getattr(torch, canonical_dtype_name(name))


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype without the prefix (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        ValueError: ``dtype`` is not a torch dtype weightsync moves.
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"expected a torch.dtype, got {dtype!r}")
    return canonical_dtype_name(str(dtype))


def resolve_dtype_name(dtype: torch.dtype | str) -> str:
    """The canonical name of a torch dtype or dtype name, checked to be floating point.

    Model weights are floating point; an integer dtype here is a caller's mistake.

    Raises:
        ValueError: unknown dtype, or not a floating-point dtype.
    """
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else canonical_dtype_name(dtype)
    if not torch_dtype(name).is_floating_point:
        raise ValueError(f"model dtype must be floating point, got {name!r}")
    return name
