"""`StagingRing`: the registered memory a sender stages buckets in before writing them, and
where a push stages (`staging_spec`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from weightsync.errors import WeightSyncError
from weightsync.plan.direct import DirectPolicy, DirectSpec
from weightsync.plan.geometry import StreamGeometry
from weightsync.plan.items import SourcePlan
from weightsync.plan.program import StagingSpec
from weightsync.sender.config import SenderConfig

if TYPE_CHECKING:
    from weightsync.transport import Transport, TransportCapabilities, WriteCost

HOST_STAGE_BYTES_PER_S = 10e9
"""The rate a sender copies into a host staging ring, as direct writes are weighed against it:
a memcpy, 10-20 GB/s for one thread of a 2-core x86 host (``bench/transport.py``)."""
GPU_STAGE_BYTES_PER_S = 1e12
"""The rate a sender copies into a GPU staging ring (a same-GPU copy: ~2,000 GB/s on an
H200, ~1,300 on an H100), with room for strided reads."""


def direct_spec(policy: DirectPolicy, cost: WriteCost, device: torch.device) -> DirectSpec:
    """What the lowering needs to choose direct writes for a ring on `device`: the policy,
    the transport's `cost` of a write, and the rate of a copy into the ring.

    Args:
        policy: `SenderConfig.direct`.
        cost: the transport's `Transport.write_cost`.
        device: the staging device, which is also the device direct writes read from.
    """
    if policy == "never":
        return DirectSpec()
    stage = GPU_STAGE_BYTES_PER_S if device.type == "cuda" else HOST_STAGE_BYTES_PER_S
    return DirectSpec(
        devices=(str(device),),
        policy=policy,
        write_s=cost.write_s,
        stage_bytes_per_s=stage,
        pitched=cost.pitched,
    )


def staging_spec(
    config: SenderConfig,
    plan: SourcePlan,
    geometry: StreamGeometry,
    *,
    capabilities: TransportCapabilities,
    write_cost: WriteCost,
) -> StagingSpec:
    """Where a push of `plan` stages and what it may write directly: decided by the device
    of the first tensor the plan reads, the config and what the transport reads.

    Raises:
        ValueError: ``config.staging == "cuda"`` and the tensors are not on a GPU the
            transport reads.
    """
    device = torch.device("cpu")
    for key, tensor in zip(geometry.keys, geometry.tensors, strict=True):
        if key in plan.work:
            device = torch.device(tensor.device)
            break
    staging_device = _staging_device(config, capabilities, device)
    direct = DirectSpec()
    if capabilities.reads(staging_device.type, staging_device.index):
        direct = direct_spec(config.direct, write_cost, staging_device)
    return StagingSpec(
        device=str(staging_device),
        num_slots=config.num_slots,
        slot_bytes=config.slot_bytes,
        chunk_bytes=config.slot_chunk_bytes(staging_device),
        stream_ordered=capabilities.stream_ordered,
        direct=direct,
    )


def _staging_device(
    config: SenderConfig, capabilities: TransportCapabilities, device: torch.device
) -> torch.device:
    staging = config.staging
    if staging == "host":
        return torch.device("cpu")
    on_gpu = device.type == "cuda"
    readable = on_gpu and capabilities.reads(device.type, device.index)
    if staging == "cuda" and not readable:
        raise ValueError(
            f"SenderConfig.staging='cuda' needs CUDA tensors and a transport that reads GPU "
            f"memory; the tensors are on {device} and the transport "
            f"{'does not' if on_gpu else 'was not asked'}; use staging='auto' or 'host'"
        )
    return device if readable else torch.device("cpu")


class StagingRing:
    """``num_slots`` slots of ``slot_bytes`` each, in one buffer registered once.

    Call protocol: `allocate` (registers the buffer with the transport), use `slot_addr` and
    the tensor views while allocated, `free` (unregisters, then drops the memory) around a
    trainer checkpoint save and `allocate` again after it.
    """

    def __init__(
        self,
        *,
        transport: Transport,
        num_slots: int,
        slot_bytes: int,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        """Describe the ring; nothing is allocated until `allocate`.

        Args:
            transport: registers the buffer so that it can read it.
            num_slots: number of slots.
            slot_bytes: bytes per slot (a multiple of 64).
            device: where the buffer lives (``cpu`` or a CUDA device).
            pin_memory: pin a host buffer (ignored on CUDA).
        """
        self._transport = transport
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.device = device
        self._pin = pin_memory and device.type == "cpu"
        self._buffer: torch.Tensor | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    @property
    def allocated(self) -> bool:
        """Whether the buffer exists and is registered."""
        return self._buffer is not None

    @property
    def num_bytes(self) -> int:
        """Bytes the ring holds when allocated."""
        return self.num_slots * self.slot_bytes

    def allocate(self) -> None:
        """Allocate the buffer and register it with the transport (no-op when allocated).

        Raises:
            WeightSyncError: the transport refused the registration.
        """
        if self._buffer is not None:
            return
        buffer = torch.empty(
            self.num_bytes, dtype=torch.uint8, device=self.device, pin_memory=self._pin
        )
        try:
            self._transport.register(buffer.data_ptr(), self.num_bytes)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(
                f"registering {self.num_bytes} bytes of {self.device} staging memory with the "
                f"transport failed: {exc}"
            ) from exc
        self._buffer = buffer

    def free(self) -> None:
        """Unregister the buffer and drop it (no-op when not allocated)."""
        if self._buffer is None:
            return
        buffer, self._buffer = self._buffer, None
        self._typed.clear()
        self._transport.unregister(buffer.data_ptr())
        del buffer

    def as_bytes(self) -> torch.Tensor:
        """The whole ring as a 1-D uint8 tensor."""
        if self._buffer is None:
            raise WeightSyncError("the staging ring is not allocated")
        return self._buffer

    def as_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole ring as a 1-D tensor of `dtype` (a view of the same memory)."""
        view = self._typed.get(dtype)
        if view is None:
            view = self._typed[dtype] = self.as_bytes().view(dtype)
        return view

    @property
    def base_addr(self) -> int:
        """Address of the ring's first byte (while allocated)."""
        return self.as_bytes().data_ptr()

    def slot_addr(self, slot: int) -> int:
        """Address of slot `slot`'s first byte."""
        return self.base_addr + slot * self.slot_bytes
