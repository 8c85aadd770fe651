"""What turns a trainer's model into the PP-local stream of HF tensors a sync reads.

`WeightExport` is the protocol; `ModelExport` exports a transformers model (or its state
dict) by pipeline stage, `TensorsExport` a mapping already in HF names; `Fp8Export` turns
any of them into the block-FP8 checkpoint of an FP8 rollout.
"""

from weightsync.export.base import ViewExport, WeightExport
from weightsync.export.fp8 import Fp8Export
from weightsync.export.hf import ModelExport, TensorsExport, hf_state_items

__all__ = [
    "Fp8Export",
    "ModelExport",
    "TensorsExport",
    "ViewExport",
    "WeightExport",
    "hf_state_items",
]
