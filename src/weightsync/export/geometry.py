"""Reading a `weightsync.plan.TensorGeometry` off real tensors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from weightsync.layout.dtypes import canonical_dtype_name
from weightsync.plan.geometry import StreamGeometry, TensorGeometry

# Name lookups cost more than the rest of a geometry; a stream has a handful of each.
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_DEVICE_NAMES: dict[torch.device, str] = {}


def tensor_geometry(tensor: Any, storages: dict[int, int], index: int) -> TensorGeometry:
    """The geometry of stream tensor number `index`.

    Args:
        tensor: the tensor.
        storages: ``{storage address: stream index of its first tensor}`` of the stream so
            far; updated with this tensor's storage.
        index: the tensor's stream index.

    Raises:
        ValueError: not a dense (strided) tensor with data: a sparse or meta tensor, or not a
            tensor at all.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"a {type(tensor).__name__}, not a torch.Tensor")
    device = tensor.device
    if tensor.layout is not torch.strided or device.type == "meta":
        raise ValueError(
            f"a {tensor.layout} tensor on {device}; the sender copies dense (strided) tensors "
            "with data"
        )
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        dtype_name = _DTYPE_NAMES[tensor.dtype] = canonical_dtype_name(tensor.dtype)
    device_name = _DEVICE_NAMES.get(device)
    if device_name is None:
        device_name = _DEVICE_NAMES[device] = str(device)
    storage = storages.setdefault(tensor.untyped_storage().data_ptr(), index)
    return TensorGeometry(
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        dtype_name,
        device_name,
        storage,
    )


def stream_geometry(tensors: Iterable[tuple[str, Any]]) -> StreamGeometry:
    """The geometry of a whole ``(key, tensor)`` stream (nothing is copied).

    Raises:
        ValueError: a key repeats, or an entry is not a dense tensor with data (naming it).
    """
    keys: list[str] = []
    geometries: list[TensorGeometry] = []
    storages: dict[int, int] = {}
    for key, tensor in tensors:
        try:
            geometries.append(tensor_geometry(tensor, storages, len(keys)))
        except ValueError as exc:
            raise ValueError(f"tensor {key!r} of the export's stream is {exc}") from None
        keys.append(key)
    return StreamGeometry(keys=tuple(keys), tensors=tuple(geometries))
