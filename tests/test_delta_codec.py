"""The delta payload and the checksum both ends share: round trips, refusals, linearity."""

from __future__ import annotations

import pytest
import torch

from weightsync.delta_codec import (
    BLOCK_ELEMENTS,
    CHECK_ROW_WORDS,
    DeltaFormatError,
    Section,
    apply_payload,
    as_bits,
    checksum_change,
    checksum_tensor,
    checksums,
    encode_payload,
    payload_size,
)

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float16]


def _params(generator: torch.Generator) -> list[torch.Tensor]:
    shapes = [(3,), (1000,), (BLOCK_ELEMENTS * 2 + 77,), (CHECK_ROW_WORDS * 9 + 5,)]
    params = []
    for i, shape in enumerate(shapes):
        dtype = DTYPES[i % len(DTYPES)]
        values = torch.randn(shape, generator=generator).to(dtype)
        params.append(values)
    return params


def _changes(params, generator, density):
    """Random sparse changes per parameter: ``[(index, elements, new bits)]``."""
    out = []
    for index, param in enumerate(params):
        mask = torch.rand(param.numel(), generator=generator) < density
        elements = mask.nonzero().reshape(-1)
        bits = as_bits(param)
        new = torch.randint(-100, 100, (elements.numel(),), generator=generator).to(bits.dtype)
        new = torch.where(new == bits[elements], new + 1, new)
        out.append((index, elements, new))
    return out


@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.9])
def test_payload_round_trip_is_bit_exact_and_checksums_predict_the_result(density) -> None:
    generator = torch.Generator().manual_seed(7)
    params = _params(generator)
    expected = [p.clone() for p in params]
    sections, predicted = [], []
    for index, elements, new in _changes(params, generator, density):
        old = as_bits(params[index])[elements]
        as_bits(expected[index])[elements] = new
        sections.append(Section(param_index=index, elements=elements, values=new))
        change = checksum_change(elements, old, new, numel=params[index].numel())
        predicted.append(int(checksum_tensor(params[index]) + change))
    payload = encode_payload(sections, "cpu")
    assert payload_size(sections).num_bytes == payload.numel()
    applied = apply_payload(payload, params)
    assert applied.num_elements == sum(s.values.numel() for s in sections)
    for index, param in enumerate(params):
        assert torch.equal(as_bits(param), as_bits(expected[index]))
        assert int(checksum_tensor(param)) == predicted[index]


def test_dense_sections_write_runs() -> None:
    param = torch.zeros(100, dtype=torch.bfloat16)
    values = as_bits(torch.arange(10, dtype=torch.bfloat16))
    payload = encode_payload(
        [Section(param_index=0, elements=None, values=values, start=40)], "cpu"
    )
    apply_payload(payload, [param])
    assert torch.equal(param[40:50], torch.arange(10, dtype=torch.bfloat16))
    assert int(param[:40].abs().sum()) == 0 and int(param[50:].abs().sum()) == 0


def test_unsorted_elements_still_round_trip() -> None:
    param = torch.zeros(BLOCK_ELEMENTS * 3, dtype=torch.int16)
    elements = torch.tensor([BLOCK_ELEMENTS * 2 + 5, 3, BLOCK_ELEMENTS + 1, 4])
    values = torch.tensor([1, 2, 3, 4], dtype=torch.int16)
    apply_payload(
        encode_payload([Section(param_index=0, elements=elements, values=values)], "cpu"), [param]
    )
    assert param[elements].tolist() == [1, 2, 3, 4]


def _one_sparse(numel=10, element=3):
    param = torch.zeros(numel, dtype=torch.int16)
    section = Section(
        param_index=0,
        elements=torch.tensor([element]),
        values=torch.tensor([9], dtype=torch.int16),
    )
    return param, encode_payload([section], "cpu")


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("magic", "not a weightsync delta"),
        ("truncated", "bytes but"),
        ("param_index", "names parameter"),
        ("past_end", "reaches past"),
    ],
)
def test_a_payload_that_does_not_fit_changes_nothing(how, message) -> None:
    param, payload = _one_sparse()
    if how == "magic":
        payload[0] ^= 1
    elif how == "truncated":
        payload = payload[:-8]
    elif how == "param_index":
        payload[64:72].view(torch.int64)[0] = 5
    elif how == "past_end":
        param = torch.zeros(3, dtype=torch.int16)  # element 3 does not exist
    before = param.clone()
    with pytest.raises(DeltaFormatError, match=message):
        apply_payload(payload, [param])
    assert torch.equal(param, before)


def test_checksum_sees_one_flipped_bit_anywhere_and_a_swap() -> None:
    generator = torch.Generator().manual_seed(3)
    param = torch.randn(CHECK_ROW_WORDS * 4 * 3 + 7, generator=generator).to(torch.bfloat16)
    base = int(checksum_tensor(param))
    bits = as_bits(param)
    for element in (0, 1, 5, CHECK_ROW_WORDS * 4, bits.numel() - 1):
        flipped = bits.clone()
        flipped[element] ^= 1
        assert int(checksum_tensor(flipped)) != base
    swapped = bits.clone()
    swapped[[10, 11]] = bits[[11, 10]]
    if bits[10] != bits[11]:
        assert int(checksum_tensor(swapped)) != base


def test_checksums_of_many_parameters_and_unaligned_views() -> None:
    flat = torch.arange(101, dtype=torch.int16)
    params = {"a": flat[1:50], "b": flat[50:]}  # a starts 2 bytes past an 8-byte boundary
    sums = checksums(params)
    assert sums == {
        "a": int(checksum_tensor(flat[1:50].clone())),
        "b": int(checksum_tensor(flat[50:].clone())),
    }


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_the_host_and_device_checksum_changes_agree(dtype) -> None:
    from weightsync.delta_codec import _device_change, _host_change, _weights

    generator = torch.Generator().manual_seed(9)
    numel = CHECK_ROW_WORDS * 8 + 13  # a grid and a tail
    param = torch.randn(numel, generator=generator).to(dtype)
    elements = torch.randperm(numel, generator=generator)[: numel // 3]
    bits = as_bits(param)
    new = torch.randint(-128, 127, (elements.numel(),), generator=generator).to(bits.dtype)
    size = bits.element_size()
    weights = _weights((numel * size + 7) // 8, torch.device("cpu"))
    host = _host_change(elements, bits[elements], new, *weights)
    device = int(_device_change(elements, bits[elements], new, *weights))
    changed = bits.clone()
    changed[elements] = new
    assert host == device == int(checksum_tensor(changed) - checksum_tensor(param))
