"""The engine-side loader: an HF state dict cut into exactly what one SGLang rank holds."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.layout.config import ModelDims, model_dims
from weightsync.layout.dtypes import torch_dtype
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.table import as_parallelism, hf_tensor_shapes, rank_layout

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
            dst = flat[segment.dst_offset : segment.dst_offset + segment.numel]
            if segment.hf_name is None:
                dst.zero_()
                continue
            src = source.get(segment.hf_name, name)
            box = src[tuple(slice(start, stop) for start, stop in segment.src_box)]
            dst.view(box.shape).copy_(box)
        params[name] = param
    return params
