"""Seeded synthetic trainer weights: a rank's PP-local export without a model or checkpoint.

The replicas of a benchmark serve ``--load-format dummy --seed S``: the same seeded tensors
(`weightsync.engine.synthetic`), generated where they live. A trainer rank generates its
pipeline stage's tensors the same way, so a sync moves real bytes whose expected result every
replica already holds.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.engine.synthetic import synthetic_hf_tensors, synthetic_tensor
from weightsync.export import ModelExport
from weightsync.layout import hf_tensor_shapes

__all__ = ["synthetic_export", "synthetic_hf_tensors", "synthetic_tensor"]


def synthetic_export(
    hf_config: Any,
    *,
    seed: int,
    dtype: torch.dtype | str,
    device: torch.device | str = "cpu",
    pp_rank: int = 0,
    pp_size: int = 1,
) -> ModelExport:
    """Pipeline stage `pp_rank` of `pp_size` of the model's synthetic weights, as an export.

    Only the stage's tensors are generated (on `device`, in `dtype`).

    Raises:
        ValueError: bad stage numbers or config.
    """
    shapes = hf_tensor_shapes(hf_config)
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    names = [
        name for name, _ in ModelExport(meta, pp_rank=pp_rank, pp_size=pp_size, hf_config=hf_config)
    ]
    tensors = dict(
        synthetic_hf_tensors(hf_config, seed=seed, dtype=dtype, device=device, names=names)
    )
    return ModelExport(tensors, pp_rank=pp_rank, pp_size=pp_size, hf_config=hf_config)
