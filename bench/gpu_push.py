"""The P2P sync on one host's GPUs, taken apart: control calls, sender settings, end to end.

    python bench/gpu_push.py --preset dense-8b     # trainer on GPU 0, a tp1 replica on GPU 1

Starts one replica (``weightsync serve --device cuda --transport cuda_ipc --load-format
dummy``) on the rollout GPU and keeps the trainer's synthetic tensors on the trainer GPU in
this process, then measures, in this order:

1. each lifecycle control call on its own (median over ``--calls`` rounds);
2. the links, over the bytes one sync writes: a raw CUDA IPC write of every destination
   region straight from one source buffer, over 1, 2 and 4 streams (no plan, no staging:
   what the transport alone reaches), an in-process peer copy and an NCCL broadcast between
   two processes;
3. ``WeightSender.push`` alone for each setting of the sweep (slot, chunk, slots, CUDA IPC
   streams), and for the default one with the transport's stream ordering hidden (writes
   then wait on the host for each chunk's copies);
4. ``TrainerSync.sync`` end to end (pause to resume) ``--repeats`` times, with its phases.

The replica snapshots its weights first (they equal the trainer's: both are seeded synthetic
weights) and must hold them again, bit for bit, after the last sync. Prints a table and one
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    GIB,
    MIB,
    PRESETS,
    GpuCeiling,
    log,
    median,
    print_table,
    workload_config,
    write_config,
)
from weightsync.testing.trainers import check_weights

# (slot MiB, chunk MiB or None for the default, slots, transport streams): the default first.
_SWEEP = (
    (1024, None, 2, 1),
    (1024, 64, 2, 1),
    (512, None, 2, 1),
    (2048, 512, 2, 1),
    (1024, None, 3, 1),
    (1024, None, 2, 2),
    (1024, None, 2, 4),
)
_LIFECYCLE = (
    ("pause_generation", {"mode": "abort"}),
    ("release_memory_occupation", {"tags": ["kv_cache"]}),
    ("begin_weight_update", {}),
    ("update_weight_version", {"new_version": "bench", "abort_all_requests": False}),
    ("end_weight_update", {}),
    ("resume_memory_occupation", {"tags": ["kv_cache"]}),
    ("flush_cache", {}),
    ("continue_generation", {}),
)


class _HostOrdered:
    """A transport as seen without its ``stream_ordered`` capability (for the comparison)."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.capabilities = dataclasses.replace(transport.capabilities, stream_ordered=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def _control_calls(url: str, rounds: int) -> dict[str, float]:
    """Median seconds of each lifecycle call, issued in the update's order."""
    from weightsync.control import RolloutClient

    client = RolloutClient(url)
    seconds: dict[str, list[float]] = {"health": []}
    try:
        for _ in range(rounds):
            for method, kwargs in _LIFECYCLE:
                start = time.perf_counter()
                await getattr(client, method)(**kwargs)
                seconds.setdefault(method, []).append(time.perf_counter() - start)
            start = time.perf_counter()
            await client.health()
            seconds["health"].append(time.perf_counter() - start)
    finally:
        await client.aclose()
    return {name: median(values) for name, values in seconds.items()}


def _raw_write(transport: Any, target: Any, device: str, repeats: int) -> float:
    """Median seconds of one write of every destination region from one source buffer (of
    at most 1 GiB) on `device`."""
    import torch

    sizes = [n * e for _, n, e in target.weights_info.values()]
    piece = min(GIB, max(sizes))
    source = torch.empty(piece, dtype=torch.uint8, device=device)
    source.random_(0, 256)
    if source.is_cuda:
        torch.cuda.synchronize(source.device)
    transport.register(source.data_ptr(), piece)
    src, dst, lengths = [], [], []
    for addr, numel, element_size in target.weights_info.values():
        done, total = 0, numel * element_size
        while done < total:
            length = min(piece, total - done)
            src.append(source.data_ptr())
            dst.append(addr + done)
            lengths.append(length)
            done += length
    seconds = []
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            transport.wait(transport.write(target.session_id, src, dst, lengths), 300.0)
            seconds.append(time.perf_counter() - start)
    finally:
        transport.unregister(source.data_ptr())
    return median(seconds[1:])


def _push_sweep(transport: Any, plan: Any, export: Any, repeats: int) -> list[dict[str, Any]]:
    from weightsync.sender import SenderConfig, WeightSender

    rows = []
    settings = [(*s, True) for s in _SWEEP] + [(*_SWEEP[0], False)]
    if not hasattr(transport, "num_streams"):
        settings = [s for s in settings if s[3] == 1]
    for slot_mb, chunk_mb, slots, streams, ordered in settings:
        config = SenderConfig(
            bucket_bytes=slot_mb * MIB,
            chunk_bytes=None if chunk_mb is None else chunk_mb * MIB,
            num_slots=slots,
        )
        if streams > 1:
            transport.num_streams = streams
        sender = WeightSender(config, transport=transport if ordered else _HostOrdered(transport))
        try:
            sender.holding(export)
            sender.push(sender.preflight(plan, export))  # allocates and registers the ring
            stats = [sender.push(sender.preflight(plan, export)) for _ in range(repeats)]
        finally:
            sender.close()
            if streams > 1:
                transport.num_streams = 1
        rows.append(
            {
                "slot_mb": slot_mb,
                "chunk_mb": chunk_mb,
                "num_slots": slots,
                "streams": streams,
                "stream_ordered": ordered,
                "seconds": median([s.seconds for s in stats]),
                "min_seconds": min(s.seconds for s in stats),
                "fill_seconds": median([s.fill_seconds for s in stats]),
                "write_seconds": median([s.write_seconds for s in stats]),
                "num_writes": stats[-1].num_writes,
                "bytes": stats[-1].bytes_written,
            }
        )
        log(
            f"  push {slot_mb}/{chunk_mb} MiB x{slots} streams={streams} ordered={ordered}: "
            f"{rows[-1]['seconds']:.4f} s"
        )
    return rows


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start the replica and the trainer side, measure, stop; the results."""
    import torch

    import weightsync as ws
    from weightsync.plan import build_plan
    from weightsync.sender import SenderConfig, WeightSender
    from weightsync.testing.launcher import start_replicas
    from weightsync.testing.synthetic import synthetic_export
    from weightsync.transport import CudaIpcConfig, MooncakeConfig, open_transport

    cuda = args.device == "cuda"
    config = workload_config(args.preset)
    model_dir = write_config(config, workdir / "model")
    extra = ["--load-format", "dummy", "--seed", str(args.seed)]
    if cuda:
        extra += ["--transport", "cuda_ipc", "--base-gpu-id", str(args.rollout_gpu)]
    t0 = time.perf_counter()
    (replica,) = start_replicas(
        model_dir,
        device=args.device,
        dtype="bf16",
        log_dir=workdir / "logs",
        extra_args=extra,
        ready_timeout_s=1200.0,
    )
    ceiling = None
    transport = None
    try:
        log(f"replica ready in {time.perf_counter() - t0:.1f} s")
        device = "cpu"
        if cuda:
            torch.cuda.set_device(args.trainer_gpu)
            device = f"cuda:{args.trainer_gpu}"
        export = synthetic_export(config, seed=args.seed, dtype=torch.bfloat16, device=device)
        check_weights([replica.url], "snapshot")
        check_weights([replica.url], "reset_tensors")
        control = asyncio.run(_control_calls(replica.url, args.calls))
        log("control calls (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in control.items()))

        transport_config: ws.TransportConfig = MooncakeConfig(protocol="tcp")
        if cuda:
            transport_config = CudaIpcConfig(device=args.trainer_gpu)
        transport = open_transport(transport_config)
        sync = ws.TrainerSync(
            hf_config=config, replicas=[replica.url], dtype="bfloat16", transport=transport
        )
        (target,) = sync.run(sync.manager.targets())
        probe = WeightSender(SenderConfig(), transport=transport)
        plan = build_plan(
            hf_config=config, targets=[target], sources=[probe.holding(export)], dtype="bfloat16"
        ).for_source(0)
        probe.close()

        num_bytes = sum(n * e for _, n, e in target.weights_info.values())
        if cuda:
            links = {}
            for streams in (1, 2, 4):
                transport.num_streams = streams
                links[f"cuda_ipc_raw_{streams}s"] = _raw_write(
                    transport, target, device, args.repeats
                )
            transport.num_streams = 1
        else:
            links = {"mooncake_raw": _raw_write(transport, target, device, args.repeats)}
        if cuda:
            gpus = (args.trainer_gpu, args.rollout_gpu)
            ceiling = GpuCeiling(num_bytes, gpus=gpus, region_bytes=GIB)
            rounds = [ceiling.measure() for _ in range(args.repeats)]
            for key in rounds[0]:
                links[key] = median([r[key] for r in rounds])
            ceiling.close()
            ceiling = None
        log(
            "links (GB/s): " + ", ".join(f"{k} {num_bytes / v / 1e9:.1f}" for k, v in links.items())
        )

        sweep = _push_sweep(transport, plan, export, args.repeats)
        reports = [sync.sync(export) for _ in range(args.repeats + 1)][1:]
        sync.close()
        check_weights([replica.url], "compare")  # raises unless bit-exact
        phases = {
            name: median([getattr(r.phases, name) for r in reports])
            for name in ("pause", "metadata", "push", "finalize", "resume")
        }
        return {
            "workload": args.preset,
            "bytes": num_bytes,
            "control_s": control,
            "links_s": links,
            "sweep": sweep,
            "e2e_s": median([r.seconds for r in reports]),
            "e2e_min_s": min(r.seconds for r in reports),
            "e2e_phases_s": phases,
            "bit_exact": True,
        }
    finally:
        if ceiling is not None:
            ceiling.close()
        if transport is not None:
            transport.close()
        replica.stop()


def _print(result: dict[str, Any]) -> None:
    num_bytes = result["bytes"]

    def gbps(seconds: float) -> str:
        return f"{num_bytes / seconds / 1e9:.1f}"

    rows = [[k, f"{v * 1e3:.2f}", "-"] for k, v in result["control_s"].items()]
    rows += [[f"link: {k}", f"{v * 1e3:.2f}", gbps(v)] for k, v in result["links_s"].items()]
    for row in result["sweep"]:
        chunk = "default" if row["chunk_mb"] is None else row["chunk_mb"]
        name = f"push {row['slot_mb']}/{chunk} MiB x{row['num_slots']} {row['streams']}s"
        name += "" if row["stream_ordered"] else " (host-synced)"
        rows.append([name, f"{row['seconds'] * 1e3:.2f}", gbps(row["seconds"])])
    rows.append(["sync, pause to resume", f"{result['e2e_s'] * 1e3:.2f}", gbps(result["e2e_s"])])
    rows += [[f"  phase {k}", f"{v * 1e3:.2f}", "-"] for k, v in result["e2e_phases_s"].items()]
    print_table(
        f"{result['workload']}: {num_bytes / 1e9:.2f} GB per sync (medians)",
        ["what", "ms", "GB/s"],
        rows,
    )


def main() -> None:
    """Parse the options, run, print the table and the JSON line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="dense-8b")
    parser.add_argument("--trainer-gpu", type=int, default=0)
    parser.add_argument("--rollout-gpu", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="rounds of control calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the same steps over Mooncake TCP on the host (a check of the script)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightsync-gpu-push-") as tmp:
        result = run(args, Path(tmp))
    _print(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
