"""Reference tokens for checking a sync: what the trainer's model generates, and what the
replicas serve."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import Any

import torch

from weightsync.control import RolloutClient
from weightsync.export import ModelExport
from weightsync.export.quantize import dequantize_block_fp8, quantize_block_fp8
from weightsync.layout.quant import is_quantized_hf_name


@torch.inference_mode()
def greedy_tokens(
    model: Any,
    dtype: torch.dtype,
    prompts: tuple[tuple[int, ...], ...],
    max_new_tokens: int,
    *,
    fp8_block: int = 0,
) -> list[list[int]]:
    """Greedy tokens of the trainer's model with its weights rounded to the rollout dtype.

    The rollout holds the weights in `dtype` and computes in float32, so rounding the trainer
    weights the same way gives the tokens a correct rollout must produce. For a block-FP8
    rollout (`fp8_block`), its linear weights are the dequantised block-FP8 values instead
    (quantised as `weightsync.export.Fp8Export` does), the rest rounded to `dtype`.
    """
    ref = copy.deepcopy(model).eval()
    quantised: set[int] = set()
    if fp8_block:
        for name, view in ModelExport(ref):
            if is_quantized_hf_name(name) and view.dim() == 2:
                codes, scales = quantize_block_fp8(view, block=fp8_block)
                view.detach().copy_(dequantize_block_fp8(codes, scales, block=fp8_block))
                quantised.add(view.untyped_storage().data_ptr())
    for param in ref.parameters():
        if param.untyped_storage().data_ptr() not in quantised:
            param.data = param.data.to(dtype).to(torch.float32)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        new: list[int] = []
        for _ in range(max_new_tokens):
            token = int(ref(input_ids=ids).logits[0, -1].argmax())
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        outputs.append(new)
    return outputs


async def served_tokens(
    urls: Sequence[str],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    api_key: str | None = None,
    timeout_s: float = 120.0,
) -> dict[str, list[list[int]]]:
    """Each replica's greedy tokens for each prompt (``{url: [tokens per prompt]}``), asked
    of every replica at once.

    Raises:
        RemoteReplicaError: a replica refused or could not be reached.
    """

    async def one(url: str) -> list[list[int]]:
        async with RolloutClient(url, api_key=api_key, timeout_s=timeout_s) as client:
            replies = await asyncio.gather(
                *(
                    client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0)
                    for prompt in prompts
                )
            )
        return [list(reply.output_ids) for reply in replies]

    results = await asyncio.gather(*(one(url) for url in urls))
    return dict(zip(urls, results, strict=True))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One real optimizer step of a transformers causal LM on a seeded random batch (two
    sequences of 12 tokens, the labels the inputs)."""
    batch = torch.randint(
        0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed)
    )
    optimizer.zero_grad()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
