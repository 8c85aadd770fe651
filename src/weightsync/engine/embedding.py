"""The vocab-parallel embedding and the parallel LM head.

The vocabulary is padded (to a multiple of 64 in SGLang's layout) and split into equal
contiguous row blocks, one per TP rank; padding rows are zero and never selected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightsync.engine.linear import as_compute
from weightsync.engine.tp_group import TensorParallelGroup


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding whose rows are split over the TP ranks.

    Args:
        weight: this rank's ``[padded_vocab / tp_size, hidden]`` block.
        tp_group: the TP ranks that hold the other blocks.
        compute_dtype: the dtype of the embeddings it returns (default: the weight's).
    """

    def __init__(
        self,
        weight: torch.nn.Parameter,
        tp_group: TensorParallelGroup,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.tp_group = tp_group
        self.vocab_start = tp_group.tp_rank * weight.shape[0]
        self.compute_dtype = compute_dtype or weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed ``input_ids`` ``[num_tokens]`` -> ``[num_tokens, hidden]``, all ranks equal."""
        if self.tp_group.tp_size == 1:
            return F.embedding(input_ids, self.weight).to(self.compute_dtype)
        # Ids outside this rank's block look up row 0 and are zeroed; the all-reduce then
        # brings in the rank that owns them.
        local_ids = input_ids - self.vocab_start
        in_block = (local_ids >= 0) & (local_ids < self.weight.shape[0])
        embedded = F.embedding(local_ids.masked_fill(~in_block, 0), self.weight)
        embedded = embedded.to(self.compute_dtype)
        embedded = embedded.masked_fill(~in_block[:, None], 0)
        return self.tp_group.all_reduce(embedded)


class ParallelLMHead(torch.nn.Module):
    """The untied LM head: this rank's ``[padded_vocab / tp_size, hidden]`` block.

    Args:
        weight: the block; `parallel_lm_head` turns it into logits.
    """

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def parallel_lm_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tp_group: TensorParallelGroup,
    vocab_size: int,
) -> torch.Tensor:
    """Logits over the real vocabulary from this rank's LM-head block.

    Args:
        hidden: ``[num_tokens, hidden]``, equal on every rank.
        weight: this rank's ``[padded_vocab / tp_size, hidden]`` block (the LM head's, or the
            embedding's when the embeddings are tied).
        tp_group: the TP ranks that hold the other blocks.
        vocab_size: the real vocabulary size; padding columns are cut off.

    Returns:
        ``[num_tokens, vocab_size]``, equal on every rank.
    """
    logits = tp_group.all_gather_last_dim(F.linear(hidden, as_compute(weight, hidden)))
    return logits[..., :vocab_size]
