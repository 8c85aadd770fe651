"""Mooncake TransferEngine: one-sided writes over RDMA across hosts, TCP where there is none."""

from weightsync.transport.mooncake.engine import PROTOCOLS, MooncakeConfig, rdma_devices
from weightsync.transport.mooncake.transport import MooncakeTransport

__all__ = ["PROTOCOLS", "MooncakeConfig", "MooncakeTransport", "rdma_devices"]
