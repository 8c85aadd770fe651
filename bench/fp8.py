"""The sender's block-FP8 quantisation of a DeepSeek-V3-shaped layer stack, and an FP8 sync.

    python bench/fp8.py --device cuda --layers 3          # on a GPU: 1 dense + 2 MoE layers
    python bench/fp8.py --device cpu --preset tiny-deepseek --layers 2   # CPU smoke test

The trainer's bf16 weights lie on `--device` as a transformers model holds them (each MoE
layer's experts fused, the export yielding per-expert views). Measured, in this order:

1. `Fp8Export` quantising every linear weight of the stack (what a push does first): bytes
   read and written (bf16 in, e4m3 codes and float32 scales out) over the time, against a
   same-device copy of as many bytes measured in the same run (a copy reads and writes each
   byte once: the device's attainable bandwidth), and against 4.8 TB/s (the H200's HBM3e);
2. an FP8 sync of the whole model: `build_plan` for one tp1 FP8 rollout rank whose
   parameters lie on the same device, and `WeightSender.push` through a transport that
   copies each write on the device (this process holds both sides: the copy stands in for
   the wire, which this bench does not measure). Every written byte is then compared with
   an independent vectorised quantiser (DeepGEMM's per-block cast, written out here) of the
   same bf16 weights: codes and scales bit-equal, bf16 parameters bit-equal.

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from weightsync.export import Fp8Export, TensorsExport
from weightsync.export.quantize import _triton_kernel
from weightsync.layout import hf_tensor_shapes, rank_layout
from weightsync.layout.quant import fp8_quantization_config, is_quantized_hf_name
from weightsync.plan import TargetRank, build_plan
from weightsync.sender import SenderConfig, WeightSender
from weightsync.testing.presets import preset_config
from weightsync.torch_dtypes import torch_dtype
from weightsync.transport.base import TransportCapabilities, WriteCost, WriteHandle

HBM_PEAK = 4.8e12
BLOCK = 128


def _config(preset: str, layers: int, experts: int | None) -> dict[str, Any]:
    if preset == "deepseek-v3":
        # transformers' DeepseekV3Config defaults are DeepSeek-V3's sizes.
        config: dict[str, Any] = {"model_type": "deepseek_v3", "first_k_dense_replace": 1}
    else:
        config = preset_config(preset)
    config.update(
        num_hidden_layers=layers,
        dtype="bfloat16",
        first_k_dense_replace=min(1, layers - 1),
        tie_word_embeddings=False,
    )
    if experts is not None:
        config["n_routed_experts"] = experts
    return config


def _trainer_tensors(config: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded bf16 weights, experts as views of fused [E, 2I, H] / [E, H, I] tensors."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = hf_tensor_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    fused: dict[str, torch.Tensor] = {}

    def randn(shape: Sequence[int]) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return out.normal_(0.0, 0.02, generator=gen)

    for name, shape in shapes.items():
        if ".mlp.experts." not in name:
            tensors[name] = randn(shape)
            continue
        prefix, rest = name.split(".mlp.experts.")
        expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
        num = config.get("n_routed_experts", 256)
        if proj in ("gate_proj", "up_proj"):
            key = prefix + ".gate_up"
            if key not in fused:
                fused[key] = randn((num, 2 * shape[0], shape[1]))
            half = shape[0]
            part = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
            tensors[name] = fused[key][expert, part]
        else:
            key = prefix + ".down"
            if key not in fused:
                fused[key] = randn((num, *shape))
            tensors[name] = fused[key][expert]
    return tensors


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's ``per_block_cast_to_fp8(use_ue8m0=False)``, written out independently."""
    rows, cols = x.shape
    padded = torch.zeros(
        (-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK), dtype=x.dtype, device=x.device
    )
    padded[:rows, :cols] = x
    view = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    # Correctly rounded (a tensor divisor: CUDA torch multiplies by 1/448 for a number).
    scale = amax / torch.full_like(amax, 448.0)
    codes = (view * (1.0 / scale)).to(torch.float8_e4m3fn)
    return codes.view_as(padded)[:rows, :cols].contiguous(), scale.view(
        padded.shape[0] // BLOCK, padded.shape[1] // BLOCK
    )


class _Pointer:
    """A device buffer at a raw address, as torch sees one (``__cuda_array_interface__``)."""

    def __init__(self, addr: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }


def _bytes_at(addr: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    """`num_bytes` at `addr` as a uint8 tensor: device memory, else host memory (a ring the
    sender placed on the host)."""
    if device.type == "cuda":
        try:
            return torch.as_tensor(_Pointer(addr, num_bytes), device=device)
        except RuntimeError:
            pass
    array = np.ctypeslib.as_array((ctypes.c_ubyte * num_bytes).from_address(addr))
    return torch.from_numpy(array)


class _DeviceCopyTransport:
    """Writes by copying on the device inside this process: the bench's stand-in for the
    wire, so that the push's plan, staging, fills and write regions run as in a sync."""

    session_id = "127.0.0.1:1"
    # A copy launch per region, at the device's copy rate.
    write_cost = WriteCost(write_s=5e-6, bytes_per_s=1e12)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The ring may live on the bench's GPU.
        on_gpu = device.type == "cuda"
        self.capabilities = TransportCapabilities(
            reads_cuda=on_gpu, device=device.index if on_gpu else None
        )

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
        """Copy each region now (on the current stream)."""
        for src, dst, length in zip(src_addrs, dst_addrs, lengths, strict=True):
            _bytes_at(dst, length, self.device).copy_(_bytes_at(src, length, self.device))
        return WriteHandle(
            target_session=target_session, num_regions=len(lengths), num_bytes=sum(lengths)
        )

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        """The copies are done once the device is."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Nothing to close."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_time(num_bytes: int, device: torch.device, repeats: int) -> float:
    """Seconds of one copy of `num_bytes` on `device` (reads and writes each byte once)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _timed(lambda: dst.copy_(src), device, repeats)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    base = _config(args.preset, args.layers, args.experts)
    fp8 = {**base, "quantization_config": fp8_quantization_config(BLOCK)}
    tensors = _trainer_tensors(base, device)
    export = Fp8Export(TensorsExport(tensors), block=BLOCK)
    export.geometry()

    quantised = [t for n, t in tensors.items() if is_quantized_hf_name(n)]
    numel = sum(t.numel() for t in quantised)
    num_blocks = sum(
        math.ceil(t.shape[0] / BLOCK) * math.ceil(t.shape[1] / BLOCK) for t in quantised
    )
    quant_bytes = numel * 2 + numel + num_blocks * 4

    def quantise() -> None:
        export.begin_push()
        for _ in export:
            pass

    quant_s = _timed(quantise, device, args.repeats)
    copy_elems = min(quant_bytes // 2, args.max_copy_bytes)
    copy_s = _copy_time(copy_elems, device, args.repeats)
    copy_bytes = 2 * copy_elems
    quant_bps, copy_bps = quant_bytes / quant_s, copy_bytes / copy_s
    kernel = "triton" if device.type == "cuda" and _triton_kernel() is not None else "torch"
    quantisation = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset,
        "layers": args.layers,
        "kernel": kernel,
        "quantised_elements": numel,
        "quant_bytes": quant_bytes,
        "quant_s": quant_s,
        "quant_gbps": quant_bps / 1e9,
        "copy_bytes": copy_bytes,
        "copy_s": copy_s,
        "copy_gbps": copy_bps / 1e9,
        "quant_vs_copy": quant_bps / copy_bps,
        "quant_vs_hbm_peak": quant_bps / HBM_PEAK,
    }
    # Shown before the sync, which allocates the rollout's memory.
    _print_quantisation(quantisation)

    # The FP8 sync into a tp1 rank on the same device.
    layout = rank_layout(fp8, {"tp_size": 1, "tp_rank": 0})
    offsets, end = {}, 0
    for name, param in layout.items():
        offsets[name] = end
        end = -(-(end + param.num_bytes) // 256) * 256
    rollout = torch.zeros(end, dtype=torch.uint8, device=device)
    base_addr = rollout.data_ptr()
    target = TargetRank(
        replica="bench",
        rank=0,
        session_id="127.0.0.1:1",
        parallelism={"tp_size": 1, "tp_rank": 0},
        weights_info={
            n: (base_addr + offsets[n], p.numel, p.element_size) for n, p in layout.items()
        },
    )
    transport = _DeviceCopyTransport(device)
    sender = WeightSender(
        SenderConfig(bucket_bytes=args.bucket_mib << 20, num_workers=1, pin_memory=False),
        transport=transport,
    )
    plan = build_plan(
        hf_config=fp8, targets=[target], sources=[sender.holding(export)], dtype="bfloat16"
    )
    t0 = time.perf_counter()
    stats = sender.push(sender.preflight(plan.for_source(0), export))
    _sync(device)
    push_s = time.perf_counter() - t0

    mismatched = []
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, param in layout.items():
        start = offsets[name]
        got = rollout[start : start + param.num_bytes]
        for seg in param.segments:
            lo, hi = (
                seg.dst_offset * param.element_size,
                (seg.dst_offset + seg.numel) * param.element_size,
            )
            if seg.hf_name is None:
                ok = bool((got[lo:hi] == 0).all())
            else:
                hf_name = seg.hf_name
                if hf_name.endswith("_scale_inv") or is_quantized_hf_name(hf_name):
                    weight = hf_name.removesuffix("_scale_inv")
                    if weight not in cache:
                        cache.clear()
                        cache[weight] = reference_quantize(tensors[weight])
                    source = cache[weight][1 if hf_name.endswith("_scale_inv") else 0]
                else:
                    source = tensors[hf_name].to(torch_dtype(param.dtype))
                box = source[tuple(slice(a, b) for a, b in seg.src_box)].contiguous()
                ok = torch.equal(got[lo:hi], box.view(torch.uint8).reshape(-1))
            if not ok:
                mismatched.append(name)
                break
    return {
        **quantisation,
        "sync_bytes_written": stats.bytes_written,
        "sync_s": push_s,
        "sync_params": len(layout),
        "sync_mismatched": mismatched,
        "sync_bit_exact": not mismatched,
    }


def _print_quantisation(result: dict[str, Any]) -> None:
    print(
        f"\nFP8 quantisation of {result['layers']} {result['preset']} layers on "
        f"{result['device']} ({result['kernel']})"
    )
    rows = [
        ("quantise (Fp8Export)", result["quant_bytes"], result["quant_s"], result["quant_gbps"]),
        ("same-device copy", result["copy_bytes"], result["copy_s"], result["copy_gbps"]),
    ]
    print(f"{'what':>22} {'GB moved':>10} {'ms':>9} {'GB/s':>9}")
    for what, num_bytes, seconds, gbps in rows:
        print(f"{what:>22} {num_bytes / 1e9:10.2f} {seconds * 1e3:9.2f} {gbps:9.1f}")
    print(
        f"quantise / copy: {result['quant_vs_copy']:.1%}; of 4.8 TB/s: "
        f"{result['quant_vs_hbm_peak']:.1%}",
        flush=True,
    )


def main() -> None:
    """Parse the arguments, run, print the table and the JSON line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="deepseek-v3", help="deepseek-v3 or tiny-deepseek")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers (the first dense)")
    parser.add_argument("--experts", type=int, default=None, help="override n_routed_experts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--max-copy-bytes", type=int, default=8 << 30)
    args = parser.parse_args()
    result = run(args)
    print(
        f"FP8 sync: {result['sync_bytes_written'] / 1e9:.2f} GB into {result['sync_params']} "
        f"parameters in {result['sync_s']:.2f} s; bit-exact vs the reference quantiser: "
        f"{result['sync_bit_exact']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
