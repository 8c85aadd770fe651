"""The weights checker: snapshot, corrupt and compare one rank's parameters.

The bit-exact check (docs/protocol.md) runs it on every rank: ``snapshot`` copies every parameter,
``reset_tensors`` overwrites every parameter in place with random values, and after a sync
``compare`` must find every parameter bitwise equal to the snapshot. ``compare`` frees the
snapshot.

Where the snapshot lives: host parameters' in host memory. GPU parameters' on their GPU when
it fits with room to spare: the snapshot of a device's parameters stays on it only if it
leaves at least `gpu_headroom_bytes` free (the larger of 2 GiB and 10 % of the device), as
free memory counts it (the driver's free memory plus what this process's allocator holds
unused), so that the next action, a generation or a trainer beside the replica on the same
GPU still finds memory. Otherwise the device's parameters are copied into plain (pageable)
host memory, as SGLang's checker always does (``param.data.detach().cpu()``): a replica of
tens of gigabytes beside a trainer of the same size leaves no GPU room for a copy. Pinned
memory is not used: pinning tens of gigabytes costs about what the copy it speeds up costs,
and torch rounds pinned allocations up to a power of two. The reply of ``snapshot`` (and the
log line of whoever runs it) says which memory each device's copy took and why, and a
warning says so when the host copies need more than the host reports available (it is not
refused: virtual machines that grow their memory on demand report too little).

``compare`` works on either copy, where the parameter lives, chunk by chunk (`CHUNK_NUMEL`
elements at a time: a chunk of a host snapshot is copied to the GPU, compared and dropped),
so its own memory stays bounded whatever the snapshot's size; ``reset_tensors`` draws its
random values chunk by chunk too.

Block-FP8 weights are compared as SGLang's weights checker does
(``weight_checker_comparator.py``): each e4m3 ``...weight`` with a ``...weight_scale_inv``
beside it is one pair, compared after dequantisation to bf16 (``codes * scale`` of each
block; the block is ``K // scale_cols``); the scale is not compared on its own. With
``allow_quant_error`` a pair may differ by up to one e4m3 step (times its block's scale) of
each side; every other parameter must be bitwise equal, flag or not. ``checksum``
summarises every parameter (SHA-256 of its bytes and its sum).

GPU work runs on the parameters' GPU: a replica holds tens of gigabytes, which CPU compares
would take minutes over. Every action ends with the GPU work done, because trainers write
into the same memory from other processes as soon as the action returns.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
# A compare report names at most this many parameters per rank in its message.
_MAX_REPORTED = 32
GPU_HEADROOM_MIN_BYTES = 2 << 30
"""The least free GPU memory a GPU snapshot leaves."""
GPU_HEADROOM_FRACTION = 0.10
"""The share of a GPU's memory a GPU snapshot leaves free, where that is more than
`GPU_HEADROOM_MIN_BYTES`."""
CHUNK_NUMEL = 1 << 24
"""Elements compared or reset at a time: bounds what ``compare`` and ``reset_tensors``
allocate (a chunk's differences in float64: 128 MiB) whatever a parameter's size."""
_MEMINFO = Path("/proc/meminfo")


def gpu_headroom_bytes(total_bytes: int) -> int:
    """The GPU memory a snapshot must leave free on a device of `total_bytes`: the larger
    of 2 GiB and 10 % of the device."""
    return max(GPU_HEADROOM_MIN_BYTES, math.ceil(GPU_HEADROOM_FRACTION * total_bytes))


def snapshot_fits_on_gpu(*, snapshot_bytes: int, free_bytes: int, total_bytes: int) -> bool:
    """Whether a snapshot of `snapshot_bytes` stays on a GPU that has `free_bytes` of its
    `total_bytes` free: only if `gpu_headroom_bytes` remain free after it."""
    return free_bytes - snapshot_bytes >= gpu_headroom_bytes(total_bytes)


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
            MemoryError: ``snapshot`` found no host memory for its copy (`snapshot`).
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
        """Copy the parameters `names` (default: all): a GPU's parameters onto that GPU when
        the copy leaves `gpu_headroom_bytes` free there, into host memory otherwise (see the
        module docstring); host parameters into host memory.

        Raises:
            MemoryError: (or torch's allocator error) the host has no memory for the copy.
        """
        names = list(self._params) if names is None else list(names)
        self._snapshot = None
        by_device: dict[torch.device, list[str]] = {}
        for name in names:
            by_device.setdefault(self._params[name].device, []).append(name)
        plans = {device: self._place(device, group) for device, group in by_device.items()}
        to_host = {
            device: sum(_num_bytes(self._params[name]) for name in by_device[device])
            for device, (on_gpu, _) in plans.items()
            if not on_gpu
        }
        _warn_of_host_memory(to_host)
        snapshot: dict[str, torch.Tensor] = {}
        notes = []
        memory: dict[str, str] = {}
        for device, group in by_device.items():
            on_gpu, why = plans[device]
            if on_gpu and not _clone_on_device(self._params, group, snapshot):
                on_gpu, why = False, "the GPU ran out of memory while copying"
            if not on_gpu:
                for name in group:
                    snapshot[name] = self._params[name].detach().to("cpu", copy=True)
            memory[str(device)] = "gpu" if on_gpu else "host"
            where = "GPU memory" if on_gpu else "host memory"
            notes.append(f"{where} for {device}" + (f" ({why})" if why else ""))
        _synchronize(self._params.values())
        self._snapshot = snapshot
        num_bytes = sum(_num_bytes(t) for t in snapshot.values())
        taken = f"snapshot of {len(names)} parameters ({num_bytes} bytes) taken in"
        message = f"{taken} {'; '.join(notes)}"
        logger.info("weights_checker %s", message)
        return CheckResult(success=True, message=message, details={"snapshot_memory": memory})

    def _place(self, device: torch.device, names: list[str]) -> tuple[bool, str]:
        """``(on_gpu, why)``: where the snapshot of `names`, on `device`, goes, and why
        (empty for host parameters)."""
        if device.type != "cuda":
            return False, ""
        need = sum(_num_bytes(self._params[name]) for name in names)
        free, total = device_free_memory(device)
        headroom = gpu_headroom_bytes(total)
        numbers = (
            f"{_gib(need)} for the copy, {_gib(free)} of {_gib(total)} free, "
            f"{_gib(headroom)} kept free"
        )
        if snapshot_fits_on_gpu(snapshot_bytes=need, free_bytes=free, total_bytes=total):
            return True, numbers
        return False, f"no room on the GPU: {numbers}"

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
                # copy_ writes into the existing storage, which the transport has registered;
                # chunk by chunk, so the float32 draw never needs a parameter's worth of memory.
                for chunk in _chunks(param):
                    chunk.copy_(_random_like(chunk, generator))
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


def device_free_memory(device: torch.device) -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of GPU `device`: the driver's free memory plus what this
    process's caching allocator holds unused (a snapshot may take that too)."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(cached, 0), total


def host_available_bytes() -> int | None:
    """The host memory available to new allocations (``MemAvailable``), or None where the
    system does not say."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _warn_of_host_memory(to_host: Mapping[torch.device, int]) -> None:
    """Warn, before any copy, when the host copies of a snapshot (`to_host`: bytes per
    device) need more memory than the host reports available: Linux may grant it and kill
    the process once it is touched. Not refused: a virtual machine that grows its memory on
    demand reports less than it can give."""
    need = sum(to_host.values())
    available = host_available_bytes()
    if need == 0 or available is None or need <= available:
        return
    devices = ", ".join(f"{num_bytes} bytes for {device}" for device, num_bytes in to_host.items())
    logger.warning(
        "weights_checker snapshot needs %d bytes of host memory (%s) but the host reports %d "
        "bytes available (MemAvailable); copying anyway. If the process is killed, free host "
        "memory or leave large parameters out with skip_tensor_list",
        need,
        devices,
        available,
    )


def _clone_on_device(
    params: Mapping[str, torch.Tensor], names: list[str], into: dict[str, torch.Tensor]
) -> bool:
    """Clone `names` on their GPU into `into`; False (and none kept) if the GPU ran out of
    memory meanwhile (another process took what was free)."""
    clones = {}
    try:
        for name in names:
            clones[name] = params[name].detach().clone()
    except torch.cuda.OutOfMemoryError:
        logger.warning(
            "weights_checker snapshot: the GPU ran out of memory while copying; copying "
            "these parameters into host memory instead"
        )
        return False
    into.update(clones)
    return True


def _chunks(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Views of at most `CHUNK_NUMEL` elements covering `tensor` (itself where it is not
    contiguous, or small)."""
    if tensor.numel() <= CHUNK_NUMEL or not tensor.is_contiguous():
        return [tensor]
    return list(tensor.view(-1).split(CHUNK_NUMEL))


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


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
    # Compared where the parameter lives (a GPU compare of tens of GB takes milliseconds),
    # a chunk at a time: a host snapshot's chunk goes to the GPU, is compared and dropped.
    actual = param.detach()
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
    a_flat = actual.reshape(-1)
    e_flat = expected.reshape(-1)
    num_different = 0
    max_error: torch.Tensor | None = None
    sum_error = 0.0
    for start in range(0, max(a_flat.numel(), 1), CHUNK_NUMEL):
        a_chunk = a_flat[start : start + CHUNK_NUMEL]
        e_chunk = e_flat[start : start + CHUNK_NUMEL].to(actual.device)
        different = a_chunk.view(int_view) != e_chunk.view(int_view)
        count = int(different.sum())
        if count == 0:
            continue
        num_different += count
        error = (a_chunk.double() - e_chunk.double()).abs()
        chunk_max = error.max()
        max_error = chunk_max if max_error is None else torch.maximum(max_error, chunk_max)
        sum_error += float(error.sum())
    if num_different == 0:
        return None
    assert max_error is not None
    return ParamDiff(
        name=name,
        num_different=num_different,
        numel=expected.numel(),
        max_abs_error=float(max_error),
        mean_abs_error=sum_error / expected.numel(),
    )
