"""Vocabulary-parallel tables (``embed_tokens``, ``lm_head``): padded rows split over a group."""

from __future__ import annotations

from weightsync.layout.config import ModelDims
from weightsync.layout.segments import SegmentBuilder
from weightsync.layout.types import ParamLayout


def vocab_param(
    name: str, hf_name: str, dims: ModelDims, rows: tuple[int, int], dtype: str
) -> ParamLayout:
    """A vocabulary-parallel parameter ``name`` loaded from HF tensor ``hf_name``.

    The rank holds rows ``rows`` of the padded table (``RankPartition.vocab_rows`` or
    ``lm_head_rows``): the real vocabulary rows among them first, then zero padding for rows
    at or past ``vocab_size``.
    """
    hidden, vocab = dims.hidden_size, dims.vocab_size
    start, stop = rows
    num_real = max(0, min(stop, vocab) - start)
    builder = SegmentBuilder()
    builder.add_rows(hf_name, (vocab, hidden), (start, start + num_real))
    builder.add_padding((stop - start - num_real) * hidden)
    return builder.build(name, (stop - start, hidden), dtype)
