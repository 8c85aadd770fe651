"""A Megatron-core ``GPTModel`` rank as a source: the TP / PP / EP-local slices it holds, in HF
coordinates, read from the model alone (no collective, no gather).

Megatron-core keeps every weight split over tensor parallel (TP), pipeline parallel (PP) and
expert parallel (EP, and expert-TP) ranks. `MegatronExport` maps each local parameter to the
boxes of HF checkpoint tensors (Llama / Qwen names) it holds:

- ``linear_qkv`` is interleaved per query group (``[q heads of g; k_g; v_g]`` for each group
  ``g``) and then split by rows over TP, so a rank holds whole groups, or, when there are
  fewer key-value groups than TP ranks, a window that cuts a group (it may start inside q and
  end in v);
- ``linear_fc1`` (SwiGLU) holds ``[gate_r; up_r]``: rows ``r`` of ``gate_proj`` and of
  ``up_proj``, two boxes;
- row-parallel weights (``linear_proj``, ``linear_fc2``) hold columns;
- the embedding and the output layer hold rows of the padded vocab: the rows at and past the
  HF vocab are padding and held by no box;
- experts are named by global id (``mlp.local_expert_indices``) and split over expert-TP;
- layers are numbered from the model (``layer.layer_number``: virtual PP stages and uneven
  stages included), never from the local index.

Everything is read from ``model.config``, ``model.pg_collection`` (a process group's
``rank()`` and ``size()`` are local queries), the layers and the local parameter shapes; the
HF vocab size and whether embeddings are tied come from the HF config. The local layer spec
and the Transformer-Engine spec spell some parameters differently; both are accepted.
``megatron.core`` itself is imported only for a model that has no ``pg_collection``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.export.pieces import HeldPiece, PiecesExport


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronRanks:
    """A rank's coordinates in Megatron's parallel groups.

    Attributes:
        tp_rank, tp_size: tensor parallel (the dense weights' split).
        pp_rank, pp_size: pipeline parallel.
        ep_rank, ep_size: expert parallel.
        etp_rank, etp_size: expert tensor parallel (the experts' split; Megatron's default is
            the TP size).
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def of(cls, model: torch.nn.Module) -> MegatronRanks:
        """Read from ``model.pg_collection`` (or ``megatron.core.parallel_state`` where the
        model has none); no communication."""
        collection = getattr(model, "pg_collection", None)
        values: dict[str, int] = {}
        for axis, group_name in (("tp", "tp"), ("pp", "pp"), ("ep", "ep"), ("etp", "expt_tp")):
            group = getattr(collection, group_name, None) if collection is not None else None
            if group is None:
                rank, size = _parallel_state(axis)
            else:
                rank, size = group.rank(), group.size()
            values[f"{axis}_rank"], values[f"{axis}_size"] = int(rank), int(size)
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class HFNames:
    """The HF checkpoint names a GPT model's tensors map to (Llama / Qwen2 / Qwen3 /
    Qwen3-MoE); ``{L}`` is the layer, ``{e}`` the expert, ``{p}`` ``weight`` or ``bias``."""

    embed: str = "model.embed_tokens.weight"
    lm_head: str = "lm_head.weight"
    final_norm: str = "model.norm.weight"
    layer: str = "model.layers.{L}."
    input_norm: str = "input_layernorm.weight"
    post_attn_norm: str = "post_attention_layernorm.weight"
    q: str = "self_attn.q_proj.{p}"
    k: str = "self_attn.k_proj.{p}"
    v: str = "self_attn.v_proj.{p}"
    o: str = "self_attn.o_proj.{p}"
    q_norm: str = "self_attn.q_norm.weight"
    k_norm: str = "self_attn.k_norm.weight"
    gate: str = "mlp.gate_proj.{p}"
    up: str = "mlp.up_proj.{p}"
    down: str = "mlp.down_proj.{p}"
    router: str = "mlp.gate.weight"
    expert_gate: str = "mlp.experts.{e}.gate_proj.{p}"
    expert_up: str = "mlp.experts.{e}.up_proj.{p}"
    expert_down: str = "mlp.experts.{e}.down_proj.{p}"
    shared_gate: str = "mlp.shared_expert.gate_proj.weight"
    shared_up: str = "mlp.shared_expert.up_proj.weight"
    shared_down: str = "mlp.shared_expert.down_proj.weight"
    shared_expert_gate: str = "mlp.shared_expert_gate.weight"


LLAMA_NAMES = HFNames()
"""The names of the Llama family of checkpoints (Llama, Qwen2, Qwen3, Qwen2/3-MoE)."""

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT_RE = re.compile(
    r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|bias)$"
)
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.(weight|bias)(\d+)$")
_INPUT_NORMS = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
_POST_ATTN_NORMS = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")


def megatron_pieces(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    hf_vocab_size: int,
    tied: bool = False,
    names: HFNames = LLAMA_NAMES,
) -> list[HeldPiece]:
    """Every box of every HF tensor this rank's parameters hold, in parameter order.

    Args:
        model: a ``GPTModel``, or this rank's list of virtual-pipeline chunks (wrappers that
            keep the model in ``.module``, such as Megatron's DDP, are unwrapped).
        hf_vocab_size: the HF vocab size (Megatron knows only the padded one).
        tied: HF ``tie_word_embeddings``: the last stage's output layer is then a copy of
            ``model.embed_tokens.weight`` (there is no ``lm_head.weight``).
        names: the HF names to map to.

    Raises:
        ValueError: a parameter no rule maps (its name says which), a local shape that
            differs from the one the model's config implies, or a model feature the rules do
            not cover (output-gated attention, GTP weight sharding).
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    pieces: list[HeldPiece] = []
    for chunk in chunks:
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module
        pieces += _ChunkRules(chunk, hf_vocab_size, tied, names).pieces()
    return pieces


class MegatronExport(PiecesExport):
    """One Megatron-core rank as a `weightsync.WeightExport`: its boxes of HF tensors.

    The holding names each HF tensor the rank holds part of, with the box it holds
    (`TensorMeta.box`); the stream yields exactly that box, as a view of the parameter
    wherever the rank holds it in one piece (a rank holding several query groups holds their
    q rows apart: those are copied into a buffer kept between syncs). Ranks holding the same
    box (data-parallel copies, norms replicated over TP) share its writes in the plan.
    Nothing here communicates.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        hf_config: Any,
        names: HFNames = LLAMA_NAMES,
    ) -> None:
        """Describe the export; the mapping is worked out at the first `holding`.

        Args:
            model: a ``GPTModel`` or this rank's virtual-pipeline chunks.
            hf_config: the HF config (object or dict): ``vocab_size`` and
                ``tie_word_embeddings``.
            names: the HF names to map to.

        Raises:
            ValueError: the HF config has no ``vocab_size``.
        """
        super().__init__()
        vocab_size = _config_value(hf_config, "vocab_size")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(
                f"MegatronExport needs the HF config's vocab_size (a positive int), got "
                f"{vocab_size!r}"
            )
        self._model = model
        self._vocab_size = vocab_size
        self._tied = bool(_config_value(hf_config, "tie_word_embeddings"))
        self._names = names

    def pieces(self) -> list[HeldPiece]:
        """The boxes of HF tensors this rank's parameters hold."""
        return megatron_pieces(
            self._model, hf_vocab_size=self._vocab_size, tied=self._tied, names=self._names
        )

    def memory_key(self) -> tuple:
        """The parameters' names, addresses, shapes, strides and dtypes."""
        return tuple(
            (name, t.data_ptr(), t.shape, t.stride(), t.dtype)
            for chunk in _chunks(self._model)
            for name, t in chunk.named_parameters()
        )


class _ChunkRules:
    """The mapping rules for one model chunk."""

    def __init__(self, chunk: torch.nn.Module, vocab_size: int, tied: bool, names: HFNames):
        self.chunk = chunk
        self.config = chunk.config
        self.ranks = MegatronRanks.of(chunk)
        self.vocab_size = vocab_size
        self.tied = tied
        self.names = names
        for key in ("gtp_weight_remat_size", "expert_gtp_weight_remat_size"):
            if getattr(self.config, key, None) not in (None, 1):
                raise ValueError(
                    f"the Megatron model shards weights with {key}={getattr(self.config, key)}, "
                    "which MegatronExport does not map; use 1"
                )
        if getattr(self.config, "attention_output_gate", False):
            raise ValueError(
                "the Megatron model has attention_output_gate=True, whose q_proj layout "
                "MegatronExport does not map"
            )

    def pieces(self) -> list[HeldPiece]:
        out: list[HeldPiece] = []
        for name, param in self.chunk.named_parameters():
            out += self._param(name, param)
        return out

    def _param(self, name: str, param: torch.Tensor) -> list[HeldPiece]:
        names = self.names
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return self._vocab(name, param)
        if name == "decoder.final_layernorm.weight":
            return [_whole(name, param, names.final_norm)]
        match = _LAYER_RE.match(name)
        if match is None:
            raise _unmapped(name)
        layer = self.chunk.decoder.layers[int(match.group(1))]
        rest = match.group(2)
        # layer_number is 1-based and global: it includes the PP, virtual-PP and uneven-stage
        # offsets of this chunk.
        prefix = names.layer.format(L=int(layer.layer_number) - 1)
        tp, tp_size = self.ranks.tp_rank, self.ranks.tp_size
        if rest in _INPUT_NORMS:
            return [_whole(name, param, prefix + names.input_norm)]
        if rest in _POST_ATTN_NORMS:
            return [_whole(name, param, prefix + names.post_attn_norm)]
        if rest == "self_attention.q_layernorm.weight":
            return [_whole(name, param, prefix + names.q_norm)]
        if rest == "self_attention.k_layernorm.weight":
            return [_whole(name, param, prefix + names.k_norm)]
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            return self._qkv(name, param, prefix, rest.rsplit(".", 1)[1])
        if rest == "self_attention.linear_proj.weight":
            hf_cols = self.config.num_attention_heads * self.config.kv_channels
            return [
                _columns(name, param, prefix + names.o.format(p="weight"), hf_cols, tp, tp_size)
            ]
        if rest == "self_attention.linear_proj.bias":
            return [_whole(name, param, prefix + names.o.format(p="bias"))]
        if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            p = rest.rsplit(".", 1)[1]
            return _gated(
                name,
                param,
                prefix + names.gate.format(p=p),
                prefix + names.up.format(p=p),
                self.config.ffn_hidden_size,
                tp,
                tp_size,
            )
        if rest == "mlp.linear_fc2.weight":
            hf_name = prefix + names.down.format(p="weight")
            return [_columns(name, param, hf_name, self.config.ffn_hidden_size, tp, tp_size)]
        if rest == "mlp.linear_fc2.bias":
            return [_whole(name, param, prefix + names.down.format(p="bias"))]
        if rest == "mlp.router.weight":
            return [_whole(name, param, prefix + names.router)]
        if rest.startswith("mlp.shared_experts."):
            return self._shared(name, param, prefix, rest.removeprefix("mlp.shared_experts."))
        return self._expert(name, param, layer, prefix, rest)

    def _vocab(self, name: str, param: torch.Tensor) -> list[HeldPiece]:
        """Rows of the padded vocab; the rows at and past the HF vocab are padding."""
        rows, hidden = param.shape
        if name.startswith("embedding."):
            embedding = self.chunk.embedding.word_embeddings
            start = int(getattr(embedding, "vocab_start_index", self.ranks.tp_rank * rows))
            hf_name = self.names.embed
        else:
            start = self.ranks.tp_rank * rows
            # Tied embeddings with PP > 1: the last stage's output layer is a copy of the
            # embedding, kept equal by Megatron's embedding-group all-reduce.
            hf_name = self.names.embed if self.tied else self.names.lm_head
        stop = min(start + rows, self.vocab_size)
        if stop <= start:
            return []
        return [
            HeldPiece(
                param_name=name,
                hf_name=hf_name,
                hf_shape=(self.vocab_size, hidden),
                box=((start, stop), (0, hidden)),
                window=((0, stop - start), (0, hidden)),
                param=param,
            )
        ]

    def _qkv(self, name: str, param: torch.Tensor, prefix: str, p: str) -> list[HeldPiece]:
        """The interleaved ``[q_g; k_g; v_g]`` rows per query group, split by rows over TP."""
        config = self.config
        head_dim, num_groups = config.kv_channels, config.num_query_groups
        heads_per_group = config.num_attention_heads // num_groups
        group_rows = (heads_per_group + 2) * head_dim
        local_rows = param.shape[0]
        tp, tp_size = self.ranks.tp_rank, self.ranks.tp_size
        if local_rows * tp_size != num_groups * group_rows:
            raise _shape_error(name, param, (num_groups * group_rows // tp_size,))
        hf_rows = {"q": config.num_attention_heads * head_dim, "k": num_groups * head_dim}
        hf_rows["v"] = hf_rows["k"]
        hf_names = {
            "q": prefix + self.names.q.format(p=p),
            "k": prefix + self.names.k.format(p=p),
            "v": prefix + self.names.v.format(p=p),
        }
        rest_dims = tuple((0, d) for d in param.shape[1:])
        low = tp * local_rows
        return [
            HeldPiece(
                param_name=name,
                hf_name=hf_names[which],
                hf_shape=(hf_rows[which], *param.shape[1:]),
                box=((hf_start, hf_start + stop - start), *rest_dims),
                window=((start - low, stop - low), *rest_dims),
                param=param,
            )
            for start, stop, which, hf_start in qkv_row_pieces(
                num_groups, heads_per_group, head_dim, low, low + local_rows
            )
        ]

    def _shared(self, name: str, param: torch.Tensor, prefix: str, sub: str) -> list[HeldPiece]:
        names, tp, tp_size = self.names, self.ranks.tp_rank, self.ranks.tp_size
        size = self.config.moe_shared_expert_intermediate_size
        if sub == "linear_fc1.weight":
            gate, up = prefix + names.shared_gate, prefix + names.shared_up
            return _gated(name, param, gate, up, size, tp, tp_size)
        if sub == "linear_fc2.weight":
            return [_columns(name, param, prefix + names.shared_down, size, tp, tp_size)]
        if sub == "gate_weight":
            return [_whole(name, param, prefix + names.shared_expert_gate)]
        raise _unmapped(name)

    def _expert(
        self, name: str, param: torch.Tensor, layer: Any, prefix: str, rest: str
    ) -> list[HeldPiece]:
        local = _LOCAL_EXPERT_RE.match(rest)
        grouped = _GROUPED_EXPERT_RE.match(rest)
        if local is not None:
            index, linear, p = int(local.group(1)), local.group(2), local.group(3)
        elif grouped is not None:
            linear, p, index = grouped.group(1), grouped.group(2), int(grouped.group(3))
        else:
            raise _unmapped(name)
        ranks = self.ranks
        local_ids = getattr(layer.mlp, "local_expert_indices", None)
        if local_ids is None:
            per_rank = self.config.num_moe_experts // ranks.ep_size
            local_ids = [ranks.ep_rank * per_rank + i for i in range(per_rank)]
        expert = int(local_ids[index])
        size = self.config.moe_ffn_hidden_size
        names = self.names
        if linear == "linear_fc1":
            gate = prefix + names.expert_gate.format(e=expert, p=p)
            up = prefix + names.expert_up.format(e=expert, p=p)
            return _gated(name, param, gate, up, size, ranks.etp_rank, ranks.etp_size)
        if p == "weight":
            down = prefix + names.expert_down.format(e=expert, p=p)
            return [_columns(name, param, down, size, ranks.etp_rank, ranks.etp_size)]
        return [_whole(name, param, prefix + names.expert_down.format(e=expert, p=p))]


def qkv_row_pieces(
    num_groups: int, heads_per_group: int, head_dim: int, low: int, high: int
) -> list[tuple[int, int, str, int]]:
    """Rows ``[low, high)`` of Megatron's interleaved ``linear_qkv`` output as pieces.

    The rows are, for each query group ``g``: the q rows of its heads, then k_g, then v_g
    (``head_dim`` rows per head). Returns ``(start, stop, which, hf_start)`` per maximal run
    of rows that is contiguous in one of q / k / v (``which``), ``hf_start`` being the run's
    first row in that HF tensor.
    """
    q_rows = heads_per_group * head_dim
    group_rows = q_rows + 2 * head_dim
    pieces: list[tuple[int, int, str, int]] = []
    for group in range(low // group_rows, -(-high // group_rows)):
        base = group * group_rows
        parts = (
            ("q", base, base + q_rows, group * q_rows),
            ("k", base + q_rows, base + q_rows + head_dim, group * head_dim),
            ("v", base + q_rows + head_dim, base + group_rows, group * head_dim),
        )
        for which, start, stop, hf_start in parts:
            a, b = max(low, start), min(high, stop)
            if a < b:
                pieces.append((a, b, which, hf_start + a - start))
    return pieces


def _whole(name: str, param: torch.Tensor, hf_name: str) -> HeldPiece:
    """A parameter replicated over its TP group: the whole HF tensor."""
    full = tuple((0, d) for d in param.shape)
    return HeldPiece(
        param_name=name,
        hf_name=hf_name,
        hf_shape=tuple(param.shape),
        box=full,
        window=full,
        param=param,
    )


def _columns(
    name: str, param: torch.Tensor, hf_name: str, hf_cols: int, rank: int, size: int
) -> HeldPiece:
    """A row-parallel weight ``[out, in / size]``: columns of the HF tensor."""
    rows, cols = param.shape
    if cols * size != hf_cols:
        raise _shape_error(name, param, (rows, hf_cols // size))
    return HeldPiece(
        param_name=name,
        hf_name=hf_name,
        hf_shape=(rows, hf_cols),
        box=((0, rows), (rank * cols, (rank + 1) * cols)),
        window=((0, rows), (0, cols)),
        param=param,
    )


def _gated(
    name: str,
    param: torch.Tensor,
    gate_name: str,
    up_name: str,
    hf_rows: int,
    rank: int,
    size: int,
) -> list[HeldPiece]:
    """A SwiGLU ``linear_fc1`` ``[gate_r; up_r]``: the same rows of gate and of up."""
    rows = param.shape[0] // 2
    if param.shape[0] != 2 * rows or rows * size != hf_rows:
        raise _shape_error(name, param, (2 * hf_rows // size, *param.shape[1:]))
    rest = tuple((0, d) for d in param.shape[1:])
    box = ((rank * rows, (rank + 1) * rows), *rest)
    shape = (hf_rows, *param.shape[1:])
    return [
        HeldPiece(
            param_name=name,
            hf_name=gate_name,
            hf_shape=shape,
            box=box,
            window=((0, rows), *rest),
            param=param,
        ),
        HeldPiece(
            param_name=name,
            hf_name=up_name,
            hf_shape=shape,
            box=box,
            window=((rows, 2 * rows), *rest),
            param=param,
        ),
    ]


def _chunks(model: Any) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _parallel_state(axis: str) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    getters = {
        "tp": (ps.get_tensor_model_parallel_rank, ps.get_tensor_model_parallel_world_size),
        "pp": (ps.get_pipeline_model_parallel_rank, ps.get_pipeline_model_parallel_world_size),
        "ep": (ps.get_expert_model_parallel_rank, ps.get_expert_model_parallel_world_size),
        "etp": (ps.get_expert_tensor_parallel_rank, ps.get_expert_tensor_parallel_world_size),
    }
    rank, size = getters[axis]
    return rank(), size()


def _unmapped(name: str) -> ValueError:
    return ValueError(
        f"no HF tensor is known for Megatron parameter {name!r}; MegatronExport maps GPT "
        "models of the Llama / Qwen family (pass names= for other HF names)"
    )


def _shape_error(name: str, param: torch.Tensor, expected: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"Megatron parameter {name!r} has local shape {tuple(param.shape)}, expected "
        f"{expected} from the model's config and parallel sizes"
    )


def _config_value(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)
