"""The numbers of a model's forward pass that its parameter shapes do not already say."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.engine.rotary import RopeConfig
from weightsync.layout import SUPPORTED_MODEL_TYPES, normalize_hf_config
from weightsync.layout.config import config_data

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
class ModelSpec:
    """What the forward pass needs from the config beyond the parameter shapes.

    The partition of every parameter (heads per rank, vocab rows, local experts) is read from
    the rank's layout, so that it is stated once, by ``weightsync.layout``; this holds only the
    numbers that no shape carries.

    Attributes:
        model_type: the HF ``model_type``.
        vocab_size: the real (unpadded) vocabulary size.
        head_dim: size of one attention head.
        num_layers: number of decoder layers.
        rms_norm_eps: epsilon of every RMSNorm.
        rope: the rotary embedding.
        sliding_windows: per layer, the attention window in tokens, or ``None`` for full.
        num_experts_per_tok: experts routed per token (MoE layers only; 0 for dense models).
        norm_topk_prob: whether the top-k routing weights are renormalised to sum to one.
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
        if self.model_type == "qwen3_moe" and self.num_experts_per_tok < 1:
            raise ValueError("ModelSpec: qwen3_moe needs num_experts_per_tok >= 1")

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelSpec:
        """Read the spec from a transformers config or a config.json dict.

        Raises:
            ValueError: an unsupported model type or feature (biases other than qwen2's qkv
                bias, an activation other than SiLU, a RoPE type other than default, linear or
                llama3), or a bad size.
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
        num_layers = dims["num_hidden_layers"]
        is_moe = model_type == "qwen3_moe"
        return cls(
            model_type=model_type,
            vocab_size=dims["vocab_size"],
            head_dim=dims["head_dim"],
            num_layers=num_layers,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf_config(data),
            sliding_windows=_sliding_windows(data, num_layers),
            # transformers' Qwen3MoeConfig defaults: 8 experts per token, no renormalisation.
            num_experts_per_tok=int(data.get("num_experts_per_tok", 8)) if is_moe else 0,
            norm_topk_prob=bool(data.get("norm_topk_prob", False)) if is_moe else False,
        )
