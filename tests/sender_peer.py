"""Peer processes for the sender tests: rollout-like receivers and trainer-like senders.

``receive``: for each group (a model config, tp and ep size) allocate every rank's parameters
from `rank_layout`, register them with one `MooncakeTransport` per rank (or, with
``--cuda-device``, on that GPU with one `CudaIpcTransport` per rank) and print one JSON
line ``{"targets": [...]}`` (the readiness signal). Then answer JSON commands on stdin, one
reply line each: ``fill`` (every parameter set to a value), ``check`` (compare with
`shard_state_dict` of a seeded random model, its linear weights quantised by the reference
block-FP8 quantiser when the group's config is block FP8; list what differs), ``unchanged``
(list what is no longer the fill value), ``digests`` (every rank's parameter digests), ``quit``.

``send``: one trainer rank (of a gloo group when ``--world-size > 1``) exports its pipeline
stage of a seeded random model, builds the plan for the given targets and pushes; prints its
`PushStats` (and, with ``--measure-memory``, the growth of its peak RSS during each push).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from fp8_reference import reference_quantize
from weightsync.export import ModelExport
from weightsync.layout import ParallelismConfig, rank_layout
from weightsync.layout.quant import is_quantized_hf_name
from weightsync.plan import TargetRank, build_plan
from weightsync.receiver.digest import ParameterDigests
from weightsync.receiver.loader import shard_state_dict
from weightsync.sender import SenderConfig, WeightSender
from weightsync.testing.presets import random_model
from weightsync.transport import CudaIpcConfig, CudaIpcTransport, MooncakeConfig, MooncakeTransport


def _reply(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _receive(groups: list[dict[str, Any]], dtype: str, cuda_device: int | None) -> None:
    ranks = []  # (group, parallelism, transport, params)
    device = torch.device("cpu") if cuda_device is None else torch.device("cuda", cuda_device)
    for group in groups:
        for tp_rank in range(group["tp"]):
            parallelism = ParallelismConfig(
                tp_size=group["tp"], tp_rank=tp_rank, ep_size=group.get("ep", 1)
            )
            transport = (
                MooncakeTransport(MooncakeConfig(timeout_s=5.0))
                if cuda_device is None
                else CudaIpcTransport(CudaIpcConfig(device=cuda_device))
            )
            params = {
                name: torch.empty(layout.shape, dtype=getattr(torch, layout.dtype), device=device)
                for name, layout in rank_layout(group["model"], parallelism, dtype).items()
            }
            for tensor in params.values():
                transport.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
            ranks.append((group, parallelism, transport, params))
    _reply(
        {
            "targets": [
                {
                    "group": group["name"],
                    "replica": group["name"],
                    "rank": parallelism.tp_rank,
                    "session_id": transport.session_id,
                    "parallelism": parallelism.to_dict(),
                    "weights_info": {
                        name: [t.data_ptr(), t.numel(), t.element_size()]
                        for name, t in params.items()
                    },
                }
                for group, parallelism, transport, params in ranks
            ]
        }
    )
    for line in sys.stdin:
        command = json.loads(line)
        selected = [r for r in ranks if r[0]["name"] == command.get("group")]
        if command["cmd"] == "quit":
            break
        if command["cmd"] == "fill":
            for *_, params in selected:
                for tensor in params.values():
                    # torch cannot fill FP8 tensors: fill their bytes.
                    if tensor.element_size() == 1:
                        tensor.view(torch.uint8).fill_(int(command["value"]))
                    else:
                        tensor.fill_(command["value"])
            _reply({"ok": True})
        elif command["cmd"] == "unchanged":
            changed = [
                f"rank {parallelism.tp_rank} {name}"
                for _, parallelism, _, params in selected
                for name, tensor in params.items()
                if not bool((tensor == command["value"]).all())
            ]
            _reply({"changed": changed})
        elif command["cmd"] == "digests":
            _reply(
                {
                    transport.session_id: ParameterDigests(params).compute()
                    for _, _, transport, params in selected
                }
            )
        elif command["cmd"] == "check":
            model = random_model(selected[0][0]["model"], seed=command["seed"])
            hf_state = dict(ModelExport(model))
            block = (selected[0][0]["model"].get("quantization_config") or {}).get(
                "weight_block_size"
            )
            if block:
                hf_state = _reference_fp8(hf_state, block[0])
            mismatched = []
            for _, parallelism, _, params in selected:
                expected = shard_state_dict(hf_state, selected[0][0]["model"], parallelism, dtype)
                mismatched += [
                    f"rank {parallelism.tp_rank} {name}"
                    for name, tensor in params.items()
                    if not torch.equal(
                        tensor.cpu().view(torch.uint8), expected[name].view(torch.uint8)
                    )
                ]
            del model, hf_state
            _reply({"mismatched": mismatched, "num_params": sum(len(r[3]) for r in selected)})
    for *_, transport, _ in ranks:
        transport.close()


def _reference_fp8(hf_state: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in hf_state.items():
        if is_quantized_hf_name(name):
            out[name], out[name + "_scale_inv"] = reference_quantize(tensor, block)
        else:
            out[name] = tensor
    return out


def _memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _send(args: argparse.Namespace) -> None:
    group = None
    if args.world_size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
        group = dist.group.WORLD
    spec = json.loads(Path(args.targets).read_text())
    model_config = spec["model"]
    targets = [TargetRank(**t) for t in spec["targets"]]
    model = random_model(model_config, seed=args.seed)
    export = ModelExport(model, pp_rank=args.rank % args.pp, pp_size=args.pp)
    transport = MooncakeTransport(MooncakeConfig(timeout_s=5.0))
    sender = WeightSender(
        SenderConfig(bucket_bytes=args.bucket_bytes, num_workers=args.num_workers),
        transport=transport,
        group=group,
    )
    holdings = sender.gather_holdings(export)
    plan = build_plan(hf_config=model_config, targets=targets, sources=holdings, dtype=args.dtype)
    results = []
    for _ in range(args.repeats):
        gc.collect()
        if args.measure_memory:
            # Writing 5 resets the peak RSS (VmHWM) to the current RSS.
            Path("/proc/self/clear_refs").write_text("5")
        rss_before = _memory_kib("VmRSS")
        stats = sender.push(sender.preflight(plan.for_source(sender.rank), export))
        peak_growth = (_memory_kib("VmHWM") - rss_before) * 1024
        results.append(
            {
                **dataclasses.asdict(stats),
                "peak_rss_growth_bytes": peak_growth,
                "staging_bytes": sender.staging_bytes,
            }
        )
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    _reply({"rank": sender.rank, "pushes": results, "model_bytes": model_bytes})
    sender.close()
    transport.close()
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


def main() -> None:
    """Run a receiver or a sender, as the arguments say."""
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    receive = sub.add_parser("receive")
    receive.add_argument("--groups", required=True, help="JSON list of {name, model, tp, ep}")
    receive.add_argument("--dtype", default="bfloat16")
    receive.add_argument(
        "--cuda-device", type=int, default=None, help="GPU parameters over CUDA IPC"
    )
    send = sub.add_parser("send")
    send.add_argument("--targets", required=True, help="JSON file: {model, targets}")
    send.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "0")))
    send.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    send.add_argument("--pp", type=int, default=1)
    send.add_argument("--seed", type=int, default=0)
    send.add_argument("--dtype", default="bfloat16")
    send.add_argument("--bucket-bytes", type=int, default=64 << 20)
    send.add_argument("--num-workers", type=int, default=1)
    send.add_argument("--repeats", type=int, default=1)
    send.add_argument("--measure-memory", action="store_true")
    args = parser.parse_args()
    if args.mode == "receive":
        _receive(json.loads(args.groups), args.dtype, args.cuda_device)
    else:
        _send(args)


if __name__ == "__main__":
    main()
