"""Block-FP8 quantisation on the tensor's device: e4m3 codes and float32 per-block scales.

The quantiser is DeepGEMM's ``per_block_cast_to_fp8`` (``use_ue8m0=False``), which is what
DeepSeek-V3's and Kimi-K2's FP8 checkpoints hold and what SGLang dequantises: per ``B x B``
block of a weight ``[..., N, K]`` (edge blocks padded with zeros),

* ``amax = max(|x|)`` in float32, clamped to at least ``1e-4`` (an all-zero block gets a tiny
  scale and zero codes, never a NaN);
* ``scale = amax / 448`` (float32; 448 is e4m3's largest finite value), stored as
  ``weight_scale_inv``: the multiplier that dequantises, despite the name;
* ``code = e4m3(x * (1 / scale))``, rounded to nearest even.

On CUDA a Triton kernel (when Triton is installed) does it in one pass: each program reads
one block once, reduces it, and writes its codes and its scale, so the quantiser moves the
weight's bytes in and a byte per element out. Elsewhere vectorised torch ops compute the same
numbers (bit for bit: the same float32 operations, correctly rounded).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
FP8 = torch.float8_e4m3fn

# Elements per torch-path step: bounds its float32 temporary.
_TORCH_STEP = 1 << 24


def scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The scale shape of a weight of ``shape``: its last two dims in blocks."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block), -(-cols // block))


def quantize_block_fp8(
    weight: torch.Tensor,
    *,
    block: int = 128,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (``[..., N, K]``, any float dtype) as e4m3 codes and float32 block scales.

    Args:
        weight: the tensor, on any device; 2 or more dims.
        block: the block size (square blocks).
        out: where to write the codes (``float8_e4m3fn``, ``weight``'s shape and device).
        scale_out: where to write the scales (float32, `scale_shape`).

    Returns:
        ``(codes, scales)``: `out` and `scale_out` when given.

    Raises:
        ValueError: fewer than 2 dims, a non-float tensor, or outputs of the wrong shape,
            dtype or device.
    """
    if weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(
            f"quantize_block_fp8 takes a float tensor of 2 or more dims, got "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    shape = tuple(weight.shape)
    s_shape = scale_shape(shape, block)
    if out is None:
        out = torch.empty(shape, dtype=FP8, device=weight.device)
    if scale_out is None:
        scale_out = torch.empty(s_shape, dtype=torch.float32, device=weight.device)
    for name, tensor, want_shape, want_dtype in (
        ("out", out, shape, FP8),
        ("scale_out", scale_out, s_shape, torch.float32),
    ):
        if (
            tuple(tensor.shape) != want_shape
            or tensor.dtype != want_dtype
            or tensor.device != weight.device
            or not tensor.is_contiguous()
        ):
            raise ValueError(
                f"quantize_block_fp8: {name} must be a contiguous {want_dtype} {want_shape} on "
                f"{weight.device}, got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            )
    if weight.numel() == 0:
        return out, scale_out
    with torch.no_grad():
        kernel = _triton_kernel() if weight.is_cuda else None
        if kernel is not None:
            _quantize_triton(kernel, weight, out, scale_out, block)
        else:
            _quantize_torch(weight, out, scale_out, block)
    return out, scale_out


def dequantize_block_fp8(codes: torch.Tensor, scales: torch.Tensor, *, block: int) -> torch.Tensor:
    """``codes * scale`` of each element's ``block x block`` block, in float32 (SGLang's
    ``block_quant_dequant`` before its cast to the model dtype)."""
    rows, cols = codes.shape[-2:]
    expanded = scales.repeat_interleave(block, -2).repeat_interleave(block, -1)
    return codes.float() * expanded[..., :rows, :cols]


def _quantize_torch(
    weight: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor, block: int
) -> None:
    rows, cols = weight.shape[-2:]
    row_blocks, col_blocks = scale_out.shape[-2:]
    x = weight.reshape(-1, rows, cols)
    codes = out.view(-1, rows, cols)
    scales = scale_out.view(-1, row_blocks, col_blocks)
    pad_rows, pad_cols = row_blocks * block - rows, col_blocks * block - cols
    # Whole block-rows per step, so the float32 product stays small.
    step = max(1, _TORCH_STEP // (block * col_blocks * block))
    for index in range(x.shape[0]):
        for first in range(0, row_blocks, step):
            last = min(row_blocks, first + step)
            part = x[index, first * block : min(rows, last * block)]
            if (pad_rows and last == row_blocks) or pad_cols:
                part = torch.nn.functional.pad(
                    part, (0, pad_cols, 0, (last - first) * block - part.shape[0])
                )
            # One float32 copy of the part: the product below is formed in float32 anyway
            # (a bf16 weight times a float32 reciprocal), and CPUs are slow on bf16 math.
            # A copy even of a float32 weight: the product below is formed in place.
            tiles = part.to(torch.float32, copy=True).reshape(
                last - first, block, col_blocks, block
            )
            amax = torch.linalg.vector_norm(tiles, float("inf"), dim=(1, 3))
            scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
            scales[index, first:last] = scale
            tiles.mul_((1.0 / scale)[:, None, :, None])
            quantised = tiles.to(FP8).reshape(part.shape)
            codes[index, first * block : min(rows, last * block)] = quantised[
                : min(rows, last * block) - first * block, :cols
            ]


@functools.cache
def _triton_kernel() -> Any:
    """The Triton kernel, or None when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def quantize_blocks(
        x_ptr,
        q_ptr,
        s_ptr,
        rows,
        cols,
        x_batch_stride,
        x_row_stride,
        row_blocks,
        col_blocks,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        j = tl.program_id(1)
        batch = tl.program_id(2).to(tl.int64)
        r = i * BLOCK + tl.arange(0, BLOCK)
        c = j * BLOCK + tl.arange(0, BLOCK)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        src = x_ptr + batch * x_batch_stride + r[:, None].to(tl.int64) * x_row_stride + c[None, :]
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-4)
        # Correctly rounded divisions, as torch's (Triton's `/` may be approximate).
        scale = tl.math.div_rn(amax, 448.0)
        inverse = tl.math.div_rn(1.0, scale)
        codes = (x * inverse).to(tl.float8e4nv)
        dst = q_ptr + batch * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        tl.store(dst, codes, mask=mask)
        tl.store(s_ptr + (batch * row_blocks + i) * col_blocks + j, scale)

    return quantize_blocks


def _quantize_triton(
    kernel: Any, weight: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor, block: int
) -> None:
    rows, cols = weight.shape[-2:]
    x = weight if weight.stride(-1) == 1 else weight.contiguous()
    # Rows and batches may be strided (a run of per-expert views); elements of a row not.
    x = x.unsqueeze(0) if x.dim() == 2 else x.reshape(-1, rows, cols)
    row_blocks, col_blocks = scale_out.shape[-2:]
    grid = (row_blocks, col_blocks, x.shape[0])
    with torch.cuda.device(weight.device):
        kernel[grid](
            x,
            out,
            scale_out,
            rows,
            cols,
            x.stride(0),
            x.stride(1),
            row_blocks,
            col_blocks,
            BLOCK=block,
            num_warps=8,
        )
