"""Predict a delta sync: the same network schedule moving only the changed elements.

A delta sync (`SyncConfig(delta=True)`) writes, per trainer rank and rollout rank, one
payload of the elements that changed since the last push (`weightsync.delta_codec`): a
64-byte head, per parameter a 64-byte section row, per sparse section a 16-byte row per
65,536-element block holding a change, then a 16-bit offset and the value of each changed
element (each part 8-byte aligned). `delta_prediction` prices that on a full prediction
(`predict_sync`):

1. **Bytes.** Each traffic unit's element runs (`TrafficUnit.element_runs`) change at the
   density of their kind (`DeltaDensity`: bf16 and other elements, FP8 codes, FP8 scales);
   a run changes ``round(density * numel)`` elements, each at random, so a block of ``k``
   of its elements holds a change with probability ``1 - (1 - density) ** k``
   (`expected_changes`). A run becomes a sparse section, or a dense one (the run's bytes
   whole, the codec's dense kind) where the sparse one would not be smaller. A transfer
   whose payload would not be smaller than its full bytes writes them full.
2. **Wire.** The full prediction's network schedule, in its order, with each transfer's
   bytes replaced by its delta bytes and its writes kept (the fixed costs stay), simulated
   on the same network (`simulate`).
3. **Devices.** Each trainer GPU reads every tensor it sends and its reference (both in the
   rollout's dtype) to find the changes, then lays out each layout's payload; each rollout
   GPU checksums its parameters (its base), applies its payloads and checksums every
   parameter again (``check="full"``, the default here: the dearer of the two), or derives
   its checksums after from the elements it wrote (``check="changes"``, the
   `weightsync.manager.config.ControlConfig` default: one checksum, and a CUDA rank derives
   in the fused scatter's pass, priced by the derived apply's own rates where they were
   measured, `KernelTimes.derive_s`, and by the plain apply's otherwise). Each step
   takes bytes over a rate plus changed elements over a rate (`DeltaRates`, fitted from
   `bench/delta_kernels.py` on one H200 at two densities). A sender's host also spends a
   fixed time on every tensor it encodes (`DeltaRates.host_tensor_s`, measured end to end:
   taking it from the stream, its entry in a fused bucket, filing its changes under each
   layout), which the kernels' rates do not hold and which a MoE's thousands of per-expert
   tensors make count. The phases run one after
   another, as a delta sync runs them: the replicas' base checksums are read before the
   push, the payloads are written after every tensor is encoded, and the replicas apply
   after the push.

The model counts a section row per (tensor, parameter) and a payload head per transfer (one
source, one target, one layer window), where the sender writes a section per parameter and a
payload per source and layout: its bytes err high by at most 64 bytes per tensor and per
window. Changes are modelled as independent and uniform; changes that cluster touch fewer
blocks than it counts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from weightsync.layout import hf_tensor_shapes
from weightsync.predict.cluster import TrainerShape
from weightsync.predict.network import NetworkModel
from weightsync.predict.prediction import SyncPrediction, predict_sync
from weightsync.predict.schedule import DEFAULT_WINDOWS
from weightsync.predict.simulator import SimulationResult, lower_bound_s, simulate
from weightsync.predict.traffic import (
    FP8_SCALE_BYTES,
    ElementKind,
    ElementRun,
    TrafficUnit,
    fp8_num_bytes,
)
from weightsync.predict.transfers import Schedule, Transfer

# The payload format of `weightsync.delta_codec` (tests hold these to its `payload_size`).
BLOCK_ELEMENTS = 1 << 16
PAYLOAD_HEAD_BYTES = 64
SECTION_BYTES = 64
BLOCK_ROW_BYTES = 16
OFFSET_BYTES = 2

# Measured by bench/density.py (AdamW on fp32 master weights, rollout in bf16): at lr 1e-6,
# 2-4 % of bf16 elements change per step, falling as Adam settles (3.7 % -> 1.8 %); block-
# quantised e4m3 codes change about ten times less often, their float32 scales nearly all.
MEASURED_ELEMENT_DENSITY = 0.02
FP8_CODE_DENSITY_RATIO = 0.1
MEASURED_FP8_SCALE_DENSITY = 1.0


def _align(num_bytes: int) -> int:
    return (num_bytes + 7) // 8 * 8


def sparse_section_bytes(num_elements: int, num_blocks: int, element_size: int) -> int:
    """Bytes of a sparse section: its row, its block rows, its offsets and its values."""
    return (
        SECTION_BYTES
        + BLOCK_ROW_BYTES * num_blocks
        + _align(OFFSET_BYTES * num_elements)
        + _align(num_elements * element_size)
    )


def dense_section_bytes(num_elements: int, element_size: int) -> int:
    """Bytes of a dense section: its row and its values."""
    return SECTION_BYTES + _align(num_elements * element_size)


def payload_bytes(section_bytes: Iterable[int]) -> int:
    """Bytes of a payload of sections of `section_bytes` (`weightsync.delta_codec.payload_size`
    of the same sections)."""
    return PAYLOAD_HEAD_BYTES + sum(section_bytes)


def expected_changes(run: ElementRun, density: float) -> tuple[int, int]:
    """``(changed elements, blocks holding one)`` of `run` at `density`, rounded up where
    the expectation is fractional (both grow with the density, both are 0 at 0).

    The changed elements are ``density * numel`` rounded half up; each 65,536-element block
    of the parameter that `run` covers ``k`` elements of holds a change with probability
    ``1 - (1 - density) ** k``.
    """
    if run.numel == 0 or density <= 0.0:
        return 0, 0
    count = min(run.numel, math.floor(density * run.numel + 0.5))
    if count == 0:
        return 0, 0
    offset = run.start % BLOCK_ELEMENTS
    first = min(run.numel, BLOCK_ELEMENTS - offset)
    rest = run.numel - first
    middle, last = divmod(rest, BLOCK_ELEMENTS)
    blocks = _hit(first, density) + middle * _hit(BLOCK_ELEMENTS, density) + _hit(last, density)
    spanned = 1 + middle + (1 if last else 0)
    return count, min(count, spanned, math.ceil(blocks - 1e-9))


def _hit(num_elements: int, density: float) -> float:
    """Probability that `num_elements` elements, each changed at `density`, hold a change."""
    if num_elements == 0:
        return 0.0
    if density >= 1.0:
        return 1.0
    return -math.expm1(num_elements * math.log1p(-density))


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaDensity:
    """The fraction of elements one step changes, per kind of element.

    Attributes:
        elements: bf16 (and other non-FP8) elements, e.g. 0.02 at lr 1e-6.
        fp8_codes: e4m3 codes of block-FP8 weights.
        fp8_scales: their float32 block scales.

    Raises:
        ValueError: a density outside [0, 1].
    """

    elements: float
    fp8_codes: float
    fp8_scales: float

    def __post_init__(self) -> None:
        for name in ("elements", "fp8_codes", "fp8_scales"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"DeltaDensity.{name} must be a fraction in [0, 1], got {value!r} "
                    "(0.02 is 2 % of elements changed per step)"
                )

    @classmethod
    def measured(
        cls,
        elements: float = MEASURED_ELEMENT_DENSITY,
        *,
        fp8_codes: float | None = None,
        fp8_scales: float | None = None,
    ) -> DeltaDensity:
        """`elements`, with FP8 codes and scales as measured beside it unless given: codes
        change `FP8_CODE_DENSITY_RATIO` as often as bf16 elements, scales nearly all."""
        return cls(
            elements=elements,
            fp8_codes=elements * FP8_CODE_DENSITY_RATIO if fp8_codes is None else fp8_codes,
            fp8_scales=MEASURED_FP8_SCALE_DENSITY if fp8_scales is None else fp8_scales,
        )

    def of(self, kind: ElementKind) -> float:
        """The density of elements of `kind`."""
        if kind == "fp8_codes":
            return self.fp8_codes
        if kind == "fp8_scales":
            return self.fp8_scales
        return self.elements


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelTimes:
    """Seconds of a delta's device work over one set of weights (`bench/delta_kernels.py`).

    Attributes:
        encode_s: reading the new weights and the reference, finding the changes.
        layout_s: laying the changes out as a payload, with the checksum changes.
        apply_s: applying the payload in place.
        checksum_s: checksumming every parameter once.
        derive_s: applying the payload with the checksums after derived from the elements
            it writes (`weightsync.delta_codec.apply_and_check`, ``check="changes"``: on
            CUDA the fused scatter derives them in its pass); None where not measured.
    """

    encode_s: float
    layout_s: float
    apply_s: float
    checksum_s: float
    derive_s: float | None = None


# bench/delta_kernels.py --device cuda --gb 8.6 on one H200: 64 bf16 tensors of 128 MiB,
# changed at 2 % and at 5 % (a same-device copy of the bytes: 4.3 ms). The checksum is the
# begin's: every parameter in one fused launch; the apply is the fused scatter
# (`weightsync.delta_kernels`).
H200_MEASURED_BYTES = 64 * 128 * 2**20
H200_KERNELS: Mapping[float, KernelTimes] = {
    0.02: KernelTimes(encode_s=23.2e-3, layout_s=21.7e-3, apply_s=10.2e-3, checksum_s=2.82e-3),
    0.05: KernelTimes(encode_s=27.2e-3, layout_s=31.7e-3, apply_s=10.8e-3, checksum_s=2.90e-3),
}

HOST_TENSOR_S = 52e-6
"""Host seconds a delta push spends per tensor it encodes, beside the device work: measured
end to end (`bench/delta.py --device cuda`, colocated, one H100 host, AdamW at lr 1e-6,
steps 2 and 3) as the encode of the Qwen3-30B-A3B shape at 4 layers (1,575 tensors, 6.23 GB
of bf16: 0.095-0.096 s) less that of dense-8b at 8 layers (91 tensors, 5.58 GB: 0.017-0.020
s), over the 1,484 tensors between them. Their bytes differ by 12 %, about 1 ms of device
work. Before a fused bucket's changes stayed in its shared outputs (a view and a shift of
each tensor's), the same host took 100 us a tensor (0.156-0.187 s for the Qwen shape)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaRates:
    """How fast one GPU does a delta's work: bytes over a rate plus changes over a rate.

    Attributes:
        encode_read_gbps: GB/s of bytes read finding changes (the new weights and the
            reference: twice the weights' bytes).
        encode_changes_per_s: changed elements found per second, beside the reading.
        layout_gbps: GB/s of weights whose changes are laid out as payloads.
        layout_changes_per_s: changed elements laid out per second, beside that.
        apply_gbps: GB/s of parameters a payload covers, applying it.
        apply_changes_per_s: changed elements written per second, beside that.
        checksum_gbps: GB/s of parameters read by a checksum.
        host_tensor_s: host seconds per tensor a sender encodes, beside the device work
            (`HOST_TENSOR_S`; 0 leaves it out).
        derive_gbps, derive_changes_per_s: applying with the checksums after derived
            (`KernelTimes.derive_s`), as `apply_gbps` and `apply_changes_per_s`; None where
            not measured (both or neither).

    Raises:
        ValueError: a rate that is not a positive, finite number (`host_tensor_s`: not a
            finite number of at least 0).
    """

    encode_read_gbps: float
    encode_changes_per_s: float
    layout_gbps: float
    layout_changes_per_s: float
    apply_gbps: float
    apply_changes_per_s: float
    checksum_gbps: float
    host_tensor_s: float = 0.0
    derive_gbps: float | None = None
    derive_changes_per_s: float | None = None

    def __post_init__(self) -> None:
        optional = {"derive_gbps", "derive_changes_per_s"}
        if (self.derive_gbps is None) != (self.derive_changes_per_s is None):
            raise ValueError(
                "DeltaRates.derive_gbps and derive_changes_per_s are measured together: "
                f"got {self.derive_gbps!r} and {self.derive_changes_per_s!r}"
            )
        for name in (f.name for f in fields(self) if f.name != "host_tensor_s"):
            value = getattr(self, name)
            if name in optional and value is None:
                continue
            if not isinstance(value, int | float) or not 0.0 < value < math.inf:
                raise ValueError(f"DeltaRates.{name} must be a positive number, got {value!r}")
        host = self.host_tensor_s
        if not isinstance(host, int | float) or not 0.0 <= host < math.inf:
            raise ValueError(
                f"DeltaRates.host_tensor_s must be a number of seconds of at least 0, got {host!r}"
            )

    @classmethod
    def fit(
        cls,
        *,
        num_bytes: int,
        element_size: int,
        measured: Mapping[float, KernelTimes],
    ) -> DeltaRates:
        """The rates that reproduce two measurements of the same weights at two densities.

        Each step's time is ``a * bytes + b * changed elements``: the two densities give
        ``a`` and ``b``. A checksum reads the same bytes whatever changed: it takes the mean
        of the two. The derived apply is fitted where both measurements hold it.

        Args:
            num_bytes: the measured weights' bytes.
            element_size: bytes per element.
            measured: ``{density: times}``, two densities.

        Raises:
            ValueError: not two densities, or times that shrink as the density grows.
        """
        if len(measured) != 2:
            raise ValueError(f"DeltaRates.fit needs two densities, got {sorted(measured)}")
        (low, at_low), (high, at_high) = sorted(measured.items())
        numel = num_bytes // element_size

        def split(step: str) -> tuple[float, float]:
            """``(seconds per byte, seconds per changed element)`` of `step`."""
            t_low, t_high = getattr(at_low, step), getattr(at_high, step)
            per_change = (t_high - t_low) / ((high - low) * numel)
            per_byte = (t_low - per_change * low * numel) / num_bytes
            if per_change <= 0 or per_byte <= 0:
                raise ValueError(
                    f"DeltaRates.fit: {step} takes {t_low:g} s at density {low:g} and "
                    f"{t_high:g} s at {high:g}; a step must grow with the changes and cost "
                    "something with none"
                )
            return per_byte, per_change

        encode, layout, apply = split("encode_s"), split("layout_s"), split("apply_s")
        checksum_s = (at_low.checksum_s + at_high.checksum_s) / 2
        derive = None
        if at_low.derive_s is not None and at_high.derive_s is not None:
            derive = split("derive_s")
        return cls(
            encode_read_gbps=1 / (encode[0] / 2) / 1e9,
            encode_changes_per_s=1 / encode[1],
            layout_gbps=1 / layout[0] / 1e9,
            layout_changes_per_s=1 / layout[1],
            apply_gbps=1 / apply[0] / 1e9,
            apply_changes_per_s=1 / apply[1],
            checksum_gbps=num_bytes / checksum_s / 1e9,
            derive_gbps=1 / derive[0] / 1e9 if derive else None,
            derive_changes_per_s=1 / derive[1] if derive else None,
        )

    @classmethod
    def h200(cls) -> DeltaRates:
        """Fitted from the H200 measurements (`H200_KERNELS`), with the host's time per
        tensor measured end to end (`HOST_TENSOR_S`)."""
        fitted = cls.fit(num_bytes=H200_MEASURED_BYTES, element_size=2, measured=H200_KERNELS)
        return replace(fitted, host_tensor_s=HOST_TENSOR_S)

    def encode_s(self, tensor_bytes: int, changes: int) -> float:
        """Seconds to find `changes` in tensors of `tensor_bytes` (and their reference)."""
        return (
            2 * tensor_bytes / (self.encode_read_gbps * 1e9) + changes / self.encode_changes_per_s
        )

    def host_s(self, tensors: int) -> float:
        """Host seconds a sender spends on `tensors` it encodes, beside the device work."""
        return tensors * self.host_tensor_s

    def layout_s(self, covered_bytes: int, changes: int) -> float:
        """Seconds to lay out `changes` of weights of `covered_bytes`."""
        return covered_bytes / (self.layout_gbps * 1e9) + changes / self.layout_changes_per_s

    def apply_s(self, covered_bytes: int, changes: int) -> float:
        """Seconds to apply `changes` into parameters of `covered_bytes`."""
        return covered_bytes / (self.apply_gbps * 1e9) + changes / self.apply_changes_per_s

    def checksum_s(self, num_bytes: int) -> float:
        """Seconds to checksum parameters of `num_bytes`."""
        return num_bytes / (self.checksum_gbps * 1e9)

    @property
    def derives(self) -> bool:
        """Whether the derived apply was measured (`derive_s` prices it)."""
        return self.derive_gbps is not None and self.derive_changes_per_s is not None

    def derive_s(self, covered_bytes: int, changes: int) -> float:
        """Seconds to apply `changes` into parameters of `covered_bytes` and derive their
        checksums after (`apply_s` where the derived apply was not measured)."""
        if self.derive_gbps is None or self.derive_changes_per_s is None:
            return self.apply_s(covered_bytes, changes)
        return covered_bytes / (self.derive_gbps * 1e9) + changes / self.derive_changes_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaPrediction:
    """What the model predicts for one delta sync, beside the full sync it replaces.

    The phases run one after another: ``total_s = encode_s + wire_s + replica_s``, with
    ``encode_s = find_s + host_s + layout_s`` (the slowest trainer GPU) and ``replica_s =
    num_checksums * checksum_s + apply_s`` (the slowest rollout GPU).

    Attributes:
        density: the densities it was priced at.
        rates: the device rates.
        full: the full sync's prediction (same cluster, same schedule).
        schedule: the network schedule with delta bytes.
        result: its simulation.
        num_bytes: bytes on the wire.
        num_changed: changed elements written, over every rollout GPU.
        num_full_transfers: transfers whose payload would not have been smaller than their
            full bytes, written full.
        find_s: the slowest trainer GPU's reading of its tensors and references.
        layout_s: the same GPU's laying out of its payloads.
        num_tensors: the tensors that GPU encodes (its host's time is `host_s`).
        wire_s: the simulated network phase.
        wire_lower_bound_s: what no execution of the delta schedule beats.
        checksum_s: one checksum of the slowest rollout GPU's parameters.
        apply_s: the same GPU's applying of its payloads.
        num_checksums: full checksums each rollout GPU reads: 1 (its base; the check after
            derives from the changes, ``check="changes"``) or 2 (``check="full"``).
    """

    density: DeltaDensity
    rates: DeltaRates
    full: SyncPrediction
    schedule: Schedule
    result: SimulationResult
    num_bytes: int
    num_changed: int
    num_full_transfers: int
    find_s: float
    layout_s: float
    wire_s: float
    wire_lower_bound_s: float
    checksum_s: float
    apply_s: float
    num_checksums: int = 1
    num_tensors: int = 0

    @property
    def host_s(self) -> float:
        """The slowest trainer GPU's host time per tensor, over the tensors it encodes
        (`DeltaRates.host_tensor_s`)."""
        return self.rates.host_s(self.num_tensors)

    @property
    def encode_s(self) -> float:
        """The sender's phase: finding the changes, its host's time per tensor, and laying
        the changes out."""
        return self.find_s + self.host_s + self.layout_s

    @property
    def replica_s(self) -> float:
        """The rollout's phase: the base's checksum, applying, the check after."""
        return self.num_checksums * self.checksum_s + self.apply_s

    @property
    def total_s(self) -> float:
        """The whole delta sync's data path."""
        return self.encode_s + self.wire_s + self.replica_s

    @property
    def phases(self) -> dict[str, float]:
        """``{phase: seconds}`` in the order they run."""
        return {"encode": self.encode_s, "wire": self.wire_s, "replica": self.replica_s}

    @property
    def bound_by(self) -> str:
        """The phase that takes longest."""
        phases = self.phases
        return max(phases, key=lambda name: phases[name])

    @property
    def full_s(self) -> float:
        """The full sync's predicted network phase."""
        return self.full.result.makespan_s

    @property
    def full_lower_bound_s(self) -> float:
        """What no schedule moving every byte beats (the busiest receiving NIC)."""
        return self.full.ideal_lower_bound_s

    @property
    def byte_ratio(self) -> float:
        """Delta bytes over full bytes on the wire."""
        return self.num_bytes / self.full.num_bytes if self.full.num_bytes else 0.0


@dataclass(frozen=True, slots=True)
class _UnitDelta:
    """One unit's share of a payload into each target of its layout."""

    section_bytes: int
    covered_bytes: int
    changes: int


def run_section(run: ElementRun, density: float) -> tuple[int, int]:
    """``(section bytes, elements it writes)`` of `run` at `density`: a sparse section, or a
    dense one where the sparse one would not be smaller; ``(0, 0)`` when nothing changed."""
    count, blocks = expected_changes(run, density)
    if count == 0:
        return 0, 0
    sparse = sparse_section_bytes(count, blocks, run.element_size)
    dense = dense_section_bytes(run.numel, run.element_size)
    return (sparse, count) if sparse < dense else (dense, run.numel)


def _unit_delta(unit: TrafficUnit, density: DeltaDensity) -> _UnitDelta:
    section_bytes = covered = changes = 0
    for run in unit.element_runs:
        num_bytes, written = run_section(run, density.of(run.kind))
        if num_bytes:
            section_bytes += num_bytes
            covered += run.num_bytes
            changes += written
    return _UnitDelta(section_bytes=section_bytes, covered_bytes=covered, changes=changes)


@dataclass(slots=True)
class _Work:
    """A GPU's device work: bytes covered, changed elements, and the tensors of the
    sender's stream they come in."""

    num_bytes: int = 0
    changes: int = 0
    tensors: int = 0
    seen: set[Any] = field(default_factory=set)

    def add(self, key: Any, num_bytes: int, changes: int, tensors: int = 1) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.num_bytes += num_bytes
            self.changes += changes
            self.tensors += tensors


def _tensor_work(
    hf_config: Any, units: Sequence[TrafficUnit], density: DeltaDensity
) -> dict[str, tuple[int, int, int]]:
    """``{hf_name: (bytes in the rollout's form, expected changed elements, stream
    tensors)}`` of every tensor the units read: what a sender reads (with its reference) to
    encode it, in the tensors its stream yields (two for an FP8 weight: codes and scales).

    Raises:
        ValueError: a unit of a tensor the config's checkpoint does not have.
    """
    shapes = hf_tensor_shapes(hf_config)
    out: dict[str, tuple[int, int, int]] = {}
    for unit in units:
        name = unit.key[0]
        if name in out or not unit.element_runs:
            continue
        shape = shapes.get(name)
        if shape is None:
            raise ValueError(
                f"the traffic names {name!r}, which the config's checkpoint does not have; "
                "predict with the config the units were made from"
            )
        numel = math.prod(shape)
        kinds = {run.kind: run for run in unit.element_runs}
        if len(kinds) == 2:
            # Counted as FP8 over a bf16 layout: e4m3 codes, then their blocks' scales.
            scales = (fp8_num_bytes(shape) - numel) // FP8_SCALE_BYTES
            out[name] = (
                numel + scales * FP8_SCALE_BYTES,
                round(numel * density.fp8_codes + scales * density.fp8_scales),
                2,
            )
            continue
        (kind, run), *_ = kinds.items()
        out[name] = (numel * run.element_size, round(numel * density.of(kind)), 1)
    return out


def delta_prediction(
    full: SyncPrediction,
    hf_config: Any,
    *,
    density: DeltaDensity,
    rates: DeltaRates | None = None,
    check: str = "full",
) -> DeltaPrediction:
    """Price a delta sync on the cluster of `full` (the rules are in the module docstring).

    Args:
        full: the full sync's prediction (`predict_sync`), whose schedule, units and network
            the delta sync keeps.
        hf_config: the model's config `full` was predicted from.
        density: the fraction of elements one step changes, per kind.
        rates: the GPUs' delta rates; default `DeltaRates.h200`.
        check: how the replicas check after applying: ``"full"`` (two full checksums per
            sync) or ``"changes"`` (one, the base's, and the apply that derives the
            checksums after: `DeltaRates.derive_s`).

    Raises:
        ValueError: a config that does not match the units of `full`, or an unknown
            `check`.
    """
    if check not in ("changes", "full"):
        raise ValueError(f"check must be 'changes' or 'full', got {check!r}")
    checks = 2 if check == "full" else 1
    rates = rates or DeltaRates.h200()
    network: NetworkModel = full.network
    by_key = {unit.key: unit for unit in full.units}
    unit_delta = {unit.key: _unit_delta(unit, density) for unit in full.units}
    tensors = _tensor_work(hf_config, full.units, density)
    senders: dict[int, tuple[_Work, _Work]] = defaultdict(lambda: (_Work(), _Work()))
    receivers: dict[int, _Work] = defaultdict(_Work)
    queues: dict[int, tuple[Transfer, ...]] = {}
    num_full = num_changed = 0
    for rank, queue in full.schedule.queues.items():
        delta_queue = []
        for transfer in queue:
            parts = [unit_delta[key] for key in transfer.units]
            sections = sum(part.section_bytes for part in parts)
            num_bytes = payload_bytes((sections,)) if sections else 0
            full_bytes = sum(by_key[key].num_bytes for key in transfer.units)
            finder, layout = senders[rank]
            # Every tensor is read to find what changed, whatever is found.
            for key in transfer.units:
                finder.add(key[0], *tensors.get(key[0], (0, 0, 1)))
            if num_bytes >= full_bytes and sections:
                num_full += 1
                num_bytes = full_bytes
            elif sections:
                receiver = receivers[transfer.target]
                for key, part in zip(transfer.units, parts, strict=True):
                    layout.add(key, part.covered_bytes, part.changes)
                    receiver.add(key, part.covered_bytes, part.changes)
            delta_queue.append(replace(transfer, num_bytes=num_bytes))
        queues[rank] = tuple(delta_queue)
    schedule = Schedule(name="delta", num_targets=full.schedule.num_targets, queues=queues)
    find_s = layout_s = 0.0
    num_tensors = 0
    for finder, layout in senders.values():
        find = rates.encode_s(finder.num_bytes, finder.changes)
        lay = rates.layout_s(layout.num_bytes, layout.changes)
        host, slowest = rates.host_s(finder.tensors), rates.host_s(num_tensors)
        if find + host + lay > find_s + slowest + layout_s:
            find_s, layout_s, num_tensors = find, lay, finder.tensors
    target_bytes = {
        target: group.num_bytes for group in full.groups for target in group.target_indices
    }
    checksum_s = apply_s = 0.0
    # Every rollout GPU checksums its parameters (its base), payload or none.
    for target, param_bytes in target_bytes.items():
        work = receivers.get(target, _Work())
        num_changed += work.changes
        check = rates.checksum_s(param_bytes)
        if checks == 2:
            apply = rates.apply_s(work.num_bytes, work.changes)
        else:
            apply = rates.derive_s(work.num_bytes, work.changes)
        if checks * check + apply > checks * checksum_s + apply_s:
            checksum_s, apply_s = check, apply
    result = simulate(schedule, network)
    return DeltaPrediction(
        density=density,
        rates=rates,
        full=full,
        schedule=schedule,
        result=result,
        num_bytes=schedule.num_bytes,
        num_changed=num_changed,
        num_full_transfers=num_full,
        find_s=find_s,
        layout_s=layout_s,
        num_tensors=num_tensors,
        wire_s=result.makespan_s,
        wire_lower_bound_s=lower_bound_s(schedule, network),
        checksum_s=checksum_s,
        apply_s=apply_s,
        num_checksums=checks,
    )


def predict_delta_sync(
    hf_config: Any,
    *,
    trainer: TrainerShape,
    rollout_tp: int,
    rollout_ep: int = 1,
    replicas: int = 1,
    network: NetworkModel | None = None,
    fp8: bool = False,
    dtype: Any = None,
    num_windows: int = DEFAULT_WINDOWS,
    density: DeltaDensity,
    rates: DeltaRates | None = None,
    check: str = "full",
) -> DeltaPrediction:
    """Predict the full sync (`predict_sync`, same arguments) and the delta sync beside it.

    Args:
        hf_config: the model's transformers config or config.json dict.
        trainer: how the trainer's GPUs split the model (`TrainerShape`).
        rollout_tp: tensor-parallel size of each replica.
        rollout_ep: expert-parallel size of each replica.
        replicas: rollout replicas.
        network: the network model; default `NetworkModel()`.
        fp8: FP8 rollout bytes for the decoder projections.
        dtype: the rollout dtype; default the config's.
        num_windows: the schedule's layer windows.
        density: the fraction of elements one step changes, per kind.
        rates: the GPUs' delta rates; default `DeltaRates.h200`.
        check: how the replicas check after applying (`delta_prediction`).

    Raises:
        ValueError: a shape the layout rules or the trainer shape reject.
    """
    full = predict_sync(
        hf_config,
        trainer=trainer,
        rollout_tp=rollout_tp,
        rollout_ep=rollout_ep,
        replicas=replicas,
        network=network,
        fp8=fp8,
        dtype=dtype,
        num_windows=num_windows,
    )
    return delta_prediction(full, hf_config, density=density, rates=rates, check=check)
