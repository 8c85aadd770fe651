"""`PeerMaps`: the receivers a CUDA IPC writer has written to, their memory mapped into it.

A receiver's registry (`weightsync.transport.cuda_ipc.registry`) is fetched on the first
write to it and again when a destination lies outside the regions last fetched (the receiver
registered more since). Each exported allocation is opened once, in the writer's context
(see `weightsync.transport.cuda_ipc.transport` for why there), and stays mapped until the
writer closes or the receiver's process behind the address changes.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from weightsync.errors import TransferError, WeightSyncError
from weightsync.transport.base import RegionTable
from weightsync.transport.cuda_ipc.driver import CudaDriver
from weightsync.transport.cuda_ipc.registry import Allocation, RegistrySnapshot, fetch_snapshot

_FETCH_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Peer:
    """A receiver as the writer sees it: its registry and the allocations mapped so far."""

    snapshot: RegistrySnapshot
    regions: RegionTable = field(default_factory=RegionTable)
    bases: list[int] = field(default_factory=list)
    allocations: dict[int, Allocation] = field(default_factory=dict)
    mapped: dict[int, int] = field(default_factory=dict)  # remote base -> local base

    def __post_init__(self) -> None:
        for addr, size in self.snapshot.regions:
            self.regions.add(addr, size)
        self.allocations = {a.base: a for a in self.snapshot.allocations}
        self.bases = sorted(self.allocations)

    def allocation(self, addr: int) -> Allocation | None:
        index = bisect.bisect_right(self.bases, addr) - 1
        if index < 0:
            return None
        found = self.allocations[self.bases[index]]
        return found if addr < found.base + found.size else None


class PeerMaps:
    """This process's mappings of the receivers' registered memory; thread-safe.

    Args:
        driver: the CUDA driver the handles are opened with.
        device: the writer's CUDA device, whose context the mappings live in.
    """

    def __init__(self, driver: CudaDriver, device: int) -> None:
        self._driver = driver
        self._device = device
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}

    def local_addresses(
        self,
        target: str,
        dst: Sequence[int],
        lengths: Sequence[int],
        refused: Callable[[str, Sequence[int]], TransferError],
    ) -> list[int]:
        """This process's address of every destination region, opening handles as needed.

        Args:
            target: the receiver's session id.
            dst: the receiver's addresses of the regions.
            lengths: bytes per region.
            refused: the error of regions the receiver does not hold, given what is wrong
                and the regions' indices.

        Raises:
            TransferError: the receiver cannot be reached, a region is not inside memory it
                registered (``refused``), or an allocation cannot be mapped.
        """
        peer = self._peer(target, refresh=False)
        missing = [
            i
            for i, (a, n) in enumerate(zip(dst, lengths, strict=True))
            if peer.regions.find(a, n) is None
        ]
        if missing:
            peer = self._peer(target, refresh=True)
            missing = [i for i in missing if peer.regions.find(dst[i], lengths[i]) is None]
        if missing:
            raise refused(
                f"{len(missing)} region(s) are not inside memory the receiver registered; "
                "nothing was written",
                missing,
            )
        local = []
        for addr in dst:
            allocation = peer.allocation(addr)
            if allocation is None:  # registered regions lie inside exported allocations
                raise refused(f"no exported allocation holds {addr:#x}", [])
            mapped = peer.mapped.get(allocation.base)
            if mapped is None:
                mapped = self._mapped_base(target, peer, allocation)
            local.append(mapped + addr - allocation.base)
        return local

    def close(self) -> None:
        """Unmap every receiver's allocations (after the copies into them finished)."""
        with self._lock:
            peers, self._peers = self._peers, {}
        for peer in peers.values():
            self._unmap(peer)

    def _peer(self, target: str, refresh: bool) -> _Peer:
        with self._lock:
            peer = self._peers.get(target)
        if peer is not None and not refresh:
            return peer
        try:
            snapshot = fetch_snapshot(target, _FETCH_TIMEOUT_S)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)  # urllib's URLError wraps the socket's
            raise TransferError(
                f"cannot reach the CUDA IPC receiver {target}: {reason}",
                target_session=target,
            ) from exc
        fresh = _Peer(snapshot=snapshot)
        with self._lock:
            old = self._peers.get(target)
            if old is not None and old.snapshot.pid == snapshot.pid:
                fresh.mapped = old.mapped
            elif old is not None:
                self._unmap(old)  # a new receiver process behind the same address
            self._peers[target] = fresh
        return fresh

    def _unmap(self, peer: _Peer) -> None:
        if peer.snapshot.pid != os.getpid():
            for local_base in peer.mapped.values():
                self._driver.ipc_close_handle(local_base)
        peer.mapped.clear()

    def _mapped_base(self, target: str, peer: _Peer, allocation: Allocation) -> int:
        with self._lock:
            mapped = peer.mapped.get(allocation.base)
            if mapped is not None:
                return mapped
            if peer.snapshot.pid == os.getpid():
                # A process cannot open its own IPC handles; its pointers work as they are.
                mapped = allocation.base
            else:
                self._driver.use_device(self._device)
                try:
                    mapped = self._driver.ipc_open_handle(allocation.handle)
                except WeightSyncError as exc:
                    raise TransferError(
                        f"cannot open the CUDA IPC handle of {peer.snapshot.pci_bus_id} "
                        f"allocation {allocation.base:#x}: {exc}",
                        target_session=target,
                    ) from exc
            peer.mapped[allocation.base] = mapped
            return mapped
