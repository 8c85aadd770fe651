"""A trainer model as the PP-local ``(hf_name, tensor)`` stream the sender consumes.

The stream uses the HF checkpoint's names with global layer numbers and yields views of the
model's own tensors, never copies. transformers 5 keeps a MoE layer's experts fused in memory
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` with each expert's gate rows before its up rows,
``mlp.experts.down_proj`` ``[E, H, I]``) while checkpoints store one tensor per expert; the
stream yields the per-expert checkpoint tensors as views of the fused ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from weightsync.export.base import ViewExport
from weightsync.layout.names import EMBED_TOKENS, LM_HEAD
from weightsync.plan import stage_layers
from weightsync.plan.types import TensorMeta

_LAYER_RE = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")
_FUSED_GATE_UP_RE = re.compile(r"^(.*\.experts)\.gate_up_proj$")
_FUSED_DOWN_RE = re.compile(r"^(.*\.experts)\.down_proj$")


class ModelExport(ViewExport):
    """One pipeline stage of a model as a re-iterable ``(hf_name, tensor)`` stream.

    A `weightsync.WeightExport`: its geometry is read once and kept while the model's
    tensors stay where they are (same names, addresses, shapes, strides and dtypes).

    Stage ``pp_rank`` of ``pp_size`` holds a contiguous slice of the decoder layers
    (`weightsync.plan.stage_layers`, the split the plan's simulator uses); stage 0 also holds
    ``model.embed_tokens.weight``; the last stage holds ``model.norm.weight`` and
    ``lm_head.weight`` (with tied embeddings there is no ``lm_head.weight``, and the last
    stage holds ``model.embed_tokens.weight`` as well, as its output layer uses it).

    Two kinds of model are accepted: one that holds every layer, numbered globally
    (``layer_offset=0``; layers of other stages are skipped), and one that holds only its
    stage's layers numbered from 0 (pass the stage's first global layer as `layer_offset`;
    every layer must then land in the stage).
    """

    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        pp_rank: int = 0,
        pp_size: int = 1,
        layer_offset: int = 0,
        hf_config: Any = None,
    ) -> None:
        """Describe the export; nothing is read until iteration.

        Args:
            model: a transformers causal LM (or any module whose state dict uses HF names),
                or such a state dict.
            pp_rank: this pipeline stage.
            pp_size: number of pipeline stages.
            layer_offset: added to the module's layer numbers to make them global.
            hf_config: the model's config (object or dict); default ``model.config``. Needed
                for ``pp_size > 1`` (the number of layers) and for tied embeddings.

        Raises:
            ValueError: bad stage numbers, a negative offset, or ``pp_size > 1`` without a
                config.
        """
        if pp_size < 1 or not 0 <= pp_rank < pp_size:
            raise ValueError(
                f"need 0 <= pp_rank < pp_size, got pp_rank={pp_rank}, pp_size={pp_size}"
            )
        if layer_offset < 0:
            raise ValueError(f"layer_offset must be >= 0, got {layer_offset}")
        super().__init__()
        self._model = model
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.layer_offset = layer_offset
        config = hf_config if hf_config is not None else getattr(model, "config", None)
        self._tied = _config_value(config, "tie_word_embeddings")
        num_layers = _config_value(config, "num_hidden_layers")
        if pp_size > 1 and num_layers is None:
            raise ValueError("pp_size > 1 needs the model's config (num_hidden_layers)")
        self.layers: range | None = (
            stage_layers(int(num_layers), pp_size)[pp_rank] if num_layers is not None else None
        )
        self._plan: list[tuple[str, str, tuple[str, ...]]] = []
        self._plan_key: Any = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this stage's HF tensors, as views of the model's tensors."""
        state = self._state()
        tied = self._tied
        if tied is None:
            tied = _same_memory(state.get(LM_HEAD), state.get(EMBED_TOKENS))
        for key, kind, names in self._stream_plan(state, bool(tied)):
            tensor = state[key].detach()
            if kind is _WHOLE:
                yield names[0], tensor
            elif kind is _GATE_UP:
                half = tensor.shape[1] // 2
                for expert in range(tensor.shape[0]):
                    yield names[2 * expert], tensor[expert, :half]
                    yield names[2 * expert + 1], tensor[expert, half:]
            else:
                for expert in range(tensor.shape[0]):
                    yield names[expert], tensor[expert]

    def memory_key(self) -> tuple:
        """The names, addresses, shapes, strides and dtypes of the model's tensors (a tensor
        moved to another device has another address): while they stay the same, so does the
        stream's geometry."""
        return tuple(
            (name, t.data_ptr(), t.shape, t.stride(), t.dtype) for name, t in self._state().items()
        )

    def _state(self) -> Mapping[str, torch.Tensor]:
        if isinstance(self._model, torch.nn.Module):
            return self._model.state_dict(keep_vars=True)
        return self._model

    def _stream_plan(
        self, state: Mapping[str, torch.Tensor], tied: bool
    ) -> list[tuple[str, str, tuple[str, ...]]]:
        """``(state key, how to expand it, the stream names it yields)`` per state entry the
        stage yields; decided once per set of names and shapes (the decision reads names
        with regular expressions, which would otherwise cost more than the stream itself)."""
        key = (tied, tuple((name, t.shape) for name, t in state.items()))
        if key != self._plan_key:
            self._plan = self._decide(state, tied)
            self._plan_key = key
        return self._plan

    def _decide(
        self, state: Mapping[str, torch.Tensor], tied: bool
    ) -> list[tuple[str, str, tuple[str, ...]]]:
        first = self.pp_rank == 0
        last = self.pp_rank == self.pp_size - 1
        plan: list[tuple[str, str, tuple[str, ...]]] = []
        for name, tensor in state.items():
            match = _LAYER_RE.match(name)
            if match is not None:
                layer = int(match.group(2)) + self.layer_offset
                if self.layers is not None and layer not in self.layers:
                    if self.layer_offset:
                        raise ValueError(
                            f"{name!r} with layer_offset={self.layer_offset} is global layer "
                            f"{layer}, outside pipeline stage {self.pp_rank}'s layers "
                            f"{self.layers.start}..{self.layers.stop - 1}"
                        )
                    continue
                plan.append((name, *_expansion(f"{match.group(1)}{layer}{match.group(3)}", tensor)))
            elif name == EMBED_TOKENS:
                if first or (tied and last):
                    plan.append((name, _WHOLE, (name,)))
            elif name == LM_HEAD:
                if last and not tied:
                    plan.append((name, _WHOLE, (name,)))
            elif last:
                plan.append((name, _WHOLE, (name,)))
        return plan


class TensorsExport(ViewExport):
    """A mapping of HF names to tensors, exported as it is (in its order, no stage filter).

    For callers that already hold their rank's tensors under HF names with global layer
    numbers (their own conversion, or another framework's ``(name, tensor)`` stream
    collected into a dict of views). A tensor may be a slice of the HF tensor (a sharded
    trainer's part of it): `slices` then says which box of which full shape it is.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        slices: Mapping[str, tuple[Sequence[int], Sequence[tuple[int, int]]]] | None = None,
    ) -> None:
        """Export `tensors` (the mapping is read at every iteration, not copied).

        Args:
            tensors: ``{hf_name: tensor}`` in stream order.
            slices: ``{hf_name: (full HF shape, box)}`` for the tensors that hold only a box
                of their HF tensor (``(start, stop)`` per dim); each such tensor must have the
                box's extents. Tensors not named are whole.

        Raises:
            ValueError: `slices` names a tensor that `tensors` lacks.
        """
        super().__init__()
        self._tensors = tensors
        self._slices = dict(slices or {})
        unknown = sorted(set(self._slices) - set(tensors))
        if unknown:
            raise ValueError(f"TensorsExport slices name tensors it was not given: {unknown}")

    def holding(self) -> Mapping[str, TensorMeta]:
        """``{hf_name: TensorMeta}``: full shapes, and the box of each sliced tensor.

        Raises:
            ValueError: a sliced tensor's shape is not its box's extents.
        """
        whole = super().holding()
        if not self._slices:
            return whole
        metas = dict(whole)
        for name, (shape, box) in self._slices.items():
            meta = TensorMeta(shape=tuple(shape), dtype=metas[name].dtype, box=tuple(box))
            if meta.local_shape != tuple(metas[name].shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(metas[name].shape)}, but its slice is "
                    f"box {tuple(box)} of shape {tuple(shape)}: expected shape {meta.local_shape}"
                )
            metas[name] = meta
        return metas

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The mapping's items, as they are (the sender reads them under ``no_grad``)."""
        return iter(self._tensors.items())

    def memory_key(self) -> tuple:
        """The names, addresses, shapes, strides and dtypes of the tensors (a tensor moved to
        another device has another address)."""
        return tuple(
            (name, t.data_ptr(), t.shape, t.stride(), t.dtype) for name, t in self._tensors.items()
        )


def hf_state_items(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    layer_offset: int = 0,
    hf_config: Any = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The PP-local ``(hf_name, tensor)`` stream of `model`; see `ModelExport`."""
    return iter(
        ModelExport(
            model, pp_rank=pp_rank, pp_size=pp_size, layer_offset=layer_offset, hf_config=hf_config
        )
    )


_WHOLE, _GATE_UP, _DOWN = "whole", "gate_up", "down"


def _expansion(name: str, tensor: torch.Tensor) -> tuple[str, tuple[str, ...]]:
    """How a stream entry named `name` expands: per-expert checkpoint tensors for a fused
    expert parameter (``(kind, names)``), the tensor itself otherwise."""
    gate_up = _FUSED_GATE_UP_RE.match(name)
    if gate_up is not None and tensor.dim() == 3:
        names = []
        for expert in range(tensor.shape[0]):
            prefix = f"{gate_up.group(1)}.{expert}."
            names += [prefix + "gate_proj.weight", prefix + "up_proj.weight"]
        return _GATE_UP, tuple(names)
    down = _FUSED_DOWN_RE.match(name)
    if down is not None and tensor.dim() == 3:
        return _DOWN, tuple(
            f"{down.group(1)}.{expert}.down_proj.weight" for expert in range(tensor.shape[0])
        )
    return _WHOLE, (name,)


def _config_value(config: Any, key: str) -> Any:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _same_memory(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.data_ptr() == b.data_ptr()
