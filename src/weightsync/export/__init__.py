"""What turns a trainer's model into the PP-local stream of HF tensors a sync reads."""

from weightsync.export.hf import ModelExport, hf_state_items

__all__ = ["ModelExport", "hf_state_items"]
