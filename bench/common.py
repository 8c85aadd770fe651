"""Helpers shared by the benchmarks: workloads, link ceilings, statistics and tables.

Workloads are config.json dicts of synthetic models (`weightsync.testing.synthetic` weights,
so no checkpoint is written). Ceilings are what the machine's links move with nothing of
weightsync in the way, each over the same number of bytes: on the host, a raw Mooncake TCP
write between two processes with big regions, an in-process memcpy and a loopback TCP socket
stream; between two GPUs, an NCCL broadcast between two processes and an in-process peer
copy.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from weightsync.layout import DTYPE_SIZES, hf_tensor_shapes
from weightsync.testing.presets import preset_config
from weightsync.transport import MooncakeConfig, MooncakeTransport

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# The workloads: `weightsync.testing.presets` (dense ones qwen3-shaped with GQA, q/k norms
# and untied embeddings; MoE ones qwen3_moe-shaped).
PRESETS: dict[str, dict[str, Any]] = {
    name: preset_config(name)
    for name in (
        "tiny",
        "dense-256m",
        "dense-1g",
        "dense-8b",
        "dense-32b",
        "moe-small",
        "qwen3-30b-a3b",
    )
}
_COMMON = {"max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def workload_config(preset: str, **overrides: Any) -> dict[str, Any]:
    """The config.json dict of a preset, with overrides (None values are ignored).

    Raises:
        ValueError: an unknown preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = {**_COMMON, **PRESETS[preset]}
    config.update({k: v for k, v in overrides.items() if v is not None})
    return config


def model_bytes(config: dict[str, Any], dtype: str) -> int:
    """Bytes of the model's HF tensors in `dtype`."""
    return DTYPE_SIZES[dtype] * sum(math.prod(s) for s in hf_tensor_shapes(config).values())


def write_config(config: dict[str, Any], folder: Path) -> Path:
    """Write `config` as ``folder/config.json``; return the folder (a model path for
    ``weightsync serve --load-format dummy``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def log(message: str) -> None:
    """Progress on stderr (stdout holds the table and the JSON line)."""
    print(message, file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else math.nan


# ---------------------------------------------------------------- link ceilings (host memory)

_REGION_BYTES = 64 * MIB
_MAX_BUFFER_BYTES = 512 * MIB
_TIMEOUT_S = 300.0


def _touched(num_bytes: int) -> np.ndarray:
    """A buffer whose pages are all mapped (a fresh allocation faults on first write, which
    would be timed as link time; the replicas' parameters are long since mapped)."""
    buffer = np.empty(num_bytes, dtype=np.uint8)
    buffer.fill(1)
    return buffer


def _ceiling_peer(num_bytes: int, conn: Any) -> None:
    """The second process: a registered buffer that Mooncake writes into, and a socket that
    streams into the same buffer; exits when the pipe closes."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    buffer = _touched(num_bytes)
    view = memoryview(buffer)
    transport = MooncakeTransport(MooncakeConfig(timeout_s=_TIMEOUT_S))
    transport.register(buffer.ctypes.data, num_bytes)
    listener = socket.create_server(("127.0.0.1", 0))

    def receive() -> None:
        conn_sock, _ = listener.accept()
        with conn_sock:
            while header := conn_sock.recv(8, socket.MSG_WAITALL):
                (length,) = struct.unpack("!Q", header)
                done = 0
                while done < length:
                    offset = done % num_bytes
                    got = conn_sock.recv_into(view[offset : min(num_bytes, offset + length - done)])
                    if got == 0:
                        return
                    done += got
                conn_sock.sendall(b"k")

    threading.Thread(target=receive, daemon=True).start()
    conn.send(
        {
            "session_id": transport.session_id,
            "addr": buffer.ctypes.data,
            "port": listener.getsockname()[1],
        }
    )
    with contextlib.suppress(EOFError):
        conn.recv()
    transport.close()


class HostCeiling:
    """Measures the host links over `num_bytes`, against a peer process it starts.

    Regions are `_REGION_BYTES` long and cycle over buffers of at most 512 MiB, so a
    measurement of any size needs at most that much memory on each side.
    """

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.buffer_bytes = min(num_bytes, _MAX_BUFFER_BYTES)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._peer = ctx.Process(target=_ceiling_peer, args=(self.buffer_bytes, child), daemon=True)
        self._peer.start()
        if not self._conn.poll(120.0):
            raise RuntimeError("the ceiling peer did not start within 120 s")
        ready = self._conn.recv()
        self._session, self._peer_addr = ready["session_id"], ready["addr"]
        self._source = np.random.default_rng(0).integers(0, 256, self.buffer_bytes, dtype=np.uint8)
        self._local = np.zeros(self.buffer_bytes, dtype=np.uint8)
        self._transport = MooncakeTransport(MooncakeConfig(timeout_s=_TIMEOUT_S))
        self._transport.register(self._source.ctypes.data, self.buffer_bytes)
        self._sock = socket.create_connection(("127.0.0.1", ready["port"]))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # One untimed round: connections set up, every page mapped on both sides.
        self.measure()

    def _regions(self) -> list[tuple[int, int]]:
        """``(offset in the buffers, length)`` of every region of one measurement."""
        regions, done = [], 0
        while done < self.num_bytes:
            offset = done % self.buffer_bytes
            length = min(_REGION_BYTES, self.num_bytes - done, self.buffer_bytes - offset)
            regions.append((offset, length))
            done += length
        return regions

    def mooncake(self) -> float:
        """Seconds to write `num_bytes` into the peer with raw Mooncake TCP writes."""
        regions = self._regions()
        src = [self._source.ctypes.data + o for o, _ in regions]
        dst = [self._peer_addr + o for o, _ in regions]
        lengths = [n for _, n in regions]
        start = time.perf_counter()
        self._transport.wait(self._transport.write(self._session, src, dst, lengths), _TIMEOUT_S)
        return time.perf_counter() - start

    def mooncake_writes(self, count: int, length: int) -> float:
        """Seconds of one raw Mooncake TCP batch of `count` writes of `length` bytes each."""
        if count * length > self.buffer_bytes:
            raise ValueError(f"{count} writes of {length} B do not fit {self.buffer_bytes} B")
        offsets = [k * length for k in range(count)]
        src = [self._source.ctypes.data + o for o in offsets]
        dst = [self._peer_addr + o for o in offsets]
        start = time.perf_counter()
        self._transport.wait(
            self._transport.write(self._session, src, dst, [length] * count), _TIMEOUT_S
        )
        return time.perf_counter() - start

    def memcpy(self) -> float:
        """Seconds to copy `num_bytes` in this process."""
        regions = self._regions()
        start = time.perf_counter()
        for offset, length in regions:
            np.copyto(self._local[offset : offset + length], self._source[offset : offset + length])
        return time.perf_counter() - start

    def socket(self) -> float:
        """Seconds to stream `num_bytes` into the peer over a loopback TCP socket."""
        view = memoryview(self._source)
        start = time.perf_counter()
        self._sock.sendall(struct.pack("!Q", self.num_bytes))
        for offset, length in self._regions():
            self._sock.sendall(view[offset : offset + length])
        if self._sock.recv(1) != b"k":
            raise RuntimeError("the ceiling peer did not acknowledge the stream")
        return time.perf_counter() - start

    def measure(self) -> dict[str, float]:
        """One round: seconds of each link over `num_bytes`."""
        return {"mooncake_tcp": self.mooncake(), "memcpy": self.memcpy(), "socket": self.socket()}

    def close(self) -> None:
        """Stop the peer and free the buffers."""
        self._sock.close()
        self._transport.close()
        self._conn.close()
        self._peer.join(30.0)
        if self._peer.is_alive():
            self._peer.kill()


def timed_rounds(rounds: int, measure: Callable[[], dict[str, float]]) -> dict[str, list[float]]:
    """`measure` called `rounds` times; each key's values collected."""
    collected: dict[str, list[float]] = {}
    for _ in range(rounds):
        for key, value in measure().items():
            collected.setdefault(key, []).append(value)
    return collected


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A plain text table on stdout."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))


# ---------------------------------------------------------------- link ceilings (GPU memory)

_GPU_BUFFER_BYTES = 1 * GIB


def _gpu_ceiling_rank(rank: int, gpus: tuple[int, int], buffer_bytes: int, init: str, conn: Any):
    """One of the two GPU ceiling processes: rank 0 on ``gpus[0]`` sends, rank 1 on
    ``gpus[1]`` receives. Commands come on `conn`: ``("nccl", regions)`` (both ranks),
    ``("peer", regions)`` (rank 0 only; an in-process copy into ``gpus[1]``), ``None`` to
    exit. Rank 0 answers each with the seconds it took."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(device)
    same_gpu = gpus[0] == gpus[1]
    if not same_gpu:  # NCCL takes no two ranks on one GPU: a colocated ceiling is a copy
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2, device_id=device)
    buffer = torch.empty(buffer_bytes, dtype=torch.uint8, device=device)
    buffer.random_(0, 256)
    peer = torch.empty(buffer_bytes, dtype=torch.uint8, device=gpus[1]) if rank == 0 else None
    torch.cuda.synchronize(device)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        kind, regions = command
        if kind == "nccl":
            # One tiny broadcast first, so that both ranks start the timed part together.
            dist.broadcast(buffer[:64], src=0)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for offset, length in regions:
                dist.broadcast(buffer[offset : offset + length], src=0)
            torch.cuda.synchronize(device)
        else:
            assert peer is not None
            start = time.perf_counter()
            for offset, length in regions:
                peer[offset : offset + length].copy_(buffer[offset : offset + length])
            torch.cuda.synchronize(device)
            torch.cuda.synchronize(peer.device)
        if rank == 0:
            conn.send(time.perf_counter() - start)
    if not same_gpu:
        dist.destroy_process_group()


class GpuCeiling:
    """Measures the GPU link from ``gpus[0]`` to ``gpus[1]`` over `num_bytes`: an NCCL
    broadcast between two processes (the baseline's link) and an in-process peer copy (what
    CUDA IPC can reach), each in regions of `region_bytes` cycling over a 1 GiB buffer. When
    both are one GPU (trainer and replica colocated) only the copy is measured."""

    def __init__(self, num_bytes: int, *, gpus: tuple[int, int], region_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.buffer_bytes = min(num_bytes, _GPU_BUFFER_BYTES)
        self.region_bytes = min(region_bytes, self.buffer_bytes)
        ctx = multiprocessing.get_context("spawn")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        self._conns = []
        self._ranks = []
        self._same_gpu = gpus[0] == gpus[1]
        for rank in range(1 if self._same_gpu else 2):
            conn, child = ctx.Pipe()
            process = ctx.Process(
                target=_gpu_ceiling_rank,
                args=(rank, gpus, self.buffer_bytes, init, child),
                daemon=True,
            )
            process.start()
            self._conns.append(conn)
            self._ranks.append(process)
        for conn in self._conns:
            if not conn.poll(180.0):
                self.close()
                raise RuntimeError("the GPU ceiling processes did not start within 180 s")
            conn.recv()
        # One untimed round: NCCL channels and peer mappings set up.
        self.measure()

    def _regions(self) -> list[tuple[int, int]]:
        regions, done = [], 0
        while done < self.num_bytes:
            offset = done % self.buffer_bytes
            length = min(self.region_bytes, self.num_bytes - done, self.buffer_bytes - offset)
            regions.append((offset, length))
            done += length
        return regions

    def _run(self, kind: str, ranks: Sequence[int]) -> float:
        regions = self._regions()
        for rank in ranks:
            self._conns[rank].send((kind, regions))
        if not self._conns[0].poll(_TIMEOUT_S):
            raise RuntimeError(f"the GPU ceiling ({kind}) did not answer in {_TIMEOUT_S} s")
        return self._conns[0].recv()

    def measure(self) -> dict[str, float]:
        """One round: seconds of each link over `num_bytes`."""
        if self._same_gpu:
            return {"peer_copy": self._run("peer", (0,))}
        return {"nccl_broadcast": self._run("nccl", (0, 1)), "peer_copy": self._run("peer", (0,))}

    def close(self) -> None:
        """Stop both processes."""
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
        for process in self._ranks:
            process.join(30.0)
            if process.is_alive():
                process.kill()
