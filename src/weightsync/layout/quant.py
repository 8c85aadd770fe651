"""Block-FP8 checkpoints (DeepSeek-V3, Kimi-K2): e4m3 weights with float32 per-block scales.

A checkpoint whose config carries ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [B, B]}`` stores every linear layer's ``X.weight`` as
``float8_e4m3fn`` with a sibling ``X.weight_scale_inv`` of float32 ``[ceil(N/B), ceil(K/B)]``
(the dequantisation multiplier of each ``B x B`` block, despite its name). SGLang's
``Fp8LinearMethod`` / ``Fp8MoEMethod`` give each such layer a ``weight_scale_inv`` parameter
(experts: ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``) right after its weight (experts:
after ``w2_weight``), filled by narrowing the HF scale by the rank's blocks. Embeddings, norms,
the router and its bias stay in the model dtype.

So a rank's weight box must start and end on block boundaries (or at the tensor's end), and
its scale box is that box divided by ``B``; SGLang refuses a split that cuts a block
(``validate_block_quant_shapes``), and so does `quantize_params`. The ``k_scale`` / ``v_scale``
scalars SGLang adds to each attention (fixed at 1.0, skipped by its weights checker) have no
HF source and are not part of the layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.layout.types import ParamLayout, Segment

FP8_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
SCALE_SUFFIX = "_scale_inv"
# The block size DeepSeek-V3 and Kimi-K2 ship with; SGLang's weights checker also assumes
# square blocks.
DEFAULT_BLOCK_SIZE = 128

# HF tensors an FP8 checkpoint quantises: the weights of every linear layer (attention
# projections, dense, shared and routed expert MLPs); `mlp.gate.weight` is no Linear.
_QUANTIZED_RE = re.compile(r"_proj(_with_mqa)?\.weight$")
_EXPERT_PARAMS = ("experts.w13_weight", "experts.w2_weight")


def block_fp8_size(quantization_config: Any, model_type: str) -> int:
    """The block size of a block-FP8 ``quantization_config``, or 0 when there is none.

    Raises:
        ValueError: a quantisation weightsync does not lay out (another ``quant_method``,
            non-square or non-positive blocks, static activation scales, layers left out of
            the quantisation), naming the key and what to use.
    """
    if quantization_config is None:
        return 0
    if not isinstance(quantization_config, Mapping):
        raise ValueError(
            f"{model_type} config: quantization_config must be a dict, got "
            f"{type(quantization_config).__name__}"
        )
    method = quantization_config.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{model_type} config: quantization_config.quant_method={method!r} is not "
            "supported; weightsync lays out block FP8 ('fp8' with weight_block_size)"
        )
    block = quantization_config.get("weight_block_size")
    if (
        not isinstance(block, Sequence)
        or len(block) != 2
        or block[0] != block[1]
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{model_type} config: quantization_config.weight_block_size={block!r}: weightsync "
            f"lays out square blocks of positive ints, e.g. [{DEFAULT_BLOCK_SIZE}, "
            f"{DEFAULT_BLOCK_SIZE}] (per-tensor FP8 is not supported)"
        )
    scheme = quantization_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"{model_type} config: quantization_config.activation_scheme={scheme!r} is not "
            "supported; use 'dynamic' (no activation scales in the checkpoint)"
        )
    fmt = quantization_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(
            f"{model_type} config: quantization_config.fmt={fmt!r} is not supported; use 'e4m3'"
        )
    for key in ("ignored_layers", "modules_to_not_convert"):
        if quantization_config.get(key):
            raise ValueError(
                f"{model_type} config: quantization_config.{key} is not supported: weightsync "
                "lays out checkpoints that quantise every linear layer"
            )
    return block[0]


def fp8_quantization_config(block_size: int) -> dict[str, Any]:
    """The ``quantization_config`` of a block-FP8 checkpoint with ``block_size`` blocks."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block_size, block_size],
    }


def is_quantized_hf_name(hf_name: str) -> bool:
    """Whether a block-FP8 checkpoint stores HF tensor ``hf_name`` in FP8 with a scale."""
    return bool(_QUANTIZED_RE.search(hf_name))


def scale_name(name: str) -> str:
    """The scale of weight ``name`` (HF ``X.weight`` or SGLang ``experts.w13_weight``)."""
    return name + SCALE_SUFFIX


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def scale_shape(shape: Sequence[int], block: int) -> tuple[int, ...]:
    """The scale shape of a weight of ``shape``: its last two dims in blocks."""
    *lead, rows, cols = shape
    return (*lead, _blocks(rows, block), _blocks(cols, block))


def quantized_hf_shapes(
    shapes: Mapping[str, tuple[int, ...]], block: int
) -> dict[str, tuple[int, ...]]:
    """``shapes`` with each quantised weight's ``weight_scale_inv`` right after it."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        out[name] = shape
        if is_quantized_hf_name(name):
            out[scale_name(name)] = scale_shape(shape, block)
    return out


def quantize_params(
    params: Sequence[ParamLayout],
    hf_shapes: Mapping[str, tuple[int, ...]],
    *,
    block: int,
    where: str,
) -> list[ParamLayout]:
    """A rank's parameters as SGLang lays them out for a block-FP8 checkpoint.

    Every parameter read only from quantised HF weights becomes ``float8_e4m3fn`` and gets
    its float32 scale parameter (``name + "_scale_inv"``), whose segments are the weight's
    boxes in blocks: right after it, or for the routed experts after ``w2_weight``.

    Args:
        params: the rank's parameters in the model dtype, in engine order.
        hf_shapes: the bf16 checkpoint's tensor shapes (without scales).
        block: the block size.
        where: the rank's parallelism, for messages (``"tp_size=2, ep_size=1"``).

    Raises:
        ValueError: a rank's box of a weight cuts a block (the message names the parameter,
            the HF tensor, the box and what the parallelism must do), or the scales of a
            fused parameter would not be the blocks of the whole (``fused_qkv_a_proj_with_mqa``
            with a ``q_lora_rank`` that is not a multiple of the block).
    """
    out: list[ParamLayout] = []
    pending: list[ParamLayout] = []
    for param in params:
        sources = [s.hf_name for s in param.segments if s.hf_name is not None]
        if not sources or not all(is_quantized_hf_name(name) for name in sources):
            out.append(param)
            continue
        weight = ParamLayout(
            name=param.name, shape=param.shape, dtype=FP8_DTYPE, segments=param.segments
        )
        scale = _scale_param(param, hf_shapes, block=block, where=where)
        out.append(weight)
        if param.name.endswith(_EXPERT_PARAMS):
            pending.append(scale)
            if param.name.endswith(_EXPERT_PARAMS[-1]):
                out += pending
                pending = []
        else:
            out.append(scale)
    out += pending
    return out


def _scale_param(
    param: ParamLayout, hf_shapes: Mapping[str, tuple[int, ...]], *, block: int, where: str
) -> ParamLayout:
    shape = scale_shape(param.shape, block)
    segments: list[Segment] = []
    offset = 0
    rows, cols = param.shape[-2:]
    for segment in param.segments:
        if segment.hf_name is None:
            raise ValueError(f"FP8 parameter {param.name!r} has padding, which has no scale")
        # A fused part must start on a block row of the parameter, or its scale rows would
        # land in the neighbour's blocks (SGLang's loader only checks the total size).
        dst_row = (segment.dst_offset // cols) % rows
        if segment.dst_offset % cols or dst_row % block:
            raise ValueError(
                f"FP8 block {block}: parameter {param.name!r} ({where}) fuses "
                f"{segment.hf_name} at row {dst_row}, which is not a multiple of {block}: "
                f"each fused part (q_lora_rank, the rank's slice of the MLP's intermediate "
                f"size) must be a multiple of {block}"
            )
        hf_shape = hf_shapes[segment.hf_name]
        box = []
        for dim, ((start, stop), size) in enumerate(zip(segment.src_box, hf_shape, strict=True)):
            if start % block or (stop % block and stop != size):
                raise ValueError(
                    f"FP8 block {block}: parameter {param.name!r} ({where}) reads "
                    f"[{start}, {stop}) of dim {dim} of {segment.hf_name} {hf_shape}, which "
                    f"cuts a {block}x{block} scale block; choose a parallelism that splits "
                    f"this dim into multiples of {block} (SGLang refuses it too)"
                )
            box.append((start // block, _blocks(stop, block)))
        numel = 1
        for start, stop in box:
            numel *= stop - start
        segments.append(
            Segment(
                dst_offset=offset,
                numel=numel,
                hf_name=scale_name(segment.hf_name),
                src_box=tuple(box),
            )
        )
        offset += numel
    expected = 1
    for size in shape:
        expected *= size
    if offset != expected:
        raise ValueError(
            f"FP8 block {block}: parameter {param.name!r} ({where}) of shape {param.shape} "
            f"fuses {', '.join(sorted({s.hf_name for s in param.segments if s.hf_name}))}, "
            f"whose scales give {offset} blocks where SGLang allocates {shape}: each fused "
            f"part (its rows on this rank: q_lora_rank, the MLP's intermediate slice) must be "
            f"a multiple of {block}"
        )
    return ParamLayout(
        name=scale_name(param.name), shape=shape, dtype=SCALE_DTYPE, segments=tuple(segments)
    )
