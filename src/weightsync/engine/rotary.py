"""Rotary position embedding (RoPE): default, linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeConfig:
    """How rotary frequencies are computed.

    Attributes:
        theta: the base wavelength (``rope_theta``).
        rope_type: ``"default"``, ``"linear"`` or ``"llama3"``.
        factor: the scaling factor (linear and llama3).
        low_freq_factor: llama3's low-frequency factor.
        high_freq_factor: llama3's high-frequency factor.
        original_max_position_embeddings: llama3's pre-training context length.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

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

    @classmethod
    def from_hf_config(cls, data: Mapping[str, Any]) -> RopeConfig:
        """Read RoPE settings from a config.json dict.

        Both spellings are read: transformers 5's ``rope_parameters`` and the older
        ``rope_theta`` + ``rope_scaling``.

        Raises:
            ValueError: an unsupported RoPE type or a partial rotary factor.
        """
        params = dict(data.get("rope_scaling") or {})
        params.update(data.get("rope_parameters") or {})
        theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("a partial_rotary_factor other than 1.0 is not supported")
        kwargs: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
        if rope_type in ("linear", "llama3"):
            kwargs["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kwargs["low_freq_factor"] = float(params["low_freq_factor"])
            kwargs["high_freq_factor"] = float(params["high_freq_factor"])
            kwargs["original_max_position_embeddings"] = int(
                params.get(
                    "original_max_position_embeddings", data.get("max_position_embeddings", 8192)
                )
            )
        return cls(**kwargs)

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        """The ``head_dim // 2`` inverse frequencies, float32 on CPU."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "default":
            return inv_freq
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


class RotaryEmbedding(torch.nn.Module):
    """Computes the cos/sin tables for a batch of positions.

    Args:
        rope: the RoPE settings.
        head_dim: size of one attention head (all of it is rotated).
        device: where the tables are computed.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        super().__init__()
        # Not persistent and not a parameter: it is derived from the config, never synced.
        self.register_buffer(
            "inv_freq", rope.inverse_frequencies(head_dim).to(device), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(cos, sin)`` tables ``[num_tokens, head_dim]`` for ``positions``, in ``dtype``."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` by the tables of its positions."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
