"""Seeded synthetic HF weights, generated tensor by tensor without a checkpoint file.

Benchmarks of large models cannot build a transformers model or write tens of gigabytes of
safetensors first. Instead, every process that needs the weights (trainer ranks, rollout
ranks started with ``weightsync serve --load-format dummy --seed S``) generates them: each HF
tensor from its own generator, seeded by the seed and the tensor's name, so any process can
produce any tensor alone, in any order, and gets the same bytes as every other process that
generates on the same kind of device.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from weightsync.layout import hf_tensor_shapes
from weightsync.torch_dtypes import torch_dtype

# Values are uniform in [-_SCALE, _SCALE] (norm weights around 1), small enough that a forward
# pass over synthetic weights stays finite.
_SCALE = 0.05


def synthetic_seed(seed: int, hf_name: str) -> int:
    """The generator seed of tensor `hf_name` (stable across processes and Python runs)."""
    return (seed * 1_000_003 + zlib.crc32(hf_name.encode())) % (1 << 63)


def synthetic_tensor(
    hf_name: str,
    shape: tuple[int, ...],
    *,
    seed: int,
    dtype: torch.dtype | str,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """One synthetic HF tensor: the same bytes for the same name, shape, seed, dtype and
    device type.

    Args:
        hf_name: the checkpoint name (part of the seed).
        shape: the tensor's shape.
        seed: the model's seed.
        dtype: the dtype of the result (values are drawn in float32, then cast).
        device: where to generate; CPU and CUDA generators give different values.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(synthetic_seed(seed, hf_name))
    values = torch.empty(shape, dtype=torch.float32, device=device)
    values.uniform_(-_SCALE, _SCALE, generator=generator)
    if hf_name.endswith("norm.weight"):
        values.add_(1.0)
    target = dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype)
    return values.to(target)


def synthetic_hf_tensors(
    hf_config: Any,
    *,
    seed: int,
    dtype: torch.dtype | str,
    device: torch.device | str = "cpu",
    names: Iterable[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the model's synthetic HF tensors one at a time, in checkpoint order.

    Args:
        hf_config: a transformers config object or a config.json dict.
        seed: the model's seed.
        dtype: the tensors' dtype.
        device: where to generate them.
        names: only these tensors (default: every tensor of the checkpoint).

    Raises:
        ValueError: a name that is not a tensor of the model's checkpoint.
    """
    shapes = hf_tensor_shapes(hf_config)
    wanted = list(shapes) if names is None else list(names)
    unknown = [name for name in wanted if name not in shapes]
    if unknown:
        raise ValueError(f"not tensors of this model's checkpoint: {unknown[:5]}")
    for name in wanted:
        yield name, synthetic_tensor(name, shapes[name], seed=seed, dtype=dtype, device=device)
