"""The cache of one sequence: keys and values of this rank's KV heads, or MLA's compressed
latents."""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's slice of a `KVCache`.

    Args:
        keys: ``[capacity, num_kv_heads, head_dim]``.
        values: same shape as ``keys``.
        owner: the cache, which knows how many positions the current forward pass sees.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: SequenceCache) -> None:
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


class LatentLayerCache:
    """One layer's slice of a `LatentCache`.

    Args:
        entries: ``[capacity, entry_dim]``.
        owner: the cache, which knows how many positions the current forward pass sees.
    """

    def __init__(self, entries: torch.Tensor, owner: SequenceCache) -> None:
        self.entries = entries
        self.owner = owner

    def store(self, entries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Store new entries ``[num_tokens, entry_dim]`` at ``positions``; returns the entries
        of positions ``[0, end)``, ``end`` one past the last position of this forward pass."""
        self.entries[positions] = entries
        return self.entries[: self.owner.end]


class SequenceCache:
    """What every cache of one sequence shares: its capacity and the current forward pass.

    Call protocol, per forward pass: the model calls `begin_forward` with the positions of
    the new tokens, then each layer stores its entries through ``layer(i)``. The new
    positions must continue the sequence (prefill ``0..n-1``, then ``n``, ``n+1``, ...):
    the queries attend to every stored position up to their own.

    Args:
        capacity: the most positions the sequence may reach.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self.end = 0

    @property
    def capacity(self) -> int:
        """The most positions the cache holds."""
        return self._capacity

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


def _check_sizes(owner: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{owner}.{name} must be positive, got {value}")


class KVCache(SequenceCache):
    """Keys and values of one sequence for every layer, up to ``capacity`` positions (see
    `SequenceCache` for the call protocol).

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
        _check_sizes(
            "KVCache",
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            capacity=capacity,
        )
        super().__init__(capacity)
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._layers = [LayerCache(self.keys[i], self.values[i], self) for i in range(num_layers)]

    def layer(self, index: int) -> LayerCache:
        """The cache of decoder layer ``index``."""
        return self._layers[index]


class LatentCache(SequenceCache):
    """MLA's compressed cache of one sequence (see `SequenceCache` for the call protocol).

    Per layer and position it holds one entry shared by every head: the normalised kv latent
    then the rotated rope key, ``kv_lora_rank + qk_rope_head_dim`` values (SGLang's MLA
    cache; keys and values are re-made from it through ``w_kc`` / ``w_vc``).

    Args:
        num_layers: decoder layers of the model.
        entry_dim: values per entry, ``kv_lora_rank + qk_rope_head_dim``.
        capacity: the most positions the sequence may reach.
        dtype: dtype of the entries (the model's compute dtype).
        device: where they live (the model's device).

    Raises:
        ValueError: a size is not positive.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        entry_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        _check_sizes("LatentCache", num_layers=num_layers, entry_dim=entry_dim, capacity=capacity)
        super().__init__(capacity)
        self.entries = torch.zeros((num_layers, capacity, entry_dim), dtype=dtype, device=device)
        self._layers = [LatentLayerCache(self.entries[i], self) for i in range(num_layers)]

    def layer(self, index: int) -> LatentLayerCache:
        """The cache of decoder layer ``index``."""
        return self._layers[index]
