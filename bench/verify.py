"""What verifying a sync costs, against what moving its bytes costs, in one run.

For one rollout rank of a workload (tp 1), on the host or a GPU:

- the replica's side: `ParameterDigests.compute` over every parameter (carved out of one
  buffer, as the reference engine allocates them), twice per sync (begin and end);
- the sender's side: the `DigestSums` of the push program lowered for that rank (a gather of
  each bucket's samples out of the staging ring, then one weighted sum), once per sync;
- the floor of the sync itself: one copy of the same bytes on the same device (a same-GPU
  CUDA IPC sync at best moves them at this rate; a cross-GPU or network sync is slower).

Prints a table and one JSON line (``verify_ms``, ``copy_ms``, ``fraction_of_copy``, ...).

    .venv/bin/python bench/verify.py [--preset dense-1g] [--device cpu|cuda] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PRESETS, print_table, workload_config
from weightsync.export import TensorsExport
from weightsync.layout import hf_tensor_shapes, rank_layout
from weightsync.plan import SourceHolding, TargetRank, build_plan
from weightsync.plan.program import StagingSpec, lower_push
from weightsync.receiver.digest import ParameterDigests
from weightsync.sender.digest import DigestSums
from weightsync.torch_dtypes import torch_dtype

MIB = 1 << 20


def timed(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    """Median seconds of `fn` (device work included), after one untimed call."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Run the benchmark and print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="dense-1g", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="override the preset's layer count")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    sizes = {"num_hidden_layers": args.layers} if args.layers else {}
    config = workload_config(args.preset, **sizes)
    dtype = "bfloat16"
    parallelism = {"tp_size": 1, "tp_rank": 0, "ep_size": 1}
    layout = rank_layout(config, parallelism, dtype)

    # The replica's parameters, carved out of one buffer.
    offsets, end = {}, 0
    for name, param in layout.items():
        offsets[name] = -(-end // 256) * 256
        end = offsets[name] + param.numel * param.element_size
    buffer = torch.zeros(end, dtype=torch.uint8, device=device)
    params = {
        name: buffer[offsets[name] : offsets[name] + p.numel * p.element_size]
        .view(torch_dtype(p.dtype))
        .view(p.shape)
        for name, p in layout.items()
    }
    replica = ParameterDigests(params)

    # The sender's program for that rank, and its digest sums over a ring.
    shapes = hf_tensor_shapes(config)
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    export = TensorsExport(tensors)
    target = TargetRank(
        replica="r0",
        rank=0,
        session_id="127.0.0.1:1",
        parallelism=parallelism,
        weights_info={n: (t.data_ptr(), t.numel(), t.element_size()) for n, t in params.items()},
    )
    holding = SourceHolding(rank=0, tensors=export.holding())
    plan = build_plan(hf_config=config, targets=[target], sources=[holding], dtype=dtype)
    slot = args.bucket_mb * MIB
    staging = StagingSpec(
        device=str(device), num_slots=2, slot_bytes=slot, chunk_bytes=min(slot, 256 * MIB)
    )
    program = lower_push(plan.for_source(0), export.geometry(), staging)
    ring = torch.zeros(staging.ring_bytes, dtype=torch.uint8, device=device)
    sums = DigestSums(program, device=device)

    def sender() -> None:
        for step in program.steps:
            if step.new_bucket:
                sums.flush(ring)
            sums.add_step(step)
        sums.flush(ring)
        sums.values()

    copy_target = torch.empty_like(buffer)
    replica_s = timed(replica.compute, args.repeat, device)
    sender_s = timed(sender, args.repeat, device)
    copy_s = timed(lambda: copy_target.copy_(buffer), args.repeat, device)
    verify_s = 2 * replica_s + sender_s
    num_samples = sum(len(step.samples) for step in program.steps)
    rows = [
        ["replica: digest of every parameter (x2 per sync)", f"{replica_s * 1e3:.3f}"],
        ["sender: gathers and sum of one push", f"{sender_s * 1e3:.3f}"],
        ["verification per sync", f"{verify_s * 1e3:.3f}"],
        [f"copy of the {end / 1e9:.2f} GB on {device.type}", f"{copy_s * 1e3:.3f}"],
    ]
    title = (
        f"{args.preset} ({config['model_type']}, {len(layout)} parameters, {len(shapes)} HF "
        f"tensors, {program.counters.num_chunks} chunks) on {device}: verification is "
        f"{verify_s / copy_s:.1%} of one copy of its bytes"
    )
    print_table(title, ["what", "ms (median)"], rows)
    print(
        json.dumps(
            {
                "bench": "verify",
                "preset": args.preset,
                "device": device.type,
                "bytes": end,
                "parameters": len(layout),
                "hf_tensors": len(shapes),
                "sample_spans": num_samples,
                "chunks": program.counters.num_chunks,
                "replica_digest_ms": replica_s * 1e3,
                "sender_digest_ms": sender_s * 1e3,
                "verify_ms": verify_s * 1e3,
                "copy_ms": copy_s * 1e3,
                "fraction_of_copy": verify_s / copy_s,
            }
        )
    )


if __name__ == "__main__":
    main()
