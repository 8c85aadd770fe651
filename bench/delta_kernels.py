"""The device work of a delta sync against a same-device copy of the same bytes, in one run.

A delta sync reads the new weights and the sender's reference to find what changed
(`weightsync.sender.delta_reference`), lays the changes out (`weightsync.delta_codec`),
and the rollout rank checksums its parameters before, applies the payload in place, and
checks them after: by default derived from the checksums before and the elements written
(``check="changes"``), or by checksumming every parameter again (``check="full"``). This
times each of those on one device over ``--gb`` of bf16 weights (tensors of
``--tensor-mb``) whose elements changed at ``--density`` (a random subset, new bits
differing from the old), beside a copy of the same bytes on the same device (what a
full colocated sync's writes cost at best). Every apply is checked bit for bit.

Encoding is timed three ways in the same run, on the same changes: per tensor as
`DeltaReference.encode` does it (``encode``), with torch's ops only (``encode_torch``,
where the fused kernels run), and a bucket of ``--bucket-mb`` at a time in one fused pass
(``encode_bucket``: `weightsync.sender.delta.encode_bucket`, as `DeltaPush` runs on CUDA),
each checked equal to torch's bit for bit; on CUDA a few other bucket sizes and the second
pass without its bitmap are timed too (``encode_bucket_variants``).

Prints a table and one JSON line.

    python bench/delta_kernels.py --device cuda --gb 8.6        # one H200
    python bench/delta_kernels.py --gb 0.5                      # the host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median, print_table
from weightsync import delta_kernels
from weightsync.delta_codec import (
    Section,
    apply_and_check,
    apply_payload,
    as_bits,
    checksum_change,
    checksum_tensor,
    checksums,
    encode_payload,
)
from weightsync.sender.delta import encode_bucket
from weightsync.sender.delta_reference import DeltaReference


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, work) -> float:
    _sync(device)
    start = time.perf_counter()
    work()
    _sync(device)
    return time.perf_counter() - start


@contextlib.contextmanager
def _torch_ops() -> Iterator[None]:
    """Run the delta path with torch's ops instead of the fused kernels."""
    before = os.environ.get("WEIGHTSYNC_DELTA_KERNELS")
    os.environ["WEIGHTSYNC_DELTA_KERNELS"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["WEIGHTSYNC_DELTA_KERNELS"]
        else:
            os.environ["WEIGHTSYNC_DELTA_KERNELS"] = before


def _encode(reference: DeltaReference, weights: list[torch.Tensor]) -> list:
    """Every tensor's changes against the reference (which then holds it)."""
    return [reference.encode("bfloat16", str(i), w) for i, w in enumerate(weights)]


def _buckets(weights: list[torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, str, Any]]]:
    """The stream cut into buckets of about `bucket_bytes` (a tensor never split), as
    `DeltaPush` cuts it."""
    buckets: list[list[tuple[str, str, Any]]] = [[]]
    held = 0
    for index, weight in enumerate(weights):
        buckets[-1].append(("bfloat16", str(index), weight))
        held += weight.numel() * weight.element_size()
        if held >= bucket_bytes:
            buckets.append([])
            held = 0
    return [b for b in buckets if b]


def _encode_buckets(reference: DeltaReference, buckets: list) -> list:
    """Every bucket's changes against the reference (which then holds them), in order."""
    return [changes for bucket in buckets for changes in encode_bucket(reference, bucket)]


@contextlib.contextmanager
def _settings(settings: dict[str, Any]) -> Iterator[None]:
    """Run the fused bucket encode under other settings of `weightsync.delta_kernels`
    (``BUCKET_ROWS``, ``BUCKET_STEPS``, ``BUCKET_WARPS``, ``BUCKET_SECOND_PASS``,
    ``BUCKET_SLOTS``)."""
    before = {name: getattr(delta_kernels, name) for name in settings}
    for name, value in settings.items():
        setattr(delta_kernels, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(delta_kernels, name, value)


# Other bucket sizes (MiB, None: the whole stream) and kernel settings, timed beside the
# default where the fused kernels run.
_VARIANTS: dict[str, tuple[int | None, dict[str, Any]]] = {
    "256 MiB": (256, {}),
    "4096 MiB": (4096, {}),
    "whole stream": (None, {}),
    "second pass by the bitmap": (0, {"BUCKET_SECOND_PASS": "bitmap"}),
    "second pass comparing again": (0, {"BUCKET_SECOND_PASS": "full"}),
    "select 128 slots": (0, {"BUCKET_SLOTS": 128}),
    "select 512 slots": (0, {"BUCKET_SLOTS": 512}),
    "tile 128x32 x1": (0, {"BUCKET_ROWS": 128, "BUCKET_STEPS": 1}),
    "tile 64x32 x4": (0, {"BUCKET_ROWS": 64, "BUCKET_STEPS": 4}),
    "tile 64x32 x4, 8 warps": (0, {"BUCKET_ROWS": 64, "BUCKET_STEPS": 4, "BUCKET_WARPS": 8}),
    "tile 32x32 x16": (0, {"BUCKET_STEPS": 16}),
}


def _same(found: list, expected: list, what: str) -> None:
    for ours, theirs in zip(found, expected, strict=True):
        if not (
            torch.equal(ours.elements, theirs.elements)
            and torch.equal(ours.new, theirs.new)
            and torch.equal(ours.old, theirs.old)
        ):
            raise RuntimeError(f"{what} differs from torch's")


def _lay_out(found: list, numel: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """One rank's payload of `found` (one parameter per tensor), and its checksum changes."""
    sections = [
        Section(param_index=i, elements=c.elements, values=c.new) for i, c in enumerate(found)
    ]
    moves = torch.stack([checksum_change(c.elements, c.old, c.new, numel=numel) for c in found])
    return encode_payload(sections, device), moves.tolist()


def _names(count: int) -> list[str]:
    """Parameter names whose sorted order is their index (a payload numbers them so)."""
    return [f"p{i:06d}" for i in range(count)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the weights, change them, and time every step `args.repeats` times."""
    device = torch.device(args.device)
    numel = args.tensor_mb * (1 << 20) // 2
    count = max(1, round(args.gb * 1e9 / (numel * 2)))
    generator = torch.Generator(device=device).manual_seed(0)
    trainer_dtype = getattr(torch, args.trainer_dtype)
    # The trainer's tensors (bf16, or fp32 cast to bf16 on the way, as an fp32 export is).
    weights = [
        torch.randn(numel, generator=generator, device=device).to(trainer_dtype)
        for _ in range(count)
    ]
    params = [w.to(torch.bfloat16) for w in weights]  # the rollout rank's parameters
    # A second rank holding the same bytes, checked by the derived check.
    derived = {name: p.clone() for name, p in zip(_names(count), params, strict=True)}
    copies = [torch.empty_like(p) for p in params]
    reference = DeltaReference("device")
    # The same reference for torch's ops, where the fused kernels run: both in one run.
    kernels = delta_kernels.ready(device)
    plain = DeltaReference("device") if kernels else None
    # The fused bucket encode's reference, and a copy of it as each repeat found it, so that
    # every variant of the bucket encode finds the same changes.
    fused = DeltaReference("device") if kernels else None
    for index, param in enumerate(params):
        reference.record("bfloat16", str(index), param)
        if plain is not None:
            plain.record("bfloat16", str(index), param)
        if fused is not None:
            fused.record("bfloat16", str(index), param)
    fused_refs = [fused._refs[("bfloat16", str(i))] for i in range(count)] if fused else []
    before = [torch.empty_like(r) for r in fused_refs]
    bucket_bytes = args.bucket_mb << 20
    variants = {
        name: (
            bucket_bytes if mb == 0 else (1 << 62 if mb is None else mb << 20),
            settings,
        )
        for name, (mb, settings) in _VARIANTS.items()
        if mb != args.bucket_mb and args.variants
    }
    variant_times: dict[str, list[float]] = {name: [] for name in variants}
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "copy",
            "encode",
            "layout",
            "apply",
            "checksum",
            "begin",
            "changes",
            "encode_torch",
            "begin_torch",
            "encode_bucket",
        )
    }
    num_bytes = count * numel * 2
    changed = 0
    for _ in range(args.repeats):
        for weight in weights:
            mask = torch.rand(numel, generator=generator, device=device) < args.density
            bits = as_bits(weight)
            # The last mantissa bit of the bf16 value: a bf16 rounding step.
            bits[mask] = bits[mask] ^ (1 if weight.element_size() == 2 else 1 << 16)
        times["copy"].append(
            _timed(device, lambda: [c.copy_(p) for c, p in zip(copies, params, strict=True)])
        )
        found: list = []
        times["encode"].append(
            _timed(device, lambda f=found: f.extend(_encode(reference, weights)))
        )
        if plain is not None:
            with _torch_ops():
                torch_found: list = []
                times["encode_torch"].append(
                    _timed(device, lambda f=torch_found: f.extend(_encode(plain, weights)))
                )
                with_torch = {name: w for name, w in zip(_names(count), params, strict=True)}
                times["begin_torch"].append(_timed(device, lambda p=with_torch: checksums(p)))
            _same(found, torch_found, "the per-tensor encode")
        if fused is not None:
            for ref, kept in zip(fused_refs, before, strict=True):
                kept.copy_(ref)
            for name, (size, settings) in variants.items():
                for ref, kept in zip(fused_refs, before, strict=True):
                    ref.copy_(kept)
                buckets = _buckets(weights, size)
                with _settings(settings):
                    variant: list = []
                    variant_times[name].append(
                        _timed(
                            device, lambda f=variant, b=buckets: f.extend(_encode_buckets(fused, b))
                        )
                    )
                _same(variant, torch_found, f"the fused bucket encode ({name})")
                del variant
            for ref, kept in zip(fused_refs, before, strict=True):
                ref.copy_(kept)
            buckets = _buckets(weights, bucket_bytes)
            bucket_found: list = []
            times["encode_bucket"].append(
                _timed(
                    device, lambda f=bucket_found, b=buckets: f.extend(_encode_buckets(fused, b))
                )
            )
            _same(bucket_found, torch_found, "the fused bucket encode")
            for ref, theirs in zip(fused_refs, plain._refs.values(), strict=True):
                if not torch.equal(ref, theirs):
                    raise RuntimeError("the fused bucket encode left another reference")
            del bucket_found
        laid: list = []
        times["layout"].append(
            _timed(device, lambda f=found, o=laid: o.append(_lay_out(f, numel, device)))
        )
        payload, moves = laid[0]
        times["apply"].append(_timed(device, lambda p=payload: apply_payload(p, params)))
        times["checksum"].append(
            _timed(device, lambda: torch.stack([checksum_tensor(p) for p in params]).cpu())
        )
        base: dict[str, int] = {}
        times["begin"].append(_timed(device, lambda b=base: b.update(checksums(derived))))
        expected = {
            name: (base[name] + move + (1 << 63)) % (1 << 64) - (1 << 63)
            for name, move in zip(derived, moves, strict=True)
        }
        checked: list = []
        times["changes"].append(
            _timed(
                device,
                lambda p=payload, e=expected, b=base, c=checked: c.append(
                    apply_and_check([p], derived, e, base=b)
                ),
            )
        )
        if checked[0].check != "changes" or checked[0].mismatched or checked[0].recomputed:
            raise RuntimeError(f"the derived check did not verify: {checked[0]}")
        changed = sum(c.elements.numel() for c in found)
        for param, other, weight in zip(params, derived.values(), weights, strict=True):
            if not (
                torch.equal(as_bits(param), as_bits(weight.to(torch.bfloat16)))
                and torch.equal(as_bits(other), as_bits(param))
            ):
                raise RuntimeError("an applied delta differs from the new weights")
    medians = {k: median(v) for k, v in times.items() if v}
    return {
        "bench": "delta_kernels",
        "trainer_dtype": args.trainer_dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bytes": num_bytes,
        "density": changed / (count * numel),
        "payload_bytes": int(payload.numel()),
        "seconds": medians,
        "copy_gbps": num_bytes / medians["copy"] / 1e9,
        # Encoding reads the new bytes and the reference: twice the bytes a copy reads.
        "encode_read_gbps": 2 * num_bytes / medians["encode"] / 1e9,
        "encode_of_copy_rate": (2 * num_bytes / medians["encode"]) / (num_bytes / medians["copy"]),
        "apply_of_copy": medians["apply"] / medians["copy"],
        "checksum_gbps": num_bytes / medians["checksum"] / 1e9,
        "begin_gbps": num_bytes / medians["begin"] / 1e9,
        # After applying: the full check (apply + checksum every parameter) against the
        # derived one (apply_and_check, check="changes").
        "full_check_s": medians["apply"] + medians["checksum"],
        "changes_check_s": medians["changes"],
        "fused_kernels": kernels,
        # Where the fused kernels ran: torch's ops on the same work, in the same run.
        "encode_torch_read_gbps": (
            2 * num_bytes / medians["encode_torch"] / 1e9 if "encode_torch" in medians else None
        ),
        "begin_torch_gbps": (
            num_bytes / medians["begin_torch"] / 1e9 if "begin_torch" in medians else None
        ),
        "encode_torch_of_copy_rate": (
            (2 * num_bytes / medians["encode_torch"]) / (num_bytes / medians["copy"])
            if "encode_torch" in medians
            else None
        ),
        "bucket_mb": args.bucket_mb,
        "tensor_mb": args.tensor_mb,
        "encode_bucket_read_gbps": (
            2 * num_bytes / medians["encode_bucket"] / 1e9 if "encode_bucket" in medians else None
        ),
        "encode_bucket_of_copy_rate": (
            (2 * num_bytes / medians["encode_bucket"]) / (num_bytes / medians["copy"])
            if "encode_bucket" in medians
            else None
        ),
        "encode_bucket_variants_s": {name: median(v) for name, v in variant_times.items() if v},
        "bit_exact": True,
    }


def main(argv: list[str] | None = None) -> int:
    """Run and print; exit 0 when every apply was bit-exact."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--gb", type=float, default=0.5)
    p.add_argument("--tensor-mb", type=int, default=128)
    p.add_argument("--density", type=float, default=0.02)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-variants",
        dest="variants",
        action="store_false",
        help="time the fused bucket encode under its default settings only",
    )
    p.add_argument(
        "--bucket-mb", type=int, default=1024, help="bytes of a fused bucket encode, in MiB"
    )
    p.add_argument(
        "--trainer-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the trainer's tensors (float32: cast to the bf16 rollout while encoding)",
    )
    args = p.parse_args(argv)
    result = run(args)
    seconds = result["seconds"]
    rows = [
        ["same-device copy", f"{seconds['copy'] * 1e3:.2f}", f"{result['copy_gbps']:.0f} GB/s"],
        [
            "encode (read new + reference)",
            f"{seconds['encode'] * 1e3:.2f}",
            f"{result['encode_read_gbps']:.0f} GB/s read, "
            f"{result['encode_of_copy_rate']:.0%} of the copy's rate",
        ],
        ["lay out + checksum change", f"{seconds['layout'] * 1e3:.2f}", ""],
        [
            "apply on the rank",
            f"{seconds['apply'] * 1e3:.2f}",
            f"{result['apply_of_copy']:.0%} of the copy",
        ],
        [
            "checksum every parameter",
            f"{seconds['checksum'] * 1e3:.2f}",
            f"{result['checksum_gbps']:.0f} GB/s",
        ],
        [
            "begin: checksums (every byte)",
            f"{seconds['begin'] * 1e3:.2f}",
            f"{result['begin_gbps']:.0f} GB/s",
        ],
        *(
            [
                [
                    "encode, torch's ops",
                    f"{seconds['encode_torch'] * 1e3:.2f}",
                    f"{result['encode_torch_read_gbps']:.0f} GB/s read, "
                    f"{result['encode_torch_of_copy_rate']:.0%} of the copy's rate",
                ],
                [
                    f"encode, fused bucket ({result['bucket_mb']} MiB)",
                    f"{seconds['encode_bucket'] * 1e3:.2f}",
                    f"{result['encode_bucket_read_gbps']:.0f} GB/s read, "
                    f"{result['encode_bucket_of_copy_rate']:.0%} of the copy's rate",
                ],
                *(
                    [f"  bucket: {name}", f"{value * 1e3:.2f}", ""]
                    for name, value in result["encode_bucket_variants_s"].items()
                ),
                [
                    "begin checksums, torch's ops",
                    f"{seconds['begin_torch'] * 1e3:.2f}",
                    f"{result['begin_torch_gbps']:.0f} GB/s",
                ],
            ]
            if result["fused_kernels"]
            else []
        ),
        [
            "apply + check, full",
            f"{result['full_check_s'] * 1e3:.2f}",
            "apply, then checksum every parameter",
        ],
        [
            "apply + check, changes",
            f"{result['changes_check_s'] * 1e3:.2f}",
            "derived from the begin's (in the scatter where the kernels run)",
        ],
    ]
    print_table(
        f"{result['device']}: {result['bytes'] / 1e9:.2f} GB bf16 "
        f"(from {result['trainer_dtype']}), "
        f"density {result['density']:.2%}, payload {result['payload_bytes'] / 1e6:.1f} MB",
        ["step", "ms", "rate"],
        rows,
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
