"""Dense MLP: fused ``gate_up_proj`` (column-parallel) and row-parallel ``down_proj``."""

from __future__ import annotations

from weightsync.layout.config import ModelDims
from weightsync.layout.names import layer_prefix
from weightsync.layout.partition import RankPartition
from weightsync.layout.segments import SegmentBuilder
from weightsync.layout.types import ParamLayout


def mlp_hf_shapes(dims: ModelDims, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of layer ``layer``'s dense MLP and their shapes."""
    prefix = layer_prefix(layer) + "mlp."
    hidden, inter = dims.hidden_size, dims.intermediate_size
    return {
        f"{prefix}gate_proj.weight": (inter, hidden),
        f"{prefix}up_proj.weight": (inter, hidden),
        f"{prefix}down_proj.weight": (hidden, inter),
    }


def mlp_params(dims: ModelDims, part: RankPartition, layer: int, dtype: str) -> list[ParamLayout]:
    """Layer ``layer``'s dense MLP parameters on the rank ``part`` describes.

    ``gate_up_proj`` is [this rank's gate rows; its up rows]; ``down_proj`` holds the matching
    columns.
    """
    prefix = layer_prefix(layer) + "mlp."
    hidden, inter = dims.hidden_size, dims.intermediate_size
    local = part.intermediate[1] - part.intermediate[0]
    gate_up = SegmentBuilder()
    gate_up.add_rows(f"{prefix}gate_proj.weight", (inter, hidden), part.intermediate)
    gate_up.add_rows(f"{prefix}up_proj.weight", (inter, hidden), part.intermediate)
    down = SegmentBuilder()
    down.add_columns(f"{prefix}down_proj.weight", (hidden, inter), part.intermediate)
    return [
        gate_up.build(f"{prefix}gate_up_proj.weight", (2 * local, hidden), dtype),
        down.build(f"{prefix}down_proj.weight", (hidden, local), dtype),
    ]
