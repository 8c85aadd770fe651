"""An FSDP2 rank as a source: the rows of each HF tensor its shards hold, zero-copy.

``torch.distributed.fsdp.fully_shard`` keeps a transformers model's parameter names and
turns every parameter into a DTensor sharded over the mesh, by default ``Shard(0)``: rank
``r`` holds rows ``[off, off + n)`` (torch.chunk's split, the last ranks holding fewer rows,
maybe none). `FSDPExport` reads each shard's offset from its DTensor (no communication) and
streams ``to_local()``, a view of FSDP's own storage, as the box it holds. transformers keeps a
MoE layer's experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
``[E, H, I]``); sharded by rows they hold whole experts, streamed as the per-expert checkpoint
tensors (views).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.export.pieces import HeldPiece, PiecesExport
from weightsync.layout.names import EMBED_TOKENS, LM_HEAD

_FUSED_RE = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def shard_box(tensor: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """The box of the global tensor a DTensor's local shard holds (None: empty), read from
    its placements without communication; a plain tensor holds the whole.

    Raises:
        ValueError: a placement whose shard is not one box (a strided shard, a partial sum).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tuple((0, d) for d in tensor.shape)
    for placement in tensor.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"a DTensor placed as {tensor.placements}: FSDPExport reads Shard and "
                "Replicate placements, whose local shard is one box of the tensor"
            )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    if any(n == 0 for n in local_shape):
        return None
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offset, local_shape, strict=True))


def fsdp_pieces(model: torch.nn.Module, *, tied: bool | None = None) -> list[HeldPiece]:
    """The boxes of HF tensors this rank's shards hold, in the model's parameter order.

    Args:
        model: a transformers causal LM (or any module whose parameter names are HF names)
            after ``fully_shard``; parameters that are not DTensors count as held whole.
        tied: the HF ``tie_word_embeddings`` (then ``lm_head.weight`` is not streamed);
            default: whether the two share memory.

    Raises:
        ValueError: a shard that is not one box, or a fused expert tensor not sharded by
            whole experts.
    """
    state = model.state_dict(keep_vars=True)
    if tied is None:
        head, embed = state.get(LM_HEAD), state.get(EMBED_TOKENS)
        tied = head is not None and embed is not None and head is embed
    pieces: list[HeldPiece] = []
    for name, tensor in state.items():
        if tied and name == LM_HEAD:
            continue
        try:
            box = shard_box(tensor)
        except ValueError as exc:
            raise ValueError(f"parameter {name!r} is {exc}") from None
        if box is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        shape = tuple(tensor.shape)
        fused = _FUSED_RE.match(name)
        if fused is None or len(shape) != 3:
            window = tuple((0, stop - start) for start, stop in box)
            pieces.append(
                HeldPiece(
                    param_name=name,
                    hf_name=name,
                    hf_shape=shape,
                    box=box,
                    window=window,
                    param=local,
                )
            )
            continue
        if any(b != (0, d) for b, d in zip(box[1:], shape[1:], strict=True)):
            raise ValueError(
                f"parameter {name!r} is sharded as {box} of {shape}: FSDPExport needs fused "
                "experts sharded by whole experts (Shard(0))"
            )
        pieces += _expert_pieces(fused.group(1), fused.group(2), name, shape, box[0], local)
    return pieces


def _expert_pieces(
    prefix: str,
    kind: str,
    name: str,
    shape: tuple[int, ...],
    experts: tuple[int, int],
    local: torch.Tensor,
) -> list[HeldPiece]:
    """Per-expert checkpoint tensors of whole experts ``[start, stop)`` of a fused tensor."""
    pieces = []
    for expert in range(*experts):
        index = expert - experts[0]
        if kind == "down_proj":
            full = tuple((0, d) for d in shape[1:])
            pieces.append(
                HeldPiece(
                    param_name=name,
                    hf_name=f"{prefix}.{expert}.down_proj.weight",
                    hf_shape=tuple(shape[1:]),
                    box=full,
                    window=(index, *full),
                    param=local,
                )
            )
            continue
        half, hidden = shape[1] // 2, shape[2]
        for proj, rows in (("gate_proj", (0, half)), ("up_proj", (half, 2 * half))):
            pieces.append(
                HeldPiece(
                    param_name=name,
                    hf_name=f"{prefix}.{expert}.{proj}.weight",
                    hf_shape=(half, hidden),
                    box=((0, half), (0, hidden)),
                    window=(index, rows, (0, hidden)),
                    param=local,
                )
            )
    return pieces


class FSDPExport(PiecesExport):
    """An FSDP2 rank's shards as a `weightsync.WeightExport`: each HF tensor's rows it holds.

    Every rank holds all layers' shards, so there is no stage filter; the stream yields each
    shard (or per-expert tensor of it) as a view of FSDP's storage. Sync between optimizer
    steps, with the parameters sharded (after a step, not between a forward's unshard and its
    reshard). Nothing here communicates.
    """

    def __init__(self, model: torch.nn.Module, *, hf_config: Any = None) -> None:
        """Describe the export; nothing is read until `holding` or iteration.

        Args:
            model: the ``fully_shard``-ed transformers model.
            hf_config: its HF config (object or dict), for ``tie_word_embeddings``; default
                ``model.config``.
        """
        super().__init__()
        self._model = model
        config = hf_config if hf_config is not None else getattr(model, "config", None)
        tied = config.get("tie_word_embeddings") if isinstance(config, Mapping) else None
        if config is not None and not isinstance(config, Mapping):
            tied = getattr(config, "tie_word_embeddings", None)
        self._tied = None if tied is None else bool(tied)

    def pieces(self) -> list[HeldPiece]:
        """The rows each local shard holds (per expert for fused experts)."""
        return fsdp_pieces(self._model, tied=self._tied)

    def memory_key(self) -> tuple:
        """The local shards' names, addresses, shapes, strides and dtypes."""
        key = []
        for name, tensor in self._model.state_dict(keep_vars=True).items():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            key.append((name, local.data_ptr(), local.shape, local.stride(), local.dtype))
        return tuple(key)
