"""CUDA IPC: copies between GPUs of one host (NVLink where present), opened in the writer's
context so they run as peer copies."""

from weightsync.transport.cuda_ipc.config import CudaIpcConfig
from weightsync.transport.cuda_ipc.transport import CudaIpcTransport

__all__ = ["CudaIpcConfig", "CudaIpcTransport"]
