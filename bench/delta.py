"""Delta syncs against full syncs of the same weights, after real optimizer steps, in one run.

Trainer ranks hold fp32 master weights (seeded synthetic, `weightsync.testing.trainers`)
and replicas serve the rollout dtype; both P2P syncs run over the same replicas: ``p2p``
(every byte) and ``p2p-delta`` (``SyncConfig(delta=True)``: only what changed). The first
delta sync is full (no reference yet) and checked bit-exact after the replicas' weights were
overwritten with random values. Then, ``--steps`` times: one AdamW step at ``--lr`` on every
rank (Gaussian gradients), a delta sync (timed; the replicas check every byte of it
themselves: their checksums before must be the verified base, after must be base + the
pushed change), then a full sync of the same weights (timed) after snapshotting the
replicas and overwriting them with random values, and the snapshot compared bit for bit:
the delta left exactly what a full write of the same weights leaves.

Prints a table per step and one JSON line: bytes on the wire and their fraction of the full
bytes, density, the delta's encode / write phases beside the full sync's push, the whole
sync's seconds, and memcpy over the bytes encoding reads, the trainer's fp32 tensors and the
reference in the rollout dtype (the bound of a CPU delta sync).

    python bench/delta.py                       # ~1 GB bf16 dense, 2 replicas x tp2, 2 ranks
    python bench/delta.py --quick               # tiny smoke run
    python bench/delta.py --device cuda --preset dense-8b --replicas 1 --rollout-tp 1 \
        --trainer-ranks 1 --trainer-pp 1 --bucket-mb 512   # colocated: both on GPU 0

On CUDA the trainer rank and the replica share GPU 0 (``--rollout-gpu-offset``, 0 by
default: colocated, as verl places them) and write over CUDA IPC; the reference stays in GPU
memory beside the trainer's fp32 weights, AdamW's two moments and the replica. The table adds
what proving the base (the replica's checksums of every parameter, before the push) and
applying the delta (with its check) took, beside the full sync.
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
from sync import launch
from weightsync.layout.dtypes import ROLLOUT_DTYPE_CHOICES, canonical_dtype_name
from weightsync.testing.trainers import SyncTrainers, TrainerSpec

TRAINER_DTYPE = "float32"  # the trainer ranks' master weights, which encoding reads


def _delta_row(step: int, step_s: float, delta: dict, full: dict) -> dict[str, Any]:
    """What one step's delta sync did beside the full sync of the same weights."""
    writes = delta["writes"]
    proved = [w["prove_seconds"] for w in writes.values() if w["prove_seconds"] is not None]
    applied = [w["apply_seconds"] for w in writes.values() if w["apply_seconds"] is not None]
    modes = sorted({w["mode"] for w in writes.values()})
    sent = sum(w["bytes"] for w in writes.values())
    full_bytes = sum(w["full_bytes"] for w in writes.values())
    deltas = delta["deltas"].values()
    return {
        "step": step,
        "optimizer_s": step_s,
        "modes": modes,
        "why_full": sorted({w["why_full"] for w in writes.values() if w["why_full"]}),
        "bytes": sent,
        "full_bytes": full_bytes,
        "bytes_fraction": sent / full_bytes if full_bytes else None,
        "density": max((w["density"] or 0.0) for w in writes.values()),
        "encode_s": max(d["encode_seconds"] for d in deltas),
        "wire_s": max(d["write_seconds"] for d in deltas),
        "prove_s": max(proved, default=None),
        "apply_s": max(applied, default=None),
        "reference_bytes": sum(d["reference_bytes"] for d in deltas),
        "delta_push_s": delta["phases"]["push"],
        "delta_finalize_s": delta["phases"]["finalize"],
        "delta_s": delta["seconds"],
        "full_push_s": full["phases"]["push"],
        "full_s": full["seconds"],
        "full_bit_exact_to_delta": True,
    }


def run(args: argparse.Namespace, config: dict, workdir: Path) -> dict[str, Any]:
    """Start the replicas and trainer ranks, run the steps, stop everything; the results."""
    dtype = canonical_dtype_name(args.dtype)
    api_key = secrets.token_hex(8)
    model_dir = write_config(config, workdir / "model")
    rollout_bytes = model_bytes(config, dtype)
    args.delta_region_mb = args.delta_region_mb or max(
        4, -(-rollout_bytes // args.rollout_tp // 8 // MIB)
    )
    replicas = launch(args, model_dir, api_key, workdir / "logs")
    ceiling: HostCeiling | GpuCeiling | None = None
    try:
        spec = TrainerSpec(
            config=config,
            urls=tuple(r.url for r in replicas),
            api_key=api_key,
            world_size=args.trainer_ranks,
            pp_size=args.trainer_pp,
            rollout_dtype=dtype,
            trainer_dtype=TRAINER_DTYPE,
            device=args.device,
            transport=args.transport,
            seed=args.seed,
            bucket_bytes=args.bucket_mb * MIB,
            num_workers=args.num_workers,
            timeout_s=args.timeout_s,
            methods=("p2p", "p2p-delta"),
            lr=args.lr,
        )
        with SyncTrainers(spec) as trainers:
            first = trainers.run("p2p-delta")  # the reference's first push: full, checked
            log(f"first delta-mode sync (full): {first['report']['seconds']:.3f} s, bit-exact")
            trainers.run("p2p")  # the full method's own first sync (plans, programs)
            rows = []
            for step in range(1, args.steps + 1):
                step_s = trainers.step()
                delta = trainers.run("p2p-delta", check=False)["report"]
                full = trainers.run("p2p")["report"]
                row = _delta_row(step, step_s, delta, full)
                rows.append(row)
                log(
                    f"step {step}: delta {row['delta_s']:.3f} s ({row['bytes'] / 1e6:.1f} MB, "
                    f"{row['modes']}), full {row['full_s']:.3f} s; bit-exact"
                )
                for why in row["why_full"]:
                    log(f"  full bytes because {why}")
        # Encoding reads the new bytes (the trainer's fp32 tensors, cast on the way) and the
        # reference (the rollout dtype): a copy of both, per rank, with the trainers stopped
        # (on CUDA a same-GPU copy, on the host a memcpy).
        per_rank = (model_bytes(config, TRAINER_DTYPE) + rollout_bytes) // args.trainer_ranks
        if args.device == "cuda":
            ceiling = GpuCeiling(per_rank, gpus=(0, 0), region_bytes=args.bucket_mb * MIB)
            memcpy_s = median([ceiling.measure()["peer_copy"] for _ in range(3)])
        else:
            ceiling = HostCeiling(per_rank)
            memcpy_s = median([ceiling.memcpy() for _ in range(3)])
        return {
            "bench": "delta",
            "workload": args.preset,
            "rollout_bytes": rollout_bytes,
            "replicas": args.replicas,
            "rollout_tp": args.rollout_tp,
            "trainer_ranks": args.trainer_ranks,
            "device": args.device,
            "lr": args.lr,
            "delta_region_mb": args.delta_region_mb,
            "memcpy_s_per_rank": memcpy_s,
            "encode_bytes_per_rank": per_rank,
            "rows": rows,
        }
    finally:
        if ceiling is not None:
            ceiling.close()
        for replica in replicas:
            replica.stop()


def print_result(result: dict[str, Any]) -> None:
    """The per-step table and the ratios against the full sync."""
    rows = result["rows"]
    copy = "GPU copy" if result.get("device") == "cuda" else "memcpy"
    memcpy_gbps = result["encode_bytes_per_rank"] / result["memcpy_s_per_rank"] / 1e9
    table = []
    for row in rows:
        encode_gbps = result["encode_bytes_per_rank"] / row["encode_s"] / 1e9
        table.append(
            [
                str(row["step"]),
                "/".join(row["modes"]),
                f"{row['density']:.2%}",
                f"{row['bytes'] / 1e6:.1f}",
                f"{row['bytes_fraction']:.2%}",
                f"{row['encode_s']:.3f} ({encode_gbps / memcpy_gbps:.0%})",
                f"{row['wire_s']:.4f}",
                _seconds(row["prove_s"]),
                _seconds(row["apply_s"]),
                f"{row['full_push_s']:.3f}",
                f"{row['full_push_s'] / row['wire_s']:.0f}x",
                f"{row['delta_s']:.3f}",
                f"{row['full_s']:.3f}",
                f"{row['full_s'] / row['delta_s']:.2f}x",
            ]
        )
    print_table(
        f"{result['workload']}: {result['rollout_bytes'] / 1e9:.2f} GB, "
        f"{result['replicas']} replicas x tp{result['rollout_tp']}, "
        f"{result['trainer_ranks']} trainer ranks, AdamW lr {result['lr']:g}; "
        f"{copy} {memcpy_gbps:.1f} GB/s",
        [
            "step",
            "mode",
            "density",
            "MB sent",
            "of full",
            f"encode s (of {copy})",
            "delta wire s",
            "prove s",
            "apply s",
            "full push s",
            "wire ratio",
            "delta sync s",
            "full sync s",
            "speed-up",
        ],
        table,
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: dense-1g (tiny: --quick)")
    p.add_argument("--layers", type=int, help="override the preset's layers")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rollout-tp", type=int, default=2)
    p.add_argument("--trainer-ranks", type=int, default=2)
    p.add_argument(
        "--trainer-pp",
        type=int,
        default=2,
        help="pipeline stages over the trainer ranks (each rank keeps fp32 master weights and "
        "AdamW's two moments for its stage: 2 stages halve that memory)",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--rollout-gpu-offset",
        type=int,
        default=0,
        help="CUDA: the replicas' first GPU (0: colocated with the trainer rank on GPU 0)",
    )
    p.add_argument("--dtype", default="bf16", choices=ROLLOUT_DTYPE_CHOICES)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--delta-region-mb", type=int, help="default: 1/8 of a rank's bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 replica, 1 step")
    p.add_argument("--workdir", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.steps, args.bucket_mb = 1, 1, 1
    args.preset = args.preset or ("tiny" if args.quick else "dense-1g")
    # What `launch` reads beside these.
    args.rollout_ep = 1
    args.transport = "cuda_ipc" if args.device == "cuda" else "mooncake"
    if args.device == "cpu":
        args.rollout_gpu_offset = None
    if args.trainer_ranks % args.trainer_pp:
        p.error("--trainer-pp must divide --trainer-ranks")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the bench; exit 0 when every sync verified and every full sync was bit-exact."""
    args = parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    config = workload_config(args.preset, num_hidden_layers=args.layers)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="weightsync-delta-"))
    try:
        result = run(args, config, root)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_result(result)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
