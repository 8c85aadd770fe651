"""What a rollout rank's parameters checksum to were they to hold a given export, computed
on the trainer's side: how `weightsync push --delta-from` (`TrainerSync.adopt_base`) knows
the checksums a replica must prove before it takes a delta against a checkpoint it was not
sent by these trainers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from weightsync.delta_codec import as_bits, bits_dtype, checksum_tensor
from weightsync.export.base import ExportDefaults, WeightExport
from weightsync.plan.delta import delta_maps
from weightsync.plan.geometry import StreamGeometry
from weightsync.plan.items import SourcePlan
from weightsync.plan.types import TensorMeta
from weightsync.sender.delta import wrap_int64
from weightsync.torch_dtypes import torch_dtype


class TappedExport(ExportDefaults):
    """`export`, whose stream also hands every tensor to `tap` as it passes (one read of
    the base serves both the reference and its checksums).

    Args:
        export: the export to read.
        tap: called with each ``(hf_name, tensor)`` before the stream hands it on.
    """

    def __init__(self, export: WeightExport, tap: Callable[[str, torch.Tensor], None]) -> None:
        self._export = export
        self._tap = tap

    def holding(self) -> Mapping[str, TensorMeta]:
        """As the wrapped export."""
        return self._export.holding()

    def geometry(self) -> StreamGeometry:
        """As the wrapped export."""
        return self._export.geometry()

    def begin_push(self) -> None:
        """As the wrapped export."""
        self._export.begin_push()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped stream, each tensor tapped before it is handed on."""
        for hf_name, tensor in self._export:
            self._tap(hf_name, tensor)
            yield hf_name, tensor


class LaidOutChecksums:
    """The checksum (`weightsync.delta_codec.checksum_tensor`) of every parameter one
    rank's plan writes, were the parameter to hold the bytes of the tensors `add`ed (cast
    to the rollout's dtype, placed by the plan's run tables, `weightsync.plan.delta_maps`)
    and zeros wherever this rank writes nothing.

    A parameter is filled in a buffer of its own (on its tensors' device) and checksummed
    once every element this rank writes there arrived, so only parameters still being
    filled are held. The checksum is linear in the bytes: the ranks' sums add up to the
    parameter's, and vocabulary padding (zeros) adds nothing.

    Args:
        plan: the rank's whole source plan.
    """

    def __init__(self, plan: SourcePlan) -> None:
        self._maps = delta_maps(plan)
        self._parts = plan.parts or (plan,)
        published = {t.session_id: t for ranks in plan.targets.values() for t in ranks}
        self._sessions: dict[tuple[int, int], list[str]] = {}
        self._shape: dict[tuple[int, int, str], tuple[int, int]] = {}
        self._left: dict[tuple[int, int, str], int] = {}
        for index, (part, delta_map) in enumerate(zip(self._parts, self._maps, strict=True)):
            for layout_id, ranks in part.targets.items():
                self._sessions[(index, layout_id)] = [t.session_id for t in ranks]
            for targets in delta_map.tensors.values():
                for target in targets:
                    key = (index, target.layout_id, target.param_name)
                    self._left[key] = self._left.get(key, 0) + target.num_elements
                    if key in self._shape:
                        continue
                    rank = published[self._sessions[(index, target.layout_id)][0]]
                    _, numel, element_size = rank.weights_info[target.param_name]
                    self._shape[key] = (numel, element_size)
        self._by_name = {name: i for i, m in enumerate(self._maps) for name in m.tensors}
        self._buffers: dict[tuple[int, int, str], torch.Tensor] = {}
        self._sums: dict[tuple[int, int, str], int] = {}

    def add(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Place `tensor` (HF tensor `hf_name` of the stream) in the parameters it lands in;
        checksum those it completes. A tensor the plan does not read is passed over.

        Raises:
            ValueError: the tensor does not fit the plan's run tables, or its elements are
                not the size the rollout published for a parameter.
        """
        index = self._by_name.get(hf_name)
        if index is None:
            return
        delta_map = self._maps[index]
        bits = as_bits(tensor.to(torch_dtype(delta_map.dtype)).contiguous())
        for target in delta_map.tensors[hf_name]:
            key = (index, target.layout_id, target.param_name)
            numel, element_size = self._shape[key]
            if element_size != bits.element_size():
                raise ValueError(
                    f"parameter {target.param_name!r} has {element_size}-byte elements, but "
                    f"HF tensor {hf_name!r} is {delta_map.dtype} for it; rebuild the plan"
                )
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = self._buffers[key] = torch.zeros(
                    numel, dtype=bits_dtype(element_size), device=bits.device
                )
            for family in target.families:
                src_end = family.src_start + (family.count - 1) * family.src_step + family.length
                dst_end = family.dst_start + (family.count - 1) * family.dst_step + family.length
                if src_end > bits.numel() or dst_end > numel:
                    raise ValueError(
                        f"HF tensor {hf_name!r} ({bits.numel()} elements) does not fit the "
                        f"runs the plan has for {target.param_name!r} ({numel} elements); "
                        "rebuild the plan"
                    )
                shape = (family.count, family.length)
                source = bits.as_strided(
                    shape, (family.src_step, 1), bits.storage_offset() + family.src_start
                )
                buffer.as_strided(shape, (family.dst_step, 1), family.dst_start).copy_(source)
            self._left[key] -= target.num_elements
            if not self._left[key]:
                self._sums[key] = int(checksum_tensor(self._buffers.pop(key)))

    def per_session(self) -> dict[str, dict[str, int]]:
        """Per target session id, ``{param_name: checksum}`` of every parameter this rank
        writes there.

        Raises:
            ValueError: a tensor the plan reads never came (the stream was incomplete).
        """
        if self._buffers:
            key = next(iter(self._buffers))
            raise ValueError(
                f"parameter {key[2]!r} was not filled: the stream lacked a tensor the plan reads"
            )
        out: dict[str, dict[str, int]] = {}
        for (index, layout_id, param_name), value in self._sums.items():
            for session in self._sessions[(index, layout_id)]:
                sums = out.setdefault(session, {})
                sums[param_name] = wrap_int64(sums.get(param_name, 0) + value)
        return out
