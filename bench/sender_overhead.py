"""Python overhead of `WeightSender.push` per HF tensor, on the host, without moving bytes.

A many-expert qwen3_moe (tiny hidden sizes, so the copies cost next to nothing) is pushed to
the targets of a rollout layout through a transport that accepts every write at once: what is
left is the sender's own per-tensor work. The first push lowers the plan into a program
(matching, checks, packing, chunking, fusing copies, coalescing); the repeated pushes run the
cached program (the export's geometry check, each tensor's arrival check, the copies and the
submits). The repeated pushes alternate with those of a sender that sums no digests
(``SenderConfig(digest=False)``), which prices the per-sync verification's sender side.
Prints a table and one JSON line.

    .venv/bin/python bench/sender_overhead.py [--layers 48] [--experts 128] [--tp 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from weightsync.export import TensorsExport
from weightsync.layout import hf_tensor_shapes, rank_layout
from weightsync.plan import TargetRank, build_plan
from weightsync.sender import SenderConfig, WeightSender
from weightsync.testing.presets import preset_config
from weightsync.transport.base import HOST_ONLY, WriteHandle
from weightsync.transport.mooncake.engine import DEFAULT_WRITE_COSTS


class _NullTransport:
    """Accepts every write as done: isolates the sender's Python from the transport's."""

    session_id = "127.0.0.1:1"
    # The push it prices is a Mooncake TCP push: the sender lowers it for that cost.
    write_cost = DEFAULT_WRITE_COSTS["tcp"]
    capabilities = HOST_ONLY

    def __init__(self) -> None:
        self.num_regions = 0

    def register(self, addr: int, num_bytes: int) -> None:
        """Nothing to register."""

    def unregister(self, addr: int) -> None:
        """Nothing to unregister."""

    def write(
        self,
        target_session: str,
        src_addrs: Sequence[int],
        dst_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> WriteHandle:
        """Count the regions; nothing moves."""
        self.num_regions += len(lengths)
        return WriteHandle(
            target_session=target_session, num_regions=len(lengths), num_bytes=sum(lengths)
        )

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """Every write is done."""

    def close(self) -> None:
        """Nothing to close."""


def _config(layers: int, experts: int) -> dict:
    return preset_config(
        "moe-small",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        tie_word_embeddings=False,
    )


def _targets(config: dict, tp: int) -> list[TargetRank]:
    targets = []
    addr = 1 << 32
    for rank in range(tp):
        parallelism = {"tp_size": tp, "tp_rank": rank, "ep_size": 1}
        info = {}
        for name, layout in rank_layout(config, parallelism, "bfloat16").items():
            info[name] = (addr, layout.numel, 2)
            addr += layout.numel * 2 + 4096
        targets.append(
            TargetRank(
                replica="r0",
                rank=rank,
                session_id=f"127.0.0.1:{1000 + rank}",
                parallelism=parallelism,
                weights_info=info,
            )
        )
    return targets


def main() -> None:
    """Run the benchmark and print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile one push")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = _config(args.layers, args.experts)
    shapes = hf_tensor_shapes(config)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    export = TensorsExport(tensors)
    transport = _NullTransport()
    base = {"bucket_bytes": 4 << 20, "num_slots": 2, "num_workers": 1, "pin_memory": False}
    sender = WeightSender(SenderConfig(**base), transport=transport)
    plain = WeightSender(SenderConfig(**base, digest=False), transport=transport)
    plan = build_plan(
        hf_config=config,
        targets=_targets(config, args.tp),
        sources=[sender.holding(export)],
        dtype="bfloat16",
    ).for_source(0)
    t0 = time.perf_counter()
    first = sender.push(sender.preflight(plan, export))  # lowers the program and allocates the ring
    first_s = time.perf_counter() - t0
    plain.push(plain.preflight(plan, export))
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        sender.push(sender.preflight(plan, export))
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    times, plain_times, stats = [], [], None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        stats = sender.push(sender.preflight(plan, export))
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain.push(plain.preflight(plan, export))
        plain_times.append(time.perf_counter() - t0)
    if not (stats is not None and stats.cached_program and not first.cached_program):
        raise SystemExit("the repeated pushes did not run the cached program")
    sender.close()
    plain.close()
    digest_us = (min(times) - min(plain_times)) / len(tensors) * 1e6
    n = len(tensors)
    best, med = min(times), statistics.median(times)
    rows = [
        ("HF tensors", f"{n}"),
        ("experts x layers", f"{args.experts} x {args.layers}"),
        ("targets (tp)", f"{args.tp}"),
        ("bytes staged", f"{stats.bytes_staged}"),
        ("buckets / chunks", f"{stats.num_buckets} / {stats.num_chunks}"),
        ("copies / writes", f"{stats.num_copies} / {stats.num_writes}"),
        ("push s (best / median)", f"{best:.4f} / {med:.4f}"),
        ("us per HF tensor (best)", f"{best / n * 1e6:.1f}"),
        ("us per HF tensor (median)", f"{med / n * 1e6:.1f}"),
        ("first push (lowers), us/tensor", f"{first_s / n * 1e6:.1f}"),
        ("without digests: push s (best)", f"{min(plain_times):.4f}"),
        ("digests, us per HF tensor (best)", f"{digest_us:.2f}"),
        ("digests, share of the push", f"{(min(times) - min(plain_times)) / best:.1%}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(
        json.dumps(
            {
                "bench": "sender_overhead",
                "hf_tensors": n,
                "experts": args.experts,
                "layers": args.layers,
                "tp": args.tp,
                "us_per_tensor_best": round(best / n * 1e6, 2),
                "us_per_tensor_median": round(med / n * 1e6, 2),
                "num_writes": stats.num_writes,
                "num_copies": stats.num_copies,
                "num_chunks": stats.num_chunks,
                "first_push_us_per_tensor": round(first_s / n * 1e6, 2),
                "no_digest_us_per_tensor_best": round(min(plain_times) / n * 1e6, 2),
                "digest_us_per_tensor": round(digest_us, 2),
                "digest_fraction_of_push": round((min(times) - min(plain_times)) / best, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
