"""`SenderConfig`: how one trainer rank stages and writes its share of a sync."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from weightsync.plan.direct import DIRECT_POLICIES, DirectPolicy

MIB = 1 << 20

# Slots hold elements of any dtype weightsync moves; a multiple of 64 bytes keeps every slot
# start aligned for every element size and for vectorised copies.
SLOT_ALIGN_BYTES = 64

StagingKind = Literal["auto", "host", "cuda"]
ReferencePlacement = Literal["device", "host"]
FiniteCheck = Literal["first", "always", "never"]
FINITE_CHECKS: tuple[str, ...] = ("first", "always", "never")
HOST_CHUNK_BYTES = 64 * MIB
GPU_CHUNK_BYTES = 256 * MIB


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderConfig:
    """Settings of a `WeightSender`.

    Attributes:
        bucket_bytes: bytes of one staging slot; a bucket is what one slot holds for one
            destination layout. Rounded down to a multiple of 64.
        num_workers: threads that run a slot's fill copies in parallel (1 = the calling
            thread only).
        timeout_s: how long one batch of writes may take before it counts as failed.
        num_slots: depth of the staging ring; with 2, filling one slot overlaps the writes
            of the other. Host memory for staging is ``num_slots * bucket_bytes``.
        staging: where the staging ring lives: ``"host"`` (pinned or plain host memory),
            ``"cuda"`` (GPU memory; needs CUDA tensors and a transport that reads GPU
            memory), or ``"auto"`` (GPU when both hold, host otherwise).
        pin_memory: pin the host staging ring (faster device-to-host copies and NIC reads);
            defaults to whether CUDA is available, since pinning needs it.
        max_outstanding_per_peer: most write requests in flight to one target at a time.
        chunk_bytes: a slot is filled and written in chunks of about this many bytes: the
            writes of one chunk start while the next chunk fills, so a push of a single
            bucket overlaps its fill with its writes too. Chunks end where writes break
            anyway (between parameters); only a run of one parameter longer than twice this
            is cut, at the cost of one more write per cut. Rounded down to a multiple of 64.
            None: 64 MiB for a host ring, 256 MiB for a GPU ring (a chunk costs ~0.1 ms of
            Python, which a GPU link at ~390 GB/s would otherwise wait on between 64 MiB
            chunks).
        check_finite: refuse, before anything is written, a push whose tensors hold a value
            that is not finite in the rollout's dtype (NaN, or infinite once cast, as a
            float32 3.4e38 becomes in bf16): ``"first"`` on a sender's first push,
            ``"always"``, or ``"never"``. The check reads every tensor once more, so by
            default it runs only until a push succeeded.
        digest: sum a sample of each parameter's staged bytes (`weightsync.layout.digest`)
            so that the replicas can verify what they received at ``end_weight_update``.
        direct: where to write straight from the trainer's tensors (one copy per byte
            instead of two) rather than stage them, among the pieces the transport can read
            that need no cast (`weightsync.plan.direct`): ``"auto"`` where that is cheaper
            by the transport's `WriteCost` (whole tensors always; a row-parallel slice over
            CUDA IPC, or over Mooncake when its rows are long enough to pay a write each),
            ``"always"`` every such piece, ``"never"`` none. The trainer's storages read
            directly are registered with the transport (Mooncake) or read by copies into
            the receivers' mapped memory (CUDA IPC).
        delta_reference: where a sender that takes delta syncs keeps its reference copy of
            the bytes it last pushed (`weightsync.sender.delta_reference`): ``"device"``
            beside each tensor (GPU memory for GPU tensors; encoding runs at memory speed),
            ``"host"`` in host memory (encoding then copies each tensor to the host).
        replay: a push that wrote every byte directly is captured (a CUDA graph into mapped
            memory, or bound write lists) and replayed on later syncs while the export's
            tensors stay where they are (`weightsync.sender.replay`): no per-tensor work.

    Raises:
        ValueError: a non-positive size, count or timeout, an unknown staging kind or
            direct policy, or ``pin_memory=True`` without CUDA.
    """

    bucket_bytes: int = 1024 * MIB
    num_workers: int = 4
    timeout_s: float = 30.0
    num_slots: int = 2
    staging: StagingKind = "auto"
    pin_memory: bool = field(default_factory=torch.cuda.is_available)
    max_outstanding_per_peer: int = 1000
    chunk_bytes: int | None = None
    check_finite: FiniteCheck = "first"
    digest: bool = True
    direct: DirectPolicy = "auto"
    replay: bool = True
    delta_reference: ReferencePlacement = "device"

    def __post_init__(self) -> None:
        names = (
            "bucket_bytes",
            "num_workers",
            "num_slots",
            "max_outstanding_per_peer",
            "chunk_bytes",
        )
        for name in names:
            value = getattr(self, name)
            if name == "chunk_bytes" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SenderConfig.{name} must be a positive int, got {value!r}")
        for name in ("bucket_bytes", "chunk_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < SLOT_ALIGN_BYTES:
                raise ValueError(
                    f"SenderConfig.{name} must be at least {SLOT_ALIGN_BYTES}, "
                    f"got {getattr(self, name)}"
                )
        if not self.timeout_s > 0:
            raise ValueError(f"SenderConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        if self.check_finite not in FINITE_CHECKS:
            raise ValueError(
                f"SenderConfig.check_finite must be one of {FINITE_CHECKS}, "
                f"got {self.check_finite!r}"
            )
        if isinstance(self.direct, bool) or self.direct not in DIRECT_POLICIES:
            raise ValueError(
                f"SenderConfig.direct must be one of {DIRECT_POLICIES} (auto: by the "
                f"transport's cost of a write), got {self.direct!r}"
            )
        if self.staging not in ("auto", "host", "cuda"):
            raise ValueError(
                f"SenderConfig.staging must be 'auto', 'host' or 'cuda', got {self.staging!r}"
            )
        if self.delta_reference not in ("device", "host"):
            raise ValueError(
                "SenderConfig.delta_reference must be 'device' or 'host', got "
                f"{self.delta_reference!r}"
            )
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "SenderConfig.pin_memory=True needs CUDA (pinning is done by the CUDA driver); "
                "pass pin_memory=False on a machine without GPUs"
            )

    @property
    def slot_bytes(self) -> int:
        """Usable bytes of one staging slot (`bucket_bytes` rounded down to 64)."""
        return self.bucket_bytes - self.bucket_bytes % SLOT_ALIGN_BYTES

    def slot_chunk_bytes(self, staging_device: torch.device) -> int:
        """Target bytes of one fill-then-write chunk for a ring on `staging_device`
        (`chunk_bytes`, or its default there, rounded down to 64)."""
        chunk = self.chunk_bytes
        if chunk is None:
            chunk = GPU_CHUNK_BYTES if staging_device.type == "cuda" else HOST_CHUNK_BYTES
        return chunk - chunk % SLOT_ALIGN_BYTES
