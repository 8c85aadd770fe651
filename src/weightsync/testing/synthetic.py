"""Seeded synthetic trainer weights: a rank's PP-local export without a model or checkpoint.

The replicas of a benchmark serve ``--load-format dummy --seed S``: the same seeded tensors
(`weightsync.engine.synthetic`), generated where they live. A trainer rank generates its
pipeline stage's tensors the same way, so a sync moves real bytes whose expected result every
replica already holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from weightsync.engine.synthetic import synthetic_hf_tensors, synthetic_tensor
from weightsync.export import ModelExport
from weightsync.layout import hf_tensor_shapes
from weightsync.torch_dtypes import torch_dtype

__all__ = ["synthetic_export", "synthetic_hf_tensors", "synthetic_tensor"]


_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def synthetic_export(
    hf_config: Any,
    *,
    seed: int,
    dtype: torch.dtype | str,
    device: torch.device | str = "cpu",
    pp_rank: int = 0,
    pp_size: int = 1,
    fused_experts: bool = False,
    values: bool = True,
) -> ModelExport:
    """Pipeline stage `pp_rank` of `pp_size` of the model's synthetic weights, as an export.

    Only the stage's tensors are generated (on `device`, in `dtype`).

    Args:
        hf_config: the model's config.
        seed: the synthetic weights' seed.
        dtype: the trainer's dtype.
        device: where the trainer holds them.
        pp_rank: the pipeline stage.
        pp_size: pipeline stages.
        fused_experts: hold each layer's routed experts as two fused tensors
            (``experts.gate_up_proj`` of shape ``(E, 2 * I, H)`` and ``experts.down_proj``
            of ``(E, H, I)``), as transformers' MoE models and Megatron's grouped experts do;
            the stream yields the same per-expert HF tensors, as views of them. Default: one
            tensor per expert and projection.
        values: fill the tensors with the seeded values; False leaves their memory
            uninitialised (nothing is generated), for what depends only on how the stream
            lies in memory: its geometry, and the push programs lowered for it.

    Raises:
        ValueError: bad stage numbers or config.
    """
    shapes = hf_tensor_shapes(hf_config)
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    names = [
        name for name, _ in ModelExport(meta, pp_rank=pp_rank, pp_size=pp_size, hf_config=hf_config)
    ]
    if values:
        tensors = synthetic_hf_tensors(
            hf_config, seed=seed, dtype=dtype, device=device, names=names
        )
    else:
        empty = torch_dtype(dtype)
        tensors = iter([(n, torch.empty(shapes[n], dtype=empty, device=device)) for n in names])
    state = _fused(tensors, shapes) if fused_experts else dict(tensors)
    return ModelExport(state, pp_rank=pp_rank, pp_size=pp_size, hf_config=hf_config)


def _fused(
    tensors: Iterator[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The stream with each layer's per-expert tensors copied into two fused ones (placed
    where the layer's first expert tensor was)."""
    counts: dict[str, int] = {}
    for name in shapes:
        match = _EXPERT_RE.match(name)
        if match is not None:
            counts[match.group(1)] = max(counts.get(match.group(1), 0), int(match.group(2)) + 1)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        match = _EXPERT_RE.match(name)
        if match is None:
            state[name] = tensor
            continue
        prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
        if kind == "down_proj":
            key = f"{prefix}.down_proj"
            if key not in state:
                state[key] = tensor.new_empty((counts[prefix], *tensor.shape))
            state[key][expert].copy_(tensor)
            continue
        key = f"{prefix}.gate_up_proj"
        rows = tensor.shape[0]
        if key not in state:
            state[key] = tensor.new_empty((counts[prefix], 2 * rows, *tensor.shape[1:]))
        half = slice(0, rows) if kind == "gate_proj" else slice(rows, 2 * rows)
        state[key][expert, half].copy_(tensor)
    return state
