"""Pure layout rules: which elements of which HF tensors make up each parameter of a rollout rank.

`rank_layout` gives a rank's parameter table (SGLang's names, shapes, dtype) with, for every
element, the HF tensor box it comes from or that it is padding; `shard_state_dict` applies the
same rule to real tensors. Nothing here touches torch.distributed or the network.
"""

from weightsync.layout.config import model_dtype, normalize_hf_config
from weightsync.layout.dtypes import dtype_name, torch_dtype
from weightsync.layout.families import SUPPORTED_MODEL_TYPES
from weightsync.layout.load import load_hf_tensors
from weightsync.layout.names import layer_index
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.partition import padded_vocab_size
from weightsync.layout.shard import shard_state_dict
from weightsync.layout.table import hf_tensor_shapes, rank_layout
from weightsync.layout.types import DTYPE_SIZES, ParamLayout, Segment

__all__ = [
    "DTYPE_SIZES",
    "SUPPORTED_MODEL_TYPES",
    "ParallelismConfig",
    "ParamLayout",
    "Segment",
    "dtype_name",
    "hf_tensor_shapes",
    "layer_index",
    "load_hf_tensors",
    "model_dtype",
    "normalize_hf_config",
    "padded_vocab_size",
    "rank_layout",
    "shard_state_dict",
    "torch_dtype",
]
