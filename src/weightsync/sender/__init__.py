"""The trainer side of a sync: stage a rank's HF tensors and write them into the rollout.

`WeightSender` executes one trainer rank's `SourcePlan` through a staging ring and a
`weightsync.transport.Transport`; `ModelExport` turns a model into the PP-local
``(hf_name, tensor)`` stream it consumes.
"""

from weightsync.export.hf import ModelExport, hf_state_items
from weightsync.sender.config import SenderConfig
from weightsync.sender.sender import WeightSender
from weightsync.sender.stats import PushStats

__all__ = ["ModelExport", "PushStats", "SenderConfig", "WeightSender", "hf_state_items"]
