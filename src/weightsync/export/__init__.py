"""What turns a trainer's model into the PP-local stream of HF tensors a sync reads.

`WeightExport` is the protocol; `ModelExport` exports a transformers model (or its state
dict) by pipeline stage, `TensorsExport` a mapping already in HF names.
"""

from weightsync.export.base import ViewExport, WeightExport
from weightsync.export.hf import ModelExport, TensorsExport, hf_state_items

__all__ = ["ModelExport", "TensorsExport", "ViewExport", "WeightExport", "hf_state_items"]
