"""The CUDA IPC registry (a real loopback HTTP server) and what needs no GPU."""

from __future__ import annotations

import ctypes.util

import pytest

from weightsync.errors import WeightSyncError
from weightsync.transport import CudaIpcConfig, CudaIpcTransport
from weightsync.transport.base import RegionTable, check_regions
from weightsync.transport.cuda_ipc.registry import (
    Allocation,
    RegistryServer,
    RegistrySnapshot,
    fetch_snapshot,
    parse_session_id,
)


def _snapshot(pid: int, base: int) -> RegistrySnapshot:
    return RegistrySnapshot(
        pid=pid,
        pci_bus_id="0000:1b:00.0",
        allocations=(Allocation(base=base, size=1 << 20, handle=bytes(range(64))),),
        regions=((base + 4096, 8192), (base + 65536, 100)),
    )


def test_the_server_answers_the_latest_snapshot() -> None:
    server = RegistryServer("127.0.0.1", 0, _snapshot(1, 1 << 40))
    try:
        session = f"ipc:127.0.0.1:{server.port}"
        assert fetch_snapshot(session, 5.0) == _snapshot(1, 1 << 40)
        server.publish(_snapshot(2, 1 << 41))
        assert fetch_snapshot(session, 5.0) == _snapshot(2, 1 << 41)
    finally:
        server.close()
    with pytest.raises(OSError):
        fetch_snapshot(session, 5.0)


@pytest.mark.parametrize("session", ["127.0.0.1:80", "ipc:127.0.0.1", "ipc::80", "ipc:h:port"])
def test_bad_session_ids_are_value_errors(session: str) -> None:
    with pytest.raises(ValueError):
        parse_session_id(session)


def test_a_malformed_document_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed"):
        RegistrySnapshot.from_json(b'{"pid": 1}')


def test_region_table_finds_only_whole_regions() -> None:
    table = RegionTable()
    table.add(1000, 100)
    table.add(2000, 50)
    assert table.find(1000, 100) == (1000, 100)
    assert table.find(1050, 10) == (1000, 100)
    assert table.find(1050, 51) is None
    assert table.find(999, 1) is None
    assert table.find(2049, 1) == (2000, 50)
    with pytest.raises(ValueError, match="overlaps"):
        table.add(1099, 10)
    with pytest.raises(ValueError, match="overlaps"):
        table.add(1990, 11)
    assert table.remove(1000) == 100
    assert table.items() == [(2000, 50)]


def test_check_regions_rejects_bad_input() -> None:
    assert check_regions([1, 2], [3, 4], [5, 6]) == ([1, 2], [3, 4], [5, 6])
    with pytest.raises(ValueError, match="equal lengths"):
        check_regions([1], [2, 3], [4])
    with pytest.raises(ValueError, match="positive"):
        check_regions([1], [2], [-1])
    with pytest.raises(ValueError, match="positive"):
        check_regions([0], [2], [1])


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="has a CUDA driver")
def test_cuda_ipc_without_a_driver_is_a_weightsync_error() -> None:
    with pytest.raises(WeightSyncError, match="CUDA driver"):
        CudaIpcTransport(CudaIpcConfig(device=0))
