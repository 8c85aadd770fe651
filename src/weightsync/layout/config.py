"""Reading an HF config (transformers object or config.json dict) into the sizes layout needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.layout.dtypes import resolve_dtype_name
from weightsync.layout.families import family_for

# config.json spellings that differ from the name used here. transformers 5 saves
# qwen3_moe's expert count as `num_local_experts`.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "num_local_experts"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDims:
    """The sizes of a model that decide its parameter layout; hashable, so layouts can cache.

    Attributes mirror the HF config keys of the same names; ``dtype`` is the checkpoint's
    dtype name (``"bfloat16"``); MoE fields are zero / empty for dense families.

    Raises:
        ValueError: a size is not a positive int, or the heads do not group evenly.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    dtype: str
    num_experts: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        family = family_for(self.model_type)
        sizes = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "decoder_sparse_step",
        ]
        if family.moe:
            sizes += ["num_experts", "moe_intermediate_size"]
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{self.model_type} config: {name} must be a positive int, got {value!r}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.model_type} config: num_attention_heads={self.num_attention_heads} "
                f"must be a multiple of num_key_value_heads={self.num_key_value_heads}"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the sparse MoE block (transformers' rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


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
    ``hidden_size // num_attention_heads`` (qwen3's config class defaults it to 128).

    Raises:
        ValueError: no or unsupported ``model_type``, a bad size, or a feature the layout rules
            do not cover (``attention_bias`` / ``mlp_bias``).
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
    hidden_size = get("hidden_size")
    head_dim = get("head_dim")
    if head_dim is None and isinstance(num_heads, int) and isinstance(hidden_size, int):
        head_dim = hidden_size // num_heads if num_heads > 0 else None
    num_kv_heads = get("num_key_value_heads")
    if num_kv_heads is None:
        num_kv_heads = num_heads
    dtype = data.get("dtype")
    if dtype is None:
        dtype = data.get("torch_dtype")
    moe_fields: dict[str, Any] = {}
    if family.moe:
        moe_fields = {
            "num_experts": get("num_experts"),
            "moe_intermediate_size": get("moe_intermediate_size"),
            "decoder_sparse_step": get("decoder_sparse_step"),
            "mlp_only_layers": tuple(sorted(set(get("mlp_only_layers") or ()))),
        }
    return ModelDims(
        model_type=family.model_type,
        vocab_size=get("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        dtype=resolve_dtype_name(dtype) if dtype is not None else "float32",
        **moe_fields,
    )


def normalize_hf_config(hf_config: Any) -> dict[str, Any]:
    """``hf_config`` reduced to the keys the layout rules read, with defaults filled in.

    Args:
        hf_config: a transformers config object or a config.json dict.

    Returns:
        A JSON-serialisable dict: ``model_type``, ``vocab_size``, ``hidden_size``,
        ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings``, ``dtype`` and, for MoE
        families, ``num_experts``, ``moe_intermediate_size``, ``decoder_sparse_step``,
        ``mlp_only_layers`` (a list). Feeding it back in gives the same layout.

    Raises:
        ValueError: as for `model_dims`.
    """
    dims = model_dims(hf_config)
    data = {f.name: getattr(dims, f.name) for f in dataclasses.fields(dims)}
    if family_for(dims.model_type).moe:
        data["mlp_only_layers"] = list(dims.mlp_only_layers)
    else:
        for name in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
            del data[name]
        del data["mlp_only_layers"]
    return data


def model_dtype(hf_config: Any) -> str:
    """The checkpoint dtype name of ``hf_config`` (``dtype`` or ``torch_dtype``; float32 if none).

    Raises:
        ValueError: as for `model_dims`.
    """
    return model_dims(hf_config).dtype
