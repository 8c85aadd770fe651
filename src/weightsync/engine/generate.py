"""Incremental generation for one sequence: prefill, then one token per step from a KV cache."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from weightsync.engine.model import ReferenceModel

MIN_SAMPLING_TEMPERATURE = 1e-5
"""The lowest temperature sampled at (0 is greedy): the logits are divided by it in float32,
where a subnormal temperature is zero and smaller ones overflow; the HTTP protocol's floor
(`weightsync.control.models.MIN_TEMPERATURE`) is the same."""


def _check_request(
    model: ReferenceModel, input_ids: Sequence[int], max_new_tokens: int, temperature: float
) -> None:
    if not input_ids:
        raise ValueError("input_ids must hold at least one token")
    vocab_size = model.spec.vocab_size
    bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids must be ints in [0, {vocab_size}), got {bad[:5]}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if 0 < temperature < MIN_SAMPLING_TEMPERATURE:
        raise ValueError(
            f"temperature must be 0 (greedy) or at least {MIN_SAMPLING_TEMPERATURE:g}, "
            f"got {temperature!r}"
        )


def _next_token(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """The chosen token ``[1]`` (int64) from ``logits`` ``[vocab]``."""
    if temperature == 0:
        return torch.argmax(logits).reshape(1)
    probs = torch.softmax(logits.to(torch.float32) / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.inference_mode()
def generate(
    model: ReferenceModel,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
) -> list[int]:
    """Continue ``input_ids`` by up to ``max_new_tokens`` tokens.

    Every TP rank of the model calls this with the same arguments (the forward passes run
    collectives) and gets the same tokens: TP rank 0 picks each token and broadcasts it, so
    the ranks cannot drift apart. There is no stop token: exactly ``max_new_tokens`` tokens
    are generated.

    Args:
        model: the rank's loaded model.
        input_ids: the prompt's token ids, each in ``[0, vocab_size)``.
        max_new_tokens: how many tokens to generate (0 returns ``[]``).
        temperature: 0 for greedy decoding, else sampling from ``softmax(logits / T)``.
        seed: seeds the sampler (same seed, same tokens); ``None`` draws a fresh seed. Unused
            when greedy.

    Returns:
        The generated token ids, without the prompt.

    Raises:
        ValueError: an empty prompt, an id outside the vocabulary, a negative
            ``max_new_tokens``, a negative temperature or one between 0 and
            `MIN_SAMPLING_TEMPERATURE`.
    """
    input_ids = list(input_ids)
    _check_request(model, input_ids, max_new_tokens, temperature)
    if max_new_tokens == 0:
        return []
    device = model.device
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
    # The last generated token is never fed back, so the cache needs one position less.
    cache = model.new_cache(len(input_ids) + max_new_tokens - 1)
    tokens = torch.tensor(input_ids, dtype=torch.int64, device=device)
    positions = torch.arange(len(input_ids), dtype=torch.int64, device=device)
    generated: list[int] = []
    for step in range(max_new_tokens):
        hidden = model.hidden_states(tokens, positions, cache)
        logits = model.compute_logits(hidden[-1:])[0]
        tokens = model.tp_group.broadcast_from_first(_next_token(logits, temperature, generator))
        generated.append(int(tokens.item()))
        positions = torch.tensor([len(input_ids) + step], dtype=torch.int64, device=device)
    return generated
