"""The numbers of a model's forward pass that its parameter shapes do not already say."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.engine.rotary import RopeConfig, yarn_mscale
from weightsync.layout import SUPPORTED_MODEL_TYPES, normalize_hf_config
from weightsync.layout.config import config_data
from weightsync.layout.families import family_for

# The reference engine runs every family the layout rules know.
ENGINE_MODEL_TYPES: tuple[str, ...] = SUPPORTED_MODEL_TYPES


def _sliding_windows(data: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = data.get("sliding_window")
    layer_types = data.get("layer_types")
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    # Mistral has no layer_types: its window, when set, applies to every layer.
    if data["model_type"] == "mistral":
        return (window,) * num_layers
    return (None,) * num_layers


@dataclass(frozen=True, slots=True, kw_only=True)
class MlaSpec:
    """Multi-head latent attention's sizes and scales (DeepSeek-V3, Kimi-K2).

    Attributes:
        kv_lora_rank: size of the compressed kv latent.
        qk_nope_head_dim: the part of a query/key head without RoPE.
        qk_rope_head_dim: the part with RoPE (one rope key shared by every head).
        v_head_dim: size of one value head.
        softmax_scale: what ``q . k`` is multiplied by before the softmax:
            ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's
            ``mscale(factor, mscale_all_dim) ** 2`` when the RoPE is scaled (transformers'
            ``yarn_apply_mscale``, SGLang's ``compute_mla_mscale_scaling``).
        rope_interleave: RoPE rotates interleaved pairs (DeepSeek's checkpoints) rather than
            the two halves.

    Raises:
        ValueError: a size is not positive, or ``qk_rope_head_dim`` is odd.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MlaSpec.{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MlaSpec.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates "
                "pairs)"
            )

    @property
    def cache_entry_dim(self) -> int:
        """Values the compressed cache holds per token and layer: ``kv_lora_rank +
        qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupedRouting:
    """DeepSeek's grouped top-k routing (see `weightsync.engine.moe.GroupedTopkRouter`).

    Attributes:
        n_group: groups the routed experts are split into.
        topk_group: groups a token's experts may come from.
        routed_scaling_factor: what the routing weights are multiplied by.
    """

    n_group: int
    topk_group: int
    routed_scaling_factor: float


def _mla_spec(data: Mapping[str, Any], dims: Mapping[str, Any], rope: RopeConfig) -> MlaSpec:
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return MlaSpec(
        kv_lora_rank=dims["kv_lora_rank"],
        qk_nope_head_dim=dims["qk_nope_head_dim"],
        qk_rope_head_dim=dims["qk_rope_head_dim"],
        v_head_dim=dims["v_head_dim"],
        softmax_scale=scale,
        # transformers' DeepseekV3Config default.
        rope_interleave=bool(data.get("rope_interleave", True)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """What the forward pass needs from the config beyond the parameter shapes.

    The partition of every parameter (heads per rank, vocab rows, local experts) is read from
    the rank's layout, so that it is stated once, by ``weightsync.layout``; this holds only the
    numbers that no shape carries.

    Attributes:
        model_type: the HF ``model_type``.
        vocab_size: the real (unpadded) vocabulary size.
        head_dim: size of one attention head (MLA: of a query/key head,
            ``qk_nope_head_dim + qk_rope_head_dim``).
        num_layers: number of decoder layers.
        rms_norm_eps: epsilon of every RMSNorm (MLA's ``q_a_layernorm`` / ``kv_a_layernorm``
            too, as SGLang has it; transformers hard-codes 1e-6 for those two).
        rope: the rotary embedding.
        sliding_windows: per layer, the attention window in tokens, or ``None`` for full.
        num_experts_per_tok: experts routed per token (MoE layers only; 0 for dense models).
        norm_topk_prob: whether the top-k routing weights are renormalised to sum to one.
        mla: multi-head latent attention's numbers, or ``None`` for grouped-head attention.
        grouped_routing: DeepSeek's grouped top-k router, or ``None`` for softmax top-k.
        fp8_block_size: the block of a block-FP8 checkpoint's weights (its linear weights
            are e4m3 with float32 block scales, dequantised where used); 0 for none.
    """

    model_type: str
    vocab_size: int
    head_dim: int
    num_layers: int
    rms_norm_eps: float
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    mla: MlaSpec | None = None
    grouped_routing: GroupedRouting | None = None
    fp8_block_size: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in ENGINE_MODEL_TYPES:
            raise ValueError(
                f"the reference engine runs {', '.join(ENGINE_MODEL_TYPES)}; "
                f"got model_type={self.model_type!r}"
            )
        for name in ("vocab_size", "head_dim", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be positive, got {getattr(self, name)}")
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"ModelSpec: {len(self.sliding_windows)} sliding windows for "
                f"{self.num_layers} layers"
            )
        if family_for(self.model_type).moe and self.num_experts_per_tok < 1:
            raise ValueError(f"ModelSpec: {self.model_type} needs num_experts_per_tok >= 1")

    @property
    def rotary_dim(self) -> int:
        """How many dims of a head RoPE rotates: all of it, or MLA's rope part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelSpec:
        """Read the spec from a transformers config or a config.json dict.

        Raises:
            ValueError: an unsupported model type or feature (biases other than qwen2's qkv
                bias, an activation other than SiLU, a RoPE type other than default, linear or
                llama3, or for DeepSeek-V3 / Kimi-K2 default or yarn; a router scoring other
                than DeepSeek's sigmoid), or a bad size.
        """
        data = config_data(hf_config)
        model_type = data.get("model_type")
        if model_type not in ENGINE_MODEL_TYPES:
            raise ValueError(
                f"the reference engine runs {', '.join(ENGINE_MODEL_TYPES)}; "
                f"got model_type={model_type!r}"
            )
        hidden_act = data.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {hidden_act!r}")
        # The sizes, with defaults for keys a config.json leaves out, as the layout reads them
        # (it also refuses biases SGLang's layout has no parameter for).
        dims = normalize_hf_config(data)
        family = family_for(model_type)
        num_layers = dims["num_hidden_layers"]
        rope = RopeConfig.from_hf_config(data)
        if family.mla:
            # SGLang's DeepseekV2 runs every rope_scaling but the default as YaRN.
            if rope.rope_type not in ("default", "yarn"):
                raise ValueError(
                    f"{model_type}: rope_type {rope.rope_type!r} is not supported (SGLang runs "
                    "any scaled RoPE of this family as YaRN); use 'yarn' or no scaling"
                )
        elif rope.rope_type == "yarn":
            raise ValueError(
                f"{model_type}: rope_type 'yarn' is supported for the MLA models (deepseek_v3, "
                "kimi_k2) only"
            )
        mla = _mla_spec(data, dims, rope) if family.mla else None
        head_dim = (
            dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"] if family.mla else dims["head_dim"]
        )
        grouped_routing = None
        if family.deepseek_moe:
            scoring_func = data.get("scoring_func", "sigmoid")
            if scoring_func != "sigmoid":
                raise ValueError(
                    f"{model_type}: scoring_func={scoring_func!r} is not supported; "
                    "DeepSeek-V3's router scores with 'sigmoid'"
                )
            # transformers' DeepseekV3Config defaults.
            grouped_routing = GroupedRouting(
                n_group=int(data.get("n_group", 8)),
                topk_group=int(data.get("topk_group", 4)),
                routed_scaling_factor=float(data.get("routed_scaling_factor", 2.5)),
            )
            num_experts_per_tok = int(data.get("num_experts_per_tok", 8))
            norm_topk_prob = bool(data.get("norm_topk_prob", True))
        elif family.moe:
            # transformers' Qwen3MoeConfig defaults: 8 experts per token, no renormalisation.
            num_experts_per_tok = int(data.get("num_experts_per_tok", 8))
            norm_topk_prob = bool(data.get("norm_topk_prob", False))
        else:
            num_experts_per_tok, norm_topk_prob = 0, False
        return cls(
            model_type=model_type,
            vocab_size=dims["vocab_size"],
            head_dim=head_dim,
            num_layers=num_layers,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope=rope,
            sliding_windows=_sliding_windows(data, num_layers),
            num_experts_per_tok=num_experts_per_tok,
            norm_topk_prob=norm_topk_prob,
            mla=mla,
            grouped_routing=grouped_routing,
            fp8_block_size=(dims.get("quantization_config") or {}).get("weight_block_size", [0])[0],
        )
