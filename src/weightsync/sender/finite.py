"""The finite check of a push: no weight that is NaN or infinite in the rollout's dtype is
written."""

from __future__ import annotations

import torch

from weightsync.errors import WeightsRefusedError
from weightsync.export.base import WeightExport
from weightsync.plan.program import PushProgram
from weightsync.torch_dtypes import torch_dtype


def refuse_non_finite(program: PushProgram, export: WeightExport) -> None:
    """Raise, before anything is written, if a tensor the program reads holds a value that is
    NaN or infinite once cast to the rollout's dtype (a float32 weight of 3.4e38 is finite,
    and infinite in bfloat16).

    Reads every such tensor once: the largest magnitude of each (a multi-tensor reduction
    over batches of the stream, so a MoE's thousands of experts cost a few launches, and at
    most a batch is held at a time) decides, as a NaN propagates and rounding is monotonic.

    Raises:
        WeightsRefusedError: naming the tensor, the trainer rank and what to do.
    """
    dtype = torch_dtype(program.dtype)
    if not dtype.is_floating_point:
        return
    needed = set(program.keys)
    batch: list[tuple[str, torch.Tensor]] = []
    batch_bytes = 0
    with torch.no_grad():
        for name, tensor in export:
            if name not in needed or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if tensor.element_size() == 1:
                # FP8 codes: a quantiser's output, finite by construction; a NaN or infinity
                # in its input makes the block's float32 scale non-finite, checked here too.
                continue
            batch.append((name, tensor))
            batch_bytes += tensor.numel() * tensor.element_size()
            if len(batch) == _FINITE_BATCH or batch_bytes >= _FINITE_BATCH_BYTES:
                _check_finite(batch, dtype, program)
                batch, batch_bytes = [], 0
        if batch:
            _check_finite(batch, dtype, program)


# Tensors per multi-tensor reduction of the finite check, and the bytes after which a batch
# is checked sooner: an export that reads its tensors into memory of their own (a checkpoint
# on disk, `weightsync.export.CheckpointExport`) holds a batch in host memory.
_FINITE_BATCH = 1024
_FINITE_BATCH_BYTES = 1 << 30


def _check_finite(
    batch: list[tuple[str, torch.Tensor]], dtype: torch.dtype, program: PushProgram
) -> None:
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in batch:
        groups.setdefault((tensor.device, tensor.dtype), []).append((name, tensor))
    for members in groups.values():
        peaks = torch.stack(torch._foreach_norm([t for _, t in members], float("inf")))
        finite = torch.isfinite(peaks.to(dtype))
        if bool(finite.all()):
            continue
        name = members[int((~finite).nonzero()[0])][0]
        raise WeightsRefusedError(
            f"trainer rank {program.plan.rank}: HF tensor {name!r} holds values that "
            f"are not finite in the rollout's {program.dtype} (NaN, or beyond its range "
            "once cast); nothing was written. Fix the trainer's weights, or set "
            "SenderConfig(check_finite='never') to write them anyway"
        )
