"""`DeltaReference.encode`: the changed elements of a tensor against the bytes last pushed,
found on the host in chunks (eight bytes at a time, the reference updated where words
differ) or at once on the tensor's device, against a plain element-by-element compare."""

from __future__ import annotations

import pytest
import torch

from weightsync.delta_codec import as_bits
from weightsync.sender import delta_reference
from weightsync.sender.delta_reference import DeltaReference, _device_changes

CASES = [
    # (rollout dtype name, its torch dtype, the trainer's dtype)
    ("bfloat16", torch.bfloat16, torch.float32),
    ("bfloat16", torch.bfloat16, torch.bfloat16),
    ("float16", torch.float16, torch.float32),
    ("float32", torch.float32, torch.float32),
    ("float8_e4m3fn", torch.float8_e4m3fn, torch.bfloat16),
    ("float64", torch.float64, torch.float32),
]


def _expected(before: torch.Tensor, after: torch.Tensor):
    """``(elements, old, new)`` by a plain compare of two tensors' bits."""
    old, new = as_bits(before.reshape(-1)), as_bits(after.reshape(-1))
    elements = (old != new).nonzero().reshape(-1)
    return elements, old[elements], new[elements]


@pytest.mark.parametrize(("name", "dtype", "source"), CASES)
@pytest.mark.parametrize("numel", [1, 3, 4099, (1 << 18) * 2 + 5])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.7])
def test_host_encode_finds_every_changed_element_and_updates_the_reference(
    name, dtype, source, numel, density, monkeypatch
) -> None:
    monkeypatch.setattr(delta_reference, "_HOST_CHUNK", 1 << 12)  # many chunks, a tail
    generator = torch.Generator().manual_seed(numel)
    weights = torch.randn(numel, generator=generator).to(source)
    reference = DeltaReference("host")
    reference.record(name, "w", weights.to(dtype))
    for step in range(2):
        mask = torch.rand(numel, generator=generator) < density
        moved = weights.to(torch.float32) * (1 + 0.05 * (step + 1))
        weights = torch.where(mask, moved, weights.to(torch.float32)).to(source)
        before = reference._refs[(name, "w")].clone()
        changes = reference.encode(name, "w", weights)
        elements, old, new = _expected(before, weights.to(dtype))
        assert torch.equal(changes.elements, elements)
        assert torch.equal(changes.old, old) and torch.equal(changes.new, new)
        assert changes.numel == numel and changes.elements.dtype == torch.int64
        assert torch.equal(reference._refs[(name, "w")], as_bits(weights.to(dtype)))


def test_views_that_are_strided_or_unaligned_are_read_as_their_values() -> None:
    generator = torch.Generator().manual_seed(1)
    reference = DeltaReference("host")
    base = torch.randn(64, 33, generator=generator).to(torch.bfloat16)
    strided = base[:, 1:]  # rows of 32 elements, 33 apart: not contiguous
    unaligned = base.reshape(-1)[1:2049]  # two bytes past an 8-byte boundary
    for key, view in (("strided", strided), ("unaligned", unaligned)):
        reference.record("bfloat16", key, view.contiguous())
        changed = view.clone()
        changed.reshape(-1)[::7] += 1
        base_view = view.contiguous().clone()
        view.copy_(changed)
        changes = reference.encode("bfloat16", key, view)
        elements, old, new = _expected(base_view, changed)
        assert elements.numel() and torch.equal(changes.elements, elements)
        assert torch.equal(changes.old, old) and torch.equal(changes.new, new)


def test_the_whole_tensor_compare_agrees_with_the_host_chunks() -> None:
    # The compare a device reference runs (here on host tensors: the same torch ops).
    generator = torch.Generator().manual_seed(2)
    weights = torch.randn(10_001, generator=generator)
    ref = as_bits(weights.to(torch.bfloat16)).clone()
    host = DeltaReference("host")
    host.record("bfloat16", "w", weights.to(torch.bfloat16))
    weights[::13] *= 1.01
    bits = as_bits(weights.to(torch.bfloat16))
    whole = _device_changes(bits, ref)
    chunked = host.encode("bfloat16", "w", weights)
    assert torch.equal(whole.elements, chunked.elements)
    assert torch.equal(whole.old, chunked.old) and torch.equal(whole.new, chunked.new)
    assert torch.equal(ref, bits)


def test_a_tensor_without_a_reference_is_refused() -> None:
    reference = DeltaReference("host")
    reference.record("bfloat16", "w", torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no delta reference of 'v'"):
        reference.encode("bfloat16", "v", torch.zeros(8))
    with pytest.raises(ValueError, match="no delta reference of 'w'"):
        reference.encode("bfloat16", "w", torch.zeros(9))


def test_the_fused_encode_runs_only_for_large_tensors_that_need_a_cast() -> None:
    """Where the H200 measured the kernel slower (no cast, or small tensors), torch's ops
    find the changes."""
    from weightsync.delta_kernels import FUSED_CAST_ELEMENTS, fuses

    big = FUSED_CAST_ELEMENTS
    assert fuses(torch.float32, torch.bfloat16, big)
    assert not fuses(torch.float32, torch.bfloat16, big - 1)
    assert not fuses(torch.bfloat16, torch.bfloat16, big * 4)
    assert not fuses(torch.bfloat16, torch.float8_e4m3fn, big)  # a cast it does not make


@pytest.mark.parametrize(("name", "dtype", "source"), [CASES[0], CASES[5]])
def test_changes_stay_what_they_were_while_later_tensors_are_encoded(
    name, dtype, source, monkeypatch
) -> None:
    """The changes the host encoder returned for one tensor are their own memory, untouched
    by the tensors encoded after it (a push holds them until it lays its payloads out), for
    elements split out of 8-byte words and for 8-byte elements alike."""
    monkeypatch.setattr(delta_reference, "_HOST_CHUNK", 1 << 12)
    generator = torch.Generator().manual_seed(3)
    reference = DeltaReference("host")
    tensors = {n: torch.randn(n * 1000 + 7, generator=generator).to(source) for n in (5, 50, 9)}
    for n, weights in tensors.items():
        reference.record(name, f"w{n}", weights.to(dtype))
    found, kept = [], []
    for n, weights in tensors.items():
        moved = (weights.to(torch.float32) * 1.5).to(source)
        changes = reference.encode(name, f"w{n}", moved)
        assert changes.elements.numel() > 0
        found.append(changes)
        kept.append((changes.elements.clone(), changes.old.clone(), changes.new.clone()))
    for changes, (elements, old, new) in zip(found, kept, strict=True):
        assert torch.equal(changes.elements, elements)
        assert torch.equal(changes.old, old) and torch.equal(changes.new, new)
