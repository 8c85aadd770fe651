"""How sparse one RL step is: the fraction of the rollout's bytes an optimizer step changes.

The trainer holds float32 master weights and steps them with `torch.optim.AdamW`; the
rollout holds them cast to bf16, or, for an FP8 rollout, block-quantised as
`weightsync.export.Fp8Export` quantises the trainer's tensors (`quantize_block_fp8`: e4m3
codes and float32 ``weight_scale_inv`` per 128 x 128 block of every linear weight; the other
tensors in bf16). For every learning rate of ``--lrs``, from the same initial weights and
with a fresh optimizer, each of ``--steps`` steps is measured against the step before:

* bf16: the fraction of elements whose bf16 bits changed;
* FP8: the fraction of e4m3 codes that changed, and of float32 scales that changed;
* delta / full: the bytes of a sparse delta at "16-bit offset + value per changed element"
  over the bytes of the whole rollout checkpoint (bf16: 4 B per changed element against 2 B
  per element, so twice the density; FP8: 3 B per changed code, 6 B per changed scale, 4 B
  per changed bf16 element of the tensors left in bf16). ``codec`` columns of the JSON line
  are the same ratio in `weightsync.delta_codec`'s payload format, tables and alignment
  included (`payload_size`, one sparse section per changed tensor, one rank).

Two kinds of model:

* a causal LM of the demo (``--lm-preset``, a `weightsync.testing.presets.random_model`:
  transformers' init, normal std 0.02 with the norms at 1 + N(0, 0.1)), trained for real as
  the demo's trainer trains it: a forward and backward pass on a random token batch per step
  (the same batches for every learning rate), gradients clipped to a norm of ``--clip``;
* a bench preset (``--preset``, cut to ``--layers``; the large ones cannot run forward on
  a CPU, so none is built): a random state dict of the checkpoint's tensors initialised as
  transformers would (normal std ``--init-std``, norms 1), and synthetic gradients:
  Gaussian noise drawn afresh each step and scaled to a global norm of ``--grad-norm``
  (what a trainer clipping at 1.0 feeds AdamW). Adam divides each gradient by its running
  RMS, so the scale matters only against its eps; the noise being uncorrelated across
  steps is what differs from a real loss.

Prints a table and, last, one JSON line ``{"bench": "density", "rows": [...], ...}``.

    python bench/density.py                          # demo "small" LM + dense-256m cut to 4 layers
    python bench/density.py --quick                  # smoke run: "tiny" both ways, 2 steps
    python bench/density.py --lm-preset none --preset moe-small --layers 2 --lrs 1e-6
    python bench/density.py --weight-decay 0.01
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, print_table
from weightsync.delta_codec import Section, as_bits, payload_size
from weightsync.export import ModelExport
from weightsync.export.quantize import quantize_block_fp8
from weightsync.layout import hf_tensor_shapes
from weightsync.layout.quant import DEFAULT_BLOCK_SIZE, is_quantized_hf_name
from weightsync.testing.presets import DEMO_PRESETS, PRESET_NAMES, preset_config, random_model

DEFAULT_LRS = (1e-6, 3e-6, 1e-5)
# Bytes a sparse delta spends on one changed element: its 16-bit offset, then its value.
OFFSET_BYTES = 2


# ---------------------------------------------------------------- workloads


@dataclass(slots=True, kw_only=True)
class Workload:
    """A model the bench steps: its float32 master tensors by HF name, how to reset them to
    the initial weights, and how one step's gradients are made."""

    label: str
    grads: str
    init: str
    tensors: dict[str, torch.Tensor]
    params: list[torch.nn.Parameter]
    initial: list[torch.Tensor]
    model: Any = None
    grad_norm: float = 1.0
    clip: float = 1.0
    batch: tuple[int, int] = (4, 64)
    info: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        """Put the initial weights back and drop the gradients."""
        with torch.no_grad():
            for param, value in zip(self.params, self.initial, strict=True):
                param.copy_(value)
                param.grad = None

    def backward(self, step: int) -> float | None:
        """Fill every parameter's gradient for step `step` (the same for every learning
        rate); the loss, or None for synthetic gradients."""
        gen = torch.Generator().manual_seed(1000 + step)
        if self.model is None:
            self._noise(gen)
            return None
        vocab = self.model.config.vocab_size
        tokens = torch.randint(0, vocab, self.batch, generator=gen)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        for param in self.params:
            param.grad = None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        return float(loss.detach())

    def _noise(self, gen: torch.Generator) -> None:
        squares = 0.0
        for param in self.params:
            if param.grad is None:
                param.grad = torch.empty_like(param)
            param.grad.normal_(0.0, 1.0, generator=gen)
            squares += float(param.grad.square().sum())
        scale = self.grad_norm / squares**0.5
        for param in self.params:
            param.grad.mul_(scale)


def millions(count: int) -> str:
    """A parameter count for a label: ``33M``, ``0.23M``."""
    return f"{count / 1e6:.0f}M" if count >= 10_000_000 else f"{count / 1e6:.2f}M"


def lm_workload(preset: str, layers: int | None, batch: tuple[int, int], clip: float) -> Workload:
    """The demo's causal LM of `preset` (optionally cut to `layers`), trained for real."""
    overrides = {"num_hidden_layers": layers} if layers else {}
    config = preset_config(preset, **overrides)
    model = random_model(config, dtype=torch.float32, seed=0)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    num_layers = config["num_hidden_layers"]
    numel = sum(p.numel() for p in params)
    return Workload(
        label=f"{preset} {num_layers}L {millions(numel)}",
        grads=f"real (LM loss, batch {batch[0]}x{batch[1]})",
        init="transformers init: normal std 0.02, norms 1 + N(0, 0.1) (random_model)",
        tensors=dict(ModelExport(model)),
        params=params,
        initial=[p.detach().clone() for p in params],
        model=model,
        clip=clip,
        batch=batch,
        info={"preset": preset, "layers": num_layers, "params": numel},
    )


def synthetic_workload(preset: str, layers: int | None, std: float, grad_norm: float) -> Workload:
    """A random state dict of `preset`'s checkpoint tensors (optionally cut to `layers`),
    stepped with synthetic gradients."""
    overrides: dict[str, Any] = {"tie_word_embeddings": False}
    if layers:
        overrides["num_hidden_layers"] = layers
    config = preset_config(preset, **overrides)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, shape in hf_tensor_shapes(config).items():
            tensor = torch.empty(shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                # One generator per tensor, seeded by its name: a tensor's values do not
                # depend on which other tensors `--layers` keeps.
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                tensor.normal_(0.0, std, generator=gen)
            tensors[name] = torch.nn.Parameter(tensor)
    params = list(tensors.values())
    numel = sum(p.numel() for p in params)
    return Workload(
        label=f"{preset} {config['num_hidden_layers']}L {millions(numel)}",
        grads=f"synthetic grads (Gaussian, norm {grad_norm:g})",
        init=f"normal std {std:g}, norms 1 (transformers' init of the config)",
        tensors=tensors,
        params=params,
        initial=[p.detach().clone() for p in params],
        grad_norm=grad_norm,
        info={"preset": preset, "layers": config["num_hidden_layers"], "params": numel},
    )


# ---------------------------------------------------------------- what the rollout holds


@dataclass(slots=True)
class RolloutBits:
    """The raw bits a rollout holds for the master weights: bf16 for every tensor; for an
    FP8 rollout, codes and scales of each linear weight (the rest as in ``bf16``)."""

    bf16: dict[str, torch.Tensor]
    codes: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether an FP8 rollout holds `name` as block-FP8 codes and scales."""
    return is_quantized_hf_name(name) and tensor.dim() == 2


def rollout_bits(tensors: dict[str, torch.Tensor], block: int) -> RolloutBits:
    """The rollout's bits of the master `tensors` (float32), cast and quantised."""
    bits = RolloutBits({}, {}, {})
    with torch.no_grad():
        for name, tensor in tensors.items():
            bits.bf16[name] = as_bits(tensor.to(torch.bfloat16).contiguous())
            if quantized(name, tensor):
                codes, scales = quantize_block_fp8(tensor, block=block)
                bits.codes[name], bits.scales[name] = as_bits(codes), as_bits(scales)
    return bits


@dataclass(slots=True)
class Changes:
    """Changed elements of a set of tensors between two steps, and their delta's bytes."""

    changed: int = 0
    elements: int = 0
    full_bytes: int = 0
    delta_bytes: int = 0
    sections: list[Section] = field(default_factory=list)

    def add(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Count one tensor's changed elements (raw bits, flat)."""
        where = torch.nonzero(old != new).reshape(-1)
        size = new.element_size()
        self.changed += where.numel()
        self.elements += new.numel()
        self.full_bytes += new.numel() * size
        self.delta_bytes += where.numel() * (OFFSET_BYTES + size)
        if where.numel():
            self.sections.append(
                Section(param_index=len(self.sections), elements=where, values=new[where])
            )

    @property
    def density(self) -> float:
        """Changed elements over all elements."""
        return self.changed / self.elements if self.elements else 0.0


def codec_bytes(parts: Iterable[Changes]) -> int:
    """Bytes of one `weightsync.delta_codec` payload holding every part's sections."""
    return payload_size([s for part in parts for s in part.sections]).num_bytes


def compare(old: RolloutBits, new: RolloutBits) -> dict[str, Any]:
    """What changed from `old` to `new`: densities and delta-over-full ratios."""
    bf16, codes, scales, rest = Changes(), Changes(), Changes(), Changes()
    for name, bits in new.bf16.items():
        bf16.add(old.bf16[name], bits)
        if name not in new.codes:
            rest.add(old.bf16[name], bits)
    for name, bits in new.codes.items():
        codes.add(old.codes[name], bits)
        scales.add(old.scales[name], new.scales[name])
    fp8 = (codes, scales, rest)
    fp8_full = sum(p.full_bytes for p in fp8)
    return {
        "bf16_density": bf16.density,
        "fp8_code_density": codes.density,
        "fp8_scale_density": scales.density,
        "bf16_delta_ratio": bf16.delta_bytes / bf16.full_bytes,
        "fp8_delta_ratio": sum(p.delta_bytes for p in fp8) / fp8_full,
        "bf16_codec_ratio": codec_bytes([bf16]) / bf16.full_bytes,
        "fp8_codec_ratio": codec_bytes(fp8) / fp8_full,
        "bf16_changed": bf16.changed,
        "bf16_elements": bf16.elements,
        "fp8_codes_changed": codes.changed,
        "fp8_codes": codes.elements,
        "fp8_scales_changed": scales.changed,
        "fp8_scales": scales.elements,
        "fp8_bf16_changed": rest.changed,
        "fp8_bf16_elements": rest.elements,
    }


# ---------------------------------------------------------------- the run


def measure(workload: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every learning rate's steps from the initial weights: one row per step."""
    start = time.perf_counter()
    initial = rollout_bits(workload.tensors, args.block)
    log(f"{workload.label}: initial rollout bits in {time.perf_counter() - start:.1f} s")
    rows = []
    for lr in args.lrs:
        workload.reset()
        optimizer = torch.optim.AdamW(workload.params, lr=lr, weight_decay=args.weight_decay)
        before = initial
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            loss = workload.backward(step)
            optimizer.step()
            after = rollout_bits(workload.tensors, args.block)
            row = {"model": workload.label, "grads": workload.grads, "lr": lr, "step": step}
            row.update(loss=loss, **compare(before, after))
            rows.append(row)
            before = after
            log(
                f"  lr {lr:g} step {step}: bf16 {row['bf16_density']:.3%} changed "
                f"({time.perf_counter() - start:.1f} s)"
            )
        del optimizer
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table of every step."""
    header = [
        "model",
        "grads",
        "lr",
        "step",
        "bf16 changed",
        "fp8 codes changed",
        "fp8 scales changed",
        "bf16 delta/full",
        "fp8 delta/full",
    ]
    table = [
        [
            row["model"],
            row["grads"].split(" (")[0],
            f"{row['lr']:g}",
            str(row["step"]),
            f"{row['bf16_density']:.3%}",
            f"{row['fp8_code_density']:.3%}",
            f"{row['fp8_scale_density']:.2%}",
            f"{row['bf16_delta_ratio']:.4f}",
            f"{row['fp8_delta_ratio']:.4f}",
        ]
        for row in rows
    ]
    print_table(
        "Elements of the rollout changed by one AdamW step (vs the step before), and a sparse "
        "delta's bytes (16-bit offset + value per changed element) over the full checkpoint's",
        header,
        table,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked and completed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--lm-preset",
        choices=(*DEMO_PRESETS, "none"),
        help="demo model trained on a real loss (default: small; tiny with --quick)",
    )
    p.add_argument("--lm-layers", type=int, help="override the LM's layer count")
    p.add_argument(
        "--preset",
        choices=(*PRESET_NAMES, "none"),
        help="preset stepped with synthetic grads (default: dense-256m; tiny with --quick)",
    )
    p.add_argument("--layers", type=int, help="layers of --preset (default: 4; 1 with --quick)")
    p.add_argument("--steps", type=int, help="optimizer steps per lr (default: 4; 2 with --quick)")
    p.add_argument("--lrs", type=float, nargs="+", default=list(DEFAULT_LRS))
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's (e.g. 0.01)")
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK_SIZE, help="FP8 block size")
    p.add_argument("--batch", type=int, nargs=2, default=(4, 64), metavar=("ROWS", "TOKENS"))
    p.add_argument("--clip", type=float, default=1.0, help="the LM's gradient-norm clip")
    p.add_argument("--grad-norm", type=float, default=1.0, help="synthetic gradients' norm")
    p.add_argument("--init-std", type=float, default=0.02, help="synthetic weights' init std")
    p.add_argument("--quick", action="store_true", help="smoke run on tiny models")
    args = p.parse_args(argv)
    quick = args.quick
    args.lm_preset = args.lm_preset or ("tiny" if quick else "small")
    args.preset = args.preset or ("tiny" if quick else "dense-256m")
    if args.layers is None:
        args.layers = 1 if quick else 4
    if args.steps is None:
        args.steps = 2 if quick else 4
    if args.steps < 1 or args.layers < 1 or args.block < 1:
        p.error("--steps, --layers and --block must be at least 1")
    if args.lm_preset == "none" and args.preset == "none":
        p.error("nothing to measure: --lm-preset and --preset are both none")
    if any(lr <= 0 for lr in args.lrs):
        p.error("--lrs must be positive")
    args.batch = tuple(args.batch)
    return args


def main(argv: list[str] | None = None) -> None:
    """Measure every model and print the table and the JSON line."""
    args = parse_args(argv)
    torch.manual_seed(0)
    workloads = []
    if args.lm_preset != "none":
        workloads.append(lambda: lm_workload(args.lm_preset, args.lm_layers, args.batch, args.clip))
    if args.preset != "none":
        workloads.append(
            lambda: synthetic_workload(args.preset, args.layers, args.init_std, args.grad_norm)
        )
    rows: list[dict[str, Any]] = []
    models = []
    for build in workloads:
        workload = build()
        log(f"{workload.label}: {workload.grads}; init {workload.init}")
        rows += measure(workload, args)
        models.append(
            {"model": workload.label, "grads": workload.grads, "init": workload.init}
            | workload.info
        )
        del workload  # one model's weights and optimizer state in memory at a time
    for model in models:
        print(f"{model['model']}: {model['grads']}; init {model['init']}")
    print(
        f"AdamW (betas 0.9, 0.999; weight decay {args.weight_decay:g}) on float32 master "
        f"weights; rollout bf16, and FP8 {args.block}x{args.block} blocks quantised from the "
        "master (e4m3 codes, float32 scales; embeddings, norms and the router in bf16)"
    )
    print_rows(rows)
    result = {
        "bench": "density",
        "rows": rows,
        "models": models,
        "steps": args.steps,
        "lrs": list(args.lrs),
        "weight_decay": args.weight_decay,
        "block": args.block,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
