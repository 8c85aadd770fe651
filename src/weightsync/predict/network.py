"""A model of the cluster's network: NICs per node, NVLink inside a node, fixed costs.

What a predicted sync runs on; pure arithmetic, no I/O. Trainer GPU ``g`` sits on trainer
node ``g // gpus_per_node``; rollout GPU ``k`` (the ``k``-th target rank, replica by
replica) on rollout node ``k // gpus_per_node``, a node of its own unless the cluster is
colocated (rollout GPU ``k`` then shares node and NIC with trainer GPU ``k``). The GPUs of a
node share its NICs evenly: GPU ``i`` of a node uses NIC
``i * nics_per_node // gpus_per_node``, so with fewer NICs than GPUs several senders (or
receivers) share one. A NIC sends and receives at once (full duplex), so each NIC is two
ports, one per direction. Two GPUs of one node talk over NVLink, a port per GPU and
direction at `nvlink_gbps`.

A transfer (one source writing a group of runs into one target) first pays its fixed cost,
``message_latency_s + num_writes * write_cost_s`` (plus, where `staging_gbps` is set, the
source's copy of its bytes into its send buffer), during which its ports carry no bytes,
then moves its bytes at the rate the simulator gives it (`weightsync.predict.simulator`).
"""

from __future__ import annotations

from dataclasses import dataclass

# A port: (kind, node, index). kind is "tx"/"rx" for a NIC's two directions and
# "nvtx"/"nvrx" for a GPU's NVLink; node names carry their side ("t3", "r0").
Port = tuple[str, str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkModel:
    """The constants a simulated sync runs with.

    Attributes:
        nic_gbps: each NIC's line rate per direction, in Gb/s (400 for a ConnectX-7).
        nvlink_gbps: each GPU's NVLink rate per direction, in Gb/s (3600: 450 GB/s, H100).
        gpus_per_node: GPUs per node, trainer and rollout alike.
        nics_per_node: NICs per node; divides `gpus_per_node` (GPUs share NICs evenly).
        write_cost_s: fixed cost of posting one write (one contiguous destination run).
        message_latency_s: fixed cost of one transfer to one target, before its first byte.
        colocated: rollout GPU ``k`` shares node ``k // gpus_per_node`` and its NICs with
            trainer GPU ``k`` (same-node transfers then go over NVLink).
        staging_gbps: the rate at which a source copies (and casts) a transfer's bytes into
            its send buffer before they leave, not overlapped with the network; None where
            that copy hides behind the network (GPUs, whose memory is far faster than
            their NICs). Hosts whose CPUs both copy and drive TCP set it.

    Raises:
        ValueError: a rate or count that is not positive, a negative cost, or a NIC count
            that does not divide the GPU count.
    """

    nic_gbps: float = 400.0
    nvlink_gbps: float = 3600.0
    gpus_per_node: int = 8
    nics_per_node: int = 8
    write_cost_s: float = 2e-6
    message_latency_s: float = 10e-6
    colocated: bool = False
    staging_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in ("nic_gbps", "nvlink_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"NetworkModel.{name} must be > 0, got {getattr(self, name)}")
        for name in ("gpus_per_node", "nics_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"NetworkModel.{name} must be an int >= 1, got {value!r}")
        if self.gpus_per_node % self.nics_per_node:
            raise ValueError(
                f"NetworkModel.nics_per_node={self.nics_per_node} must divide "
                f"gpus_per_node={self.gpus_per_node} (GPUs share NICs evenly)"
            )
        if self.staging_gbps is not None and not self.staging_gbps > 0:
            raise ValueError(f"NetworkModel.staging_gbps must be > 0, got {self.staging_gbps}")
        for name in ("write_cost_s", "message_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"NetworkModel.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def nic_bytes_per_s(self) -> float:
        """One NIC's rate per direction in bytes/s."""
        return self.nic_gbps * 1e9 / 8

    @property
    def nvlink_bytes_per_s(self) -> float:
        """One GPU's NVLink rate per direction in bytes/s."""
        return self.nvlink_gbps * 1e9 / 8

    def setup_s(self, num_writes: int, num_bytes: int = 0) -> float:
        """Time of one transfer of `num_writes` writes and `num_bytes` before its bytes move."""
        staging = num_bytes * 8 / (self.staging_gbps * 1e9) if self.staging_gbps else 0.0
        return self.message_latency_s + num_writes * self.write_cost_s + staging

    def trainer_node(self, gpu: int) -> str:
        """The node trainer GPU `gpu` sits on."""
        return f"t{gpu // self.gpus_per_node}"

    def rollout_node(self, gpu: int) -> str:
        """The node rollout GPU `gpu` sits on (a trainer node when colocated)."""
        side = "t" if self.colocated else "r"
        return f"{side}{gpu // self.gpus_per_node}"

    def _nic(self, gpu: int) -> int:
        return (gpu % self.gpus_per_node) * self.nics_per_node // self.gpus_per_node

    def route(self, source_gpu: int, target_gpu: int) -> tuple[Port, Port]:
        """The sending and the receiving port of a write from a trainer to a rollout GPU."""
        source_node, target_node = self.trainer_node(source_gpu), self.rollout_node(target_gpu)
        if source_node == target_node:
            index = source_gpu % self.gpus_per_node
            return ("nvtx", source_node, index), (
                "nvrx",
                target_node,
                target_gpu % self.gpus_per_node,
            )
        return ("tx", source_node, self._nic(source_gpu)), (
            "rx",
            target_node,
            self._nic(target_gpu),
        )

    def capacity(self, port: Port) -> float:
        """A port's rate in bytes/s."""
        return self.nvlink_bytes_per_s if port[0].startswith("nv") else self.nic_bytes_per_s
