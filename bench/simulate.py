"""The network simulator's predictions against real syncs measured in the same run.

For each point (``replicas x tp``) it starts real replicas (`weightsync serve`, seeded
synthetic weights) and real trainer ranks, times the push phase (the data phase: what the
simulator predicts) of ``--repeats`` P2P syncs without digests, and predicts the same sync:
the plan the senders execute (`build_plan` on the same layout, read by `plan_schedule`)
simulated on a `NetworkModel` whose constants are fitted, in this run, from the transport
alone:

- CPU (Mooncake TCP): every process shares the host, so the host is one node with one NIC
  whose rate is what ``min(trainer ranks, receiving ranks)`` raw Mooncake TCP writers, each
  writing the sync's bytes into its own peer process, move together (`HostFit`); the
  message latency is a batch of one 4 KiB write, submit to completion; the cost per write is
  the extra time of a batch of many small writes over that latency and their bytes; the
  senders' staging copy (`NetworkModel.staging_gbps`) runs at an in-process memcpy's rate,
  since it and TCP share the same two cores.
- CUDA (``--device cuda``, trainer and replica on one GPU, CUDA IPC): one node, the copy's
  rate is an in-process device copy of the sync's bytes (as NVLink), the cost per write that
  of many small copies, the staging copy the same device copy.

The transport is fitted again right after every timed push, so that both see the same load
on the host; each push is predicted with the constants fitted after it, and the medians are
compared. Prints a table (predicted, measured, error) and one JSON line (``points``, each
with its fitted constants, and ``max_abs_error``).

With ``--cluster`` it measures nothing and predicts instead the cluster the issue targets:
Kimi-K2 as it ships (FP8), 256 trainer GPUs (tp 8, pp 4, dp 8) into 8 replicas of tp 16 /
ep 16 (128 GPUs), 400 Gb/s per NIC, one NIC per GPU: the full sync (`predict_sync`) and, at
each of ``--delta-densities`` (bf16 elements; FP8 codes a tenth of it, scales all, as
`bench/density.py` measured), the delta sync (`weightsync.predict.delta`) phase by phase,
with device rates fitted from `bench/delta_kernels.py` on one H200 (`DeltaRates.h200`).

    python bench/simulate.py                         # dense-256m; 1x1, 2x1, 2x2, 3x2 on CPU
    python bench/simulate.py --quick                 # tiny, two points
    python bench/simulate.py --device cuda --points 1x1 --trainer-ranks 1 --preset dense-1g
    python bench/simulate.py --cluster               # Kimi-K2 FP8, 256 -> 128 GPUs, delta
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    KIB,
    MIB,
    PRESETS,
    GpuCeiling,
    HostCeiling,
    log,
    median,
    print_table,
    workload_config,
    write_config,
)
from sync import launch
from weightsync.layout.dtypes import canonical_dtype_name
from weightsync.plan import build_plan, simulate_sources, simulate_targets
from weightsync.predict import (
    DeltaDensity,
    DeltaRates,
    NetworkModel,
    TrainerShape,
    delta_prediction,
    plan_schedule,
    predict_sync,
    simulate,
)
from weightsync.testing.trainers import SyncTrainers, TrainerSpec

METHOD = "p2p-nodigest"
SMALL_WRITES = 2048  # writes in the per-write fit
SMALL_WRITE_BYTES = 16 * KIB

# The "Cluster" target: Kimi-K2 FP8 from 256 trainer GPUs into 128 rollout GPUs at
# 400 Gb/s (the cluster of tests/test_predict.py's 1T case).
CLUSTER_CONFIG = Path(__file__).resolve().parent.parent / "src/weightsync/configs/kimi-k2.json"
CLUSTER_TRAINER = TrainerShape(num_gpus=256, tp=8, pp=4)
CLUSTER_ROLLOUT = {"rollout_tp": 16, "rollout_ep": 16, "replicas": 8}
CLUSTER_NIC_GBPS = 400.0
CLUSTER_TARGET_S = 0.2
# bf16 elements changed per step at lr 1e-6 (bench/density.py): 3.7 % at first, 1.8 % settled.
CLUSTER_DENSITIES = (0.018, 0.02, 0.037)


class HostFit:
    """Fits Mooncake TCP on this host, one round per `measure`.

    The rate is what `streams` raw writers, each to its own peer process, move together: the
    senders of a sync write at once, and on a host of few cores concurrent streams get more
    of it than one (measured: ~1.4x for two on two cores). A sync runs at most
    ``min(senders, receivers)`` such pairs at once.
    """

    def __init__(self, num_bytes: int, streams: int) -> None:
        self.num_bytes = num_bytes
        self._ceilings = [HostCeiling(num_bytes) for _ in range(max(1, streams))]
        # As many small writes as fit the measurement's buffer, at most SMALL_WRITES.
        buffer_bytes = self._ceilings[0].buffer_bytes
        self._count = max(1, min(SMALL_WRITES, buffer_bytes // SMALL_WRITE_BYTES))

    def _together(self) -> float:
        """Seconds for every stream to write `num_bytes` at once."""
        threads = [threading.Thread(target=c.mooncake) for c in self._ceilings]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start

    def measure(self) -> dict[str, float]:
        """The link's rate, a message's latency and the cost per write, measured now."""
        ceiling = self._ceilings[0]
        # Medians of three: the host is shared, one reading can catch a burst of load.
        total = self.num_bytes * len(self._ceilings)
        rate = total / median([self._together() for _ in range(3)])
        single = self.num_bytes / median([ceiling.mooncake() for _ in range(3)])
        small = median([ceiling.mooncake_writes(self._count, SMALL_WRITE_BYTES) for _ in range(3)])
        # A batch of one small write: the fixed cost of a message, submit to completion.
        latency = median([ceiling.mooncake_writes(1, 4 * KIB) for _ in range(3)])
        data_s = self._count * SMALL_WRITE_BYTES / single
        write_cost = max(0.0, (small - latency - data_s) / self._count)
        # The sender's staging copy shares the host's cores with TCP: a memcpy of the bytes.
        staging = self.num_bytes / median([ceiling.memcpy() for _ in range(3)])
        return {
            "bytes_per_s": rate,
            "single_stream_bytes_per_s": single,
            "write_cost_s": write_cost,
            "message_latency_s": latency,
            "staging_bytes_per_s": staging,
        }

    def close(self) -> None:
        """Stop the peers."""
        for ceiling in self._ceilings:
            ceiling.close()


class GpuFit:
    """Fits one GPU's device copy (trainer and replica on GPU 0), one round per `measure`."""

    def __init__(self, num_bytes: int, streams: int = 1) -> None:
        self.num_bytes = num_bytes
        self._small_bytes = SMALL_WRITES * 64 * KIB
        self._big = GpuCeiling(num_bytes, gpus=(0, 0), region_bytes=256 * MIB)
        self._small = GpuCeiling(self._small_bytes, gpus=(0, 0), region_bytes=64 * KIB)

    def measure(self) -> dict[str, float]:
        """The copy's rate and the cost per copy, measured now (no message latency)."""
        rate = self.num_bytes / self._big.measure()["peer_copy"]
        small = self._small.measure()["peer_copy"]
        write_cost = max(0.0, (small - self._small_bytes / rate) / SMALL_WRITES)
        # The sender stages its bytes with a device copy before the IPC copy: the same rate.
        return {
            "bytes_per_s": rate,
            "write_cost_s": write_cost,
            "message_latency_s": 0.0,
            "staging_bytes_per_s": rate,
        }

    def close(self) -> None:
        """Stop the copy processes."""
        self._big.close()
        self._small.close()


def network_for(device: str, fitted: dict[str, float], num_endpoints: int) -> NetworkModel:
    """The fitted model: one node holding every process, one shared link."""
    gbps = fitted["bytes_per_s"] * 8 / 1e9
    common = {
        "gpus_per_node": max(8, num_endpoints),
        "nics_per_node": 1,
        "write_cost_s": fitted["write_cost_s"],
        "message_latency_s": fitted["message_latency_s"],
        "staging_gbps": fitted["staging_bytes_per_s"] * 8 / 1e9,
    }
    if device == "cuda":
        return NetworkModel(nvlink_gbps=gbps, colocated=True, **common)
    return NetworkModel(nic_gbps=gbps, **common)


def plan_for(config: dict, args: Namespace, replicas: int, tp: int):
    """The schedule of the plan the senders execute for this point."""
    dtype = canonical_dtype_name(args.dtype)
    plan = build_plan(
        hf_config=config,
        targets=simulate_targets(config, tp=tp, replicas=replicas, dtype=dtype),
        sources=simulate_sources(config, num_sources=args.trainer_ranks, pp=args.trainer_pp),
        dtype=dtype,
    )
    return plan_schedule(plan)


def measure_point(
    config: dict, args: Namespace, replicas: int, tp: int, workdir: Path
) -> dict[str, Any]:
    """Start one point's replicas and trainer ranks; per repeat, time a push and fit the
    transport right after it (the same load on the host for both); stop everything."""
    point = Namespace(**{**vars(args), "replicas": replicas, "rollout_tp": tp, "rollout_ep": 1})
    api_key = secrets.token_hex(8)
    model_dir = write_config(config, workdir / "model")
    schedule = plan_for(config, args, replicas, tp)
    running = launch(point, model_dir, api_key, workdir / "logs")
    fitter: HostFit | GpuFit | None = None
    try:
        spec = TrainerSpec(
            config=config,
            urls=tuple(r.url for r in running),
            api_key=api_key,
            world_size=args.trainer_ranks,
            pp_size=args.trainer_pp,
            rollout_dtype=canonical_dtype_name(args.dtype),
            trainer_dtype=canonical_dtype_name(args.dtype),
            device=args.device,
            seed=args.seed,
            bucket_bytes=args.bucket_mb * MIB,
            num_workers=args.num_workers,
            timeout_s=args.timeout_s,
            transport=args.transport,
            methods=(METHOD,),
        )
        with SyncTrainers(spec) as trainers:
            warmup = trainers.run(METHOD)["report"]
            if schedule.num_bytes != warmup["bytes"]:
                raise RuntimeError(
                    f"the plan moves {schedule.num_bytes} B, the sync {warmup['bytes']} B"
                )
            # As many streams as pairs of sending and receiving processes can run at once.
            streams = min(args.trainer_ranks, replicas * tp)
            fitter = (HostFit if args.device == "cpu" else GpuFit)(warmup["bytes"], streams)
            fitter.measure()  # untimed: connections and pages set up
            pushes, fits, predictions, network_only = [], [], [], []
            for _ in range(args.repeats):
                pushes.append(trainers.run(METHOD)["report"]["phases"]["push"])
                fitted = fitter.measure()
                network = network_for(args.device, fitted, replicas * tp + args.trainer_ranks)
                fits.append(fitted)
                predictions.append(simulate(schedule, network).makespan_s)
                bare = dataclasses.replace(network, staging_gbps=None)
                network_only.append(simulate(schedule, bare).makespan_s)
    finally:
        if fitter is not None:
            fitter.close()
        for replica in running:
            replica.stop()
    return {
        "bytes": warmup["bytes"],
        "plan_writes": sum(t.num_writes for t in schedule.transfers()),
        "measured_writes": warmup["num_writes"],
        "predicted_s": median(predictions),
        "measured_push_s": median(pushes),
        "error": median(predictions) / median(pushes) - 1,
        "paired_errors": [p / m - 1 for p, m in zip(predictions, pushes, strict=True)],
        "link_gbps": median([f["bytes_per_s"] for f in fits]) * 8 / 1e9,
        "single_stream_gbps": median(
            [f.get("single_stream_bytes_per_s", f["bytes_per_s"]) for f in fits]
        )
        * 8
        / 1e9,
        "write_cost_us": median([f["write_cost_s"] for f in fits]) * 1e6,
        "message_latency_us": median([f["message_latency_s"] for f in fits]) * 1e6,
        "staging_gbps": median([f["staging_bytes_per_s"] for f in fits]) * 8 / 1e9,
        "predicted_runs_s": predictions,
        "network_only_s": median(network_only),
        "network_only_error": median(network_only) / median(pushes) - 1,
        "push_runs_s": pushes,
    }


def predict_cluster(densities: list[float]) -> dict[str, Any]:
    """The full and the delta sync of the issue's cluster, and one row per density."""
    config = json.loads(CLUSTER_CONFIG.read_text())
    network = NetworkModel(nic_gbps=CLUSTER_NIC_GBPS)
    log("Kimi-K2 FP8, 256 -> 128 GPUs: planning and simulating the full sync")
    full = predict_sync(
        config, trainer=CLUSTER_TRAINER, network=network, fp8=True, **CLUSTER_ROLLOUT
    )
    rates = DeltaRates.h200()
    # The default check derives the checksums after in the scatter's pass; a full read
    # after is priced beside it.
    checks = ("changes", "full") if rates.derives else ("full",)
    rows = []
    for density, check in itertools.product(densities, checks):
        log(f"  delta at {density:.2%} of bf16 elements, check={check}")
        delta = delta_prediction(
            full, config, density=DeltaDensity.measured(density), rates=rates, check=check
        )
        rows.append(
            {
                "check": check,
                "density": dataclasses.asdict(delta.density),
                "bytes": delta.num_bytes,
                "byte_ratio": delta.byte_ratio,
                "find_s": delta.find_s,
                "host_s": delta.host_s,
                "num_tensors": delta.num_tensors,
                "layout_s": delta.layout_s,
                "encode_s": delta.encode_s,
                "wire_s": delta.wire_s,
                "wire_lower_bound_s": delta.wire_lower_bound_s,
                "checksum_s": delta.checksum_s,
                "num_checksums": delta.num_checksums,
                "apply_s": delta.apply_s,
                "replica_s": delta.replica_s,
                "total_s": delta.total_s,
                "bound_by": delta.bound_by,
                "meets_target": delta.total_s <= CLUSTER_TARGET_S,
            }
        )
    return {
        "bench": "simulate-cluster",
        "model": "kimi-k2 (fp8)",
        "trainer": dataclasses.asdict(CLUSTER_TRAINER),
        "rollout": CLUSTER_ROLLOUT,
        "nic_gbps": CLUSTER_NIC_GBPS,
        "full_bytes": full.num_bytes,
        "full_s": full.result.makespan_s,
        "full_lower_bound_s": full.ideal_lower_bound_s,
        "target_s": CLUSTER_TARGET_S,
        "rates": dataclasses.asdict(rates),
        "deltas": rows,
    }


def print_cluster(summary: dict[str, Any]) -> None:
    """The cluster's table: the full sync, then each delta's phases."""
    rows = [
        [
            "full",
            f"{summary['full_bytes'] / 1e12:.3f} TB",
            "-",
            f"{summary['full_s']:.3f}",
            "-",
            f"{summary['full_s']:.3f}",
            "wire",
        ]
    ]
    for row in summary["deltas"]:
        rows.append(
            [
                f"delta {row['density']['elements']:.1%}, check={row['check']}",
                f"{row['bytes'] / 1e9:.1f} GB ({row['byte_ratio']:.2%})",
                f"{row['encode_s']:.3f}",
                f"{row['wire_s']:.3f}",
                f"{row['replica_s']:.3f}",
                f"{row['total_s']:.3f}",
                row["bound_by"],
            ]
        )
    print_table(
        f"Kimi-K2 FP8: 256 trainer GPUs (tp 8, pp 4) -> 8 x tp 16 ep 16, "
        f"{summary['nic_gbps']:g} Gb/s per NIC; no full sync beats "
        f"{summary['full_lower_bound_s']:.3f} s",
        ["sync", "on the wire", "encode s", "wire s", "replica s", "total s", "bound by"],
        rows,
    )
    for row in summary["deltas"]:
        verdict = "meets" if row["meets_target"] else "misses"
        print(
            f"delta {row['density']['elements']:.1%}, check={row['check']}: "
            f"{row['total_s']:.3f} s {verdict} the "
            f"{summary['target_s']:g} s target; replica = "
            f"{row['num_checksums']} x checksum "
            f"{row['checksum_s'] * 1e3:.1f} ms + apply {row['apply_s'] * 1e3:.1f} ms; encode = "
            f"find {row['find_s'] * 1e3:.1f} ms + host {row['host_s'] * 1e3:.1f} ms "
            f"({row['num_tensors']} tensors) + lay out {row['layout_s'] * 1e3:.1f} ms; wire "
            f"lower bound {row['wire_lower_bound_s'] * 1e3:.1f} ms"
        )


def parse_args(argv: list[str] | None) -> Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: dense-256m (tiny: --quick)")
    p.add_argument(
        "--points",
        nargs="+",
        default=None,
        help="replicas x tp, e.g. 2x1 (default: 1x1 2x1 2x2 3x2)",
    )
    p.add_argument("--trainer-ranks", type=int, default=2)
    p.add_argument("--trainer-pp", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="tiny model, two points, one repeat")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="predict the issue's cluster (Kimi-K2 FP8, 256 -> 128 GPUs), full and delta; "
        "measures nothing",
    )
    p.add_argument(
        "--delta-densities",
        type=float,
        nargs="+",
        default=list(CLUSTER_DENSITIES),
        help="--cluster: fractions of bf16 elements changed (default: measured at lr 1e-6)",
    )
    args = p.parse_args(argv)
    for density in args.delta_densities:
        if not 0.0 <= density <= 1.0:
            p.error(f"--delta-densities: {density:g} is not a fraction in [0, 1]")
    if args.quick:
        args.repeats = 1
        args.points = args.points or ["1x1", "2x1"]
    args.preset = args.preset or ("tiny" if args.quick else "dense-256m")
    args.points = args.points or ["1x1", "2x1", "2x2", "3x2"]
    args.transport = "cuda_ipc" if args.device == "cuda" else "mooncake"
    args.rollout_gpu_offset = 0 if args.device == "cuda" else None
    if args.device == "cuda" and (args.points != ["1x1"] or args.trainer_ranks != 1):
        p.error("--device cuda calibrates one GPU: --points 1x1 --trainer-ranks 1")
    if args.trainer_ranks % args.trainer_pp:
        p.error("--trainer-pp must divide --trainer-ranks")
    parsed = []
    for point in args.points:
        try:
            replicas, tp = (int(v) for v in point.lower().split("x"))
        except ValueError:
            p.error(f"--points: {point!r} is not REPLICASxTP (e.g. 2x1)")
        parsed.append((replicas, tp))
    args.parsed_points = parsed
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every point (or predict the cluster); print the table and the JSON line."""
    args = parse_args(argv)
    if args.cluster:
        summary = predict_cluster(args.delta_densities)
        print_cluster(summary)
        print(json.dumps(summary), flush=True)
        return 0
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    config = workload_config(args.preset)
    root = Path(tempfile.mkdtemp(prefix="weightsync-bench-simulate-"))
    points = []
    try:
        for replicas, tp in args.parsed_points:
            log(f"{replicas} replica(s) x tp{tp}: measuring")
            measured = measure_point(config, args, replicas, tp, root / f"r{replicas}tp{tp}")
            log(
                f"  push {measured['measured_push_s']:.3f} s, "
                f"predicted {measured['predicted_s']:.3f} s"
            )
            points.append({"replicas": replicas, "rollout_tp": tp, **measured})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{args.preset}, {args.trainer_ranks} trainer rank(s) pp{args.trainer_pp}, {args.device} "
        f"({args.transport}), {METHOD}, median of {args.repeats}"
    )
    header = (
        "point",
        "MB",
        "writes",
        "link Gb/s",
        "us/write",
        "no staging",
        "predicted",
        "measured",
        "error",
    )
    print(" | ".join(f"{h:>10}" for h in header))
    for p in points:
        row = (
            f"{p['replicas']}x tp{p['rollout_tp']}",
            f"{p['bytes'] / 1e6:.1f}",
            f"{p['plan_writes']}/{p['measured_writes']}",
            f"{p['link_gbps']:.2f}",
            f"{p['write_cost_us']:.1f}",
            f"{p['network_only_s']:.3f} s",
            f"{p['predicted_s']:.3f} s",
            f"{p['measured_push_s']:.3f} s",
            f"{p['error']:+.1%}",
        )
        print(" | ".join(f"{v:>10}" for v in row))
    summary = {
        "preset": args.preset,
        "device": args.device,
        "transport": args.transport,
        "trainer_ranks": args.trainer_ranks,
        "method": METHOD,
        "points": points,
        "max_abs_error": max(abs(p["error"]) for p in points),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
