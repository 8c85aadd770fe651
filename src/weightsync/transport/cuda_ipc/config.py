"""`CudaIpcConfig`: how a `CudaIpcTransport` is set up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaIpcConfig:
    """Settings of a `CudaIpcTransport` (one process, one GPU, peers on the same host).

    Attributes:
        device: the CUDA device (as this process numbers it) whose memory the process
            registers and writes from.
        hostname: the address the small registry server (that publishes this process's IPC
            handles) binds; loopback unless peers reach it otherwise.
        port: the registry server's port; 0 picks a free one.
        num_streams: streams one write's bytes are spread over (pieces of at least 8 MiB),
            so that several copy engines can drive the link at once.

    Raises:
        ValueError: a negative device or port, an empty hostname, or ``num_streams < 1``.
    """

    device: int = 0
    hostname: str = "127.0.0.1"
    port: int = 0
    num_streams: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.device, int) or self.device < 0:
            raise ValueError(f"CudaIpcConfig.device must be a device index, got {self.device!r}")
        if not self.hostname:
            raise ValueError("CudaIpcConfig.hostname must not be empty")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"CudaIpcConfig.port must be in [0, 65535], got {self.port!r}")
        if not isinstance(self.num_streams, int) or self.num_streams < 1:
            raise ValueError(f"CudaIpcConfig.num_streams must be >= 1, got {self.num_streams!r}")
