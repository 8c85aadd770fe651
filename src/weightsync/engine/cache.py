"""The KV cache of one sequence: preallocated keys and values of this rank's KV heads."""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's slice of a `KVCache`.

    Args:
        keys: ``[capacity, num_kv_heads, head_dim]``.
        values: same shape as ``keys``.
        owner: the cache, which knows how many positions the current forward pass sees.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: KVCache) -> None:
        self.keys = keys
        self.values = values
        self.owner = owner

    def store(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values at ``positions`` and return all of positions ``[0, end)``.

        Args:
            keys: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens.
            values: same shape as ``keys``.
            positions: ``[num_tokens]`` positions of the new tokens.

        Returns:
            ``(keys, values)`` ``[end, num_kv_heads, head_dim]``, where ``end`` is one past
            the last position of this forward pass.
        """
        self.keys[positions] = keys
        self.values[positions] = values
        end = self.owner.end
        return self.keys[:end], self.values[:end]


class KVCache:
    """Keys and values of one sequence for every layer, up to ``capacity`` positions.

    Call protocol, per forward pass: the model calls `begin_forward` with the positions of
    the new tokens, then each layer stores its keys and values through `layer(i)`. The new
    positions must continue the sequence (prefill ``0..n-1``, then ``n``, ``n+1``, ...):
    the queries attend to every stored position up to their own.

    Args:
        num_layers: decoder layers of the model.
        num_kv_heads: KV heads on this rank.
        head_dim: size of one head.
        capacity: the most positions the sequence may reach.
        dtype: dtype of the keys and values (the model's).
        device: where they live (the model's device).

    Raises:
        ValueError: a size is not positive.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("capacity", capacity),
        ):
            if value < 1:
                raise ValueError(f"KVCache.{name} must be positive, got {value}")
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.end = 0
        self._layers = [LayerCache(self.keys[i], self.values[i], self) for i in range(num_layers)]

    @property
    def capacity(self) -> int:
        """The most positions the cache holds."""
        return self.keys.shape[1]

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Prepare for a forward pass over new tokens at ``positions``.

        Raises:
            ValueError: a position is negative or beyond the capacity.
        """
        first, last = int(positions.min()), int(positions.max())
        if first < 0 or last >= self.capacity:
            raise ValueError(
                f"positions {first}..{last} do not fit a KV cache of {self.capacity} positions"
            )
        self.end = last + 1

    def layer(self, index: int) -> LayerCache:
        """The cache of decoder layer ``index``."""
        return self._layers[index]
