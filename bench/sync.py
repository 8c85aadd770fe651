"""P2P weight sync against the broadcast baseline and the link's ceiling, in one run.

For a workload (a synthetic model, replicas at a rollout TP size, trainer ranks, device), the
bench starts the replicas (``weightsync serve --load-format dummy``: seeded synthetic weights,
the same bytes the trainer generates), starts the trainer ranks (a gloo group, each with its
PP-local synthetic tensors), and then times, alternating, ``--repeats`` times each:

- p2p: `TrainerSync` + `WeightSender`, pause to resume: over Mooncake TCP on CPU; on GPU
  (``--device cuda``) staged on the trainer's GPU and written over CUDA IPC;
- baseline: `BroadcastSync` (verl/slime-style bucketed broadcast over a group with every
  rollout rank, gloo on CPU and NCCL on GPU, loaded tensor by tensor), pause to resume;
- ceiling: on CPU, a raw Mooncake TCP write of the same bytes P2P writes, between two
  processes with 64 MiB regions, plus memcpy and a loopback socket for context; on GPU, an
  NCCL broadcast of the same bytes from the trainer's first GPU to the first rollout GPU
  (two processes) and an in-process peer copy between the same GPUs.

Before every timed sync the replicas' weights are snapshotted and overwritten with random
values (on their GPUs with ``--device cuda``); after it they must equal the snapshot bit for
bit. Both methods' first sync (group creation, metadata, staging allocation) is a warm-up and
is not timed. Trainer and replicas generate the same seeded synthetic weights
(`weightsync.engine.synthetic`), so the warm-up's compare also checks the first sync against the
replica's own copy of the weights.

Prints a table and, last, one JSON line: ``{"workload", "bytes", "p2p_s", "baseline_s",
"speedup", "p2p_gbps", "ceiling_gbps", "fraction_of_ceiling", ...}`` (bytes: what P2P writes
into the replicas per sync; seconds: medians; ceiling: raw Mooncake TCP on CPU, NCCL
broadcast on GPU).

    python bench/sync.py                       # ~1 GB bf16 dense, 2 replicas x tp2, 2 ranks
    python bench/sync.py --quick               # tiny smoke run
    python bench/sync.py --preset moe-small --plot sync.png
    python bench/sync.py --device cuda --preset dense-8b --replicas 1 --rollout-tp 1 \
        --trainer-ranks 1 --bucket-mb 512     # trainer on GPU 0, the replica on GPU 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import queue
import secrets
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    GIB,
    MIB,
    PRESETS,
    GpuCeiling,
    HostCeiling,
    check_weights,
    log,
    median,
    model_bytes,
    print_table,
    workload_config,
    write_config,
)
from weightsync.testing.launcher import ServedReplica, start_replicas

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_METHODS = ("p2p", "baseline")
# The link each device's P2P rate is compared with, and how the table names each link.
_CEILINGS = {"cpu": "mooncake_tcp", "cuda": "nccl_broadcast"}
_LINK_NAMES = {
    "mooncake_tcp": "mooncake tcp (raw)",
    "memcpy": "memcpy",
    "socket": "socket",
    "nccl_broadcast": "nccl broadcast (raw)",
    "peer_copy": "peer copy (in-process)",
}
_RESULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerArgs:
    """What every trainer rank of the bench needs."""

    config: dict[str, Any]
    urls: tuple[str, ...]
    api_key: str
    world_size: int
    pp_size: int
    rollout_dtype: str
    trainer_dtype: str
    device: str
    seed: int
    bucket_bytes: int
    num_workers: int
    init_method: str
    timeout_s: float
    transport: str
    ipc_streams: int


# ---------------------------------------------------------------- trainer ranks


def _stage_export(args: TrainerArgs, rank: int, device: str) -> Any:
    """This rank's PP-local synthetic tensors, as the sender's export."""
    import torch

    from weightsync.engine.synthetic import synthetic_hf_tensors
    from weightsync.layout import hf_tensor_shapes
    from weightsync.sender import ModelExport

    pp_rank = rank % args.pp_size
    shapes = hf_tensor_shapes(args.config)
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    names = [
        name
        for name, _ in ModelExport(
            meta, pp_rank=pp_rank, pp_size=args.pp_size, hf_config=args.config
        )
    ]
    tensors = dict(
        synthetic_hf_tensors(
            args.config, seed=args.seed, dtype=args.trainer_dtype, device=device, names=names
        )
    )
    return ModelExport(tensors, pp_rank=pp_rank, pp_size=args.pp_size, hf_config=args.config)


def trainer_main(rank: int, args: TrainerArgs, commands: Any, results: Any) -> None:
    """One trainer rank: build both syncs, then run the commands the bench sends."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    syncs: dict[str, Any] = {}
    transport = None
    try:
        import torch.distributed as dist

        from weightsync.baseline import BroadcastConfig, BroadcastSync
        from weightsync.manager import SyncConfig, SyncManager, TrainerSync
        from weightsync.sender import SenderConfig, WeightSender
        from weightsync.transport import (
            CudaIpcConfig,
            CudaIpcTransport,
            MooncakeConfig,
            MooncakeTransport,
        )

        cuda = args.device == "cuda"
        device = f"cuda:{rank}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=args.init_method,
            rank=rank,
            world_size=args.world_size,
        )
        group = dist.group.WORLD
        t0 = time.perf_counter()
        export = _stage_export(args, rank, device)
        generate_s = time.perf_counter() - t0

        def manager() -> Any:
            if rank != 0:
                return None
            return SyncManager(args.urls, SyncConfig(api_key=args.api_key, http_timeout_s=600.0))

        if args.transport == "cuda_ipc":
            transport = CudaIpcTransport(CudaIpcConfig(device=rank, num_streams=args.ipc_streams))
        else:
            transport = MooncakeTransport(MooncakeConfig(protocol="tcp", timeout_s=args.timeout_s))
        sender = WeightSender(
            SenderConfig(
                bucket_bytes=args.bucket_bytes,
                num_workers=args.num_workers,
                timeout_s=args.timeout_s,
            ),
            transport=transport,
            group=group,
        )
        # The sender's own counters of each push (fill and write seconds), for the report.
        pushes: list[Any] = []
        push = sender.push

        def recording_push(plan: Any, tensors: Any) -> Any:
            stats = push(plan, tensors)
            pushes.append(stats)
            return stats

        sender.push = recording_push  # type: ignore[method-assign]
        syncs["p2p"] = TrainerSync(
            sender, hf_config=args.config, manager=manager(), dtype=args.rollout_dtype
        )
        syncs["baseline"] = BroadcastSync(
            hf_config=args.config,
            config=BroadcastConfig(bucket_bytes=args.bucket_bytes, timeout_s=args.timeout_s),
            group=group,
            manager=manager(),
            dtype=args.rollout_dtype,
        )
        results.put({"kind": "ready", "rank": rank, "generate_s": generate_s})
        while True:
            command = commands.get()
            if command["kind"] == "stop":
                break
            method = command["method"]
            pushes.clear()
            if rank == 0:
                check_weights(args.urls, "snapshot", args.api_key)
                check_weights(args.urls, "reset_tensors", args.api_key)
            start = time.perf_counter()
            report = syncs[method].sync(export)
            wall_s = time.perf_counter() - start
            event = {
                "kind": "run",
                "rank": rank,
                "method": method,
                "push": dataclasses.asdict(pushes[-1]) if pushes else None,
            }
            if rank == 0:
                # Raises (and so fails the bench) unless every parameter equals the snapshot.
                check_weights(args.urls, "compare", args.api_key)
                event.update(report=report.to_dict(), wall_s=wall_s, bit_exact=True)
            results.put(event)
    except BaseException as exc:
        results.put(
            {"kind": "error", "rank": rank, "message": str(exc), "trace": traceback.format_exc()}
        )
    finally:
        for sync in syncs.values():
            try:
                sync.close()
            except Exception:
                traceback.print_exc()
        if transport is not None:
            transport.close()
        results.put({"kind": "exit", "rank": rank})


# ---------------------------------------------------------------- the bench process


class Trainers:
    """The trainer ranks as spawned processes, driven by commands."""

    def __init__(self, args: TrainerArgs) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(args.world_size)]
        self.processes = [
            ctx.Process(target=trainer_main, args=(rank, args, self.commands[rank], self.results))
            for rank in range(args.world_size)
        ]
        for process in self.processes:
            process.start()
        ready = [self._next("ready") for _ in self.processes]
        self.generate_s = max(r["generate_s"] for r in ready)

    def _next(self, kind: str) -> dict[str, Any]:
        deadline = time.monotonic() + _RESULT_TIMEOUT_S
        while True:
            try:
                event = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.pid for p in self.processes if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"trainer ranks failed or hung (dead: {dead})") from None
                continue
            if event["kind"] == "error":
                raise RuntimeError(f"trainer rank {event['rank']} failed:\n{event['trace']}")
            if event["kind"] == kind:
                return event

    def run(self, method: str) -> dict[str, Any]:
        """One sync by `method`, verified bit-exact: rank 0's result, with every rank's
        sender counters (``pushes``, P2P only)."""
        for commands in self.commands:
            commands.put({"kind": "run", "method": method})
        events = sorted((self._next("run") for _ in self.commands), key=lambda e: e["rank"])
        return {**events[0], "pushes": [e["push"] for e in events if e["push"] is not None]}

    def stop(self) -> None:
        for commands in self.commands:
            commands.put({"kind": "stop"})
        for process in self.processes:
            process.join(60.0)
            if process.is_alive():
                process.kill()
                process.join()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(
    args: argparse.Namespace, model_dir: Path, api_key: str, log_dir: Path
) -> list[ServedReplica]:
    """Start the replicas; on CUDA, replica i's TP rank r uses GPU ``offset + i * tp + r``
    (``--base-gpu-id``), after the trainer's, and takes writes over ``--transport``."""
    kwargs = {
        "num_replicas": args.replicas,
        "tp": args.rollout_tp,
        "ep": args.rollout_ep,
        "dtype": args.dtype,
        "device": args.device,
        "api_key": api_key,
        "log_dir": log_dir,
        "extra_args": ["--load-format", "dummy", "--seed", str(args.seed)],
        "ready_timeout_s": 1200.0,
    }
    if args.device == "cpu":
        return start_replicas(model_dir, **kwargs)
    replicas: list[ServedReplica] = []
    try:
        for index in range(args.replicas):
            extra = [
                *kwargs["extra_args"],
                "--transport",
                args.transport,
                "--base-gpu-id",
                str(_rollout_gpu(args, index)),
            ]
            (replica,) = start_replicas(
                model_dir,
                **{
                    **kwargs,
                    "num_replicas": 1,
                    "log_dir": log_dir / f"r{index}",
                    "extra_args": extra,
                },
            )
            replicas.append(replica)
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


def _rollout_gpu(args: argparse.Namespace, replica: int) -> int:
    """The GPU of replica `replica`'s TP rank 0."""
    offset = args.trainer_ranks if args.rollout_gpu_offset is None else args.rollout_gpu_offset
    return offset + replica * args.rollout_tp


def run_workload(
    args: argparse.Namespace, config: dict[str, Any], workdir: Path, label: str
) -> dict[str, Any]:
    """Start everything for one workload, time it, stop everything; the results."""
    rollout_dtype = _DTYPES[args.dtype]
    api_key = secrets.token_hex(8)
    model_dir = write_config(config, workdir / "model")
    log(f"{label}: {model_bytes(config, rollout_dtype) / GIB:.2f} GiB, starting replicas")
    t0 = time.perf_counter()
    replicas: list[ServedReplica] = []
    trainers: Trainers | None = None
    ceiling: HostCeiling | GpuCeiling | None = None
    try:
        replicas = _launch(args, model_dir, api_key, workdir / "logs")
        log(f"replicas ready in {time.perf_counter() - t0:.1f} s; starting trainer ranks")
        trainers = Trainers(
            TrainerArgs(
                config=config,
                urls=tuple(r.url for r in replicas),
                api_key=api_key,
                world_size=args.trainer_ranks,
                pp_size=args.trainer_pp,
                rollout_dtype=rollout_dtype,
                trainer_dtype=_DTYPES[args.trainer_dtype or args.dtype],
                device=args.device,
                seed=args.seed,
                bucket_bytes=args.bucket_mb * MIB,
                num_workers=args.num_workers,
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                timeout_s=args.timeout_s,
                transport=args.transport,
                ipc_streams=args.ipc_streams,
            )
        )
        log(f"trainer tensors generated in {trainers.generate_s:.1f} s; warm-up syncs")
        methods = args.methods
        warmup = {method: trainers.run(method) for method in methods}
        num_bytes = warmup["p2p"]["report"]["bytes"]
        log(f"warm-up done ({num_bytes / 1e9:.2f} GB per sync); starting the ceiling")
        if args.device == "cpu":
            ceiling = HostCeiling(num_bytes)
        else:
            ceiling = GpuCeiling(num_bytes, gpus=(0, _rollout_gpu(args, 0)), region_bytes=GIB)
        runs: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
        links: dict[str, list[float]] = {}
        for repeat in range(args.repeats):
            order = methods if repeat % 2 == 0 else methods[::-1]
            for method in order:
                result = trainers.run(method)
                runs[method].append(result)
                report = result["report"]
                log(
                    f"  {method}: {report['seconds']:.3f} s (push {report['phases']['push']:.3f}"
                    " s), bit-exact"
                )
            measured = ceiling.measure()
            for key, seconds in measured.items():
                links.setdefault(key, []).append(seconds)
            rates = (f"{k}: {num_bytes / v / 1e9:.1f} GB/s" for k, v in measured.items())
            log("  " + ", ".join(rates))
        return _summarize(args, config, label, num_bytes, runs, links, warmup)
    finally:
        if ceiling is not None:
            ceiling.close()
        if trainers is not None:
            trainers.stop()
        for replica in replicas:
            replica.stop()


def _summarize(
    args: argparse.Namespace,
    config: dict[str, Any],
    label: str,
    num_bytes: int,
    runs: dict[str, list[dict[str, Any]]],
    links: dict[str, list[float]],
    warmup: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    rollout_dtype = _DTYPES[args.dtype]
    methods = tuple(runs)
    seconds = {m: median([r["report"]["seconds"] for r in runs.get(m, [])]) for m in _METHODS}
    push = {m: median([r["report"]["phases"]["push"] for r in runs.get(m, [])]) for m in _METHODS}
    link_s = {key: median(values) for key, values in links.items()}
    # Per P2P run, the slowest rank's fill and write seconds (what the push waited on).
    fill_s = median([max(p["fill_seconds"] for p in r["pushes"]) for r in runs["p2p"]])
    write_s = median([max(p["write_seconds"] for p in r["pushes"]) for r in runs["p2p"]])
    links_gbps = {key: num_bytes / value / 1e9 for key, value in link_s.items()}
    ceiling = _CEILINGS[args.device]
    ceiling_gbps = links_gbps.get(ceiling)
    p2p_gbps = num_bytes / seconds["p2p"] / 1e9
    p2p_push_gbps = num_bytes / push["p2p"] / 1e9
    return {
        "workload": label,
        "preset": args.preset,
        "setup": _setup(args),
        "bytes": num_bytes,
        "p2p_s": seconds["p2p"],
        "baseline_s": seconds["baseline"],
        "speedup": seconds["baseline"] / seconds["p2p"],
        "p2p_gbps": p2p_gbps,
        "ceiling_gbps": ceiling_gbps,
        "fraction_of_ceiling": p2p_gbps / ceiling_gbps if ceiling_gbps else None,
        "ceiling": ceiling,
        "p2p_push_gbps": p2p_push_gbps,
        "push_fraction_of_ceiling": p2p_push_gbps / ceiling_gbps if ceiling_gbps else None,
        "baseline_gbps": num_bytes / seconds["baseline"] / 1e9,
        "p2p_push_s": push["p2p"],
        "baseline_push_s": push["baseline"],
        "p2p_fill_s": fill_s,
        "p2p_write_s": write_s,
        "p2p_num_writes": runs["p2p"][-1]["report"]["num_writes"],
        "p2p_replayed": all(p["replayed"] for r in runs["p2p"] for p in r["pushes"]),
        "memcpy_gbps": links_gbps.get("memcpy"),
        "socket_gbps": links_gbps.get("socket"),
        "links_gbps": links_gbps,
        "transport": args.transport,
        "model_bytes": model_bytes(config, rollout_dtype),
        "model_type": config["model_type"],
        "num_hidden_layers": config["num_hidden_layers"],
        "replicas": args.replicas,
        "rollout_tp": args.rollout_tp,
        "trainer_ranks": args.trainer_ranks,
        "trainer_pp": args.trainer_pp,
        "device": args.device,
        "dtype": rollout_dtype,
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "methods": list(methods),
        "bit_exact": all(r["bit_exact"] for m in methods for r in runs[m]),
        "runs_s": {m: [r["report"]["seconds"] for r in runs[m]] for m in methods},
        "phases": {m: runs[m][-1]["report"]["phases"] for m in methods},
        "warmup_s": {m: warmup[m]["report"]["seconds"] for m in methods},
    }


def _setup(args: argparse.Namespace) -> str:
    return (
        f"{args.replicas} replica(s) x tp{args.rollout_tp}, {args.trainer_ranks} trainer "
        f"rank(s) pp{args.trainer_pp}, {args.device}"
    )


def _print(result: dict[str, Any]) -> None:
    num_bytes = result["bytes"]
    rows = []
    for method in result["methods"]:
        runs = result["runs_s"][method]
        phases = result["phases"][method]
        rows.append(
            [
                method,
                f"{result[f'{method}_s']:.3f}",
                f"{min(runs):.3f}",
                f"{num_bytes / result[f'{method}_s'] / 1e9:.3f}",
                f"{phases['push']:.3f}",
                f"{phases['pause'] + phases['finalize'] + phases['resume']:.3f}",
                "yes" if result["bit_exact"] else "NO",
            ]
        )
    for key, gbps in result["links_gbps"].items():
        name = _LINK_NAMES.get(key, key)
        rows.append([name, f"{num_bytes / gbps / 1e9:.3f}", "-", f"{gbps:.3f}", "-", "-", "-"])
    print_table(
        f"{result['workload']}: {num_bytes / 1e9:.3f} GB written per sync, median of "
        f"{result['repeats']}",
        ["method", "seconds", "min s", "GB/s", "push s", "lifecycle s", "bit-exact"],
        rows,
    )
    print(
        f"P2P sender, slowest rank (median): fill {result['p2p_fill_s']:.3f} s, writes not "
        f"hidden by fills {result['p2p_write_s']:.3f} s, {result['p2p_num_writes']} writes"
        + (", replayed" if result["p2p_replayed"] else "")
    )
    fraction = result["fraction_of_ceiling"]
    name = _LINK_NAMES[result["ceiling"]]
    print(
        f"speedup over the baseline: {result['speedup']:.2f}x; P2P at "
        + (
            f"{fraction:.0%} of {name} end to end, its push at "
            f"{result['push_fraction_of_ceiling']:.0%}"
            if fraction
            else "(no ceiling measured)"
        )
    )


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib (or the 'plot' extra)"
        ) from None
    sizes = [r["model_bytes"] / 1e9 for r in results]
    last = results[-1]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [r["p2p_s"] for r in results], "o-", label=f"P2P ({last['transport']})")
    ax.plot(sizes, [r["baseline_s"] for r in results], "s-", label="broadcast baseline")
    if all(r["ceiling_gbps"] for r in results):
        ax.plot(
            sizes,
            [r["bytes"] / r["ceiling_gbps"] / 1e9 for r in results],
            ":",
            label=f"{_LINK_NAMES[last['ceiling']]} (same bytes)",
        )
    ax.set_xlabel("model size (GB, rollout dtype)")
    ax.set_ylabel("sync seconds (pause to resume)")
    ax.set_title(f"{last['preset']} ({last['model_type']}): {last['setup']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="default: dense-1g (tiny with --quick)"
    )
    for name in ("hidden", "intermediate", "layers", "experts", "moe-intermediate", "vocab"):
        parser.add_argument(f"--{name}", type=int, help="override the preset's size")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rollout-tp", type=int, default=2)
    parser.add_argument("--rollout-ep", type=int, default=1)
    parser.add_argument("--trainer-ranks", type=int, default=2)
    parser.add_argument("--trainer-pp", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--rollout-gpu-offset", type=int, help="first rollout GPU (default: after the trainer's)"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=_METHODS,
        default=list(_METHODS),
        help="what to time (default: both; the speedup needs both)",
    )
    parser.add_argument(
        "--transport",
        choices=("mooncake", "cuda_ipc"),
        help="P2P transport (default: mooncake on cpu, cuda_ipc on cuda)",
    )
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--trainer-dtype", choices=sorted(_DTYPES), help="default: --dtype")
    parser.add_argument("--bucket-mb", type=int, default=256, help="both methods' bucket")
    parser.add_argument("--num-workers", type=int, default=4, help="P2P sender fill threads")
    parser.add_argument(
        "--ipc-streams", type=int, default=1, help="CUDA IPC streams one write is spread over"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--quick", action="store_true", help="1 replica, 1 repeat, 1 MiB buckets (tiny model)"
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of seconds vs model size")
    parser.add_argument(
        "--plot-layers", type=int, nargs="+", help="layer counts to plot (default: L/4 L/2 L)"
    )
    parser.add_argument("--workdir", type=Path, help="keep configs and replica logs here")
    return parser


def _check_gpus(args: argparse.Namespace) -> None:
    """Refuse a GPU layout the machine cannot hold, before anything starts."""
    import torch

    needed = max(args.trainer_ranks, _rollout_gpu(args, args.replicas - 1) + args.rollout_tp)
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < needed:
        raise SystemExit(
            f"--device cuda with {args.trainer_ranks} trainer rank(s) and {args.replicas} "
            f"replica(s) x tp{args.rollout_tp} needs {needed} GPUs; found {found}"
        )
    if _rollout_gpu(args, 0) < args.trainer_ranks:
        raise SystemExit("--rollout-gpu-offset must leave the trainer's GPUs to the trainer")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.replicas, args.repeats, args.bucket_mb = 1, 1, 1
    args.preset = args.preset or ("tiny" if args.quick else "dense-1g")
    if args.trainer_ranks % args.trainer_pp:
        raise SystemExit("--trainer-pp must divide --trainer-ranks")
    args.methods = tuple(m for m in _METHODS if m in args.methods)
    if "p2p" not in args.methods:
        raise SystemExit("--methods must include p2p (its bytes size the ceiling)")
    args.transport = args.transport or ("cuda_ipc" if args.device == "cuda" else "mooncake")
    if args.transport == "cuda_ipc" and args.device != "cuda":
        raise SystemExit("--transport cuda_ipc needs --device cuda")
    if args.device == "cuda":
        _check_gpus(args)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    base = workload_config(
        args.preset,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        moe_intermediate_size=args.moe_intermediate,
        vocab_size=args.vocab,
    )
    layers = [base["num_hidden_layers"]]
    if args.plot:
        full = base["num_hidden_layers"]
        layers = args.plot_layers or sorted({max(1, full // 4), max(1, full // 2), full})
    root = args.workdir or Path(tempfile.mkdtemp(prefix="weightsync-bench-"))
    results = []
    try:
        for num_layers in layers:
            config = {**base, "num_hidden_layers": num_layers}
            gb = model_bytes(config, _DTYPES[args.dtype]) / 1e9
            label = (
                f"{args.preset} ({config['model_type']}, {num_layers} layers, {gb:.2f} GB "
                f"{args.dtype}), {_setup(args)}"
            )
            result = run_workload(args, config, root / f"layers{num_layers}", label)
            _print(result)
            results.append(result)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.plot:
        _plot(results, args.plot)
        log(f"plot written to {args.plot}")
    final = dict(results[-1])
    if len(results) > 1:
        final["sizes"] = [
            {k: r[k] for k in ("model_bytes", "bytes", "p2p_s", "baseline_s", "speedup")}
            for r in results
        ]
    print(json.dumps(final), flush=True)
    return 0 if all(r["bit_exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
