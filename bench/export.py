"""Syncing from a sharded trainer's own shards against gathering first, in one run (CPU).

Two trainer ranks (gloo) take one optimizer step, then sync into the same running replica:

- ``sharded``: each rank's own slices (`FSDPExport`: an FSDP2 rank's ``to_local()`` rows;
  `MegatronExport`: a Megatron-core TP rank's slices) and a sync;
- ``gather``: every full tensor on every rank first (FSDP2: ``full_tensor()`` of every
  parameter; Megatron: Megatron-Bridge's export, which gathers over TP), what a trainer
  without sharded sources does, then a sync of the full tensors (`ModelExport`, the plan
  spreading the writes over both ranks).

Each way syncs ``--repeats`` times after one untimed warm-up (so both run a cached plan);
times are rank 0's medians, gather included. Every sync is verified by the replica's digests.
Prints a table and one JSON line with the ratio.

    .venv/bin/python bench/export.py [--trainer fsdp|megatron] [--preset small] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import model_bytes, print_table, write_config
from weightsync.testing.launcher import serve_replicas
from weightsync.testing.presets import PRESET_NAMES, preset_config


def _fsdp_source(rank: int, config: dict) -> tuple[Any, Any]:
    """An FSDP2 model after one step: its `FSDPExport`, and the gather of its full tensors."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import weightsync as ws
    from weightsync.export.fsdp import FSDPExport
    from weightsync.testing.presets import random_model

    mesh = init_device_mesh("cpu", (2,))
    model = random_model(config, seed=0).train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config["vocab_size"], (1, 16), generator=generator)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

    def gathered() -> Any:
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        return ws.ModelExport(full, hf_config=config)

    return FSDPExport(model), gathered


def _megatron_source(rank: int, config: dict, tp: int) -> tuple[Any, Any]:
    """A Megatron-core model at TP2 after one step: its `MegatronExport`, and Megatron-Bridge's
    export of the full tensors to every rank."""
    import weightsync as ws
    from weightsync.testing.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(config, tp=tp)
    trainer.train(1)

    def gathered() -> Any:
        return ws.ModelExport(trainer.bridge_state(), hf_config=config)

    return trainer.export(), gathered


def _rank(
    rank: int, port: int, trainer: str, config: dict, url: str, repeats: int, results: Any
) -> None:
    import torch
    import torch.distributed as dist

    import weightsync as ws

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if trainer == "fsdp":
            sharded, gathered = _fsdp_source(rank, config)
        else:
            sharded, gathered = _megatron_source(rank, config, tp=2)
        sync_config = ws.SyncConfig(transport=ws.MooncakeConfig(protocol="tcp", timeout_s=120))
        times: dict[str, list[float]] = {"sharded": [], "gather": []}
        reports: dict[str, Any] = {}
        with ws.TrainerSync(
            sync_config, hf_config=config, group=dist.group.WORLD, replicas=[url], dtype="float32"
        ) as sync:
            for method in ("sharded", "gather"):
                for attempt in range(repeats + 1):
                    dist.barrier()
                    start = time.perf_counter()
                    export = sharded if method == "sharded" else gathered()
                    report = sync.sync(export)
                    if attempt:
                        times[method].append(time.perf_counter() - start)
                    reports[method] = report
        if rank == 0:
            results.put(
                {
                    method: {
                        "seconds": statistics.median(times[method]),
                        "bytes_written": reports[method].bytes_written,
                        "per_source": {
                            r: (s.bytes_written, s.num_writes)
                            for r, s in reports[method].push.per_source.items()
                        },
                        "verified": bool(reports[method].verified),
                    }
                    for method in times
                }
            )
    finally:
        dist.destroy_process_group()


def _wait_result(results: Any, ranks: list[Any]) -> dict:
    """Rank 0's result, or an error as soon as a rank died without one."""
    while True:
        try:
            return results.get(timeout=2.0)
        except queue.Empty:
            dead = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a trainer rank exited with code {dead[0]}") from None


def main() -> None:
    """Run the benchmark; print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="small", choices=PRESET_NAMES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rollout-tp", type=int, default=2)
    parser.add_argument(
        "--trainer",
        default="fsdp",
        choices=("fsdp", "megatron"),
        help="FSDP2 over 2 ranks, or Megatron-core at TP2 (gathered by Megatron-Bridge)",
    )
    args = parser.parse_args()
    config = preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = write_config(config, Path(tmp) / "model")
        with serve_replicas(
            model_path,
            tp=args.rollout_tp,
            dtype="fp32",
            log_dir=Path(tmp),
            extra_args=["--load-format", "dummy"],
        ) as replicas:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            context = multiprocessing.get_context("spawn")
            results = context.Queue()
            ranks = [
                context.Process(
                    target=_rank,
                    args=(r, port, args.trainer, config, replicas[0].url, args.repeats, results),
                )
                for r in range(2)
            ]
            for process in ranks:
                process.start()
            result = _wait_result(results, ranks)
            for process in ranks:
                process.join(timeout=120)
    sharded, gather = result["sharded"], result["gather"]
    mib = model_bytes(config, "float32") / 2**20
    rows = [
        [
            method,
            f"{entry['seconds']:.3f}",
            f"{entry['bytes_written'] / 2**20:.1f}",
            " / ".join(f"{b / 2**20:.1f} MiB, {w} writes" for b, w in entry["per_source"].values()),
            "yes" if entry["verified"] else "no",
        ]
        for method, entry in (("sharded (own shards)", sharded), ("gather, then sync", gather))
    ]
    trainer = "FSDP2, 2 ranks" if args.trainer == "fsdp" else "Megatron-core TP2"
    title = f"{trainer}, {args.preset} ({mib:.0f} MiB fp32), 1 replica at tp {args.rollout_tp}"
    print_table(title, ["source", "s (median)", "MiB written", "per rank", "verified"], rows)
    ratio = gather["seconds"] / sharded["seconds"]
    print(f"gather-then-sync / sharded: {ratio:.2f}x")
    print(
        json.dumps(
            {
                "bench": "export",
                "trainer": args.trainer,
                "preset": args.preset,
                "model_mib": round(mib, 1),
                "rollout_tp": args.rollout_tp,
                "repeats": args.repeats,
                "sharded_s": sharded["seconds"],
                "gather_s": gather["seconds"],
                "gather_over_sharded": ratio,
            }
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
