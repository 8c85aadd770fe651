"""Transports: one-sided writes of bytes into memory a peer registered.

`Transport` is the protocol every transport follows (see `weightsync.transport.base` for the
call sequence and failure semantics). `MooncakeTransport` writes over Mooncake TransferEngine
(RDMA across nodes, TCP where there is no RDMA NIC); `CudaIpcTransport` copies between GPUs of
one host over CUDA IPC. Each is configured by a frozen config (`MooncakeConfig`,
`CudaIpcConfig`) and made by `open_transport`, and declares what it offers beyond writes from
host memory in a `TransportCapabilities`. Transports know bytes and addresses only, never
parameter names.
"""

from __future__ import annotations

from weightsync.transport.base import (
    HOST_ONLY,
    MemoryMapper,
    Transport,
    TransportCapabilities,
    WriteCost,
    WriteHandle,
    register_tensor,
)
from weightsync.transport.cuda_ipc import CudaIpcConfig, CudaIpcTransport
from weightsync.transport.mooncake import MooncakeConfig, MooncakeTransport

TransportConfig = MooncakeConfig | CudaIpcConfig
"""The configuration of one of the transports; its type picks the transport."""

# The transports by the name configs, command lines and server info use.
TRANSPORTS: dict[str, type[MooncakeConfig] | type[CudaIpcConfig]] = {
    "mooncake": MooncakeConfig,
    "cuda_ipc": CudaIpcConfig,
}


def transport_name(config: TransportConfig) -> str:
    """The name of the transport `config` configures (a key of `TRANSPORTS`).

    Raises:
        ValueError: `config` is not a transport config.
    """
    for name, config_type in TRANSPORTS.items():
        if isinstance(config, config_type):
            return name
    raise ValueError(
        f"not a transport config: {type(config).__name__}; use MooncakeConfig or CudaIpcConfig"
    )


def open_transport(config: TransportConfig) -> Transport:
    """The transport `config` configures, started (close it when done).

    Raises:
        ValueError: `config` is not a transport config.
        WeightSyncError: the transport could not start (no Mooncake, no CUDA driver, ...).
    """
    if isinstance(config, MooncakeConfig):
        return MooncakeTransport(config)
    if isinstance(config, CudaIpcConfig):
        return CudaIpcTransport(config)
    transport_name(config)
    raise AssertionError("unreachable")


__all__ = [
    "HOST_ONLY",
    "TRANSPORTS",
    "CudaIpcConfig",
    "CudaIpcTransport",
    "MemoryMapper",
    "MooncakeConfig",
    "MooncakeTransport",
    "Transport",
    "TransportCapabilities",
    "TransportConfig",
    "WriteCost",
    "WriteHandle",
    "open_transport",
    "register_tensor",
    "transport_name",
]
