"""Transports: one-sided writes of bytes into memory a peer registered.

`Transport` is the protocol every transport follows (see `weightsync.transport.base` for the
call sequence and failure semantics). `MooncakeTransport` writes over Mooncake TransferEngine
(RDMA across nodes, TCP where there is no RDMA NIC); `CudaIpcTransport` copies between GPUs of
one host over CUDA IPC. Transports know bytes and addresses only, never parameter names.
"""

from weightsync.transport.base import Transport, WriteHandle, register_tensor
from weightsync.transport.cuda_ipc import CudaIpcTransport
from weightsync.transport.mooncake import MooncakeTransport
from weightsync.transport.mooncake_engine import MooncakeConfig

__all__ = [
    "CudaIpcTransport",
    "MooncakeConfig",
    "MooncakeTransport",
    "Transport",
    "WriteHandle",
    "register_tensor",
]
