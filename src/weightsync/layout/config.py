"""Reading an HF config (transformers object or config.json dict) into the sizes layout needs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.layout.dtypes import resolve_dtype_name
from weightsync.layout.families import family_for
from weightsync.layout.quant import block_fp8_size, fp8_quantization_config

# config.json spellings that differ from the name used here. transformers 5 saves
# qwen3_moe's expert count as `num_local_experts`; DeepSeek-V3 calls it `n_routed_experts`.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
}

# The MLA sizes of the DeepSeek-V3 family, all positive ints (q_lora_rank may also be None).
_MLA_SIZES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDims:
    """The sizes of a model that decide its parameter layout; hashable, so layouts can cache.

    Attributes mirror the HF config keys of the same names (``num_experts`` is DeepSeek's
    ``n_routed_experts``); ``dtype`` is the checkpoint's dtype name (``"bfloat16"``). Fields a
    family does not have are zero / empty / None: the MoE fields for dense families,
    ``num_key_value_heads`` and ``head_dim`` for MLA (whose heads are made by ``kv_b_proj``,
    not grouped), the MLA and DeepSeek-MoE fields for every other family.
    ``fp8_block_size`` is the block of a block-FP8 checkpoint (`weightsync.layout.quant`),
    0 for an unquantised one.

    Raises:
        ValueError: a size is not a positive int, or the heads do not group evenly.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    tie_word_embeddings: bool
    dtype: str
    num_key_value_heads: int = 0
    head_dim: int = 0
    num_experts: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    fp8_block_size: int = 0

    def __post_init__(self) -> None:
        family = family_for(self.model_type)
        sizes = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ]
        if family.mla:
            sizes += list(_MLA_SIZES)
            if self.q_lora_rank is not None:
                sizes.append("q_lora_rank")
        else:
            sizes += ["num_key_value_heads", "head_dim"]
        if family.moe:
            sizes += ["num_experts", "moe_intermediate_size"]
        if family.deepseek_moe:
            sizes.append("n_shared_experts")
        else:
            sizes.append("decoder_sparse_step")
        for name in sizes:
            _require_positive(self.model_type, name, getattr(self, name))
        if family.deepseek_moe:
            value = self.first_k_dense_replace
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{self.model_type} config: first_k_dense_replace must be an int >= 0, "
                    f"got {value!r}"
                )
        if self.fp8_block_size and not family.deepseek_moe:
            raise ValueError(
                f"{self.model_type} config: block-FP8 checkpoints are laid out for the "
                "DeepSeek-V3 family only"
            )
        if not family.mla and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.model_type} config: num_attention_heads={self.num_attention_heads} "
                f"must be a multiple of num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def qk_head_dim(self) -> int:
        """MLA: the size of one query/key head, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the sparse MoE block (transformers' rule).

        DeepSeek: every layer from ``first_k_dense_replace`` on (SGLang also reads
        ``moe_layer_freq``, which `model_dims` requires to be 1); qwen3_moe: every
        ``decoder_sparse_step``-th layer not in ``mlp_only_layers``.
        """
        if self.num_experts == 0:
            return False
        if family_for(self.model_type).deepseek_moe:
            return layer >= self.first_k_dense_replace
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def _require_positive(model_type: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{model_type} config: {name} must be a positive int, got {value!r}")


def config_data(hf_config: Any) -> dict[str, Any]:
    """A config.json-style dict of a transformers config object or a mapping.

    Raises:
        ValueError: ``hf_config`` is neither a mapping nor has ``to_dict()``.
    """
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        raise ValueError(
            f"hf_config must be a transformers config or a config.json dict, got "
            f"{type(hf_config).__name__}"
        )
    return dict(to_dict())


def _lookup(data: Mapping[str, Any], defaults: Mapping[str, Any], key: str) -> Any:
    for alias in _ALIASES.get(key, (key,)):
        if data.get(alias) is not None:
            return data[alias]
    return defaults.get(key)


def model_dims(hf_config: Any) -> ModelDims:
    """The layout-relevant sizes of ``hf_config`` (a transformers config or config.json dict).

    Keys a config.json leaves out take their transformers 5 defaults for that model type;
    ``num_key_value_heads`` defaults to ``num_attention_heads`` and ``head_dim`` to
    ``hidden_size // num_attention_heads`` (qwen3's config class defaults it to 128). For the
    DeepSeek-V3 family (``deepseek_v3``, and Kimi-K2's ``kimi_k2``) an explicit
    ``q_lora_rank: null`` means no q low-rank projection (DeepSeek-V2-Lite style).

    Raises:
        ValueError: no or unsupported ``model_type``, a bad size, or a feature the layout rules
            do not cover (``attention_bias`` / ``mlp_bias``; for DeepSeek, a
            ``moe_layer_freq`` other than 1 or a ``topk_method`` other than ``noaux_tc``).
    """
    data = config_data(hf_config)
    family = family_for(data.get("model_type"))
    defaults = family.config_defaults

    def get(key: str) -> Any:
        return _lookup(data, defaults, key)

    for flag in ("attention_bias", "mlp_bias"):
        if get(flag):
            raise ValueError(
                f"{family.model_type} config: {flag}=True is not supported by weightsync's "
                "layout rules"
            )
    num_heads = get("num_attention_heads")
    dtype = data.get("dtype")
    if dtype is None:
        dtype = data.get("torch_dtype")
    fields: dict[str, Any] = {}
    if family.mla:
        fields = {name: get(name) for name in _MLA_SIZES}
        # None is a value here (no q_lora), so a present key wins even when it is null.
        fields["q_lora_rank"] = (
            data["q_lora_rank"] if "q_lora_rank" in data else defaults["q_lora_rank"]
        )
    else:
        hidden_size = get("hidden_size")
        head_dim = get("head_dim")
        if head_dim is None and isinstance(num_heads, int) and isinstance(hidden_size, int):
            head_dim = hidden_size // num_heads if num_heads > 0 else None
        num_kv_heads = get("num_key_value_heads")
        fields = {
            "head_dim": head_dim,
            "num_key_value_heads": num_heads if num_kv_heads is None else num_kv_heads,
        }
    if family.moe:
        fields |= {
            "num_experts": get("num_experts"),
            "moe_intermediate_size": get("moe_intermediate_size"),
        }
    if family.deepseek_moe:
        _check_deepseek_moe(family.model_type, get)
        fields |= {
            "n_shared_experts": get("n_shared_experts"),
            "first_k_dense_replace": get("first_k_dense_replace"),
        }
    elif family.moe:
        fields |= {
            "decoder_sparse_step": get("decoder_sparse_step"),
            "mlp_only_layers": tuple(sorted(set(get("mlp_only_layers") or ()))),
        }
    return ModelDims(
        model_type=family.model_type,
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=num_heads,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        dtype=resolve_dtype_name(dtype) if dtype is not None else "float32",
        fp8_block_size=block_fp8_size(data.get("quantization_config"), family.model_type),
        **fields,
    )


def _check_deepseek_moe(model_type: str, get: Callable[[str], Any]) -> None:
    """Refuse the DeepSeek MoE variants whose parameters SGLang lays out differently."""
    # SGLang makes layer i sparse iff i >= first_k_dense_replace and i % moe_layer_freq == 0;
    # transformers ignores moe_layer_freq. Only 1 makes the two agree.
    freq = get("moe_layer_freq")
    if freq != 1:
        raise ValueError(
            f"{model_type} config: moe_layer_freq={freq!r} is not supported (transformers "
            "ignores it, SGLang skips MoE layers by it); use 1"
        )
    # SGLang's router has e_score_correction_bias only with noaux_tc; transformers always has it.
    topk_method = get("topk_method")
    if topk_method != "noaux_tc":
        raise ValueError(
            f"{model_type} config: topk_method={topk_method!r} is not supported; weightsync "
            "lays out DeepSeek-V3's router (topk_method 'noaux_tc', with "
            "e_score_correction_bias)"
        )


def normalize_hf_config(hf_config: Any) -> dict[str, Any]:
    """``hf_config`` reduced to the keys the layout rules read, with defaults filled in.

    Args:
        hf_config: a transformers config object or a config.json dict.

    Returns:
        A JSON-serialisable dict: ``model_type`` (an alias's canonical type: ``kimi_k2``
        gives ``deepseek_v3``), ``vocab_size``, ``hidden_size``, ``intermediate_size``,
        ``num_hidden_layers``, ``num_attention_heads``, ``tie_word_embeddings``, ``dtype``;
        for grouped-head attention ``num_key_value_heads`` and ``head_dim``; for MLA
        ``q_lora_rank`` (None without), ``kv_lora_rank``, ``qk_nope_head_dim``,
        ``qk_rope_head_dim``, ``v_head_dim``; for MoE families ``num_experts`` and
        ``moe_intermediate_size``, then qwen3_moe's ``decoder_sparse_step`` and
        ``mlp_only_layers`` (a list) or DeepSeek's ``n_shared_experts`` and
        ``first_k_dense_replace``; for a block-FP8 checkpoint its ``quantization_config``.
        Feeding it back in gives the same layout.

    Raises:
        ValueError: as for `model_dims`.
    """
    dims = model_dims(hf_config)
    family = family_for(dims.model_type)
    names = [
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "tie_word_embeddings",
        "dtype",
    ]
    if family.mla:
        names += ["q_lora_rank", *_MLA_SIZES]
    else:
        names += ["num_key_value_heads", "head_dim"]
    if family.moe:
        names += ["num_experts", "moe_intermediate_size"]
    if family.deepseek_moe:
        names += ["n_shared_experts", "first_k_dense_replace"]
    elif family.moe:
        names += ["decoder_sparse_step", "mlp_only_layers"]
    data = {name: getattr(dims, name) for name in names}
    if "mlp_only_layers" in data:
        data["mlp_only_layers"] = list(dims.mlp_only_layers)
    if dims.fp8_block_size:
        data["quantization_config"] = fp8_quantization_config(dims.fp8_block_size)
    return data


def model_dtype(hf_config: Any) -> str:
    """The checkpoint dtype name of ``hf_config`` (``dtype`` or ``torch_dtype``; float32 if none).

    Raises:
        ValueError: as for `model_dims`.
    """
    return model_dims(hf_config).dtype
