"""The delta sync's prediction: the payload bytes against the codec, the expected changes,
the densities and rates, and the prediction on modelled clusters."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.cli.simulate_cmd import SimulateOptionError, SimulateOptions, run_simulation
from weightsync.delta_codec import BLOCK_ELEMENTS, Section, bits_dtype, encode_payload, payload_size
from weightsync.layout import hf_tensor_shapes
from weightsync.layout.quant import fp8_quantization_config
from weightsync.plan import simulate_targets
from weightsync.predict import (
    FP8_CODE_DENSITY_RATIO,
    H200_KERNELS,
    HOST_TENSOR_S,
    DeltaDensity,
    DeltaRates,
    ElementRun,
    KernelTimes,
    NetworkModel,
    TrainerShape,
    delta_prediction,
    dense_section_bytes,
    expected_changes,
    payload_bytes,
    predict_delta_sync,
    predict_sync,
    run_section,
    sparse_section_bytes,
    traffic_units,
)
from weightsync.predict.delta import H200_MEASURED_BYTES
from weightsync.testing.presets import preset_config

# --- the payload's bytes against the codec ---------------------------------------------------


def _sparse(param_index: int, numel: int, density: float, element_size: int, seed: int):
    """A sparse section of random elements (ascending, as the sender finds them)."""
    generator = torch.Generator().manual_seed(seed)
    count = round(density * numel)
    elements = torch.randperm(numel, generator=generator)[:count].sort().values
    values = torch.randint(-100, 100, (count,), generator=generator).to(bits_dtype(element_size))
    return Section(param_index=param_index, elements=elements, values=values)


def _num_blocks(section: Section) -> int:
    return int(torch.unique(section.elements // BLOCK_ELEMENTS).numel())


@pytest.mark.parametrize(
    ("shapes", "density"),
    [
        # (numel, element size): bf16 weights, FP8 codes, float32 scales, odd sizes.
        ([(300_000, 2)], 0.02),
        ([(300_000, 2), (200_003, 1), (4_000, 4)], 0.02),
        ([(131_072, 2), (65_535, 1), (70_001, 4)], 0.002),
        ([(1_000_000, 2), (7, 2), (65_537, 8)], 0.3),
        ([(5, 1), (9, 2), (3, 4)], 0.5),
    ],
)
def test_payload_bytes_match_the_codec(shapes, density) -> None:
    sections = [
        _sparse(index, numel, density, size, seed=index)
        for index, (numel, size) in enumerate(shapes)
    ]
    # A dense section beside them: a run the sender sends whole.
    sections.append(
        Section(param_index=len(shapes), elements=None, values=torch.ones(1001, dtype=torch.int16))
    )
    modelled = payload_bytes(
        [
            sparse_section_bytes(s.values.numel(), _num_blocks(s), s.values.element_size())
            for s in sections[:-1]
        ]
        + [dense_section_bytes(1001, 2)]
    )
    assert modelled == payload_size(sections).num_bytes
    assert modelled == encode_payload(sections, "cpu").numel()
    assert payload_bytes([]) == payload_size([]).num_bytes


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 400_000),
    density=st.floats(0.0, 1.0),
    element_size=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_section_bytes_match_the_codec_on_random_sparse_tensors(
    numel, density, element_size, seed
) -> None:
    section = _sparse(0, numel, density, element_size, seed)
    count = section.values.numel()
    modelled = payload_bytes([sparse_section_bytes(count, _num_blocks(section), element_size)])
    assert modelled == payload_size([section]).num_bytes


# --- expected changes ------------------------------------------------------------------------


def _run(start: int, numel: int, size: int = 2, kind: str = "elements") -> ElementRun:
    return ElementRun(kind=kind, start=start, numel=numel, element_size=size)


RUNS = [
    _run(0, 1),
    _run(0, 1000),
    _run(65_000, 2_000),  # across one block boundary
    _run(12_345, 1_000_000),
    _run(0, 3 * BLOCK_ELEMENTS),
    _run(100, 7168 * 2048, size=1, kind="fp8_codes"),
]


@pytest.mark.parametrize("run", RUNS)
def test_expected_changes_grow_with_the_density_and_stay_in_bounds(run: ElementRun) -> None:
    first = run.start // BLOCK_ELEMENTS
    spanned = (run.start + run.numel - 1) // BLOCK_ELEMENTS - first + 1
    assert expected_changes(run, 0.0) == (0, 0)
    assert expected_changes(run, 1.0) == (run.numel, min(run.numel, spanned))
    last = (0, 0)
    last_bytes = 0
    for density in [i / 1000 for i in range(0, 1001, 7)] + [1e-6, 1e-5, 1e-4]:
        count, blocks = expected_changes(run, density)
        assert blocks <= min(count, spanned)
        assert (count == 0) == (blocks == 0)
    for density in sorted([i / 1000 for i in range(0, 1001, 7)] + [1e-6, 1e-5, 1e-4, 1.0]):
        now = expected_changes(run, density)
        assert now[0] >= last[0] and now[1] >= last[1], (density, now, last)
        section, written = run_section(run, density)
        # A section never grows as fewer elements change, and is never larger than dense.
        assert section >= last_bytes
        assert section <= dense_section_bytes(run.numel, run.element_size)
        assert written <= run.numel
        last, last_bytes = now, section


@pytest.mark.parametrize(
    ("start", "numel", "density"), [(0, 600_000, 2e-5), (40_000, 300_000, 1e-4)]
)
def test_expected_blocks_are_what_random_sparse_tensors_hold(start, numel, density) -> None:
    """At densities where a block often holds no change, the expectation is the mean."""
    generator = torch.Generator().manual_seed(7)
    counts = []
    for _ in range(200):
        mask = torch.rand(numel, generator=generator) < density
        elements = mask.nonzero().reshape(-1) + start
        counts.append(torch.unique(elements // BLOCK_ELEMENTS).numel())
    mean = sum(counts) / len(counts)
    _, blocks = expected_changes(_run(start, numel), density)
    assert blocks == math.ceil(mean - 0.5) or abs(blocks - mean) < 0.6, (blocks, mean)


def test_runs_of_scales_go_dense() -> None:
    scales = _run(0, 56 * 16, size=4, kind="fp8_scales")
    assert run_section(scales, 1.0) == (dense_section_bytes(56 * 16, 4), 56 * 16)
    # Six bytes a changed scale against four: dense from two thirds changed.
    assert run_section(scales, 0.7)[0] == dense_section_bytes(56 * 16, 4)
    assert run_section(scales, 0.5)[0] < dense_section_bytes(56 * 16, 4)


# --- densities and rates ----------------------------------------------------------------------


def test_densities_derive_fp8_as_measured() -> None:
    measured = DeltaDensity.measured(0.02)
    assert measured.fp8_codes == pytest.approx(0.02 * FP8_CODE_DENSITY_RATIO)
    assert measured.fp8_scales == 1.0
    given = DeltaDensity.measured(0.03, fp8_codes=0.01, fp8_scales=0.5)
    assert (given.elements, given.fp8_codes, given.fp8_scales) == (0.03, 0.01, 0.5)
    assert given.of("elements") == 0.03 and given.of("fp8_codes") == 0.01
    assert given.of("fp8_scales") == 0.5
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"DeltaDensity\.elements must be a fraction"):
            DeltaDensity.measured(bad)
    with pytest.raises(ValueError, match=r"DeltaDensity\.fp8_scales"):
        DeltaDensity(elements=0.1, fp8_codes=0.1, fp8_scales=2.0)


def test_h200_rates_reproduce_the_measured_kernels() -> None:
    rates = DeltaRates.h200()
    numel = H200_MEASURED_BYTES // 2
    for density, times in H200_KERNELS.items():
        changes = round(density * numel)
        assert rates.encode_s(H200_MEASURED_BYTES, changes) == pytest.approx(times.encode_s)
        assert rates.layout_s(H200_MEASURED_BYTES, changes) == pytest.approx(times.layout_s)
        assert rates.apply_s(H200_MEASURED_BYTES, changes) == pytest.approx(times.apply_s)
    checksums = [t.checksum_s for t in H200_KERNELS.values()]
    assert rates.checksum_s(H200_MEASURED_BYTES) == pytest.approx(sum(checksums) / 2)
    # Reading new + reference: more than a same-device copy's 2 x 8.6 GB / 4.29 ms would be
    # suspicious; the fit reads at a fifth of it.
    assert 500 < rates.encode_read_gbps < 2 * H200_MEASURED_BYTES / 4.29e-3 / 1e9


def test_rates_refuse_what_cannot_be() -> None:
    flat = KernelTimes(encode_s=1.0, layout_s=1.0, apply_s=1.0, checksum_s=1.0)
    faster = KernelTimes(encode_s=0.5, layout_s=2.0, apply_s=2.0, checksum_s=1.0)
    with pytest.raises(ValueError, match=r"encode_s takes 1 s at density 0\.01"):
        DeltaRates.fit(num_bytes=2**30, element_size=2, measured={0.01: flat, 0.05: faster})
    with pytest.raises(ValueError, match="needs two densities"):
        DeltaRates.fit(num_bytes=2**30, element_size=2, measured={0.01: flat})
    good = dataclasses.asdict(DeltaRates.h200())
    with pytest.raises(ValueError, match=r"DeltaRates\.apply_gbps must be a positive number"):
        DeltaRates(**{**good, "apply_gbps": 0.0})
    for bad in (-1e-6, math.nan, math.inf, "1e-4"):
        with pytest.raises(ValueError, match=r"DeltaRates\.host_tensor_s must be a number"):
            DeltaRates(**{**good, "host_tensor_s": bad})
    assert DeltaRates(**{**good, "host_tensor_s": 0.0}).host_s(1000) == 0.0


def test_the_derived_apply_is_fitted_where_measured_and_prices_check_changes(full) -> None:
    """A derived apply measured at both densities gets its own rates, which price a
    ``check="changes"`` replica (one checksum, the derived apply); unmeasured, the plain
    apply stands in for it; half a pair of rates is refused."""
    plain = {
        0.02: KernelTimes(encode_s=2e-2, layout_s=2e-2, apply_s=1e-2, checksum_s=3e-3),
        0.05: KernelTimes(encode_s=3e-2, layout_s=3e-2, apply_s=1.1e-2, checksum_s=3e-3),
    }
    derived = {d: dataclasses.replace(t, derive_s=t.apply_s * 1.5) for d, t in plain.items()}
    num_bytes = 2**33
    rates = DeltaRates.fit(num_bytes=num_bytes, element_size=2, measured=derived)
    assert rates.derives
    for density, times in derived.items():
        changes = round(density * num_bytes // 2)
        assert rates.derive_s(num_bytes, changes) == pytest.approx(times.derive_s)
        assert rates.apply_s(num_bytes, changes) == pytest.approx(times.apply_s)
    unmeasured = DeltaRates.fit(num_bytes=num_bytes, element_size=2, measured=plain)
    assert not unmeasured.derives and unmeasured.derive_s(10**9, 10**6) == pytest.approx(
        unmeasured.apply_s(10**9, 10**6)
    )
    # Half measured (one density only): not fitted.
    half = {0.02: derived[0.02], 0.05: plain[0.05]}
    assert not DeltaRates.fit(num_bytes=num_bytes, element_size=2, measured=half).derives
    good = dataclasses.asdict(rates)
    with pytest.raises(ValueError, match="measured together"):
        DeltaRates(**{**good, "derive_changes_per_s": None})
    with pytest.raises(ValueError, match=r"DeltaRates\.derive_gbps must be a positive number"):
        DeltaRates(**{**good, "derive_gbps": -1.0})
    config, prediction = full
    density = DeltaDensity.measured(0.02)
    changes = delta_prediction(prediction, config, density=density, rates=rates, check="changes")
    checked = delta_prediction(prediction, config, density=density, rates=rates, check="full")
    assert changes.num_checksums == 1 and checked.num_checksums == 2
    # The same slowest replica's work, priced by the derived apply and by the plain one.
    assert changes.apply_s == pytest.approx(1.5 * checked.apply_s, rel=0.2)
    assert changes.apply_s > checked.apply_s
    assert changes.replica_s == pytest.approx(changes.checksum_s + changes.apply_s)


def test_the_host_pays_for_every_tensor_the_busiest_sender_encodes(full) -> None:
    config, prediction = full
    density = DeltaDensity.measured(0.02)
    rates = DeltaRates.h200()
    assert rates.host_tensor_s == HOST_TENSOR_S > 0
    delta = delta_prediction(prediction, config, density=density, rates=rates)
    # Every tensor a sender's transfers name is encoded once, whatever it writes to how many
    # targets, and a bf16 weight an FP8 rollout serves is two of its stream's tensors (codes
    # and scales): the slowest sender's count is among the senders' counts.
    shapes = hf_tensor_shapes(config)
    quantized = {
        unit.key[0]
        for unit in prediction.units
        if {run.kind for run in unit.element_runs} == {"fp8_codes", "fp8_scales"}
    }
    per_sender = {
        rank: {key[0] for transfer in queue for key in transfer.units} & shapes.keys()
        for rank, queue in prediction.schedule.queues.items()
    }
    counts = {len(names) + len(names & quantized) for names in per_sender.values()}
    assert delta.num_tensors in counts
    assert delta.host_s == pytest.approx(delta.num_tensors * HOST_TENSOR_S)
    # Without the host's share, the same prediction's encode is its device work alone, and
    # the host's share only ever adds.
    bare = delta_prediction(
        prediction, config, density=density, rates=dataclasses.replace(rates, host_tensor_s=0.0)
    )
    assert bare.host_s == 0.0
    assert bare.encode_s == pytest.approx(bare.find_s + bare.layout_s)
    assert delta.encode_s >= bare.encode_s
    assert delta.total_s == pytest.approx(delta.encode_s + delta.wire_s + delta.replica_s)
    slow = dataclasses.replace(rates, host_tensor_s=10 * HOST_TENSOR_S)
    slower = delta_prediction(prediction, config, density=density, rates=slow)
    assert slower.host_s == pytest.approx(slower.num_tensors * 10 * HOST_TENSOR_S)
    assert slower.encode_s > delta.encode_s


# --- predictions on modelled clusters ---------------------------------------------------------

NETWORK = NetworkModel(nic_gbps=100.0, gpus_per_node=4, nics_per_node=2)


def _fp8_config(name: str) -> dict:
    config = preset_config(name, torch_dtype="bfloat16")
    return {**config, "quantization_config": fp8_quantization_config(128)}


CLUSTERS = [
    # (config, fp8 rollout, rollout tp, ep, replicas, trainer gpus, tp, pp)
    (preset_config("tiny", torch_dtype="bfloat16"), False, 2, 1, 2, 4, 2, 1),
    (preset_config("tiny-moe", torch_dtype="bfloat16"), False, 2, 2, 3, 8, 2, 2),
    (preset_config("tiny-deepseek", torch_dtype="bfloat16"), True, 2, 2, 2, 4, 2, 2),
    (_fp8_config("tiny-deepseek"), True, 1, 1, 2, 6, 1, 3),
]


def _full(cluster):
    config, fp8, tp, ep, replicas, gpus, trainer_tp, pp = cluster
    full = predict_sync(
        config,
        trainer=TrainerShape(num_gpus=gpus, tp=trainer_tp, pp=pp),
        rollout_tp=tp,
        rollout_ep=ep,
        replicas=replicas,
        network=NETWORK,
        fp8=fp8,
    )
    return config, full


@pytest.fixture(scope="module", params=range(len(CLUSTERS)))
def full(request):
    return _full(CLUSTERS[request.param])


DENSITIES = [0.0, 1e-4, 0.002, 0.02, 0.05, 0.2, 0.5, 1.0]


def test_delta_bytes_grow_with_the_density_and_never_pass_full(full) -> None:
    config, prediction = full
    last = None
    for elements in DENSITIES:
        density = DeltaDensity(elements=elements, fp8_codes=elements, fp8_scales=elements)
        delta = delta_prediction(prediction, config, density=density)
        sizes = [t.num_bytes for t in delta.schedule.transfers()]
        full_sizes = [t.num_bytes for t in prediction.schedule.transfers()]
        assert all(d <= f for d, f in zip(sizes, full_sizes, strict=True))
        assert delta.num_bytes == sum(sizes) <= prediction.num_bytes
        if last is not None:
            assert all(d >= p for d, p in zip(sizes, last.sizes, strict=True))
            # A transfer written full needs no laying out and no applying: the device work
            # grows with the density while every transfer carries a payload.
            if not delta.num_full_transfers:
                assert delta.encode_s >= last.delta.encode_s
                assert delta.replica_s >= last.delta.replica_s
                assert delta.num_changed >= last.delta.num_changed
        last = dataclasses.make_dataclass("Last", ["sizes", "delta"])(sizes, delta)
    # Everything changed: every transfer writes its full bytes, as a full sync does, except
    # where padding (a vocabulary shard past the real rows, never changed) makes a payload of
    # dense sections smaller.
    units = {unit.key: unit for unit in prediction.units}
    padded = 0
    for mine, theirs in zip(
        last.delta.schedule.transfers(), prediction.schedule.transfers(), strict=True
    ):
        real = sum(r.num_bytes for k in theirs.units for r in units[k].element_runs)
        if real == theirs.num_bytes:
            assert mine.num_bytes == theirs.num_bytes
        else:
            padded += 1
            assert mine.num_bytes < theirs.num_bytes
    assert last.delta.num_full_transfers == prediction.schedule.num_transfers - padded


def test_delta_keeps_the_schedule_and_its_fixed_costs(full) -> None:
    config, prediction = full
    delta = delta_prediction(prediction, config, density=DeltaDensity.measured(0.02))
    for mine, theirs in zip(
        delta.schedule.transfers(), prediction.schedule.transfers(), strict=True
    ):
        assert dataclasses.replace(mine, num_bytes=theirs.num_bytes) == theirs
        assert mine.units == theirs.units
    assert delta.schedule.queues.keys() == prediction.schedule.queues.keys()
    assert delta.wire_s >= delta.wire_lower_bound_s * (1 - 1e-9)
    assert delta.wire_s <= prediction.result.makespan_s
    assert 0 < delta.num_bytes < prediction.num_bytes


def test_a_transfer_carries_a_payload_of_its_units_sections(full) -> None:
    config, prediction = full
    density = DeltaDensity.measured(0.02)
    delta = delta_prediction(prediction, config, density=density)
    units = {unit.key: unit for unit in prediction.units}
    for mine, theirs in zip(
        delta.schedule.transfers(), prediction.schedule.transfers(), strict=True
    ):
        sections = [
            run_section(run, density.of(run.kind))[0]
            for key in theirs.units
            for run in units[key].element_runs
        ]
        expected = payload_bytes(s for s in sections if s) if any(sections) else 0
        assert mine.num_bytes == min(expected, theirs.num_bytes)


def test_phases_add_up(full) -> None:
    config, prediction = full
    delta = delta_prediction(prediction, config, density=DeltaDensity.measured(0.05))
    assert delta.encode_s == pytest.approx(delta.find_s + delta.host_s + delta.layout_s)
    # The base's and a read after: what a CUDA rank with the fused checksum runs.
    assert delta.num_checksums == 2
    assert delta.replica_s == pytest.approx(2 * delta.checksum_s + delta.apply_s)
    derived = delta_prediction(
        prediction, config, density=DeltaDensity.measured(0.05), check="changes"
    )
    assert derived.num_checksums == 1  # the base's; the check after derives from the changes
    assert derived.replica_s == pytest.approx(delta.checksum_s + delta.apply_s)
    with pytest.raises(ValueError, match="check must be"):
        delta_prediction(prediction, config, density=DeltaDensity.measured(0.05), check="some")
    assert delta.total_s == pytest.approx(sum(delta.phases.values()))
    assert delta.total_s == pytest.approx(delta.encode_s + delta.wire_s + delta.replica_s)
    assert delta.phases[delta.bound_by] == max(delta.phases.values())
    assert delta.full_s == prediction.result.makespan_s
    assert delta.full_lower_bound_s == prediction.ideal_lower_bound_s
    assert delta.byte_ratio == delta.num_bytes / prediction.num_bytes
    assert min(delta.find_s, delta.layout_s, delta.checksum_s, delta.apply_s) > 0


def test_nothing_changed_reads_and_checksums_but_writes_nothing(full) -> None:
    config, prediction = full
    delta = delta_prediction(
        prediction, config, density=DeltaDensity(elements=0.0, fp8_codes=0.0, fp8_scales=0.0)
    )
    assert delta.num_bytes == 0 and delta.num_changed == 0
    assert delta.layout_s == 0 and delta.apply_s == 0
    assert delta.find_s > 0 and delta.checksum_s > 0
    # Each transfer still pays its fixed costs.
    assert delta.wire_s == pytest.approx(
        max(
            sum(NETWORK.setup_s(t.num_writes) for t in queue)
            for queue in prediction.schedule.queues.values()
        )
    )


def test_faster_rates_give_faster_phases(full) -> None:
    config, prediction = full
    density = DeltaDensity.measured(0.02)
    rates = DeltaRates.h200()
    # Twice the rates, and half the host's time per tensor (a time, not a rate).
    given = dataclasses.asdict(rates)
    doubled = DeltaRates(
        **{
            k: v / 2 if k == "host_tensor_s" else None if v is None else 2 * v
            for k, v in given.items()
        }
    )
    slow = delta_prediction(prediction, config, density=density, rates=rates)
    fast = delta_prediction(prediction, config, density=density, rates=doubled)
    assert fast.encode_s == pytest.approx(slow.encode_s / 2)
    assert fast.replica_s == pytest.approx(slow.replica_s / 2)
    assert fast.wire_s == slow.wire_s


def test_fp8_scales_go_dense_and_codes_change_less() -> None:
    config = _fp8_config("tiny-deepseek")
    targets = simulate_targets(config, tp=1, replicas=1)
    _, units = traffic_units(config, targets, fp8=True)
    density = DeltaDensity.measured(0.02)
    kinds = {run.kind for unit in units for run in unit.element_runs}
    assert kinds == {"elements", "fp8_codes", "fp8_scales"}
    for unit in units:
        for run in unit.element_runs:
            section, written = run_section(run, density.of(run.kind))
            if run.kind == "fp8_scales":
                assert (section, written) == (dense_section_bytes(run.numel, 4), run.numel)
            elif run.kind == "fp8_codes" and run.numel >= 10_000:
                # 0.2 % of codes at three bytes each, against one byte per code.
                assert section < run.numel * 0.01


def test_predict_delta_sync_is_predict_sync_then_the_delta() -> None:
    config, _, tp, ep, replicas, gpus, trainer_tp, pp = CLUSTERS[1]
    trainer = TrainerShape(num_gpus=gpus, tp=trainer_tp, pp=pp)
    kwargs = {"trainer": trainer, "rollout_tp": tp, "rollout_ep": ep, "replicas": replicas}
    density = DeltaDensity.measured(0.03)
    delta = predict_delta_sync(config, network=NETWORK, density=density, **kwargs)
    again = delta_prediction(
        predict_sync(config, network=NETWORK, **kwargs), config, density=density
    )
    assert (delta.num_bytes, delta.total_s) == (again.num_bytes, again.total_s)
    with pytest.raises(ValueError, match="does not have"):
        delta_prediction(delta.full, preset_config("tiny", torch_dtype="bfloat16"), density=density)


# --- the command line ---------------------------------------------------------------------------


def _options(**delta) -> SimulateOptions:
    return SimulateOptions(
        trainer_gpus=32,
        trainer_tp=4,
        trainer_ep=1,
        trainer_pp=None,
        trainer_dp=None,
        rollout_gpus=16,
        rollout_tp=4,
        rollout_ep=None,
        replicas=None,
        nic_gbps=200.0,
        gpus_per_node=8,
        nics_per_node=8,
        fp8=None,
        num_windows=4,
        plot=None,
        **delta,
    )


def _bundled(name: str) -> dict:
    from importlib import resources

    return json.loads((resources.files("weightsync") / "configs" / f"{name}.json").read_text())


def test_simulation_prints_the_delta_beside_the_full_sync(capsys) -> None:
    config = _bundled("qwen3-30b-a3b")
    run_simulation(config, _options(delta_density=0.02), label="qwen3-30b-a3b", as_json=True)
    summary = json.loads(capsys.readouterr().out)
    delta = summary["delta"]
    assert delta["density"] == {
        "elements": 0.02,
        "fp8_codes": pytest.approx(0.002),
        "fp8_scales": 1.0,
    }
    assert delta["full_s"] == summary["makespan_s"]
    assert delta["full_lower_bound_s"] == summary["ideal_lower_bound_s"]
    assert delta["total_s"] == pytest.approx(
        delta["encode_s"] + delta["wire_s"] + delta["replica_s"]
    )
    # bf16 at 2 %: four bytes a changed element against two, plus the tables.
    assert 0.04 < delta["byte_ratio"] < 0.045
    assert delta["bytes"] == pytest.approx(delta["byte_ratio"] * summary["bytes"])
    assert delta["total_s"] < summary["makespan_s"]
    assert delta["bound_by"] in ("encode", "wire", "replica")
    run_simulation(config, _options(), label="qwen3-30b-a3b", as_json=True)
    assert "delta" not in json.loads(capsys.readouterr().out)
    run_simulation(
        config,
        _options(delta_density=0.05, delta_fp8_code_density=0.01, delta_fp8_scale_density=0.5),
        label="qwen3-30b-a3b",
        as_json=False,
    )
    out = capsys.readouterr().out
    for text in ("Predicted delta sync: 5.00% of elements changed", "replica", "delta total"):
        assert text in out
    assert "FP8 codes 1.00%, scales 50%" in out


@pytest.mark.parametrize(
    ("delta", "option", "message"),
    [
        ({"delta_density": 1.5}, "--delta-density", "must be a fraction in [0, 1], got 1.5"),
        ({"delta_density": -0.01}, "--delta-density", "must be a fraction"),
        (
            {"delta_density": 0.02, "delta_fp8_code_density": 2.0},
            "--delta-fp8-code-density",
            "must be a fraction",
        ),
        ({"delta_fp8_scale_density": 0.5}, "--delta-fp8-scale-density", "add --delta-density"),
    ],
)
def test_simulation_refuses_bad_densities(delta, option, message) -> None:
    with pytest.raises(SimulateOptionError, match=re.escape(message)) as info:
        run_simulation(_bundled("qwen3-30b-a3b"), _options(**delta), label="q", as_json=True)
    assert info.value.option == option
