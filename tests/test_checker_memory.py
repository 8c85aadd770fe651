"""Where the weights checker keeps its snapshot, and how a rank out of memory is described.

The GPU side runs in tests/test_checker_gpu.py; here the decision is a pure function fed with
free and total numbers, and the host path runs with CPU tensors."""

from __future__ import annotations

import math

import pytest
import torch

from weightsync.receiver import checker as checker_module
from weightsync.receiver.checker import (
    WeightsChecker,
    gpu_headroom_bytes,
    snapshot_fits_on_gpu,
)
from weightsync.server.ranks.memory import describe_out_of_memory, is_out_of_memory

GIB = 1 << 30
H200 = 150_754_820_096  # what torch.cuda.mem_get_info reports as an H200's total


@pytest.mark.parametrize(
    ("total", "headroom"),
    [
        (16 * GIB, 2 * GIB),
        (20 * GIB, 2 * GIB),
        (24 * GIB, math.ceil(2.4 * GIB)),
        (H200, 15075482010),
    ],
)
def test_the_headroom_is_the_larger_of_2_gib_and_a_tenth(total, headroom):
    assert gpu_headroom_bytes(total) == headroom


@pytest.mark.parametrize(
    ("snapshot", "free", "total", "on_gpu"),
    [
        # The case: a 61 GB replica beside a 61 GB trainer on one H200.
        (61 * GIB, H200 - 122 * GIB, H200, False),
        # The same replica alone on the GPU: the copy fits with 14 GiB to spare.
        (61 * GIB, H200 - 61 * GIB, H200, True),
        # Exactly the headroom left over is enough; a byte less is not.
        (10 * GIB, 10 * GIB + gpu_headroom_bytes(H200), H200, True),
        (10 * GIB, 10 * GIB + gpu_headroom_bytes(H200) - 1, H200, False),
        # A small GPU keeps 2 GiB.
        (1 * GIB, 3 * GIB, 16 * GIB, True),
        (1 * GIB, 3 * GIB - 1, 16 * GIB, False),
        # More than is free never fits.
        (8 * GIB, 4 * GIB, 80 * GIB, False),
        (0, 0, 80 * GIB, False),
    ],
)
def test_a_gpu_snapshot_must_leave_the_headroom_free(snapshot, free, total, on_gpu):
    assert (
        snapshot_fits_on_gpu(snapshot_bytes=snapshot, free_bytes=free, total_bytes=total) is on_gpu
    )


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "big.weight": torch.randn(10, 7),  # 70 elements: several chunks of 16
        "half.weight": torch.randn(33).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
    }


def test_a_host_snapshot_compares_chunk_by_chunk(monkeypatch):
    monkeypatch.setattr(checker_module, "CHUNK_NUMEL", 16)
    params = _params()
    ptrs = {name: t.data_ptr() for name, t in params.items()}
    checker = WeightsChecker(params)
    taken = checker.run("snapshot")
    assert taken.success
    assert taken.message.endswith("taken in host memory for cpu"), taken.message
    assert taken.details == {"snapshot_memory": {"cpu": "host"}}
    expected = {name: t.clone() for name, t in params.items()}
    assert checker.run("compare").success

    checker.run("snapshot")
    big = params["big.weight"].view(-1)
    # Differences in the first, a middle and the last chunk.
    changes = {0: 1.5, 20: -2.0, 69: 0.25}
    for index, delta in changes.items():
        big[index] += delta
    report = checker.run("compare")
    assert not report.success
    diff = report.details["differing"]["big.weight"]
    assert diff["num_different"] == len(changes) and diff["numel"] == 70
    errors = (big.double() - expected["big.weight"].view(-1).double()).abs()
    assert diff["max_abs_error"] == pytest.approx(float(errors.max()))
    assert diff["mean_abs_error"] == pytest.approx(float(errors.sum()) / 70)
    assert set(report.details["differing"]) == {"big.weight"}
    assert not checker.has_snapshot
    assert {name: t.data_ptr() for name, t in params.items()} == ptrs
    # A NaN in a middle chunk makes the errors NaN, as a whole-tensor compare would.
    checker.run("snapshot")
    big[47] = float("nan")
    nan = checker.run("compare").details["differing"]["big.weight"]
    assert nan["num_different"] == 1
    assert math.isnan(nan["max_abs_error"]) and math.isnan(nan["mean_abs_error"])


def test_reset_draws_chunk_by_chunk_in_place(monkeypatch):
    monkeypatch.setattr(checker_module, "CHUNK_NUMEL", 16)
    params = _params()
    before = {name: t.clone() for name, t in params.items()}
    ptrs = {name: t.data_ptr() for name, t in params.items()}
    checker = WeightsChecker(params)
    checker.run("snapshot")
    assert checker.run("reset_tensors", seed=7).success
    assert {name: t.data_ptr() for name, t in params.items()} == ptrs
    # Every chunk of the float parameters was drawn: none is left as it was.
    drawn = params["big.weight"].view(-1).split(16)
    for chunk, old in zip(drawn, before["big.weight"].view(-1).split(16), strict=True):
        assert not torch.equal(chunk, old)
    report = checker.run("compare")
    assert set(report.details["differing"]) >= {"big.weight", "half.weight"}


def test_a_snapshot_beyond_what_the_host_reports_available_is_warned_of(monkeypatch, caplog):
    # Not refused: virtual machines that grow their memory on demand report too little.
    monkeypatch.setattr(checker_module, "host_available_bytes", lambda: 100)
    params = _params()
    need = sum(t.numel() * t.element_size() for t in params.values())
    checker = WeightsChecker(params)
    with caplog.at_level("WARNING", logger="weightsync.receiver.checker"):
        assert checker.run("snapshot").success
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"needs {need} bytes of host memory ({need} bytes for cpu)" in warning, warning
    assert "reports 100 bytes available (MemAvailable)" in warning, warning
    assert checker.run("compare").success


def test_an_out_of_memory_on_the_gpu_is_described_with_its_sizes():
    failure = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "139.81 GiB of which 1.02 GiB is free. Process 4242 has 138.78 GiB memory in use. Of "
        "the allocated memory 120.00 GiB is allocated by PyTorch, and 17.00 GiB is reserved "
        "by PyTorch but unallocated."
    )
    assert is_out_of_memory(failure)
    message = describe_out_of_memory(
        failure, what="weights_checker reset_tensors", tp_rank=1, device=torch.device("cuda:0")
    )
    assert message == (
        "out of memory on tp rank 1 (cuda:0) in weights_checker reset_tensors: asked for "
        "2.00 GiB of GPU memory; 1.02 GiB of 139.81 GiB was free on the GPU"
    )


def test_an_out_of_memory_on_the_host_is_described_with_its_sizes():
    try:
        torch.empty(1 << 60, dtype=torch.uint8)
    except RuntimeError as exc:
        failure = exc
    else:
        pytest.skip("this host granted 2**60 bytes")
    assert is_out_of_memory(failure)
    message = describe_out_of_memory(
        failure, what="generate", tp_rank=0, device=torch.device("cpu")
    )
    assert message.startswith(
        f"out of memory on tp rank 0 (cpu) in generate: asked for {1 << 60} bytes "
        "(1073741824.00 GiB) of host memory; the host has "
    ), message
    assert "available now (MemAvailable)" in message
    # A MemoryError's own words come first, the host's memory after them.
    said = describe_out_of_memory(
        MemoryError("a 5 GB buffer"), what="x", tp_rank=0, device=torch.device("cpu")
    )
    assert said.startswith("out of memory on tp rank 0 (cpu) in x: a 5 GB buffer; the host ")
    bare = describe_out_of_memory(MemoryError(), what="x", tp_rank=0, device=torch.device("cpu"))
    assert bare.startswith("out of memory on tp rank 0 (cpu) in x: a host allocation failed;")
    assert not is_out_of_memory(RuntimeError("probability tensor contains inf"))
    assert not is_out_of_memory(ValueError("bad"))
