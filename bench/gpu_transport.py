"""Why a cross-process copy into CUDA IPC memory can run 10x below NVLink rate, measured.

Every variant copies the same 4 GiB from GPU0 of a writer process into a 4 GiB buffer that a
receiver process allocated on GPU1, then the receiver checks every byte. Each variant runs in
a fresh writer process, so no peer access enabled by an earlier variant leaks into it.

Layouts:
- ``shared``: both processes see both GPUs (receiver on cuda:1, writer on cuda:0);
- ``isolated``: each process sees only its own GPU (``CUDA_VISIBLE_DEVICES``), as launchers
  that pin one GPU per process arrange it.

Variants:
- ``torch_copy``: the receiver shares its tensor the torch.multiprocessing way, the writer
  rebuilds it and calls ``dst.copy_(src)`` (the plain way);
- ``torch_copy_dst_device``: the same under ``torch.cuda.device(dst.device)``;
- ``ipc_transport``: `CudaIpcTransport` (what it does: the next variant, plus its polling);
- ``drv_lazy_only``: the handle opened in the writer's context with
  ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``, no explicit peer enabling, one ``cuMemcpyAsync``;
- ``drv_no_flag``: the same without the flag;
- ``drv_open_in_dst_ctx``: the handle opened in the context of the receiver's GPU (where
  PyTorch opens it), the copy issued from the writer's context;
- ``inproc_peer``: in-process GPU0 -> GPU1 ``copy_`` (the ceiling);
- ``inproc_no_peer``: in-process ``cuMemcpyAsync`` GPU0 -> GPU1 with peer access never
  enabled.

    python bench/gpu_transport.py [--num-bytes N] [--repeat R] [--out DIR]
    eval "$(python bench/gpu_transport.py --setup-mooncake)"   # carried Mooncake CUDA build
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

GIB = 1 << 30
SEED = 1234
SHARED = ["torch_copy", "torch_copy_dst_device", "ipc_transport", "drv_lazy_only"]
SHARED += ["drv_no_flag", "drv_open_in_dst_ctx", "inproc_peer", "inproc_no_peer"]
ISOLATED = ["torch_copy", "ipc_transport", "drv_lazy_only", "drv_no_flag"]


def random_bytes(num_bytes: int, seed: int, device: str) -> Any:
    """Seeded random bytes on `device` (the same on every GPU of one model)."""
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.randint(
        0, 256, (num_bytes,), dtype=torch.uint8, device=device, generator=generator
    )


# ---------------------------------------------------------------- receiver


def _receiver(args: argparse.Namespace) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    from weightsync.transport import CudaIpcConfig, CudaIpcTransport

    device = torch.device(args.device)
    torch.cuda.set_device(device)
    buffer = torch.zeros(args.num_bytes, dtype=torch.uint8, device=device)
    transport = CudaIpcTransport(CudaIpcConfig(device=device.index))
    transport.register(buffer.data_ptr(), args.num_bytes)
    share = base64.b64encode(pickle.dumps(reduce_tensor(buffer))).decode()
    ready = {"session_id": transport.session_id, "addr": buffer.data_ptr(), "share": share}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "zero":
            buffer.zero_()
            torch.cuda.synchronize(device)
            print("ok", flush=True)
        elif words[0] == "eqrand":
            expected = random_bytes(args.num_bytes, int(words[1]), args.device)
            print(int(bool(torch.equal(buffer, expected))), flush=True)
            del expected
    transport.close()


# ---------------------------------------------------------------- writer variants


def _open(info: dict[str, Any], flags: int, in_device: int | None) -> tuple[int, dict[str, Any]]:
    """Open the receiver's allocation with the driver; returns the mapped destination."""
    from weightsync.transport.cuda_ipc.driver import driver
    from weightsync.transport.cuda_ipc.registry import fetch_snapshot

    cuda = driver()
    snapshot = fetch_snapshot(info["session_id"], 10.0)
    allocation = next(a for a in snapshot.allocations if a.base <= info["addr"] < a.base + a.size)
    peer = cuda.device_by_pci_bus_id(snapshot.pci_bus_id)
    cuda.use_device(peer if in_device == -1 else 0)
    base = cuda.ipc_open_handle(allocation.handle, flags)
    cuda.use_device(0)
    detail = {
        "peer_ordinal": peer,
        "can_access_peer": peer is not None and cuda.can_access_peer(0, peer),
    }
    return base + info["addr"] - allocation.base, detail


def _driver_copy(dst: int, src: int, num_bytes: int) -> Callable[[], None]:
    from weightsync.transport.cuda_ipc.driver import driver

    cuda = driver()
    cuda.use_device(0)
    stream = cuda.stream_create()

    def run() -> None:
        cuda.use_device(0)
        code = cuda.memcpy_async(dst, src, num_bytes, stream)
        if code != 0:
            raise RuntimeError(f"cuMemcpyAsync: {cuda.error_name(code)}")
        cuda.stream_synchronize(stream)

    return run


def _variant(
    name: str, info: dict[str, Any], src: Any
) -> tuple[Callable[[], None], dict[str, Any]]:
    import torch

    from weightsync.transport import CudaIpcConfig, CudaIpcTransport
    from weightsync.transport.cuda_ipc.driver import IPC_MEM_LAZY_ENABLE_PEER_ACCESS as LAZY

    num_bytes = src.numel()
    if name in ("torch_copy", "torch_copy_dst_device"):
        rebuild, rebuild_args = pickle.loads(base64.b64decode(info["share"]))
        dst = rebuild(*rebuild_args)

        def run() -> None:
            if name == "torch_copy":
                dst.copy_(src)
            else:
                with torch.cuda.device(dst.device):
                    dst.copy_(src)
            torch.cuda.synchronize(src.device)
            torch.cuda.synchronize(dst.device)

        return run, {"dst_device": str(dst.device)}
    if name == "ipc_transport":
        transport = CudaIpcTransport(CudaIpcConfig(device=0))
        transport.register(src.data_ptr(), num_bytes)

        def write() -> None:
            transport.wait(
                transport.write(info["session_id"], [src.data_ptr()], [info["addr"]], [num_bytes]),
                60.0,
            )

        return write, {}
    if name.startswith("drv_"):
        flags = 0 if name == "drv_no_flag" else LAZY
        dst_addr, detail = _open(info, flags, -1 if name == "drv_open_in_dst_ctx" else None)
        return _driver_copy(dst_addr, src.data_ptr(), num_bytes), detail
    local = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1")
    if name == "inproc_peer":

        def copy() -> None:
            local.copy_(src)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)

        return copy, {"local": True}
    return _driver_copy(local.data_ptr(), src.data_ptr(), num_bytes), {"local": True}


def _writer(args: argparse.Namespace) -> None:
    import torch

    result: dict[str, Any] = {"variant": args.variant, "visible": torch.cuda.device_count()}
    try:
        torch.cuda.set_device(0)
        info = json.loads(sys.stdin.readline())
        src = random_bytes(args.num_bytes, SEED, "cuda:0")
        torch.cuda.synchronize(0)
        run, detail = _variant(args.variant, info, src)
        result.update(detail)
        run()
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        result["gbps_median"] = args.num_bytes / statistics.median(times) / 1e9
        result["gbps_best"] = args.num_bytes / min(times) / 1e9
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- orchestration


def _spawn(role: list[str], env_update: dict[str, str], num_bytes: int) -> subprocess.Popen[str]:
    env = dict(os.environ, **env_update)
    env.setdefault("PYTHONUNBUFFERED", "1")
    command = [sys.executable, __file__, *role, "--num-bytes", str(num_bytes)]
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def _ask(process: subprocess.Popen[str], line: str) -> str:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()
    return process.stdout.readline().strip()


def investigate(num_bytes: int, repeat: int) -> list[dict[str, Any]]:
    """Run every variant of every layout; returns one row per variant."""
    layouts = [
        ("shared", {}, "cuda:1", {}, SHARED),
        (
            "isolated",
            {"CUDA_VISIBLE_DEVICES": "1"},
            "cuda:0",
            {"CUDA_VISIBLE_DEVICES": "0"},
            ISOLATED,
        ),
    ]
    rows = []
    for layout, receiver_env, receiver_device, writer_env, variants in layouts:
        receiver = _spawn(
            ["--role", "receiver", "--device", receiver_device], receiver_env, num_bytes
        )
        assert receiver.stdout is not None
        ready_line = receiver.stdout.readline()
        if not ready_line:
            rows.append({"layout": layout, "error": f"receiver exited {receiver.wait()}"})
            continue
        try:
            for variant in variants:
                _ask(receiver, "zero")
                writer = _spawn(
                    ["--role", "writer", "--variant", variant, "--repeat", str(repeat)],
                    writer_env,
                    num_bytes,
                )
                try:
                    out, _ = writer.communicate(ready_line, timeout=120)
                except subprocess.TimeoutExpired:
                    writer.kill()
                    out = json.dumps({"variant": variant, "error": "timed out after 120 s"})
                lines = [line for line in out.splitlines() if line.startswith("{")]
                row = {
                    "layout": layout,
                    **(json.loads(lines[-1]) if lines else {"error": "no output"}),
                }
                if not row.get("local") and "error" not in row:
                    row["verified"] = _ask(receiver, f"eqrand {SEED}") == "1"
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            _ask(receiver, "quit")
            receiver.wait(timeout=60)
    return rows


def setup_mooncake(root: Path, dest: Path) -> list[str]:
    """Unpack the carried Mooncake CUDA build and its system libraries under `dest`.

    Only libraries the system lacks are linked into ``dest/lib``, so the carried Debian
    libraries never shadow the system's own. Returns the shell ``export`` lines.
    """
    site, debs, links = dest / "site", dest / "debs", dest / "lib"
    for path in (site, debs, links):
        path.mkdir(parents=True, exist_ok=True)
    for archive in sorted((root / ".whl").glob("mooncake-*.tar.gz")):
        with tarfile.open(archive) as tar:
            tar.extractall(site, filter="data")
    for deb in sorted((root / ".debs").glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(debs)], check=True)
    known = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    system = {line.split()[0] for line in known.splitlines()[1:] if line.strip()}
    for libdir in (debs / "usr/lib/x86_64-linux-gnu", debs / "lib/x86_64-linux-gnu"):
        for lib in sorted(libdir.glob("*.so.*")) if libdir.is_dir() else ():
            link = links / lib.name
            if lib.name not in system and not link.exists():
                link.symlink_to(lib.resolve())
    paths = [str(links)]
    import importlib.util

    nvidia = importlib.util.find_spec("nvidia")
    for location in nvidia.submodule_search_locations if nvidia else ():
        paths += sorted({str(p.parent) for p in Path(location).glob("*/lib/libcudart.so*")})
    return [
        f"export PYTHONPATH={site}:${{PYTHONPATH:-}}",
        f"export LD_LIBRARY_PATH={':'.join(paths)}:${{LD_LIBRARY_PATH:-}}",
    ]


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'layout':9} {'variant':22} {'GB/s med':>9} {'GB/s best':>9} {'ok':>5}  detail")
    for row in rows:
        detail = {
            k: v
            for k, v in row.items()
            if k not in ("layout", "variant", "gbps_median", "gbps_best", "verified")
        }
        median, best = row.get("gbps_median", float("nan")), row.get("gbps_best", float("nan"))
        print(
            f"{row.get('layout', ''):9} {row.get('variant', ''):22} {median:9.1f} {best:9.1f} "
            f"{row.get('verified', '-')!s:>5}  {json.dumps(detail)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-bytes", type=int, default=4 * GIB)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--setup-mooncake", action="store_true")
    parser.add_argument("--role", choices=("receiver", "writer"), help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda:1", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setup_mooncake:
        print("\n".join(setup_mooncake(ROOT, Path("/tmp/mooncake-cuda"))))
        return
    if args.role == "receiver":
        _receiver(args)
        return
    if args.role == "writer":
        _writer(args)
        return
    rows = investigate(args.num_bytes, args.repeat)
    _print_rows(rows)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ipc_investigation.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps({"ipc_investigation": rows}, separators=(",", ":")))


if __name__ == "__main__":
    main()
