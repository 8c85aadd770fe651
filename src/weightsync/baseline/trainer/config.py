"""`BroadcastConfig`: how the broadcast baseline packs and broadcasts a sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.baseline.flat_bucket import FLATTENED_BUCKET

MIB = 1 << 20
LOAD_FORMATS = (FLATTENED_BUCKET, None)
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastConfig:
    """Settings of a `BroadcastSync`.

    Attributes:
        bucket_bytes: bytes of one broadcast bucket (full HF tensors in the rollout dtype); a
            larger tensor travels alone.
        backend: the weights update group's backend: ``gloo`` (CPU tensors), ``nccl`` (CUDA
            tensors) or ``auto`` (``nccl`` when the trainer's tensors are on a GPU, ``gloo``
            otherwise). Either way the group is a stand-alone one, never split from a
            default group.
        master_address: where trainer rank 0 hosts the group's rendezvous store; the
            replicas must reach it.
        group_name: prefix of the group's name (a counter is appended per group created).
        load_format: ``flattened_bucket`` (one broadcast per bucket) or ``None`` (one
            broadcast per tensor, SGLang's default).
        timeout_s: how long the rendezvous, one broadcast or one replica's load may take.

    Raises:
        ValueError: a non-positive size or timeout, or an unknown backend or load format.
    """

    bucket_bytes: int = 512 * MIB
    backend: str = "auto"
    master_address: str = "127.0.0.1"
    group_name: str = "weightsync_broadcast"
    load_format: str | None = "flattened_bucket"
    timeout_s: float = 300.0

    def backend_for(self, device: torch.device) -> str:
        """The backend of a group whose trainer tensors live on `device`."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.type == "cuda" else "gloo"

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(
                f"BroadcastConfig.bucket_bytes must be a positive int, got {self.bucket_bytes!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"BroadcastConfig.backend must be one of {BACKENDS}, got {self.backend!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"BroadcastConfig.load_format must be one of {LOAD_FORMATS}, "
                f"got {self.load_format!r}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"BroadcastConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        if not self.master_address or not self.group_name:
            raise ValueError("BroadcastConfig.master_address and group_name must not be empty")
