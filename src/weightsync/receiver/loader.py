"""The engine-side loader: HF tensors cut into exactly what one SGLang rank holds.

Two entry points apply `weightsync.layout.rank_layout`'s rule to real tensors:
`shard_state_dict` builds a rank's parameters from a full HF state dict (what a checkpoint
load leaves), and `load_hf_tensors` copies HF tensors one by one into a rank's existing
parameters, in place (what an engine's ``load_weights`` does when weights arrive by name: a
checkpoint shard, or a broadcast bucket). A full set of tensors loaded either way leaves the
same bytes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.layout.config import ModelDims, model_dims
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.table import (
    _hf_shapes,
    _rank_layout,
    as_parallelism,
    hf_tensor_shapes,
    rank_layout,
    rollout_dtype_name,
)
from weightsync.layout.types import ParamLayout
from weightsync.torch_dtypes import torch_dtype


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
                copy_box(flat, target.dst_offset, target.numel, tensor, target.src_box)
                if target.param_name not in padded:
                    padded.add(target.param_name)
                    _zero_padding(flat, index.layouts[target.param_name])
    return num_used


def copy_box(
    flat: torch.Tensor,
    dst_offset: int,
    numel: int,
    tensor: torch.Tensor,
    src_box: tuple[tuple[int, int], ...],
) -> None:
    """Copy box `src_box` of `tensor`, read row-major and cast, into elements
    ``[dst_offset, dst_offset + numel)`` of the flat parameter view `flat`."""
    box = tensor[tuple(slice(start, stop) for start, stop in src_box)]
    flat[dst_offset : dst_offset + numel].view(box.shape).copy_(box)


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


# transformers 5 keeps a MoE layer's experts in memory as two stacked tensors
# (`mlp.experts.gate_up_proj` [E, 2*I, H] with gate rows first, `mlp.experts.down_proj`
# [E, H, I]) and writes them per expert only when saving. A model's own state_dict() can
# therefore be loaded too.
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


class _HFSource:
    """Looks up HF tensors by checkpoint name, checking presence and shape once per name."""

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor],
        dims: ModelDims,
        expected: Mapping[str, tuple[int, ...]],
        parallelism: ParallelismConfig,
    ) -> None:
        self._state_dict = state_dict
        self._dims = dims
        self._expected = expected
        self._parallelism = parallelism
        self._checked: dict[str, torch.Tensor] = {}

    def _where(self, param_name: str) -> str:
        p = self._parallelism
        return (
            f"rollout rank tp_rank={p.tp_rank}/{p.tp_size} (ep_rank={p.ep_rank}) for {param_name}"
        )

    def _stacked_expert(self, hf_name: str) -> torch.Tensor | None:
        match = _EXPERT_RE.match(hf_name)
        if match is None:
            return None
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        dims = self._dims
        num_experts, hidden, inter = dims.num_experts, dims.hidden_size, dims.moe_intermediate_size
        stacked_name = prefix + ("down_proj" if proj == "down" else "gate_up_proj")
        stacked = self._state_dict.get(stacked_name)
        if stacked is None:
            return None
        expected = (
            (num_experts, hidden, inter) if proj == "down" else (num_experts, 2 * inter, hidden)
        )
        if tuple(stacked.shape) != expected:
            raise ValueError(
                f"HF tensor {stacked_name!r} has shape {tuple(stacked.shape)}, expected {expected}"
            )
        if proj == "gate":
            return stacked[expert, :inter]
        if proj == "up":
            return stacked[expert, inter:]
        return stacked[expert]

    def get(self, hf_name: str, param_name: str) -> torch.Tensor:
        """HF tensor ``hf_name``, which parameter ``param_name`` needs.

        Raises:
            ValueError: the tensor is missing, not a tensor, or has the wrong shape.
        """
        tensor = self._checked.get(hf_name)
        if tensor is not None:
            return tensor
        tensor = self._state_dict.get(hf_name)
        if tensor is None:
            tensor = self._stacked_expert(hf_name)
        if tensor is None:
            raise ValueError(
                f"HF tensor {hf_name!r} is missing from the state dict; {self._where(param_name)} "
                "needs it"
            )
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"HF tensor {hf_name!r} is a {type(tensor).__name__}, not a torch.Tensor"
            )
        expected = self._expected[hf_name]
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"HF tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                f"({self._where(param_name)})"
            )
        self._checked[hf_name] = tensor
        return tensor


def shard_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    parallelism: ParallelismConfig | Mapping[str, Any],
    dtype: torch.dtype | str | None = None,
    *,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Exactly what SGLang's loader leaves on one rank, from a full HF state dict.

    Each parameter is allocated once and filled by copying boxes of the HF tensors straight
    into it (cast to the rollout dtype), following `rank_layout`; padding is zero. Extra
    tensors in ``hf_state_dict`` are ignored. Per-expert tensors may also come stacked, as a
    transformers 5 MoE model holds them in memory (``mlp.experts.gate_up_proj`` /
    ``mlp.experts.down_proj``).

    Args:
        hf_state_dict: HF checkpoint names to tensors (any dtype, any device).
        hf_config: a transformers config object or a config.json dict.
        parallelism: the rank's `ParallelismConfig`, or a dict of its fields.
        dtype: the rollout dtype (torch dtype or name); None or ``"auto"`` for the config's
            dtype (float32 if it names none).
        device: where to allocate the parameters; default CPU.

    Returns:
        ``{param_name: tensor}`` in `rank_layout` order, with its names, shapes and dtype.

    Raises:
        ValueError: a needed HF tensor is missing (the message names it and the rank) or has
            the wrong shape (expected and actual), or as for `rank_layout`.
    """
    dims = model_dims(hf_config)
    par = as_parallelism(parallelism)
    layouts = rank_layout(hf_config, par, dtype)
    source = _HFSource(hf_state_dict, dims, hf_tensor_shapes(hf_config), par)
    target_device = torch.device(device) if device is not None else torch.device("cpu")
    params: dict[str, torch.Tensor] = {}
    for name, layout in layouts.items():
        param = torch.empty(layout.shape, dtype=torch_dtype(layout.dtype), device=target_device)
        flat = param.view(-1)
        for segment in layout.segments:
            if segment.hf_name is None:
                flat[segment.dst_offset : segment.dst_offset + segment.numel].zero_()
                continue
            src = source.get(segment.hf_name, name)
            copy_box(flat, segment.dst_offset, segment.numel, src, segment.src_box)
        params[name] = param
    return params
