"""`GenerationBounds`: how long a ``/generate`` request of a reference replica may be."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.server.http import ControlError


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationBounds:
    """The lengths a replica serves: prompt plus new tokens within the model's context, and
    no more new tokens than its limit.

    Attributes:
        context_length: the model's context length in tokens (``max_position_embeddings``).
        max_new_tokens_limit: the most new tokens one request may ask for.

    Raises:
        ValueError: a bound that is not a positive int.
    """

    context_length: int
    max_new_tokens_limit: int

    def __post_init__(self) -> None:
        for name in ("context_length", "max_new_tokens_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def of_model(
        cls, hf_config: Mapping[str, Any], *, max_new_tokens_limit: int | None = None
    ) -> GenerationBounds:
        """The bounds of the model `hf_config` describes; `max_new_tokens_limit` defaults to
        its context length.

        Raises:
            ValueError: the config has no positive ``max_position_embeddings``.
        """
        context_length = hf_config.get("max_position_embeddings")
        if isinstance(context_length, bool) or not isinstance(context_length, int):
            raise ValueError(
                "the model's config.json needs max_position_embeddings (an int: the context "
                f"length generation is bounded by), got {context_length!r}"
            )
        limit = context_length if max_new_tokens_limit is None else max_new_tokens_limit
        return cls(context_length=context_length, max_new_tokens_limit=limit)

    def check(self, *, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse a request that asks for too many tokens.

        Raises:
            ControlError: 400 naming the bound: `max_new_tokens` over the limit, or prompt
                plus `max_new_tokens` over the context length.
        """
        if max_new_tokens > self.max_new_tokens_limit:
            raise ControlError(
                f"sampling_params.max_new_tokens={max_new_tokens} is over this server's limit "
                f"of {self.max_new_tokens_limit} (weightsync serve --max-new-tokens-limit; by "
                f"default the model's context length, {self.context_length})",
                status_code=400,
            )
        total = num_prompt_tokens + max_new_tokens
        if total > self.context_length:
            raise ControlError(
                f"the prompt ({num_prompt_tokens} tokens) plus sampling_params.max_new_tokens "
                f"({max_new_tokens}) is {total} tokens, over the model's context length of "
                f"{self.context_length} (max_position_embeddings); send a shorter prompt or "
                "ask for fewer tokens",
                status_code=400,
            )
