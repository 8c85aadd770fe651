"""Dtype names: weightsync passes dtypes as torch names without the ``torch.`` prefix.

This is the one table of dtypes weightsync moves (their element sizes) and of the spellings
users type for them; everything else, torch included, is converted through it.
"""

from __future__ import annotations

from typing import Any

# Element sizes of the dtypes weightsync moves, by their torch names without the prefix.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "float64": 8,
}

FLOAT_DTYPES: frozenset[str] = frozenset(
    {"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float64"}
)

# Spellings users type on command lines and in configs, mapped to the canonical names.
DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
}

# The dtypes a rollout serves from the command line (`weightsync serve --dtype`, the demo).
ROLLOUT_DTYPE_CHOICES: tuple[str, ...] = ("bf16", "fp16", "fp32")


def canonical_dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype: a name, an alias or a torch dtype.

    ``"torch.bfloat16"``, ``"bf16"`` and ``torch.bfloat16`` all give ``"bfloat16"``.

    Raises:
        ValueError: the dtype is not one weightsync moves.
    """
    if dtype is None or isinstance(dtype, bool | int | float):
        raise ValueError(f"expected a dtype or dtype name, got {dtype!r}")
    key = str(dtype).strip().lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPE_SIZES)}")
    return key


def resolve_dtype_name(dtype: Any) -> str:
    """The canonical name of a model dtype, checked to be floating point.

    Model weights are floating point; an integer dtype here is a caller's mistake.

    Raises:
        ValueError: unknown dtype, or not a floating-point dtype.
    """
    name = canonical_dtype_name(dtype)
    if name not in FLOAT_DTYPES:
        raise ValueError(f"model dtype must be floating point, got {name!r}")
    return name


def dtype_size(dtype: Any) -> int:
    """Bytes per element of a dtype (a name, an alias or a torch dtype).

    Raises:
        ValueError: the dtype is not one weightsync moves.
    """
    return DTYPE_SIZES[canonical_dtype_name(dtype)]
