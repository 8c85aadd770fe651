"""The per-sync digest: its sample, its partial sums, and the two vectorized sums that must
agree with it (the sender's over the staging ring, the replica's over its parameters)."""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.layout.digest import (
    MAX_STRIDE,
    SAMPLES_PER_PARAMETER,
    digest_of,
    num_samples,
    run_digest,
    sample_positions,
    sample_run,
    sample_stride,
    weight,
)
from weightsync.receiver.digest import ParameterDigests
from weightsync.sender.digest import expand_spans

SIZES = st.integers(min_value=1, max_value=5 * MAX_STRIDE)


@given(SIZES)
def test_every_parameter_is_sampled_evenly_with_its_first_and_last_byte(num_bytes: int) -> None:
    positions = [p for _, p in sample_positions(num_bytes)]
    assert positions == sorted(set(positions))
    assert positions[0] == 0 and positions[-1] == num_bytes - 1
    assert len(positions) == num_samples(num_bytes)
    stride = sample_stride(num_bytes)
    assert stride <= MAX_STRIDE
    # No gap longer than the stride: any run of `stride` bytes holds a sample.
    assert all(b - a <= stride for a, b in itertools.pairwise(positions))
    assert len(positions) <= SAMPLES_PER_PARAMETER + 1 + num_bytes // MAX_STRIDE


@settings(deadline=None, max_examples=60)
@given(SIZES, st.data())
def test_partial_digests_of_any_split_add_up_to_the_whole(num_bytes: int, data) -> None:
    cuts = sorted(
        set(data.draw(st.lists(st.integers(1, max(1, num_bytes - 1)), max_size=6))) - {num_bytes}
    )
    edges = [0, *cuts, num_bytes]
    rng = random.Random(num_bytes)
    payload = rng.randbytes(num_bytes)
    parts = [run_digest(payload[lo:hi], num_bytes, lo) for lo, hi in itertools.pairwise(edges)]
    assert sum(parts) == digest_of(payload)


def test_a_run_knows_its_samples() -> None:
    stride = sample_stride(1000)
    assert stride == 16
    run = sample_run(1000, 10, 40)  # bytes 10..49: samples 16, 32, 48
    assert (run.first_offset, run.count, run.first_k, run.tail_offset) == (6, 3, 1, -1)
    tail = sample_run(1000, 990, 10)  # 992 is sample 62, and the last byte 999 its tail
    assert (tail.count, tail.first_k, tail.tail_offset, tail.tail_k) == (1, 62, 9, 63)
    assert sample_run(1000, 993, 5).count == 0  # between samples: nothing to read
    with pytest.raises(ValueError, match="not a run"):
        sample_run(1000, 990, 20)


def test_the_digest_sees_a_changed_sampled_byte_and_a_swap() -> None:
    payload = bytearray(range(256)) * 40
    base = digest_of(bytes(payload))
    for k, position in sample_positions(len(payload))[:20]:
        changed = bytearray(payload)
        changed[position] ^= 0xFF
        assert digest_of(bytes(changed)) != base, (k, position)
    # Two sampled bytes swapped: the weights differ by position.
    (_, a), (_, b) = sample_positions(len(payload))[3:5]
    swapped = bytearray(payload)
    swapped[a], swapped[b] = swapped[b], swapped[a]
    assert payload[a] != payload[b]
    assert digest_of(bytes(swapped)) != base
    # Zeros (a parameter never written) differ from any real payload's digest.
    assert digest_of(bytes(len(payload))) != base


def test_every_term_fits_an_int64_however_large_the_parameter() -> None:
    largest = 1 << 43  # 8 TiB
    count = num_samples(largest)
    assert 256 * max(weight(k) for k in range(count - 3, count)) * count < 1 << 63
    assert 256 * ((1 << 31) - 1) * count < 1 << 63


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_the_replica_sums_match_the_reference_per_parameter(
    dtype: torch.dtype, device: str
) -> None:
    torch.manual_seed(0)
    # Some parameters in one flat buffer (carved), the others each in their own storage.
    flat = torch.randint(0, 255, (10_000,), dtype=torch.uint8, device=device)
    params = {
        "carved.a": flat[:4000].view(dtype),
        "carved.b": flat[4000:9000].view(dtype),
        "own.c": (torch.randn(333, device=device) * 100).to(dtype),
        "own.d": torch.ones(1, device=device).to(dtype),
    }
    digests = ParameterDigests(params)
    for name, value in digests.compute().items():
        assert value == digest_of(_raw(params[name])), name
    before = digests.compute()
    # Written in place, as a sync writes (on a GPU: the captured graph reads the new bytes).
    params["carved.b"].view(torch.uint8)[0] += 1  # sample 0 of carved.b
    params["own.d"].view(torch.uint8)[-1] += 1  # the last byte, a sample of its own
    again = digests.compute()
    assert again["carved.b"] != before["carved.b"]
    assert again["carved.b"] == digest_of(_raw(params["carved.b"]))
    assert again["own.d"] == digest_of(_raw(params["own.d"])) != before["own.d"]
    changed = {"carved.b", "own.d"}
    assert {k: v for k, v in again.items() if k not in changed} == {
        k: v for k, v in before.items() if k not in changed
    }


@pytest.mark.parametrize("device", DEVICES)
def test_a_launched_digest_is_what_the_bytes_held_at_its_launch(device: str) -> None:
    # Launched, then the bytes change behind it (on a GPU: later on the same stream, as a
    # writer that waited for the launch's event): collect gives what they held before.
    params = {"a": torch.arange(4096, dtype=torch.int32, device=device)}
    digests = ParameterDigests(params)
    before = digests.compute()
    handle = digests.launch()
    assert (handle is not None) == (device == "cuda") == digests.on_gpu
    if handle is not None:
        assert len(bytes.fromhex(handle)) == 64  # a cudaIpcEventHandle_t
        assert digests.launch() == handle  # one event, recorded anew; the pending one read
    params["a"].view(torch.uint8)[0] += 1
    assert digests.collect() == before
    with pytest.raises(RuntimeError, match="without a launch"):
        digests.collect()
    assert digests.compute() != before


@pytest.mark.parametrize("device", DEVICES)
def test_value_tensors_follow_the_names_and_order_puts_other_digests_in_it(device: str) -> None:
    params = {
        "z": torch.arange(100, dtype=torch.int32, device=device),
        "a": torch.ones(7, dtype=torch.bfloat16, device=device),
    }
    digests = ParameterDigests(params)
    assert digests.names == ("z", "a")
    values = digests.compute_values()
    assert values.dtype == np.int64
    assert values.tolist() == [digest_of(_raw(params[n])) for n in ("z", "a")]
    # An array of its own: the next digest does not change it.
    params["a"].view(torch.uint8)[0] += 1
    assert digests.compute_values()[1] != values[1]
    as_dict = {"a": int(values[1]), "z": int(values[0])}
    assert np.array_equal(digests.order(as_dict), values)
    # Missing, or no int64: -1, which no digest equals.
    assert digests.order({"a": 5}).tolist() == [-1, 5]
    assert digests.order({"z": 1 << 70, "a": -(1 << 70)}).tolist() == [-1, -1]


def test_the_sender_sums_of_spans_match_the_reference() -> None:
    from weightsync.plan.program import SampleSpan

    rng = random.Random(1)
    num_bytes = 5000
    payload = rng.randbytes(num_bytes)
    # The parameter staged in three runs at scattered ring offsets, in two steps.
    ring = bytearray(20_000)
    pieces = [(0, 1234, 100), (1234, 3000, 9000), (3000, 5000, 15000)]
    spans, groups = [], []
    for step, (lo, hi, at) in enumerate(pieces):
        ring[at : at + hi - lo] = payload[lo:hi]
        run = sample_run(num_bytes, lo, hi - lo)
        spans.append(
            SampleSpan(
                ring_offset=at + run.first_offset,
                stride=run.stride,
                count=run.count,
                first_k=run.first_k,
                tail_offset=at + run.tail_offset if run.tail_offset >= 0 else -1,
                tail_k=run.tail_k,
                digest=0,
            )
        )
        groups.append(min(step, 1))
    offsets, weights, slots, bounds = expand_spans(spans, groups, 2)
    assert bounds.tolist()[0] == 0 and bounds.tolist()[-1] == offsets.numel()
    ring_tensor = torch.tensor(list(ring), dtype=torch.uint8)
    total = int(((ring_tensor[offsets].to(torch.int64) + 1) * weights).sum())
    assert set(slots.tolist()) == {0}
    assert total == digest_of(payload)


GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("_", [pytest.param(None, marks=GPU)])
def test_a_gate_holds_its_stream_until_the_host_opens_it(_) -> None:
    from weightsync.cuda_events import StreamGate, wait_reached

    device = torch.device("cuda", 0)
    assert StreamGate.supported(device)
    gate = StreamGate(device)
    stream = torch.cuda.Stream(device)
    target = torch.zeros(1 << 20, device=device)
    for value in (1.0, 2.0):  # closed again after it was opened
        gate.close(stream)
        assert not gate.is_open
        with torch.cuda.stream(stream):
            target.fill_(value)
        done = torch.cuda.Event()
        done.record(stream)
        time.sleep(0.05)
        assert not done.query() and int(target[0].item()) == value - 1
        gate.open()
        assert gate.is_open and wait_reached([done], 10.0)
        assert torch.all(target == value)


@pytest.mark.parametrize("_", [pytest.param(None, marks=GPU)])
def test_a_gated_digest_reads_the_bytes_of_when_the_gate_opens(_) -> None:
    from weightsync.cuda_events import StreamGate

    device = torch.device("cuda", 0)
    params = {"a": torch.arange(4096, dtype=torch.int32, device=device)}
    digests = ParameterDigests(params)
    before = digests.compute()
    gate = StreamGate(device)
    digests.launch(gate)
    # Written after the launch, before the gate opens: the digest sees the new bytes.
    params["a"].view(torch.uint8)[0] += 1
    # This stream alone: a device-wide sync would wait for the held one, for ever.
    torch.cuda.current_stream(device).synchronize()
    gate.open()
    after = digests.collect()
    assert after != before and after == {"a": digest_of(_raw(params["a"]))}
    # Never opened by its holder: collect opens it, and does not wait for ever.
    digests.launch(gate)
    assert digests.collect() == after and gate.is_open


def test_without_a_gpu_no_gate_is_made() -> None:
    from weightsync.cuda_events import StreamGate

    assert not StreamGate.supported(torch.device("cpu"))
