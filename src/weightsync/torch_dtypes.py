"""Between weightsync's dtype names (`weightsync.layout.dtypes`) and torch dtypes, and the
raw bytes of a tensor's storage."""

from __future__ import annotations

import torch

from weightsync.layout.dtypes import canonical_dtype_name

_BY_NAME: dict[str, torch.dtype] = {}
"""Names `torch_dtype` resolved (a delta push asks for a name per tensor)."""


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a dtype name, alias or torch dtype (``"bf16"`` -> ``torch.bfloat16``).

    Raises:
        ValueError: not a dtype weightsync moves.
    """
    if isinstance(dtype, torch.dtype):
        canonical_dtype_name(dtype)
        return dtype
    found = _BY_NAME.get(dtype)
    if found is None:
        found = _BY_NAME[dtype] = getattr(torch, canonical_dtype_name(dtype))
    return found


def dtype_name(dtype: torch.dtype | str) -> str:
    """The name of a torch dtype without the prefix (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        ValueError: not a dtype weightsync moves.
    """
    return canonical_dtype_name(dtype)


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s whole storage as a 1-D uint8 tensor (a view of the same memory, on the
    tensor's device)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )
