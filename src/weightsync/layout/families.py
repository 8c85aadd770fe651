"""The model families weightsync can lay out, keyed by the HF config's ``model_type``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# transformers 5 config-class defaults shared by the families below; ``None`` for head_dim and
# num_key_value_heads means "derive it" (hidden_size // num_attention_heads, and
# num_attention_heads).
_COMMON_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None,
    "head_dim": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFamily:
    """The rule that turns one family's HF checkpoint into SGLang's parameters.

    Attributes:
        model_type: the HF config's ``model_type``.
        qkv_bias: the q/k/v projections always carry a bias (fused into ``qkv_proj.bias``).
        qk_norm: attention has per-head ``q_norm`` / ``k_norm`` RMSNorms.
        qk_norm_first: SGLang registers ``q_norm``/``k_norm`` before ``qkv_proj`` (its
            parameter order, which the reference engine follows).
        moe: decoder layers may hold a sparse MoE block instead of the dense MLP.
        mla: attention is DeepSeek's multi-head latent attention (low-rank q and kv
            projections, one shared rope key) instead of grouped q/k/v heads.
        deepseek_moe: the MoE block is DeepSeek's: a router with a score-correction bias,
            shared experts beside the routed ones, and the first ``first_k_dense_replace``
            layers dense (instead of qwen's ``decoder_sparse_step`` / ``mlp_only_layers``).
        lm_head_when_tied: the engine keeps its own ``lm_head.weight`` even when the
            embeddings are tied (loaded from ``embed_tokens``).
        config_defaults: the transformers config-class defaults for keys a config.json may
            leave out.
    """

    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_first: bool = False
    moe: bool = False
    mla: bool = False
    deepseek_moe: bool = False
    lm_head_when_tied: bool = False
    config_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.qk_norm_first and not self.qk_norm:
            raise ValueError(f"{self.model_type}: qk_norm_first needs qk_norm")
        if self.deepseek_moe and not self.moe:
            raise ValueError(f"{self.model_type}: deepseek_moe needs moe")
        if self.mla and (self.qkv_bias or self.qk_norm):
            raise ValueError(f"{self.model_type}: MLA has no qkv bias and no q/k norms")


def _defaults(**values: Any) -> Mapping[str, Any]:
    return MappingProxyType({**_COMMON_DEFAULTS, **values})


_LLAMA_DEFAULTS = _defaults(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
)

# transformers 5.24's DeepseekV3Config defaults. `moe_layer_freq` and `topk_method` are not
# keys of that class (SGLang reads them; real DeepSeek-V3 and Kimi-K2 configs carry them):
# their defaults are what transformers' modeling code does regardless.
_DEEPSEEK_V3_DEFAULTS = _defaults(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=256,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    first_k_dense_replace=3,
    moe_layer_freq=1,
    topk_method="noaux_tc",
)

_DEEPSEEK_V3 = ModelFamily(
    model_type="deepseek_v3",
    moe=True,
    mla=True,
    deepseek_moe=True,
    config_defaults=_DEEPSEEK_V3_DEFAULTS,
)

FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {
        "llama": ModelFamily(model_type="llama", config_defaults=_LLAMA_DEFAULTS),
        "mistral": ModelFamily(
            model_type="mistral",
            config_defaults=_defaults(
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
            ),
        ),
        "qwen2": ModelFamily(
            model_type="qwen2",
            qkv_bias=True,
            config_defaults=_defaults(
                vocab_size=151936,
                hidden_size=4096,
                intermediate_size=22016,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=32,
            ),
        ),
        "qwen3": ModelFamily(
            model_type="qwen3",
            qk_norm=True,
            qk_norm_first=True,
            config_defaults=_defaults(
                vocab_size=151936,
                hidden_size=4096,
                intermediate_size=22016,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=32,
                head_dim=128,
            ),
        ),
        "qwen3_moe": ModelFamily(
            model_type="qwen3_moe",
            qk_norm=True,
            moe=True,
            lm_head_when_tied=True,
            config_defaults=_defaults(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=24,
                num_attention_heads=32,
                num_key_value_heads=4,
                num_experts=128,
                moe_intermediate_size=768,
                decoder_sparse_step=1,
                mlp_only_layers=(),
            ),
        ),
        "deepseek_v3": _DEEPSEEK_V3,
        # Kimi-K2 checkpoints are DeepSeek-V3's architecture (`architectures` is
        # DeepseekV3ForCausalLM, SGLang serves them with that class) under their own
        # model_type, which transformers 5.24 does not know: an alias of the same family.
        "kimi_k2": _DEEPSEEK_V3,
    }
)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def family_for(model_type: str) -> ModelFamily:
    """The family of an HF ``model_type`` (an alias such as ``kimi_k2`` gives its family,
    whose ``model_type`` is the canonical one, ``deepseek_v3``).

    Raises:
        ValueError: the type is not supported; the message lists the supported ones.
    """
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return family
