"""MooncakeTransport over TCP between this process and real peer processes on 127.0.0.1.

Each peer (tests/transport_peer.py) registers a file-backed buffer that this process maps
too, so every destination byte is checked directly after a write.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from transport_peer import PeerProcess
from weightsync.errors import TransferError, WeightSyncError
from weightsync.transport import (
    MooncakeConfig,
    MooncakeTransport,
    Transport,
    TransportCapabilities,
    register_tensor,
)
from weightsync.transport.mooncake.engine import rdma_devices

MIB = 1 << 20
PEER_BYTES = 320 * MIB
SRC_BYTES = 256 * MIB
TIMEOUT_S = 5.0
FILL = 0xAB


@pytest.fixture(scope="module", autouse=True)
def _mooncake_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MC_TRANSFER_TIMEOUT", "5")
        patch.setenv("MC_LOG_LEVEL", "ERROR")
        yield


def _shared_file(tmp_path_factory: pytest.TempPathFactory, name: str, num_bytes: int) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("shm")
    path = base / f"weightsync-{name}-{os.getpid()}"
    with path.open("wb") as f:
        f.truncate(num_bytes)
    return path


class _MappedPeer:
    """A peer process plus this process's view of its destination buffer."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, name: str, num_bytes: int):
        self.path = _shared_file(tmp_path_factory, name, num_bytes)
        self.dest = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(num_bytes,))
        self.peer = PeerProcess(num_bytes=num_bytes, file=self.path)

    def close(self) -> None:
        self.peer.close()
        del self.dest
        self.path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def mapped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_MappedPeer]:
    peer = _MappedPeer(tmp_path_factory, "main", PEER_BYTES)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def source() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, SRC_BYTES, dtype=np.uint8)


@pytest.fixture(scope="module")
def writer(source: np.ndarray) -> Iterator[MooncakeTransport]:
    transport = MooncakeTransport(MooncakeConfig(timeout_s=TIMEOUT_S))
    transport.register(source.ctypes.data, source.nbytes)
    yield transport
    transport.close()


def test_transport_follows_the_protocol(writer: MooncakeTransport) -> None:
    assert isinstance(writer, Transport)
    assert writer.protocol == "tcp"
    assert writer.session_id.startswith("127.0.0.1:")
    # Mooncake reads host memory, and GPU memory of any device when built with CUDA; its
    # writes never wait on a CUDA stream and it maps no receiver's memory.
    capabilities = writer.capabilities
    assert capabilities.reads("cpu") and capabilities.device is None
    assert not capabilities.stream_ordered and not capabilities.maps_device_memory


def test_capabilities_say_which_memory_a_transport_reads() -> None:
    host = TransportCapabilities()
    assert host.reads("cpu") and not host.reads("cuda") and not host.reads("cuda", 0)
    any_gpu = TransportCapabilities(reads_cuda=True)
    assert any_gpu.reads("cuda", 3) and any_gpu.reads("cuda") and not any_gpu.reads("mps")
    one_gpu = TransportCapabilities(reads_cuda=True, device=1, stream_ordered=True)
    assert one_gpu.reads("cuda", 1) and one_gpu.reads("cuda") and not one_gpu.reads("cuda", 0)
    with pytest.raises(ValueError, match="need reads_cuda"):
        TransportCapabilities(stream_ordered=True)
    with pytest.raises(ValueError, match="need reads_cuda"):
        TransportCapabilities(maps_device_memory=True)
    with pytest.raises(ValueError, match="device index or None"):
        TransportCapabilities(reads_cuda=True, device=-1)


def test_256_mib_write_lands_byte_for_byte(
    writer: MooncakeTransport, mapped: _MappedPeer, source: np.ndarray
) -> None:
    mapped.dest[:] = 0
    handle = writer.write(
        mapped.peer.session_id, [source.ctypes.data], [mapped.peer.addr], [SRC_BYTES]
    )
    assert handle.num_bytes == SRC_BYTES and handle.num_regions == 1
    writer.wait(handle, 60.0)
    assert np.array_equal(mapped.dest[:SRC_BYTES], source)
    assert not mapped.dest[SRC_BYTES:].any()
    assert writer.outstanding(mapped.peer.session_id) == 0


def test_scattered_small_regions_and_large_ones(
    writer: MooncakeTransport, mapped: _MappedPeer, source: np.ndarray
) -> None:
    rng = np.random.default_rng(1)
    mapped.dest[:] = FILL
    expected = np.full(PEER_BYTES, FILL, dtype=np.uint8)
    # 2,000 small regions of 1..4096 bytes in shuffled 8 KiB slots of the first 16 MiB, then
    # three large ones further up; gaps between regions must keep the fill value.
    slots = rng.permutation(2048)[:2000]
    offsets = [int(slot) * 8192 + int(rng.integers(0, 4096)) for slot in slots]
    lengths = [int(n) for n in rng.integers(1, 4097, size=2000)]
    for offset, length in (
        (20 * MIB, 64 * MIB + 3),
        (100 * MIB + 1, 32 * MIB),
        (200 * MIB, 9 * MIB),
    ):
        offsets.append(offset)
        lengths.append(length)
    src_offsets = [int(rng.integers(0, SRC_BYTES - n)) for n in lengths]
    for dst, src, n in zip(offsets, src_offsets, lengths, strict=True):
        expected[dst : dst + n] = source[src : src + n]
    handle = writer.write(
        mapped.peer.session_id,
        [source.ctypes.data + s for s in src_offsets],
        [mapped.peer.addr + d for d in offsets],
        lengths,
    )
    writer.wait(handle, 60.0)
    assert np.array_equal(mapped.dest, expected)


def test_more_regions_than_slots_from_two_threads_do_not_wedge(
    writer: MooncakeTransport, mapped: _MappedPeer, source: np.ndarray
) -> None:
    mapped.dest[:] = 0
    region, per_thread = 1024, 3000
    peaks: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peaks.append(writer.outstanding(mapped.peer.session_id))
            done.wait(0.001)

    def push(thread: int) -> None:
        base = thread * per_thread * region
        offsets = [base + i * region for i in range(per_thread)]
        handle = writer.write(
            mapped.peer.session_id,
            [source.ctypes.data + o for o in offsets],
            [mapped.peer.addr + o for o in offsets],
            [region] * per_thread,
        )
        writer.wait(handle, 60.0)

    watcher = threading.Thread(target=watch)
    watcher.start()
    pushers = [threading.Thread(target=push, args=(t,)) for t in range(2)]
    for thread in pushers:
        thread.start()
    for thread in pushers:
        thread.join(timeout=120)
    done.set()
    watcher.join()
    assert not any(thread.is_alive() for thread in pushers)
    total = 2 * per_thread * region
    assert np.array_equal(mapped.dest[:total], source[:total])
    assert max(peaks) <= writer.config.max_outstanding_per_peer
    assert writer.outstanding(mapped.peer.session_id) == 0


def test_a_tiny_slot_limit_still_delivers_every_region(
    mapped: _MappedPeer, source: np.ndarray
) -> None:
    mapped.dest[:] = 0
    with MooncakeTransport(MooncakeConfig(timeout_s=TIMEOUT_S, max_outstanding_per_peer=3)) as t:
        register_tensor(t, torch.from_numpy(source))
        offsets = [i * 4096 for i in range(0, 400, 2)]
        handle = t.write(
            mapped.peer.session_id,
            [source.ctypes.data + o for o in offsets],
            [mapped.peer.addr + o for o in offsets],
            [4096] * len(offsets),
        )
        assert t.outstanding(mapped.peer.session_id) <= 3
        t.wait(handle, 30.0)
    for o in offsets:
        assert np.array_equal(mapped.dest[o : o + 4096], source[o : o + 4096])
    assert not mapped.dest[4096:8192].any()


@pytest.mark.parametrize("length", [4096, 8 * MIB])
def test_write_past_the_end_fails_and_leaves_the_destination_untouched(
    writer: MooncakeTransport, mapped: _MappedPeer, source: np.ndarray, length: int
) -> None:
    mapped.dest[:] = FILL
    dst = mapped.peer.addr + PEER_BYTES - length + 100
    handle = writer.write(mapped.peer.session_id, [source.ctypes.data], [dst], [length])
    with pytest.raises(TransferError) as caught:
        writer.wait(handle, TIMEOUT_S)
    error = caught.value
    assert error.target_session == mapped.peer.session_id
    assert error.byte_ranges == ((dst, length),)
    assert error.return_code is not None and error.return_code < 0
    assert "may still land later" in str(error)
    assert (mapped.dest == FILL).all()
    with pytest.raises(TransferError):  # a failed handle keeps failing
        writer.wait(handle, TIMEOUT_S)
    assert writer.outstanding(mapped.peer.session_id) == 0


def test_bad_arguments_are_value_errors(writer: MooncakeTransport, source: np.ndarray) -> None:
    addr = source.ctypes.data
    with pytest.raises(ValueError, match="equal lengths"):
        writer.write("127.0.0.1:1", [addr, addr], [addr], [1, 1])
    with pytest.raises(ValueError, match="positive"):
        writer.write("127.0.0.1:1", [addr], [addr], [0])
    unregistered = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="not inside memory registered"):
        writer.write("127.0.0.1:1", [unregistered.ctypes.data], [addr], [64])
    with pytest.raises(ValueError, match="not inside memory registered"):
        writer.write("127.0.0.1:1", [addr + SRC_BYTES - 8], [addr], [64])
    with pytest.raises(ValueError, match="overlaps"):
        writer.register(addr + 4096, 4096)
    with pytest.raises(ValueError):
        writer.unregister(addr + 1)
    with pytest.raises(ValueError, match="this transport"):
        writer.wait(object(), 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [{"protocol": "udp"}, {"timeout_s": 0}, {"max_outstanding_per_peer": 0}, {"hostname": ""}],
)
def test_bad_configs_are_value_errors(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MooncakeConfig(**fields)  # type: ignore[arg-type]


def test_engine_timeout_is_whole_seconds_at_least_five() -> None:
    assert MooncakeConfig(timeout_s=0.5).engine_timeout_s == 5
    assert MooncakeConfig(timeout_s=30.2).engine_timeout_s == 31


@pytest.mark.skipif(bool(rdma_devices()), reason="this machine has RDMA devices")
def test_auto_is_tcp_and_rdma_fails_without_an_rdma_device() -> None:
    with MooncakeTransport(MooncakeConfig(protocol="auto")) as transport:
        assert transport.protocol == "tcp"
    with pytest.raises(WeightSyncError, match="no RDMA device"):
        MooncakeTransport(MooncakeConfig(protocol="rdma"))


def test_a_port_taken_between_mooncakes_pick_and_bind_is_picked_again(monkeypatch) -> None:
    # Mooncake picks a free port, then binds it; a process binding it in between makes
    # initialize raise. Injected here for the first tries, on top of the real engine.
    import mooncake.engine

    real = mooncake.engine.TransferEngine
    raced = []

    class RacedEngine(real):  # type: ignore[misc, valid-type]
        def initialize(self, *args: object) -> int:
            if len(raced) < 2:
                raced.append(args)
                raise RuntimeError("bind: Address already in use")
            return super().initialize(*args)

    monkeypatch.setattr(mooncake.engine, "TransferEngine", RacedEngine)
    with MooncakeTransport(MooncakeConfig(timeout_s=TIMEOUT_S)) as transport:
        assert transport.protocol == "tcp" and transport.session_id
    assert len(raced) == 2
    raced.clear()

    class AlwaysRaced(real):  # type: ignore[misc, valid-type]
        def initialize(self, *args: object) -> int:
            raced.append(args)
            raise RuntimeError("bind: Address already in use")

    monkeypatch.setattr(mooncake.engine, "TransferEngine", AlwaysRaced)
    with pytest.raises(WeightSyncError, match="could not bind a port after 5 tries"):
        MooncakeTransport(MooncakeConfig(timeout_s=TIMEOUT_S))
    assert len(raced) == 5


def test_close_is_idempotent_and_final(source: np.ndarray) -> None:
    transport = MooncakeTransport(MooncakeConfig(timeout_s=TIMEOUT_S))
    transport.register(source.ctypes.data, 4096)
    transport.close()
    transport.close()
    with pytest.raises(WeightSyncError, match="closed"):
        transport.write("127.0.0.1:1", [source.ctypes.data], [1], [1])
    with pytest.raises(WeightSyncError, match="closed"):
        transport.register(source.ctypes.data, 4096)


def test_a_killed_peer_fails_fast(
    writer: MooncakeTransport, source: np.ndarray, tmp_path_factory: pytest.TempPathFactory
) -> None:
    mapped = _MappedPeer(tmp_path_factory, "killed", 16 * MIB)
    try:
        session = mapped.peer.session_id
        writer.wait(writer.write(session, [source.ctypes.data], [mapped.peer.addr], [MIB]), 10.0)
        mapped.peer.kill()
        for transport in (writer, MooncakeTransport(MooncakeConfig(timeout_s=TIMEOUT_S))):
            if transport is not writer:
                transport.register(source.ctypes.data, MIB)
            start = time.monotonic()
            handle = transport.write(session, [source.ctypes.data], [mapped.peer.addr], [MIB])
            with pytest.raises(TransferError) as caught:
                transport.wait(handle, TIMEOUT_S)
            assert time.monotonic() - start < TIMEOUT_S / 2
            assert caught.value.target_session == session
            if transport is not writer:
                transport.close()
    finally:
        mapped.close()


@pytest.mark.serial  # wall-clock bounds: not beside another test
def test_a_hung_peer_fails_within_the_timeout(
    writer: MooncakeTransport, source: np.ndarray, tmp_path_factory: pytest.TempPathFactory
) -> None:
    mapped = _MappedPeer(tmp_path_factory, "hung", 64 * MIB)
    try:
        session, dst = mapped.peer.session_id, mapped.peer.addr
        writer.wait(writer.write(session, [source.ctypes.data], [dst], [MIB]), 10.0)
        mapped.peer.pause()
        start = time.monotonic()
        handle = writer.write(session, [source.ctypes.data], [dst], [64 * MIB])
        with pytest.raises(TransferError, match="timed out") as caught:
            writer.wait(handle, TIMEOUT_S)
        elapsed = time.monotonic() - start
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5.0
        assert "may still land later" in str(caught.value)
        assert caught.value.return_code is None
        # The timed-out region keeps its slot until Mooncake resolves it.
        assert writer.outstanding(session) == 1
        mapped.peer.resume()
        writer.wait(writer.write(session, [source.ctypes.data], [dst], [MIB]), 30.0)
        deadline = time.monotonic() + 30.0
        while writer.outstanding(session) and time.monotonic() < deadline:
            writer.wait(writer.write(session, [source.ctypes.data], [dst], [4096]), 30.0)
        assert writer.outstanding(session) == 0
        assert np.array_equal(mapped.dest[:MIB], source[:MIB])
    finally:
        mapped.peer.resume()
        mapped.close()
