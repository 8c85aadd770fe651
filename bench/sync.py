"""P2P weight sync against the broadcast baseline and the link's ceiling, in one run.

Replicas serve seeded synthetic weights (``--load-format dummy``) and trainer ranks hold the
same (`weightsync.testing.trainers`). Alternating, ``--repeats`` times each, it times pause to
resume of p2p (`weightsync.TrainerSync`: Mooncake TCP on CPU, CUDA IPC on GPU) and of the
baseline (`BroadcastSync`: verl/slime-style bucketed broadcast over a group with every rollout
rank, loaded tensor by tensor), beside the link's ceiling over the same bytes (CPU: raw
Mooncake TCP between two processes, memcpy, a loopback socket; GPU: NCCL broadcast and an
in-process peer copy). Every timed sync is checked bit-exact. Prints a table and one JSON
line (``workload, bytes, p2p_s, baseline_s, speedup, p2p_gbps, ceiling_gbps,
fraction_of_ceiling, ...``; medians).

Colocated (``--device cuda --rollout-gpu-offset 0``: the trainer and the replica on one GPU,
as verl places them by default) the ceiling is a same-GPU copy of the same bytes, and the
baseline is verl's ``naive`` one, SGLang's ``update_weights_from_tensor`` (``from-tensor``:
buckets shared as CUDA IPC handles, rebuilt and loaded tensor by tensor); NCCL takes no two
ranks on one GPU, so the broadcast baseline is not run there. ``phases_s`` gives each
phase's median (pause, metadata, push, finalize, resume) per method, ``lifecycle_s`` the
median of each sync's control plane (pause + finalize + resume).

    python bench/sync.py                       # ~1 GB bf16 dense, 2 replicas x tp2, 2 ranks
    python bench/sync.py --quick               # tiny smoke run
    python bench/sync.py --device cuda --preset dense-8b --replicas 1 --rollout-tp 1 \
        --trainer-ranks 1 --bucket-mb 512     # trainer on GPU 0, the replica on GPU 1
    python bench/sync.py --device cuda --preset dense-8b --replicas 1 --rollout-tp 1 \
        --trainer-ranks 1 --rollout-gpu-offset 0   # colocated: both on GPU 0
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MIB,
    PRESETS,
    GpuCeiling,
    HostCeiling,
    log,
    median,
    model_bytes,
    print_table,
    workload_config,
    write_config,
)
from weightsync.layout.dtypes import ROLLOUT_DTYPE_CHOICES, canonical_dtype_name
from weightsync.testing.launcher import ServedReplica, start_replicas
from weightsync.testing.trainers import METHODS, SyncTrainers, TrainerSpec
from weightsync.transport import TRANSPORTS

# The link each device's P2P rate is compared with, and how the table names each link.
CEILINGS = {"cpu": "mooncake_tcp", "cuda": "nccl_broadcast"}
LINK_NAMES = {
    "mooncake_tcp": "mooncake tcp (raw)",
    "memcpy": "memcpy",
    "socket": "socket",
    "nccl_broadcast": "nccl broadcast (raw)",
    "peer_copy": "peer copy (in-process)",
}


def colocated(args: argparse.Namespace) -> bool:
    """Whether a replica shares a GPU with a trainer rank."""
    if args.device != "cuda":
        return False
    first = rollout_gpu(args, 0)
    last = rollout_gpu(args, args.replicas - 1) + args.rollout_tp
    return first < args.trainer_ranks and last > 0


def rollout_gpu(args: argparse.Namespace, replica: int) -> int:
    """The GPU of replica `replica`'s TP rank 0 (after the trainer's, by default)."""
    offset = args.trainer_ranks if args.rollout_gpu_offset is None else args.rollout_gpu_offset
    return offset + replica * args.rollout_tp


def launch(args: argparse.Namespace, model_dir: Path, api_key: str, logs: Path) -> list:
    """Start the replicas (on CUDA one at a time, each on its own GPUs)."""
    common = {
        "tp": args.rollout_tp,
        "ep": args.rollout_ep,
        "dtype": args.dtype,
        "device": args.device,
        "api_key": api_key,
        "ready_timeout_s": 1200.0,
    }
    extra = ["--load-format", "dummy", "--seed", str(args.seed)]
    if getattr(args, "delta_region_mb", 0):
        extra += ["--delta-region-mb", str(args.delta_region_mb)]
    if args.device == "cpu":
        return start_replicas(
            model_dir, num_replicas=args.replicas, log_dir=logs, extra_args=extra, **common
        )
    replicas: list[ServedReplica] = []
    try:
        for index in range(args.replicas):
            gpu = ["--transport", args.transport, "--base-gpu-id", str(rollout_gpu(args, index))]
            replicas += start_replicas(
                model_dir, log_dir=logs / f"r{index}", extra_args=extra + gpu, **common
            )
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


def run_workload(args: argparse.Namespace, config: dict, workdir: Path, label: str) -> dict:
    """Start everything for one workload, time it, stop everything; the results."""
    dtype = canonical_dtype_name(args.dtype)
    api_key = secrets.token_hex(8)
    model_dir = write_config(config, workdir / "model")
    log(f"{label}: starting replicas")
    replicas: list[ServedReplica] = []
    ceiling: HostCeiling | GpuCeiling | None = None
    try:
        replicas = launch(args, model_dir, api_key, workdir / "logs")
        spec = TrainerSpec(
            config=config,
            urls=tuple(r.url for r in replicas),
            api_key=api_key,
            world_size=args.trainer_ranks,
            pp_size=args.trainer_pp,
            rollout_dtype=dtype,
            trainer_dtype=canonical_dtype_name(args.trainer_dtype or args.dtype),
            device=args.device,
            seed=args.seed,
            bucket_bytes=args.bucket_mb * MIB,
            num_workers=args.num_workers,
            timeout_s=args.timeout_s,
            transport=args.transport,
            ipc_streams=args.ipc_streams,
            fused_experts=args.trainer_experts == "fused",
            methods=args.methods,
            direct=args.direct,
        )
        with SyncTrainers(spec) as trainers:
            log(f"trainer weights generated in {trainers.generate_s:.1f} s; warm-up syncs")
            warmup = {method: trainers.run(method) for method in args.methods}
            for method, event in warmup.items():
                log(f"  warm-up {method}: {event['report']['seconds']:.3f} s, bit-exact")
            num_bytes = warmup["p2p"]["report"]["bytes"]
            if args.device == "cpu":
                ceiling = HostCeiling(num_bytes)
            else:
                gpus = (0, rollout_gpu(args, 0))
                ceiling = GpuCeiling(num_bytes, gpus=gpus, region_bytes=1 << 30)
            runs: dict[str, list[dict]] = {method: [] for method in args.methods}
            links: dict[str, list[float]] = {}
            for repeat in range(args.repeats):
                for method in args.methods if repeat % 2 == 0 else args.methods[::-1]:
                    event = trainers.run(method)
                    report = {**event["report"], "replica_digest_s": event["replica_digest_s"]}
                    runs[method].append(report)
                    log(f"  {method}: {report['seconds']:.3f} s, bit-exact")
                for key, seconds in ceiling.measure().items():
                    links.setdefault(key, []).append(seconds)
            loop = trainers.loop("p2p", args.loop_syncs) if args.loop_syncs else []
            if loop:
                log(f"  p2p loop of {len(loop)} syncs: bit-exact")
        return summarize(args, config, label, num_bytes, runs, links, warmup, loop)
    finally:
        if ceiling is not None:
            ceiling.close()
        for replica in replicas:
            replica.stop()


def summarize(args, config, label, num_bytes, runs, links, warmup, loop=()) -> dict[str, Any]:
    """The workload's results: medians, rates and ratios measured in this run."""
    seconds = {m: median([r["seconds"] for r in runs.get(m, [])]) for m in METHODS}
    push = {m: median([r["phases"]["push"] for r in runs.get(m, [])]) for m in METHODS}
    phase_names = ("pause", "metadata", "push", "finalize", "resume")
    phases_s = {
        m: {p: median([r["phases"][p] for r in runs[m]]) for p in phase_names} for m in args.methods
    }
    links_gbps = {key: num_bytes / median(values) / 1e9 for key, values in links.items()}
    ceiling = CEILINGS[args.device]
    if ceiling not in links_gbps and "peer_copy" in links_gbps:
        ceiling = "peer_copy"  # trainer and replica on one GPU
    ceiling_gbps = links_gbps.get(ceiling)
    p2p = runs["p2p"]
    p2p_gbps = num_bytes / seconds["p2p"] / 1e9
    push_gbps = num_bytes / push["p2p"] / 1e9
    # What verifying costs: the senders' digest work (the slowest rank's, measured inside the
    # push) and the replicas' (measured inside the session), against the whole sync; with
    # p2p-nodigest also the difference of the two syncs, end to end.
    sender_s = median(
        [max(s["digest_seconds"] for s in r["sources"].values()) for r in runs["p2p"]]
    )
    replica_s = median([r["replica_digest_s"] for r in runs["p2p"]])
    verify = {
        "sender_s": sender_s,
        "replica_s": replica_s,
        "fraction_of_sync": (sender_s + replica_s) / seconds["p2p"],
        "ab_s": seconds["p2p"] - seconds["p2p-nodigest"] if "p2p-nodigest" in runs else None,
    }
    slowest = {  # per run, the slowest rank's fill and write seconds
        key: median([max(s[key] for s in r["sources"].values()) for r in p2p])
        for key in ("fill_seconds", "write_seconds")
    }
    return {
        "workload": label,
        "preset": args.preset,
        "bytes": num_bytes,
        "p2p_s": seconds["p2p"],
        "baseline_s": seconds["baseline"],
        "p2p-nodigest_s": seconds["p2p-nodigest"],
        "speedup": seconds["baseline"] / seconds["p2p"] if "baseline" in runs else None,
        "from-tensor_s": seconds["from-tensor"],
        "speedup_vs_from_tensor": (
            seconds["from-tensor"] / seconds["p2p"] if "from-tensor" in runs else None
        ),
        "colocated": colocated(args),
        "p2p_gbps": p2p_gbps,
        "ceiling": ceiling,
        "ceiling_gbps": ceiling_gbps,
        "fraction_of_ceiling": p2p_gbps / ceiling_gbps if ceiling_gbps else None,
        "p2p_push_s": push["p2p"],
        "p2p_push_gbps": push_gbps,
        "push_fraction_of_ceiling": push_gbps / ceiling_gbps if ceiling_gbps else None,
        "baseline_push_s": push["baseline"],
        "p2p_fill_s": slowest["fill_seconds"],
        "p2p_write_s": slowest["write_seconds"],
        "p2p_num_writes": p2p[-1]["num_writes"],
        "p2p_writes_per_target": _writes_per_target(p2p[-1]),
        "direct": args.direct,
        "p2p_cached_program": all(r["cached_program"] for r in p2p),
        "p2p_replayed": all(s.get("replayed") for r in p2p for s in r["sources"].values()),
        "p2p_bytes_direct": sum(s.get("bytes_direct", 0) for s in p2p[-1]["sources"].values()),
        "p2p_bytes_staged": sum(s.get("bytes_staged", 0) for s in p2p[-1]["sources"].values()),
        "trainer_experts": args.trainer_experts,
        "verification": verify,
        "links_gbps": links_gbps,
        "transport": args.transport,
        "model_bytes": model_bytes(config, canonical_dtype_name(args.dtype)),
        "model_type": config["model_type"],
        "replicas": args.replicas,
        "rollout_tp": args.rollout_tp,
        "trainer_ranks": args.trainer_ranks,
        "trainer_pp": args.trainer_pp,
        "device": args.device,
        "repeats": args.repeats,
        "methods": list(args.methods),
        "bit_exact": True,  # every run above was checked, or the bench failed
        "runs_s": {m: [r["seconds"] for r in runs[m]] for m in args.methods},
        "phases": {m: runs[m][-1]["phases"] for m in args.methods},
        "phases_s": phases_s,
        "lifecycle_s": {m: median([_lifecycle(r) for r in runs[m]]) for m in args.methods},
        "warmup_s": {m: warmup[m]["report"]["seconds"] for m in args.methods},
        "loop": _loop_summary(loop, num_bytes, ceiling_gbps, phase_names),
    }


def _writes_per_target(report: dict[str, Any]) -> dict[str, int]:
    """The most and the fewest write requests one target took from one source rank in a
    sync (``max``, ``min``), and their sum over all sources and targets (``total``)."""
    counts = [n for s in report["sources"].values() for n in s["writes_per_target"].values()]
    return {"max": max(counts, default=0), "min": min(counts, default=0), "total": sum(counts)}


def _loop_summary(loop, num_bytes, ceiling_gbps, phase_names) -> dict[str, Any] | None:
    """The back-to-back syncs' medians (`--loop-syncs`), or None."""
    if not loop:
        return None
    seconds = median([r["seconds"] for r in loop])
    push = median([r["phases"]["push"] for r in loop])
    return {
        "syncs": len(loop),
        "p2p_s": seconds,
        "p2p_push_s": push,
        "fraction_of_ceiling": num_bytes / seconds / 1e9 / ceiling_gbps if ceiling_gbps else None,
        "push_fraction_of_ceiling": (
            num_bytes / push / 1e9 / ceiling_gbps if ceiling_gbps else None
        ),
        "phases_s": {p: median([r["phases"][p] for r in loop]) for p in phase_names},
        "lifecycle_s": median([_lifecycle(r) for r in loop]),
        "replayed": all(s.get("replayed") for r in loop for s in r["sources"].values()),
    }


def _lifecycle(report: dict[str, Any]) -> float:
    """A sync's control plane: what of it is not moving bytes or fetching metadata (pause to
    the push, the push's landing to resume)."""
    phases = report["phases"]
    return phases["pause"] + phases["finalize"] + phases["resume"]


def _copies_per_byte(result: dict[str, Any]) -> float:
    """Copies each byte written took: the writes, plus the copies into the staging ring."""
    return (result["bytes"] + result["p2p_bytes_staged"]) / result["bytes"]


def print_result(result: dict[str, Any]) -> None:
    """The table of one workload."""
    num_bytes = result["bytes"]
    rows = []
    for method in result["methods"]:
        push = result["phases_s"][method]["push"]
        lifecycle = result["lifecycle_s"][method]
        row = [method, f"{result[f'{method}_s']:.3f}", f"{min(result['runs_s'][method]):.3f}"]
        row += [f"{num_bytes / result[f'{method}_s'] / 1e9:.3f}", f"{push:.4f}"]
        rows.append([*row, f"{lifecycle * 1e3:.2f}", "yes"])
    for key, gbps in result["links_gbps"].items():
        rows.append(
            [LINK_NAMES[key], f"{num_bytes / gbps / 1e9:.3f}", "-", f"{gbps:.3f}"] + ["-"] * 3
        )
    title = (
        f"{result['workload']}: {num_bytes / 1e9:.3f} GB per sync, median of {result['repeats']}"
    )
    print_table(
        title, ["method", "seconds", "min s", "GB/s", "push s", "lifecycle ms", "exact"], rows
    )
    cached = ", cached program" if result["p2p_cached_program"] else ""
    replayed = ", replayed" if result["p2p_replayed"] else ""
    per_target = result["p2p_writes_per_target"]
    print_table(
        f"P2P writes (direct={result['direct']}; one sync, all source ranks)",
        ["writes", "per target and rank (max)", "GB direct", "GB staged", "copies per byte"],
        [
            [
                str(result["p2p_num_writes"]),
                str(per_target["max"]),
                f"{result['p2p_bytes_direct'] / 1e9:.3f}",
                f"{result['p2p_bytes_staged'] / 1e9:.3f}",
                f"{_copies_per_byte(result):.2f}",
            ]
        ],
    )
    print(
        f"P2P, slowest rank (median): fill {result['p2p_fill_s']:.3f} s, writes not hidden "
        f"{result['p2p_write_s']:.3f} s{cached}{replayed}"
    )
    fraction = result["fraction_of_ceiling"]
    at = (
        f"{fraction:.0%} of {LINK_NAMES[result['ceiling']]} end to end, push at "
        if fraction
        else ""
    )
    push = f"{result['push_fraction_of_ceiling']:.0%}" if fraction else "(no ceiling)"
    speedups = [
        f"{result[key]:.2f}x over {name}"
        for key, name in (
            ("speedup", "the broadcast baseline"),
            ("speedup_vs_from_tensor", "update_weights_from_tensor"),
        )
        if result[key] is not None
    ]
    print(f"speedup: {', '.join(speedups)}; P2P at {at}{push}")
    phases = result["phases_s"]["p2p"]
    print(
        "P2P phases (median ms): "
        + ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in phases.items())
        + f"; lifecycle (pause + finalize + resume) {result['lifecycle_s']['p2p'] * 1e3:.2f}"
    )
    loop = result["loop"]
    if loop is not None:
        at = (
            f" ({loop['fraction_of_ceiling']:.0%} of {LINK_NAMES[result['ceiling']]}, push "
            f"{loop['push_fraction_of_ceiling']:.0%})"
            if loop["fraction_of_ceiling"]
            else ""
        )
        print(
            f"P2P loop, {loop['syncs']} syncs back to back (median): {loop['p2p_s'] * 1e3:.2f} ms"
            f"{at}; phases "
            + ", ".join(f"{n} {s * 1e3:.2f}" for n, s in loop["phases_s"].items())
            + f", lifecycle {loop['lifecycle_s'] * 1e3:.2f} ms"
        )
    verify = result["verification"]
    ab = (
        f"; p2p - p2p-nodigest end to end: {verify['ab_s'] * 1e3:+.1f} ms"
        if verify["ab_s"] is not None
        else ""
    )
    print(
        f"verification: senders' digests {verify['sender_s'] * 1e3:.2f} ms, replicas' "
        f"{verify['replica_s'] * 1e3:.2f} ms: {verify['fraction_of_sync']:.1%} of the sync{ab}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked and completed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: dense-1g (tiny: --quick)")
    for name in ("hidden", "intermediate", "layers", "experts", "moe-intermediate", "vocab"):
        p.add_argument(f"--{name}", type=int, help="override the preset's size")
    for name, default in (("replicas", 2), ("rollout-tp", 2), ("rollout-ep", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--trainer-ranks", type=int, default=2)
    p.add_argument("--trainer-pp", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rollout-gpu-offset", type=int, help="first rollout GPU (default: after)")
    p.add_argument(
        "--methods", nargs="+", choices=METHODS,
        help="default: p2p baseline (colocated: p2p from-tensor); p2p-nodigest: p2p without "
        "the senders' digests, to measure what verifying costs; from-tensor: "
        "update_weights_from_tensor (replicas on this host)",
    )  # fmt: skip
    p.add_argument("--transport", choices=sorted(TRANSPORTS), help="default: by device")
    p.add_argument("--dtype", default="bf16", choices=ROLLOUT_DTYPE_CHOICES)
    p.add_argument("--trainer-dtype", choices=ROLLOUT_DTYPE_CHOICES, help="default: --dtype")
    p.add_argument("--bucket-mb", type=int, default=256, help="both methods' bucket")
    p.add_argument("--num-workers", type=int, default=4, help="P2P fill threads per rank")
    p.add_argument("--ipc-streams", type=int, default=1, help="CUDA IPC streams per write")
    p.add_argument(
        "--direct",
        choices=("auto", "always", "never"),
        default="auto",
        help="P2P's SenderConfig.direct: write from the trainer's tensors by the transport's "
        "cost of a write (auto), wherever possible (always), or stage every byte (never)",
    )
    p.add_argument(
        "--loop-syncs",
        type=int,
        default=0,
        help="after the timed runs, this many P2P syncs back to back, as an RL loop runs "
        "them: no corruption between them, the replicas compared bit for bit after the last",
    )
    p.add_argument(
        "--trainer-experts",
        choices=("fused", "separate"),
        default="fused",
        help="how the trainer holds a MoE layer's experts: two fused tensors (as transformers "
        "and Megatron do) or one tensor per expert and projection",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 replica, 1 repeat")
    p.add_argument("--workdir", type=Path, help="keep configs and replica logs here")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.repeats, args.bucket_mb = 1, 1, 1
    args.preset = args.preset or ("tiny" if args.quick else "dense-1g")
    if args.methods is None:
        args.methods = ["p2p", "from-tensor" if colocated(args) else "baseline"]
    args.methods = tuple(m for m in METHODS if m in args.methods)
    if colocated(args) and "baseline" in args.methods:
        p.error(
            "the broadcast baseline cannot run colocated (NCCL takes no two ranks on one "
            "GPU); use --methods p2p from-tensor"
        )
    args.transport = args.transport or ("cuda_ipc" if args.device == "cuda" else "mooncake")
    if args.trainer_ranks % args.trainer_pp:
        p.error("--trainer-pp must divide --trainer-ranks")
    if "p2p" not in args.methods:
        p.error("--methods must include p2p (its bytes size the ceiling)")
    if args.transport == "cuda_ipc" and args.device != "cuda":
        p.error("--transport cuda_ipc needs --device cuda")
    if args.device == "cuda":
        import torch

        needed = max(args.trainer_ranks, rollout_gpu(args, args.replicas - 1) + args.rollout_tp)
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < needed:
            p.error(f"this placement needs {needed} GPUs; found {found}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the bench; exit 0 when every sync was bit-exact."""
    args = parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sizes = {"hidden_size": args.hidden, "intermediate_size": args.intermediate}
    sizes |= {"num_hidden_layers": args.layers, "num_experts": args.experts}
    sizes |= {"moe_intermediate_size": args.moe_intermediate, "vocab_size": args.vocab}
    config = workload_config(args.preset, **sizes)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="weightsync-bench-"))
    gb = model_bytes(config, canonical_dtype_name(args.dtype)) / 1e9
    label = (
        f"{args.preset} ({config['model_type']}, {config['num_hidden_layers']} layers, "
        f"{gb:.2f} GB {args.dtype}), {args.replicas} replica(s) x tp{args.rollout_tp}, "
        f"{args.trainer_ranks} trainer rank(s) pp{args.trainer_pp}, {args.device}"
    )
    try:
        result = run_workload(args, config, root / f"layers{config['num_hidden_layers']}", label)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_result(result)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
