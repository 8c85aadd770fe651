"""Tensors shared by reference between processes, as SGLang's ``update_weights_from_tensor``
takes them: a ``ForkingPickler`` payload (SGLang's ``MultiprocessingSerializer``) that holds
a CUDA IPC handle for a GPU tensor, or the name of a shared-memory file for a CPU one; the
receiving process maps the same memory, nothing is copied on the way.

A flattened bucket is SGLang's ``FlattenedTensorBucket`` as a dict: ``flattened_tensor`` (one
uint8 tensor) and ``metadata``, one record per tensor with SGLang's fields (``name``,
``shape``, ``dtype``, ``start_idx``, ``end_idx``, ``numel``; byte offsets). The records are
``types.SimpleNamespace``, which SGLang's safe unpickler admits and its loader reads by
attribute, and so does `load_shared`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import types
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

from weightsync.baseline.flat_bucket import FLATTENED_BUCKET, FlatBucketLayout
from weightsync.torch_dtypes import torch_dtype

# What a payload may name: torch's rebuild functions, storages, dtypes and devices, and
# plain containers; anything else (a callable that runs code) is refused.
_ALLOWED = frozenset(
    {
        ("builtins", name)
        for name in ("bool", "bytes", "dict", "float", "int", "list", "str", "tuple", "slice")
    }
    | {
        ("collections", "OrderedDict"),
        ("copyreg", "__newobj__"),
        ("types", "SimpleNamespace"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch", "dtype"),
        ("torch", "Tensor"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch._utils", "_rebuild_tensor"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    }
)
_DTYPE_NAMES = frozenset(
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise ValueError(
            f"a shared-tensor payload may not name {module}.{name}: only tensors, storages, "
            "dtypes and plain containers are accepted"
        )


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU storages shared by file name while pickling: a file descriptor can only pass to
    a process this one spawned (its authkey), a shared-memory file to any process."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def serialize(obj: Any) -> str:
    """`obj` (tensors inside plain containers) as a base64 ``ForkingPickler`` payload for
    one receiver (each payload holds a reference that the one `deserialize` of it gives
    back: serialize once per receiving process); the tensors must stay alive, unchanged,
    until every receiver loaded them."""
    buffer = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize(payload: str | bytes) -> Any:
    """The object of a `serialize` payload (base64 text, or its bytes), its tensors mapped
    from the sender's memory.

    Raises:
        ValueError: not base64, or a payload that names anything but tensors and plain
            containers.
    """
    try:
        data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
    except ValueError as exc:
        raise ValueError(f"a shared-tensor payload is base64; this one is not: {exc}") from exc
    return _SafeUnpickler(io.BytesIO(data)).load()


def flattened_bucket(buffer: torch.Tensor, layout: FlatBucketLayout) -> dict[str, Any]:
    """SGLang's flattened bucket: the tensors of `layout` in `buffer` (uint8, at least
    ``layout.num_bytes``)."""
    metadata = [
        types.SimpleNamespace(
            name=span.name,
            shape=tuple(span.shape),
            dtype=torch_dtype(span.dtype),
            start_idx=span.offset_bytes,
            end_idx=span.offset_bytes + span.num_bytes,
            numel=span.num_bytes,
        )
        for span in layout.spans
    ]
    return {"flattened_tensor": buffer[: layout.num_bytes], "metadata": metadata}


def named_tensors(obj: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a deserialized payload: a flattened bucket's views
    (``load_format="flattened_bucket"``), or the payload's own list of pairs (``None``).

    Raises:
        ValueError: an unknown load format, or a payload not of its shape.
    """
    if load_format == FLATTENED_BUCKET:
        if not isinstance(obj, dict) or {"flattened_tensor", "metadata"} - set(obj):
            raise ValueError(
                "a flattened_bucket payload is {'flattened_tensor': uint8 tensor, 'metadata': "
                "[...]}"
            )
        flat = obj["flattened_tensor"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
            raise ValueError("a flattened bucket's flattened_tensor is a 1-D uint8 tensor")
        pairs = []
        for meta in obj["metadata"]:
            if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
                raise ValueError(
                    f"tensor {meta.name!r} lies at bytes {meta.start_idx}..{meta.end_idx} of a "
                    f"flattened bucket of {flat.numel()}"
                )
            view = flat[meta.start_idx : meta.end_idx].view(meta.dtype).view(tuple(meta.shape))
            pairs.append((str(meta.name), view))
        return pairs
    if load_format is None:
        if not isinstance(obj, list | tuple) or not all(
            isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[1], torch.Tensor)
            for p in obj
        ):
            raise ValueError("a payload without load_format is a list of (name, tensor) pairs")
        return [(str(name), tensor) for name, tensor in obj]
    raise ValueError(
        f"load_format {load_format!r} is not supported; use {FLATTENED_BUCKET!r} or null"
    )
