"""The weights checker: snapshot, corrupt and compare one rank's parameters.

The bit-exact check of PROTOCOL.md runs it on every rank: ``snapshot`` copies every parameter
(host parameters into host memory; GPU parameters on their GPU while it has room, else into
host memory), ``reset_tensors`` overwrites every parameter in place with random values, and
after a sync ``compare`` must find every parameter bitwise equal to the snapshot. ``compare``
frees the snapshot.

Block-FP8 weights are compared as SGLang's weights checker does
(``weight_checker_comparator.py``): each e4m3 ``...weight`` with a ``...weight_scale_inv``
beside it is one pair, compared after dequantisation to bf16 (``codes * scale`` of each
block; the block is ``K // scale_cols``); the scale is not compared on its own. With
``allow_quant_error`` a pair may differ by up to one e4m3 step (times its block's scale) of
each side; every other parameter must be bitwise equal, flag or not. ``checksum``
summarises every parameter (SHA-256 of its bytes and its sum).

GPU parameters are snapshotted, reset and compared on their GPU: a replica holds tens of
gigabytes, which host copies and CPU compares would take minutes over. Every action ends
with the GPU work done, because trainers write into the same memory from other processes
as soon as the action returns.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
# A compare report names at most this many parameters per rank in its message.
_MAX_REPORTED = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """The outcome of one checker action on one rank.

    Attributes:
        success: whether the action succeeded (``compare``: no parameter differs).
        message: what happened, for people: differing parameters one per line.
        details: the same as data (``compare``: ``{"differing": {name: {...}}}``;
            ``checksum``: ``{"checksums": {name: {"sha256": str, "sum": float}}}``).
    """

    success: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamDiff:
    """How one parameter differs from its snapshot."""

    name: str
    num_different: int
    numel: int
    max_abs_error: float
    mean_abs_error: float

    def describe(self) -> str:
        """One line for a report."""
        return (
            f"{self.name}: {self.num_different}/{self.numel} elements differ, "
            f"max abs error {self.max_abs_error:.6g}, mean abs error {self.mean_abs_error:.6g}"
        )


class WeightsChecker:
    """Snapshot / reset / compare / checksum over a fixed set of named tensors.

    Args:
        params: the rank's parameters by name; they are read and written in place, never
            replaced, so registered memory stays valid.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._params = dict(params)
        self._snapshot: dict[str, torch.Tensor] | None = None

    @property
    def has_snapshot(self) -> bool:
        """Whether a snapshot is held (taken and not yet compared)."""
        return self._snapshot is not None

    def run(
        self,
        action: str,
        *,
        allow_quant_error: bool = False,
        skip_tensor_list: Collection[str] = (),
        seed: int | None = None,
    ) -> CheckResult:
        """Run one action by name (what ``POST /weights_checker`` does on each rank).

        Args:
            action: ``snapshot``, ``reset_tensors``, ``compare`` or ``checksum``.
            allow_quant_error: ``compare`` tolerates, in block-FP8 weights only, one e4m3
                step of either side after dequantisation (SGLang's semantics).
            skip_tensor_list: parameters to leave out; an entry skips every parameter whose
                name contains it (an exact name skips that parameter only).
            seed: seed of ``reset_tensors``'s random values (default: fresh randomness).

        Raises:
            ValueError: unknown action, or a skip entry that matches no parameter.
        """
        if action not in ACTIONS:
            raise ValueError(f"unknown weights_checker action {action!r}; use one of {ACTIONS}")
        names = self._selected(skip_tensor_list)
        if action == "snapshot":
            return self.snapshot(names)
        if action == "reset_tensors":
            return self.reset_tensors(names, seed=seed)
        if action == "compare":
            return self.compare(names, allow_quant_error=allow_quant_error)
        return self.checksum(names)

    def snapshot(self, names: Collection[str] | None = None) -> CheckResult:
        """Copy the parameters `names` (default: all): on their own device, or into host
        memory for GPU parameters once their GPU is out of memory."""
        names = list(self._params) if names is None else list(names)
        self._snapshot = None
        snapshot: dict[str, torch.Tensor] = {}
        on_host = False
        for name in names:
            param = self._params[name].detach()
            if param.device.type == "cuda" and not on_host:
                try:
                    snapshot[name] = param.clone()
                    continue
                except torch.cuda.OutOfMemoryError:
                    on_host = True
            snapshot[name] = param.to("cpu", copy=True)
        _synchronize(self._params.values())
        self._snapshot = snapshot
        num_bytes = sum(t.numel() * t.element_size() for t in snapshot.values())
        where = " (partly in host memory)" if on_host else ""
        return CheckResult(
            success=True,
            message=f"snapshot of {len(names)} parameters ({num_bytes} bytes) taken{where}",
        )

    def reset_tensors(
        self, names: Collection[str] | None = None, *, seed: int | None = None
    ) -> CheckResult:
        """Overwrite the parameters `names` (default: all) with random values, in place.

        Values are drawn on each parameter's device, so with a `seed` they depend on the
        device type (CPU and CUDA generators differ), not on anything else.
        """
        names = list(self._params) if names is None else list(names)
        generators: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for name in names:
                param = self._params[name]
                generator = generators.get(param.device)
                if generator is None:
                    generator = generators[param.device] = torch.Generator(device=param.device)
                    if seed is None:
                        generator.seed()
                    else:
                        generator.manual_seed(seed)
                # copy_ writes into the existing storage, which the transport has registered.
                param.copy_(_random_like(param, generator))
        _synchronize(self._params.values())
        return CheckResult(success=True, message=f"{len(names)} parameters reset to random values")

    def compare(
        self, names: Collection[str] | None = None, *, allow_quant_error: bool = False
    ) -> CheckResult:
        """Compare the parameters `names` (default: all snapshotted) with the snapshot, then
        free the snapshot.

        A parameter passes when its bytes equal the snapshot's. A block-FP8 weight and its
        ``weight_scale_inv`` pass together when their dequantised bf16 values equal the
        snapshot's, or, with `allow_quant_error`, differ by at most one e4m3 step of the
        snapshot's plus one of the parameter's (each times its block's scale).
        """
        if self._snapshot is None:
            return CheckResult(
                success=False,
                message="no snapshot to compare with: run weights_checker snapshot first",
            )
        snapshot, self._snapshot = self._snapshot, None
        names = list(snapshot) if names is None else list(names)
        missing = [n for n in names if n not in snapshot]
        pairs = _fp8_pairs([n for n in names if n in snapshot], self._params)
        scales = set(pairs.values())
        diffs = []
        for name in names:
            if name not in snapshot or name in scales:
                continue
            if name in pairs:
                scale = pairs[name]
                diff = _fp8_diff(
                    name,
                    (snapshot[name], snapshot[scale]),
                    (self._params[name], self._params[scale]),
                    allow_quant_error,
                )
            else:
                diff = _diff(name, snapshot[name], self._params[name])
            if diff is not None:
                diffs.append(diff)
        del snapshot
        tolerance = "bitwise"
        if pairs:
            within = " within one e4m3 step" if allow_quant_error else ""
            tolerance = f"bitwise, block-FP8 weights dequantised{within}"
        if not diffs and not missing:
            return CheckResult(
                success=True, message=f"{len(names)} parameters equal the snapshot ({tolerance})"
            )
        lines = [f"{len(diffs)} of {len(names)} parameters differ from the snapshot ({tolerance}):"]
        lines += [f"  {d.describe()}" for d in diffs[:_MAX_REPORTED]]
        if len(diffs) > _MAX_REPORTED:
            lines.append(f"  ... and {len(diffs) - _MAX_REPORTED} more parameters")
        if missing:
            lines.append(f"  not in the snapshot: {', '.join(missing)}")
        details = {
            "differing": {
                d.name: {
                    "num_different": d.num_different,
                    "numel": d.numel,
                    "max_abs_error": d.max_abs_error,
                    "mean_abs_error": d.mean_abs_error,
                }
                for d in diffs
            },
            "missing": missing,
        }
        return CheckResult(success=False, message="\n".join(lines), details=details)

    def checksum(self, names: Collection[str] | None = None) -> CheckResult:
        """SHA-256 of the bytes and the sum of the values of the parameters `names`."""
        names = list(self._params) if names is None else list(names)
        checksums = {}
        for name in names:
            host = self._params[name].detach().to("cpu").contiguous()
            digest = hashlib.sha256(host.reshape(-1).view(torch.uint8).numpy()).hexdigest()
            total = float(host.double().sum()) if host.dtype.is_floating_point else int(host.sum())
            checksums[name] = {"sha256": digest, "sum": total}
        return CheckResult(
            success=True,
            message=f"checksums of {len(names)} parameters",
            details={"checksums": checksums},
        )

    def _selected(self, skip_tensor_list: Collection[str]) -> list[str]:
        unused = [s for s in skip_tensor_list if not any(s in name for name in self._params)]
        if unused:
            raise ValueError(
                f"skip_tensor_list entries {unused} match no parameter of this rank "
                f"(parameters are named like {next(iter(self._params), '?')!r})"
            )
        return [n for n in self._params if not any(s in n for s in skip_tensor_list)]


def _synchronize(params: Collection[torch.Tensor]) -> None:
    """Wait for the GPU work queued on the parameters' devices."""
    for device in {p.device for p in params if p.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def _random_like(param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    device = param.device
    if param.dtype.is_floating_point:
        values = torch.empty(param.shape, dtype=torch.float32, device=device).uniform_(
            -1.0, 1.0, generator=generator
        )
        return values.to(param.dtype)
    if param.dtype == torch.bool:
        return torch.rand(param.shape, generator=generator, device=device) > 0.5
    info = torch.iinfo(param.dtype)
    return torch.randint(
        info.min, info.max, param.shape, generator=generator, dtype=torch.int64, device=device
    ).to(param.dtype)


def _fp8_pairs(names: list[str], params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{weight: its scale}`` of the block-FP8 weights among `names` (SGLang's
    ``_build_quantized_set``: a weight whose ``weight`` -> ``weight_scale_inv`` exists)."""
    present = set(names)
    pairs = {}
    for name in names:
        if not name.endswith("weight") or params[name].dtype != torch.float8_e4m3fn:
            continue
        scale = name[: -len("weight")] + "weight_scale_inv"
        if scale in present and params[scale].dtype == torch.float32:
            codes, scales = params[name], params[scale]
            if codes.dim() >= 2 and codes.shape[-1] % scales.shape[-1] == 0:
                pairs[name] = scale
    return pairs


def _dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """SGLang's ``block_quant_dequant`` in float32 (square blocks of ``K // scale_cols``)."""
    rows, cols = codes.shape[-2:]
    block = cols // scales.shape[-1]
    expanded = scales.float().repeat_interleave(block, -2).repeat_interleave(block, -1)
    return codes.float() * expanded[..., :rows, :cols]


def _e4m3_step(codes: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at each code: ``2**floor(log2|q|) * 0.125``, the smallest normal's
    step for zeros and subnormals (SGLang's ``_ulp``)."""
    magnitude = codes.float().abs().clamp_min(torch.finfo(torch.float8_e4m3fn).smallest_normal)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * 0.125


def _fp8_diff(
    name: str,
    expected: tuple[torch.Tensor, torch.Tensor],
    actual: tuple[torch.Tensor, torch.Tensor],
    allow_quant_error: bool,
) -> ParamDiff | None:
    codes, scales = (t.detach() for t in actual)
    want_codes, want_scales = (t.to(codes.device) for t in expected)
    if codes.shape != want_codes.shape or scales.shape != want_scales.shape:
        return _diff(name, want_codes, codes)
    got = _dequantize(codes, scales).to(torch.bfloat16).float()
    want = _dequantize(want_codes, want_scales).to(torch.bfloat16).float()
    error = (got - want).abs()
    different = error != 0
    if not bool(different.any()):
        return None
    if allow_quant_error:
        tolerance = _dequantize(_e4m3_step(want_codes), want_scales) + _dequantize(
            _e4m3_step(codes), scales
        )
        different &= ~(error <= tolerance)
        if not bool(different.any()):
            return None
    return ParamDiff(
        name=f"{name} (FP8 with its weight_scale_inv, dequantised)",
        num_different=int(different.sum()),
        numel=codes.numel(),
        max_abs_error=float(error.max()),
        mean_abs_error=float(error.mean()),
    )


def _diff(name: str, expected: torch.Tensor, param: torch.Tensor) -> ParamDiff | None:
    # Compared where the parameter lives (a GPU compare of tens of GB takes milliseconds).
    actual = param.detach()
    expected = expected.to(actual.device)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return ParamDiff(
            name=f"{name} (shape/dtype {tuple(actual.shape)}/{actual.dtype}, "
            f"snapshot {tuple(expected.shape)}/{expected.dtype})",
            num_different=actual.numel(),
            numel=actual.numel(),
            max_abs_error=math.nan,
            mean_abs_error=math.nan,
        )
    int_view = _INT_VIEWS[expected.element_size()]
    a_bits = actual.contiguous().reshape(-1).view(int_view)
    e_bits = expected.contiguous().reshape(-1).view(int_view)
    different = a_bits != e_bits
    if not bool(different.any()):
        return None
    a_val = actual.reshape(-1).double()
    e_val = expected.reshape(-1).double()
    error = (a_val - e_val).abs()
    num_different = int(different.sum())
    return ParamDiff(
        name=name,
        num_different=num_different,
        numel=expected.numel(),
        max_abs_error=float(error.max()),
        mean_abs_error=float(error.mean()),
    )
