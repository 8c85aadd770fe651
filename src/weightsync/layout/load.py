"""The engine-side loader: HF tensors copied one by one into a rank's existing parameters.

This is what an inference engine's ``load_weights`` does when weights arrive by name (a
checkpoint shard, or a broadcast bucket): each HF tensor is looked up in the rank's layout and
the boxes the rank holds are copied into the parameters in place, whatever other tensors came
before or come later. The rule is `rank_layout`'s, so a full set of tensors loaded this way
leaves exactly what `shard_state_dict` builds.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.layout.config import ModelDims, model_dims
from weightsync.layout.dtypes import torch_dtype
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.table import _hf_shapes, _rank_layout, as_parallelism, rollout_dtype_name
from weightsync.layout.types import ParamLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadTarget:
    """Where one box of an HF tensor goes on this rank.

    Attributes:
        param_name: the engine parameter.
        dst_offset: first element of the run in the flattened parameter.
        numel: elements in the run.
        src_box: ``(start, stop)`` per dim of the HF tensor.
    """

    param_name: str
    dst_offset: int
    numel: int
    src_box: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadIndex:
    """A rank's layout inverted: per HF tensor, the runs of parameters it fills.

    Attributes:
        targets: ``{hf_name: (LoadTarget, ...)}`` for every tensor of the checkpoint; empty
            for tensors this rank holds none of (another EP rank's experts).
        layouts: the rank's parameter table (`rank_layout`).
        hf_shapes: every checkpoint tensor's shape (`hf_tensor_shapes`).
    """

    targets: dict[str, tuple[LoadTarget, ...]]
    layouts: dict[str, ParamLayout]
    hf_shapes: dict[str, tuple[int, ...]]


@functools.lru_cache(maxsize=64)
def _index(dims: ModelDims, parallelism: ParallelismConfig, dtype: str) -> LoadIndex:
    layouts = {layout.name: layout for layout in _rank_layout(dims, parallelism, dtype)}
    hf_shapes = dict(_hf_shapes(dims))
    targets: dict[str, list[LoadTarget]] = {name: [] for name in hf_shapes}
    for layout in layouts.values():
        for segment in layout.segments:
            if segment.hf_name is not None:
                targets[segment.hf_name].append(
                    LoadTarget(
                        param_name=layout.name,
                        dst_offset=segment.dst_offset,
                        numel=segment.numel,
                        src_box=segment.src_box,
                    )
                )
    return LoadIndex(
        targets={name: tuple(runs) for name, runs in targets.items()},
        layouts=layouts,
        hf_shapes=hf_shapes,
    )


def load_index(
    hf_config: Any,
    parallelism: ParallelismConfig | Mapping[str, Any],
    dtype: torch.dtype | str | None = None,
) -> LoadIndex:
    """The rank's layout inverted by HF tensor (cached per model, rank and dtype).

    Raises:
        ValueError: as for `rank_layout`.
    """
    dims = model_dims(hf_config)
    return _index(dims, as_parallelism(parallelism), rollout_dtype_name(dims, dtype))


def load_hf_tensors(
    params: Mapping[str, torch.Tensor],
    hf_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    hf_config: Any,
    parallelism: ParallelismConfig | Mapping[str, Any],
    dtype: torch.dtype | str | None = None,
) -> int:
    """Copy HF tensors, one at a time, into the parts of `params` this rank holds.

    Any subset of the checkpoint may come, in any order: each tensor fills its runs of the
    rank's parameters (cast to the parameter's dtype) and nothing else. A tensor of which the
    rank holds nothing (another expert-parallel rank's expert) is skipped. The padding of
    every parameter a tensor touches is zeroed, as engines' weight loaders zero the padding
    rows of the vocabulary. Parameters are written in place; their memory does not move.

    A mapping or a sequence is checked whole before anything is copied; an iterator (tensors
    generated one at a time) is checked tensor by tensor.

    Args:
        params: the rank's parameters by engine name (`rank_layout`'s names and shapes).
        hf_tensors: HF checkpoint names to full tensors (a mapping or ``(name, tensor)``
            pairs).
        hf_config: a transformers config object or a config.json dict.
        parallelism: the rank's `ParallelismConfig`, or a dict of its fields.
        dtype: the rollout dtype; None or ``"auto"`` for the config's.

    Returns:
        How many of the tensors this rank used.

    Raises:
        ValueError: a name that is not a tensor of the checkpoint, a tensor of the wrong
            shape, or a parameter missing from `params` or of the wrong shape or dtype (the
            message names it and the rank).
    """
    index = load_index(hf_config, parallelism, dtype)
    par = as_parallelism(parallelism)
    where = f"rollout rank tp_rank={par.tp_rank}/{par.tp_size} (ep_rank={par.ep_rank})"
    items = hf_tensors.items() if isinstance(hf_tensors, Mapping) else hf_tensors
    if isinstance(items, Sequence | Set):
        # Everything at hand (a received bucket): check it all before the first copy.
        for hf_name, tensor in items:
            _check(index, hf_name, tensor, where)
    padded: set[str] = set()
    num_used = 0
    with torch.no_grad():
        for hf_name, tensor in items:
            targets = _check(index, hf_name, tensor, where)
            if not targets:
                continue
            num_used += 1
            for target in targets:
                flat = _param(params, index.layouts[target.param_name], where).view(-1)
                box = tensor[tuple(slice(start, stop) for start, stop in target.src_box)]
                dst = flat[target.dst_offset : target.dst_offset + target.numel]
                dst.view(box.shape).copy_(box)
                if target.param_name not in padded:
                    padded.add(target.param_name)
                    _zero_padding(flat, index.layouts[target.param_name])
    return num_used


def _check(
    index: LoadIndex, hf_name: str, tensor: torch.Tensor, where: str
) -> tuple[LoadTarget, ...]:
    targets = index.targets.get(hf_name)
    if targets is None:
        raise ValueError(f"{hf_name!r} is not a tensor of this model's checkpoint ({where})")
    expected = index.hf_shapes[hf_name]
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"HF tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {expected} ({where})"
        )
    return targets


def _param(params: Mapping[str, torch.Tensor], layout: ParamLayout, where: str) -> torch.Tensor:
    param = params.get(layout.name)
    if param is None:
        raise ValueError(f"parameter {layout.name!r} is missing from the parameters of {where}")
    if tuple(param.shape) != layout.shape or param.dtype != torch_dtype(layout.dtype):
        raise ValueError(
            f"parameter {layout.name!r} of {where} is {tuple(param.shape)} {param.dtype}; "
            f"the layout says {layout.shape} {layout.dtype}"
        )
    if not param.is_contiguous():
        raise ValueError(f"parameter {layout.name!r} of {where} is not contiguous")
    return param


def _zero_padding(flat: torch.Tensor, layout: ParamLayout) -> None:
    for segment in layout.segments:
        if segment.hf_name is None:
            flat[segment.dst_offset : segment.dst_offset + segment.numel].zero_()
