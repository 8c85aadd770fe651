"""Pure layout rules: which elements of which HF tensors make up each parameter of a rollout rank.

`rank_layout` gives a rank's parameter table (SGLang's names, shapes, dtype) with, for every
element, the HF tensor box it comes from or that it is padding. Plain functions over shapes
and names: nothing here imports torch, touches tensor memory or the network (the engine-side
loader that applies the rule to real tensors is `weightsync.receiver.loader`).
"""

from weightsync.layout.config import config_data, model_dtype, normalize_hf_config
from weightsync.layout.dtypes import (
    DTYPE_ALIASES,
    DTYPE_SIZES,
    canonical_dtype_name,
    dtype_size,
    resolve_dtype_name,
)
from weightsync.layout.families import SUPPORTED_MODEL_TYPES
from weightsync.layout.names import layer_index
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.partition import padded_vocab_size
from weightsync.layout.shared_experts import sglang_fuses_shared_experts
from weightsync.layout.table import as_parallelism, hf_tensor_shapes, rank_layout
from weightsync.layout.types import ParamLayout, Segment

__all__ = [
    "DTYPE_ALIASES",
    "DTYPE_SIZES",
    "SUPPORTED_MODEL_TYPES",
    "ParallelismConfig",
    "ParamLayout",
    "Segment",
    "as_parallelism",
    "canonical_dtype_name",
    "config_data",
    "dtype_size",
    "hf_tensor_shapes",
    "layer_index",
    "model_dtype",
    "normalize_hf_config",
    "padded_vocab_size",
    "rank_layout",
    "resolve_dtype_name",
    "sglang_fuses_shared_experts",
]
