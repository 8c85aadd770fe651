"""Transport throughput against chunk size and number of scattered regions.

For each transport available on this machine, beside the machine's own ceiling measured in
the same run:

- host memory: `MooncakeTransport` (TCP) into a second process, against an in-process
  memcpy and a raw loopback TCP socket into the same second process;
- GPU memory (two or more GPUs, ``--gpu``): `CudaIpcTransport` GPU0 -> GPU1 of a second
  process, against an in-process peer copy GPU0 -> GPU1 (and Mooncake TCP between GPU memory
  of two processes with ``--gpu-mooncake``, when Mooncake has CUDA support).

Chunk sweep: one write of ``--total`` bytes cut into contiguous regions of 64 KiB .. 256 MiB.
Region sweep: 1 .. 10,000 regions of ``total / n`` bytes each, at shuffled destination slots
twice their size apart. From it, each transport's cost of a write is fitted (least squares
of ``seconds = n * write_s + total / bytes_per_s``): the figures a
`weightsync.transport.WriteCost` takes (``MooncakeConfig(write_cost=...)`` for your link).
Prints a table per sweep and one JSON line at the end. Timings are the median of
``--repeat`` runs.

    python bench/transport.py [--quick] [--gpu] [--gpu-mooncake] [--no-cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from weightsync.transport import CudaIpcConfig, CudaIpcTransport, MooncakeConfig, MooncakeTransport

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
CHUNKS = [64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
REGION_COUNTS = [1, 10, 100, 1000, 10000]
TIMEOUT_S = 120.0


def _median_rate(num_bytes: int, run: Callable[[], None], repeat: int) -> float:
    """GB/s of the median of `repeat` timed runs (after one untimed warm-up)."""
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def _scatter(total: int, count: int, seed: int) -> tuple[list[int], list[int], int]:
    """``(src_offsets, dst_offsets, size)``: `count` regions of `total // count` bytes; the
    destinations are shuffled slots twice their size apart."""
    size = total // count
    slots = np.random.default_rng(seed).permutation(count)
    return [i * size for i in range(count)], [int(s) * 2 * size for s in slots], size


# ---------------------------------------------------------------- the second process


def _peer_main(args: argparse.Namespace) -> None:
    """Register a buffer (and, on host, accept raw socket streams into it); wait for EOF."""
    tensor = None
    if args.device == "cpu":
        buffer = np.zeros(args.num_bytes, dtype=np.uint8)
        addr = buffer.ctypes.data
        view = memoryview(buffer)
    else:
        import torch

        tensor = torch.zeros(args.num_bytes, dtype=torch.uint8, device=args.device)
        addr = tensor.data_ptr()
    if args.transport == "ipc":
        transport: Any = CudaIpcTransport(CudaIpcConfig(device=int(args.device.split(":")[1])))
    else:
        transport = MooncakeTransport(MooncakeConfig(timeout_s=30.0))
    transport.register(addr, args.num_bytes)
    port = 0
    if tensor is None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def receive() -> None:
            while True:
                conn, _ = listener.accept()
                with conn:
                    while header := conn.recv(8, socket.MSG_WAITALL):
                        (length,) = struct.unpack("!Q", header)
                        got = 0
                        while got < length:
                            n = conn.recv_into(view[got:length])
                            if n == 0:
                                return
                            got += n
                        conn.sendall(b"k")

        threading.Thread(target=receive, daemon=True).start()
    print(json.dumps({"session_id": transport.session_id, "addr": addr, "port": port}), flush=True)
    sys.stdin.read()
    transport.close()


class _Peer:
    def __init__(self, num_bytes: int, transport: str, device: str = "cpu") -> None:
        command = [sys.executable, __file__, "--peer", "--num-bytes", str(num_bytes)]
        command += ["--transport", transport, "--device", device]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.process.wait()} before it was ready")
        ready = json.loads(line)
        self.session_id, self.addr, self.port = ready["session_id"], ready["addr"], ready["port"]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _transport_run(transport: Any, target: str, src: list[int], dst: list[int], lengths: list[int]):
    def run() -> None:
        transport.wait(transport.write(target, src, dst, lengths), TIMEOUT_S)

    return run


# ---------------------------------------------------------------- host memory


def _cpu(total: int, repeat: int) -> dict[str, Any]:
    source = np.random.default_rng(0).integers(0, 256, 2 * total, dtype=np.uint8)
    local = np.zeros(2 * total, dtype=np.uint8)
    peer = _Peer(2 * total, "mooncake")
    transport = MooncakeTransport(MooncakeConfig(timeout_s=TIMEOUT_S))
    transport.register(source.ctypes.data, source.nbytes)
    sock = socket.create_connection(("127.0.0.1", peer.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src_view = memoryview(source)

    def memcpy(src_offsets: list[int], dst_offsets: list[int], size: int):
        def run() -> None:
            for s, d in zip(src_offsets, dst_offsets, strict=True):
                local[d : d + size] = source[s : s + size]

        return run

    def stream(src_offsets: list[int], size: int):
        def run() -> None:
            sock.sendall(struct.pack("!Q", size * len(src_offsets)))
            for s in src_offsets:
                sock.sendall(src_view[s : s + size])
            if sock.recv(1) != b"k":
                raise RuntimeError("socket peer did not acknowledge")

        return run

    def row(src_offsets: list[int], dst_offsets: list[int], size: int) -> dict[str, float]:
        num_bytes = size * len(src_offsets)
        run = _transport_run(
            transport,
            peer.session_id,
            [source.ctypes.data + s for s in src_offsets],
            [peer.addr + d for d in dst_offsets],
            [size] * len(src_offsets),
        )
        return {
            "mooncake_tcp": _median_rate(num_bytes, run, repeat),
            "memcpy": _median_rate(num_bytes, memcpy(src_offsets, dst_offsets, size), repeat),
            "socket": _median_rate(num_bytes, stream(src_offsets, size), repeat),
        }

    try:
        chunks = {}
        for chunk in [c for c in CHUNKS if c <= total]:
            offsets = list(range(0, total, chunk))
            chunks[chunk] = row(offsets, offsets, chunk)
        regions = {}
        for count in REGION_COUNTS:
            src_offsets, dst_offsets, size = _scatter(total, count, seed=count)
            regions[count] = row(src_offsets, dst_offsets, size)
    finally:
        sock.close()
        transport.close()
        peer.close()
    return {"total_bytes": total, "chunks": chunks, "regions": regions}


# ---------------------------------------------------------------- GPU memory


def _gpu(total: int, repeat: int, with_mooncake: bool) -> dict[str, Any]:
    import torch

    src = torch.randint(0, 256, (2 * total,), dtype=torch.uint8, device="cuda:0")
    local = torch.zeros(2 * total, dtype=torch.uint8, device="cuda:1")
    torch.cuda.synchronize("cuda:0")
    base = src.data_ptr()
    transports = {
        "cuda_ipc": (CudaIpcTransport(CudaIpcConfig(device=0)), _Peer(2 * total, "ipc", "cuda:1"))
    }
    if with_mooncake:
        mooncake = MooncakeTransport(MooncakeConfig(timeout_s=TIMEOUT_S))
        if mooncake.capabilities.reads("cuda"):
            transports["mooncake_tcp"] = (mooncake, _Peer(2 * total, "mooncake", "cuda:1"))
        else:
            print("Mooncake has no CUDA support here: GPU rows without it", file=sys.stderr)
            mooncake.close()
    for transport, _ in transports.values():
        transport.register(base, src.numel())

    def peer_copy(src_offsets: list[int], dst_offsets: list[int], size: int):
        def run() -> None:
            for s, d in zip(src_offsets, dst_offsets, strict=True):
                local[d : d + size].copy_(src[s : s + size], non_blocking=True)
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")

        return run

    def row(src_offsets: list[int], dst_offsets: list[int], size: int, names: list[str]):
        num_bytes = size * len(src_offsets)
        result = {
            "peer_copy": _median_rate(num_bytes, peer_copy(src_offsets, dst_offsets, size), repeat)
        }
        for name in names:
            transport, peer = transports[name]
            run = _transport_run(
                transport,
                peer.session_id,
                [base + s for s in src_offsets],
                [peer.addr + d for d in dst_offsets],
                [size] * len(src_offsets),
            )
            result[name] = _median_rate(num_bytes, run, repeat if name == "cuda_ipc" else 1)
        return result

    try:
        chunks, regions = {}, {}
        for chunk in [c for c in CHUNKS if c <= total]:
            offsets = list(range(0, total, chunk))
            # Mooncake TCP moves GPU bytes through host memory: only large chunks are worth timing.
            names = [n for n in transports if n == "cuda_ipc" or chunk >= 16 * MIB]
            chunks[chunk] = row(offsets, offsets, chunk, names)
        for count in REGION_COUNTS:
            src_offsets, dst_offsets, size = _scatter(total, count, seed=count)
            names = [n for n in transports if n == "cuda_ipc" or count <= 100]
            regions[count] = row(src_offsets, dst_offsets, size, names)
    finally:
        for transport, peer in transports.values():
            transport.close()
            peer.close()
    return {"total_bytes": total, "chunks": chunks, "regions": regions}


# ---------------------------------------------------------------- output


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale} {unit}"
    return f"{num_bytes} B"


def fit_write_cost(total: int, rates: dict[int, float]) -> dict[str, float]:
    """``write_s`` and ``bytes_per_s`` fitted to ``seconds = n * write_s + total / bytes_per_s``
    over ``{number of regions n: GB/s}`` of one transport's region sweep (least squares)."""
    points = [(n, total / (gbps * 1e9)) for n, gbps in rates.items()]
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    spread = sum((n - mean_n) ** 2 for n, _ in points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / spread if spread else 0.0
    intercept = mean_t - slope * mean_n
    return {"write_s": max(slope, 0.0), "bytes_per_s": total / intercept if intercept > 0 else 0.0}


def _fits(sweep: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The fitted write cost of every transport of a region sweep (not the in-process rows)."""
    names = {name for row in sweep["regions"].values() for name in row} - {"memcpy", "peer_copy"}
    return {
        name: fit_write_cost(
            sweep["total_bytes"],
            {n: row[name] for n, row in sweep["regions"].items() if name in row},
        )
        for name in sorted(names)
    }


def _print_fits(title: str, fits: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    for name, fit in fits.items():
        print(
            f"{name:>14}: {fit['write_s'] * 1e6:.1f} us per write, "
            f"{fit['bytes_per_s'] / 1e9:.2f} GB/s"
        )


def _print_table(title: str, key_name: str, rows: dict[int, dict[str, float]], fmt) -> None:
    columns = sorted({name for row in rows.values() for name in row})
    print(f"\n{title} (GB/s, median)")
    print(f"{key_name:>12} " + " ".join(f"{c:>13}" for c in columns))
    for key, row in rows.items():
        cells = [f"{row[c]:13.2f}" if c in row else f"{'-':>13}" for c in columns]
        print(f"{fmt(key):>12} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized run")
    parser.add_argument("--no-cpu", action="store_true", help="skip the host-memory sweeps")
    parser.add_argument("--gpu", action="store_true", help="run the GPU sweeps (2+ GPUs)")
    parser.add_argument("--gpu-mooncake", action="store_true", help="add Mooncake between GPUs")
    parser.add_argument("--total", type=int, help="bytes per timed write (host)")
    parser.add_argument("--gpu-total", type=int, default=GIB, help="bytes per timed write (GPU)")
    parser.add_argument("--repeat", type=int, help="timed runs per point")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="mooncake", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if args.peer:
        _peer_main(args)
        return
    total = args.total or (64 * MIB if args.quick else 256 * MIB)
    repeat = args.repeat or (2 if args.quick else 3)
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}}
    if not args.no_cpu:
        result["cpu"] = _cpu(total, repeat)
        _print_table(
            "host memory, one write cut into chunks", "chunk", result["cpu"]["chunks"], _size
        )
        _print_table("host memory, scattered regions", "regions", result["cpu"]["regions"], str)
        result["cpu"]["write_cost"] = _fits(result["cpu"])
        _print_fits("host memory, the cost of a write (fitted)", result["cpu"]["write_cost"])
    if args.gpu:
        result["gpu"] = _gpu(args.gpu_total, repeat, args.gpu_mooncake)
        _print_table(
            "GPU0 -> GPU1, one write cut into chunks", "chunk", result["gpu"]["chunks"], _size
        )
        _print_table("GPU0 -> GPU1, scattered regions", "regions", result["gpu"]["regions"], str)
        result["gpu"]["write_cost"] = _fits(result["gpu"])
        _print_fits("GPU0 -> GPU1, the cost of a write (fitted)", result["gpu"]["write_cost"])
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
