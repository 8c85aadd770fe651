"""What turns a trainer's model into the stream of HF tensors a sync reads.

`WeightExport` is the protocol (`ExportDefaults` gives its optional parts); `ModelExport`
exports a transformers model (or its state dict) by pipeline stage, `TensorsExport` a mapping
already in HF names; `Fp8Export` turns any of them into the block-FP8 checkpoint of an FP8
rollout; `CheckpointExport` reads a checked safetensors checkpoint from disk; `MegatronExport`
(`weightsync.export.megatron`) a Megatron-core rank's TP / PP / EP slices and `FSDPExport`
(`weightsync.export.fsdp`) an FSDP2 rank's shards, each as the boxes of HF tensors it holds.
"""

from weightsync.export.base import ExportDefaults, ViewExport, WeightExport
from weightsync.export.checkpoint import CheckpointExport
from weightsync.export.fp8 import Fp8Export
from weightsync.export.fsdp import FSDPExport
from weightsync.export.hf import ModelExport, TensorsExport, hf_state_items
from weightsync.export.megatron import MegatronExport

__all__ = [
    "CheckpointExport",
    "ExportDefaults",
    "FSDPExport",
    "Fp8Export",
    "MegatronExport",
    "ModelExport",
    "TensorsExport",
    "ViewExport",
    "WeightExport",
    "hf_state_items",
]
