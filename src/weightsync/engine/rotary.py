"""Rotary position embedding (RoPE): default, linear, llama3 and YaRN frequency scaling."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``),
    as transformers' and SGLang's ``yarn_get_mscale`` compute it."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeConfig:
    """How rotary frequencies are computed.

    Attributes:
        theta: the base wavelength (``rope_theta``).
        rope_type: ``"default"``, ``"linear"``, ``"llama3"`` or ``"yarn"``.
        factor: the scaling factor (linear, llama3 and yarn).
        low_freq_factor: llama3's low-frequency factor.
        high_freq_factor: llama3's high-frequency factor.
        original_max_position_embeddings: llama3's and yarn's pre-training context length.
        beta_fast: yarn's rotation count where extrapolation ends.
        beta_slow: yarn's rotation count where interpolation begins.
        mscale: yarn's ``mscale`` (None when the config gives none).
        mscale_all_dim: yarn's ``mscale_all_dim`` (None when the config gives none).

    Raises:
        ValueError: an unsupported type, a non-positive theta or factor, or yarn settings on
            which transformers and SGLang scale the rotary tables differently.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; choose one of "
                f"{', '.join(_ROPE_TYPES)}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"RopeConfig: theta and factor must be positive, got {self}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("RopeConfig: llama3 needs high_freq_factor > low_freq_factor")
        if self.rope_type == "yarn":
            # SGLang's DeepseekScalingRotaryEmbedding scales cos/sin by
            # mscale(f, mscale or 1) / mscale(f, mscale_all_dim or 0); transformers only when
            # both are given, else by mscale(f). Serve only settings on which they agree.
            sglang = yarn_mscale(self.factor, self.mscale or 1.0) / yarn_mscale(
                self.factor, self.mscale_all_dim or 0.0
            )
            if abs(sglang - self.attention_factor) > 1e-12:
                raise ValueError(
                    f"rope_scaling mscale={self.mscale}, mscale_all_dim={self.mscale_all_dim}: "
                    f"transformers scales the rotary tables by {self.attention_factor}, SGLang "
                    f"by {sglang}; give both mscale and mscale_all_dim"
                )

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's ``attention_factor``; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @classmethod
    def from_hf_config(cls, data: Mapping[str, Any]) -> RopeConfig:
        """Read RoPE settings from a config.json dict.

        Both spellings are read: transformers 5's ``rope_parameters`` and the older
        ``rope_theta`` + ``rope_scaling``.

        Raises:
            ValueError: an unsupported RoPE type, a partial rotary factor, or yarn without a
                ``factor``, with an explicit ``attention_factor`` or with ``truncate: false``
                (SGLang has neither).
        """
        params = dict(data.get("rope_scaling") or {})
        params.update(data.get("rope_parameters") or {})
        theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("a partial_rotary_factor other than 1.0 is not supported")
        kwargs: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
        if rope_type in ("linear", "llama3", "yarn"):
            if params.get("factor") is None:
                raise ValueError(f"rope_type {rope_type!r} needs a factor")
            kwargs["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kwargs["low_freq_factor"] = float(params["low_freq_factor"])
            kwargs["high_freq_factor"] = float(params["high_freq_factor"])
        if rope_type in ("llama3", "yarn"):
            kwargs["original_max_position_embeddings"] = int(
                params.get(
                    "original_max_position_embeddings", data.get("max_position_embeddings", 8192)
                )
            )
        if rope_type == "yarn":
            for key in ("attention_factor", "attn_factor"):
                if params.get(key) is not None:
                    raise ValueError(
                        f"rope_scaling {key}={params[key]} is not supported (transformers and "
                        "SGLang apply it differently); leave it out"
                    )
            if params.get("truncate", True) is not True:
                raise ValueError("rope_scaling truncate=False is not supported (SGLang truncates)")
            # transformers reads these with `or`: a zero or missing value takes the default.
            kwargs["beta_fast"] = float(params.get("beta_fast") or 32)
            kwargs["beta_slow"] = float(params.get("beta_slow") or 1)
            for key in ("mscale", "mscale_all_dim"):
                if params.get(key) is not None:
                    kwargs[key] = float(params[key])
        return cls(**kwargs)

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        """The ``head_dim // 2`` inverse frequencies, float32 on CPU."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "default":
            return inv_freq
        if self.rope_type == "yarn":
            return self._yarn_inverse_frequencies(head_dim)
        # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly.
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def _yarn_inverse_frequencies(self, dim: int) -> torch.Tensor:
        # YaRN: high frequencies (many rotations over the original context) are kept, low ones
        # interpolated by `factor`, with a linear ramp between the two correction dims.
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
        extrapolated = 1.0 / pos_freqs
        interpolated = 1.0 / (self.factor * pos_freqs)

        def correction_dim(num_rotations: float) -> float:
            context = self.original_max_position_embeddings
            return (dim * math.log(context / (num_rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # transformers' and SGLang's guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return interpolated * (1 - extrapolation) + extrapolated * extrapolation


class RotaryEmbedding(torch.nn.Module):
    """Computes the cos/sin tables for a batch of positions.

    Args:
        rope: the RoPE settings.
        rotary_dim: how many dims of a head are rotated (a whole head, or MLA's rope part).
        device: where the tables are computed.
    """

    def __init__(self, rope: RopeConfig, rotary_dim: int, device: torch.device) -> None:
        super().__init__()
        # Not persistent and not a parameter: it is derived from the config, never synced.
        self.register_buffer(
            "inv_freq", rope.inverse_frequencies(rotary_dim).to(device), persistent=False
        )
        self.attention_factor = rope.attention_factor

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(cos, sin)`` tables ``[num_tokens, rotary_dim]`` for ``positions``, in
        ``dtype``, scaled by the RoPE's attention factor."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, dim]`` by the tables of its positions
    (rotate-half: dim ``i`` pairs with dim ``i + dim / 2``)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of ``x`` ``[num_tokens, num_heads, dim]``
    (DeepSeek's ``rope_interleave``); the result is de-interleaved (``[evens; odds]``), as
    transformers returns it. Queries and keys get the same permutation, so their products
    are those of the interleaved rotation (SGLang's GPT-J style)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
