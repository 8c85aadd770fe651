"""The parallelism of one rollout rank, as SGLang publishes it (`RankParallelismConfig`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_FIELDS = (
    "tp_size",
    "tp_rank",
    "pp_size",
    "pp_rank",
    "ep_size",
    "ep_rank",
    "moe_tp_size",
    "moe_tp_rank",
    "attn_tp_size",
    "attn_tp_rank",
    "attn_dp_size",
    "attn_dp_rank",
    "num_fused_shared_experts",
    "moe_dense_tp_size",
    "enable_dp_lm_head",
    "world_size",
    "global_rank",
    "local_rank",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelismConfig:
    """Where one rollout rank sits in its replica's parallel layout.

    Only ``tp_size`` and ``tp_rank`` are required. The others default the way SGLang 0.5.23
    derives them: no pipeline or expert parallelism; MoE tensor parallelism
    ``moe_tp_size = tp_size // ep_size`` with ``moe_tp_rank = tp_rank % moe_tp_size`` and
    ``ep_rank = tp_rank // moe_tp_size``; attention tensor parallelism
    ``attn_tp_size = tp_size // attn_dp_size`` with ``attn_tp_rank = tp_rank % attn_tp_size``
    and ``attn_dp_rank = tp_rank // attn_tp_size`` (one attention data-parallel group unless
    ``attn_dp_size`` says otherwise); no shared experts fused into the routed experts; dense
    MLPs split over the whole TP group; ``world_size = tp_size * pp_size``.

    ``attn_dp_size > 1`` is SGLang's DP attention (``--attn-dp-size``, formerly
    ``--enable-dp-attention`` with ``--dp-size``): attention weights are split over the
    ``attn_tp_size`` ranks of one attention-DP group and replicated across the groups, while
    the MoE stays split over EP and MoE-TP across the whole TP group. ``enable_dp_lm_head`` is
    ``--enable-dp-lm-head``: the untied ``lm_head`` follows attention TP instead of the whole
    TP group (without DP attention the two are the same). ``num_fused_shared_experts`` is
    SGLang's count of shared experts held as extra expert slots of ``mlp.experts`` (0 when
    they stay ``mlp.shared_experts``); ``moe_dense_tp_size`` is ``--moe-dense-tp-size``
    (None: not set; SGLang accepts only None, 1 or ``tp_size``, and 1 replicates the dense
    MLP layers).

    Raises:
        ValueError: a size is not positive, a rank is outside its size, or the sizes do not
            divide (``ep_size`` must divide ``tp_size``, ``moe_tp_size * ep_size == tp_size``,
            ``attn_tp_size * attn_dp_size == tp_size`` and ``tp_rank`` must be
            ``attn_dp_rank * attn_tp_size + attn_tp_rank``), or ``moe_dense_tp_size`` is a
            value SGLang refuses.
    """

    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int | None = None
    moe_tp_size: int | None = None
    moe_tp_rank: int | None = None
    attn_tp_size: int | None = None
    attn_tp_rank: int | None = None
    attn_dp_size: int = 1
    attn_dp_rank: int | None = None
    num_fused_shared_experts: int = 0
    moe_dense_tp_size: int | None = None
    enable_dp_lm_head: bool = False
    world_size: int | None = None
    global_rank: int | None = None
    local_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "ep_size", "attn_dp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig.{name} must be a positive int, got {value!r}")
        fused = self.num_fused_shared_experts
        if not isinstance(fused, int) or fused < 0:
            raise ValueError(
                f"ParallelismConfig.num_fused_shared_experts must be an int >= 0, got {fused!r}"
            )
        dense = self.moe_dense_tp_size
        if dense is not None and dense not in (1, self.tp_size):
            # SGLang's server arguments assert the same ("only supports None, 1, or tp_size").
            raise ValueError(
                f"ParallelismConfig.moe_dense_tp_size={dense!r}: SGLang supports only None, 1 "
                f"or tp_size={self.tp_size} (--moe-dense-tp-size)"
            )
        if not isinstance(self.enable_dp_lm_head, bool):
            raise ValueError(
                "ParallelismConfig.enable_dp_lm_head must be a bool, got "
                f"{self.enable_dp_lm_head!r}"
            )
        if self.tp_size % self.attn_dp_size:
            raise ValueError(
                f"ParallelismConfig: attn_dp_size={self.attn_dp_size} must divide "
                f"tp_size={self.tp_size}"
            )
        if self.tp_size % self.ep_size:
            raise ValueError(
                f"ParallelismConfig: ep_size={self.ep_size} must divide tp_size={self.tp_size}"
            )
        # Derived fields are filled in here so that every reader sees one resolved config.
        moe_tp_size = (
            self.moe_tp_size if self.moe_tp_size is not None else self.tp_size // self.ep_size
        )
        if moe_tp_size < 1 or moe_tp_size * self.ep_size != self.tp_size:
            raise ValueError(
                f"ParallelismConfig: moe_tp_size={moe_tp_size} * ep_size={self.ep_size} "
                f"must equal tp_size={self.tp_size}"
            )
        defaults = {
            "moe_tp_size": moe_tp_size,
            "moe_tp_rank": self.tp_rank % moe_tp_size,
            "ep_rank": self.tp_rank // moe_tp_size,
            "attn_tp_size": self.tp_size // self.attn_dp_size,
            "world_size": self.tp_size * self.pp_size,
            "global_rank": self.pp_rank * self.tp_size + self.tp_rank,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.local_rank is None:
            object.__setattr__(self, "local_rank", self.global_rank)
        attn_tp_size = self.attn_tp_size
        if not isinstance(attn_tp_size, int) or attn_tp_size * self.attn_dp_size != self.tp_size:
            raise ValueError(
                f"ParallelismConfig: attn_tp_size={attn_tp_size!r} * attn_dp_size="
                f"{self.attn_dp_size} must equal tp_size={self.tp_size}"
            )
        # SGLang lays attention ranks out (dp, tp) with tp fastest inside the TP group.
        if self.attn_tp_rank is None:
            object.__setattr__(self, "attn_tp_rank", self.tp_rank % attn_tp_size)
        if self.attn_dp_rank is None:
            object.__setattr__(self, "attn_dp_rank", self.tp_rank // attn_tp_size)
        for size_name, rank_name in (
            ("tp_size", "tp_rank"),
            ("pp_size", "pp_rank"),
            ("ep_size", "ep_rank"),
            ("moe_tp_size", "moe_tp_rank"),
            ("attn_tp_size", "attn_tp_rank"),
            ("attn_dp_size", "attn_dp_rank"),
            ("world_size", "global_rank"),
        ):
            size, rank = getattr(self, size_name), getattr(self, rank_name)
            if not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(
                    f"ParallelismConfig.{rank_name}={rank!r} must be in [0, {size_name}={size})"
                )
        if self.attn_dp_rank * attn_tp_size + self.attn_tp_rank != self.tp_rank:
            raise ValueError(
                f"ParallelismConfig: tp_rank={self.tp_rank} must be attn_dp_rank="
                f"{self.attn_dp_rank} * attn_tp_size={attn_tp_size} + attn_tp_rank="
                f"{self.attn_tp_rank}, as SGLang places attention ranks"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelismConfig:
        """Build a config from a dict such as SGLang's `RankParallelismConfig.to_dict()`.

        Unknown keys are ignored, so newer servers that publish more fields still parse.
        """
        return cls(**{k: data[k] for k in _FIELDS if k in data and data[k] is not None})

    def to_dict(self) -> dict[str, int | bool | None]:
        """All fields as a plain dict; `from_dict(to_dict())` returns an equal config."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def layout_key(self) -> tuple[int, ...]:
        """The fields that decide which bytes this rank holds.

        Two ranks (of any replicas) with equal keys hold byte-identical weights, so the
        trainer stages their bytes once and writes them to both. ``moe_dense_tp_size`` enters
        as the dense MLP's effective split (None and ``tp_size`` lay out alike).
        """
        return (
            self.tp_size,
            self.tp_rank,
            self.pp_size,
            self.pp_rank,
            self.ep_size,
            self.ep_rank,
            self.moe_tp_size,
            self.moe_tp_rank,
            self.attn_tp_size,
            self.attn_tp_rank,
            self.num_fused_shared_experts,
            self.moe_dense_tp_size if self.moe_dense_tp_size is not None else self.tp_size,
            int(self.enable_dp_lm_head),
        )
