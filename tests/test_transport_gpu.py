"""Transports between GPU memory of two processes (run with ``-m gpu`` on a GPU machine).

CUDA IPC needs two GPUs; Mooncake needs a build with CUDA support (the
``mooncake-transfer-engine`` wheels, not ``-non-cuda``) and uses the second GPU when there is
one.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Iterator

import pytest

from transport_peer import PeerProcess, random_bytes
from weightsync.errors import TransferError
from weightsync.transport import CudaIpcConfig, CudaIpcTransport, MooncakeConfig, MooncakeTransport

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIB, GIB = 1 << 20, 1 << 30
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)


def _mooncake_has_cuda() -> bool:
    try:
        from mooncake import engine
    except ImportError:
        return False
    return bool(getattr(engine, "SUPPORT_CUDA", False))


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module", autouse=True)
def _mooncake_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MC_TRANSFER_TIMEOUT", "5")
        patch.setenv("MC_LOG_LEVEL", "ERROR")
        yield


@two_gpus
@pytest.mark.parametrize("streams", [1, 4])
def test_cuda_ipc_moves_4_gib_gpu0_to_gpu1_at_nvlink_rate(streams: int) -> None:
    num_bytes = 4 * GIB
    peer = PeerProcess(num_bytes=num_bytes, transport="ipc", device="cuda:1")
    try:
        src = random_bytes(num_bytes, 7, "cuda:0")
        torch.cuda.synchronize(0)
        with CudaIpcTransport(CudaIpcConfig(device=0, num_streams=streams)) as transport:
            transport.register(src.data_ptr(), num_bytes)

            def write() -> float:
                start = time.perf_counter()
                handle = transport.write(
                    peer.session_id, [src.data_ptr()], [peer.addr], [num_bytes]
                )
                transport.wait(handle, 30.0)
                return time.perf_counter() - start

            write()  # opens the IPC handle once
            seconds = [write() for _ in range(5)]
        rate = num_bytes / statistics.median(seconds) / 1e9
        print(f"CUDA IPC 4 GiB GPU0 -> GPU1, {streams} stream(s): {rate:.1f} GB/s (median of 5)")
        assert peer.command("eqrand 7") == "1"
        assert rate >= 300.0
    finally:
        peer.close()


@two_gpus
def test_cuda_ipc_scattered_regions_and_a_write_past_the_end() -> None:
    num_bytes = 64 * MIB
    peer = PeerProcess(num_bytes=num_bytes, transport="ipc", device="cuda:1")
    try:
        src = random_bytes(num_bytes, 3, "cuda:0")
        generator = torch.Generator().manual_seed(0)
        slots = torch.randperm(4096, generator=generator)[:3000].tolist()
        lengths = torch.randint(1, 8193, (3000,), generator=generator).tolist()
        offsets = [slot * 16384 for slot in slots]
        expected = torch.zeros(num_bytes, dtype=torch.uint8, device="cuda:0")
        for offset, length in zip(offsets, lengths, strict=True):
            expected[offset : offset + length] = src[offset : offset + length]
        torch.cuda.synchronize(0)
        with CudaIpcTransport(CudaIpcConfig(device=0)) as transport:
            transport.register(src.data_ptr(), num_bytes)
            handle = transport.write(
                peer.session_id,
                [src.data_ptr() + o for o in offsets],
                [peer.addr + o for o in offsets],
                lengths,
            )
            transport.wait(handle, 30.0)
            assert peer.command(f"sha 0 {num_bytes}") == _sha(expected)
            # The first region is fine, the second runs past the end: nothing is written.
            dst = [peer.addr, peer.addr + num_bytes - 4096]
            bad = transport.write(peer.session_id, [src.data_ptr()] * 2, dst, [MIB, 8192])
            with pytest.raises(TransferError, match="not inside memory the receiver registered"):
                transport.wait(bad, 5.0)
            assert peer.command(f"sha 0 {num_bytes}") == _sha(expected)
    finally:
        peer.close()


@two_gpus
def test_cuda_ipc_write_after_stream_waits_for_the_producing_work() -> None:
    num_bytes = 256 * MIB
    peer = PeerProcess(num_bytes=num_bytes, transport="ipc", device="cuda:1")
    try:
        src = torch.zeros(num_bytes, dtype=torch.uint8, device="cuda:0")
        expected = random_bytes(num_bytes, 5, "cuda:0")
        torch.cuda.synchronize(0)
        with CudaIpcTransport(CudaIpcConfig(device=0)) as transport:
            transport.register(src.data_ptr(), num_bytes)
            stream = torch.cuda.current_stream(0)
            for _ in range(3):
                src.zero_()
                torch.cuda.synchronize(0)
                # The source is still zeros when `write` returns: a long sleep kernel holds
                # the stream, and the bytes are only copied in behind it. A copy that did
                # not wait for the stream would send zeros.
                torch.cuda._sleep(200_000_000)
                src.copy_(expected)
                handle = transport.write(
                    peer.session_id,
                    [src.data_ptr()],
                    [peer.addr],
                    [num_bytes],
                    after_stream=stream.cuda_stream,
                )
                assert not stream.query()
                transport.wait(handle, 30.0)
                assert peer.command("eqrand 5") == "1"
                assert peer.command("zero") == "ok"
    finally:
        peer.close()


@pytest.mark.skipif(not _mooncake_has_cuda(), reason="Mooncake without CUDA support")
def test_mooncake_between_gpu_memory_of_two_processes() -> None:
    num_bytes = 256 * MIB
    device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    peer = PeerProcess(num_bytes=num_bytes, transport="mooncake", device=device)
    try:
        src = random_bytes(num_bytes, 11, "cuda:0")
        torch.cuda.synchronize(0)
        with MooncakeTransport(MooncakeConfig(timeout_s=5.0)) as transport:
            transport.register(src.data_ptr(), num_bytes)
            start = time.perf_counter()
            handle = transport.write(peer.session_id, [src.data_ptr()], [peer.addr], [num_bytes])
            transport.wait(handle, 60.0)
            seconds = time.perf_counter() - start
            print(f"Mooncake TCP 256 MiB GPU -> GPU: {num_bytes / seconds / 1e9:.2f} GB/s")
            assert peer.command("eqrand 11") == "1"
            assert peer.command("zero") == "ok"
            offsets = [i * 65536 for i in range(0, 4000, 2)]
            handle = transport.write(
                peer.session_id,
                [src.data_ptr() + o for o in offsets],
                [peer.addr + o for o in offsets],
                [4096] * len(offsets),
            )
            transport.wait(handle, 60.0)
        expected = torch.zeros(num_bytes, dtype=torch.uint8, device="cuda:0")
        for offset in offsets:
            expected[offset : offset + 4096] = src[offset : offset + 4096]
        assert peer.command(f"sha 0 {num_bytes}") == _sha(expected)
    finally:
        peer.close()
