"""The delta payload and the checksum both ends share: round trips, refusals, linearity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.delta_codec import (
    BLOCK_ELEMENTS,
    CHECK_ROW_WORDS,
    DeltaFormatError,
    Section,
    _check_section,
    _payload_tables,
    _sections_fit,
    apply_and_check,
    apply_payload,
    as_bits,
    checksum_change,
    checksum_tensor,
    checksums,
    encode_payload,
    lay_out,
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


def test_a_payload_laid_out_in_used_memory_is_the_same_bytes() -> None:
    """Written into memory that held other bytes (a sender's reused buffer, at an offset),
    a payload is byte for byte what a fresh one is, its padding included; memory too small
    or not bytes is refused before anything is written."""
    generator = torch.Generator().manual_seed(11)
    params = _params(generator)
    sections = [
        Section(param_index=index, elements=elements, values=new)
        for index, elements, new in _changes(params, generator, 0.05)
    ]
    sections.append(
        Section(param_index=0, elements=None, values=as_bits(params[0])[:3].clone(), start=0)
    )
    fresh = encode_payload(sections, "cpu")
    layout = lay_out(sections)
    assert layout.num_bytes == fresh.numel() == payload_size(sections).num_bytes
    used = torch.full((fresh.numel() + 64,), 0xAB, dtype=torch.uint8)
    layout.write(used[8:])
    assert torch.equal(used[8 : 8 + fresh.numel()], fresh)
    assert (used[:8] == 0xAB).all() and (used[8 + fresh.numel() :] == 0xAB).all()
    small = torch.full((fresh.numel() - 8,), 0xAB, dtype=torch.uint8)
    with pytest.raises(ValueError, match="at least that large"):
        layout.write(small)
    assert (small == 0xAB).all()
    with pytest.raises(ValueError, match="at least that large"):
        layout.write(torch.zeros(fresh.numel(), dtype=torch.int16))


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
@pytest.mark.parametrize("rows", [8, 300], ids=["one-pass", "several-passes"])
def test_the_host_and_device_checksum_changes_agree(dtype, rows) -> None:
    """The host's change (in passes of `_CHANGE_CHUNK` elements, in any order, some in the
    grid's partial last row) is the device's and the checksums' difference."""
    from weightsync.delta_codec import _device_change, _host_change, _weights

    generator = torch.Generator().manual_seed(9)
    numel = CHECK_ROW_WORDS * rows + 13  # a grid and a tail
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


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("numel", [1, 7, CHECK_ROW_WORDS * 3, CHECK_ROW_WORDS * 700 + 3])
def test_the_host_checksum_is_the_device_checksum(dtype, numel) -> None:
    from weightsync.delta_codec import _device_checksum, _words

    generator = torch.Generator().manual_seed(numel)
    param = torch.randn(numel + 1, generator=generator).to(dtype)[1:]  # maybe unaligned
    host = checksums({"p": param})["p"]
    assert host == int(checksum_tensor(param)) == int(_device_checksum(_words(param)))


def _named(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A rank's parameters by name (numbered by sorted name in payloads)."""
    return {f"p{i}": p for i, p in enumerate(_params(generator))}


def _payloads(params, generator, density, *, dense=False):
    """Two payloads of random changes of `params` (the second over the first's result, the
    same parameters again), the parameters they leave and the checksums they imply."""
    target = {n: p.clone() for n, p in params.items()}
    names = sorted(target)
    payloads = []
    for _ in range(2):
        sections = []
        for index, elements, new in _changes([target[n] for n in names], generator, density):
            if dense and index == 1 and elements.numel():
                start, stop = int(elements.min()), int(elements.max()) + 1
                values = as_bits(target[names[index]])[start:stop].clone()
                values[elements - start] = new
                sections.append(
                    Section(param_index=index, elements=None, values=values, start=start)
                )
                as_bits(target[names[index]])[start:stop] = values
                continue
            sections.append(Section(param_index=index, elements=elements, values=new))
            as_bits(target[names[index]])[elements] = new
        payloads.append(encode_payload(sections, "cpu"))
    return payloads, target, checksums(target)


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3])
@pytest.mark.parametrize("dense", [False, True])
def test_the_changes_check_derives_what_a_full_pass_reads(density, dense) -> None:
    generator = torch.Generator().manual_seed(5)
    params = _named(generator)
    base = checksums(params)
    payloads, target, expected = _payloads(params, generator, density, dense=dense)
    checked = apply_and_check(payloads, params, expected, base=base)
    assert checked.check == "changes" and checked.recomputed == ()
    assert checked.refused is None and not checked.mismatched and not checked.unexpected
    assert checked.checksums == checksums(params) == expected
    assert all(torch.equal(as_bits(params[n]), as_bits(target[n])) for n in params)


def _one_change(params, name, elements):
    """A payload setting `elements` of `params[name]` to new bits, the checksums after."""
    order = sorted(params).index(name)
    bits = as_bits(params[name])
    index = torch.tensor(elements, dtype=torch.int64)
    new = bits[index] ^ 0x11
    after = bits.clone()
    after[index] = new
    sums = checksums(params)
    sums[name] = int(checksum_tensor(after))
    section = Section(param_index=order, elements=index, values=new)
    return encode_payload([section], "cpu"), sums


def test_a_wrong_value_in_a_payload_fails_the_changes_check() -> None:
    params = _named(torch.Generator().manual_seed(6))
    base = checksums(params)
    payload, expected = _one_change(params, "p2", [4, 70_000, 100_001])
    # The last value's low byte, as a flipped bit on the wire would change it.
    payload[-8] ^= 0x01
    checked = apply_and_check([payload], params, expected, base=base)
    assert checked.check == "changes"
    assert checked.mismatched == ("p2",)
    assert checked.checksums["p2"] == checksums(params)["p2"]  # derived = what it holds


def test_a_stray_write_into_a_changed_element_fails_the_changes_check() -> None:
    params = _named(torch.Generator().manual_seed(7))
    base = checksums(params)
    payload, expected = _one_change(params, "p1", [10, 500])
    # Written after the base was read, into an element the delta also writes: the old
    # value the rank reads before writing is not the one the trainers' change starts from.
    as_bits(params["p1"])[500] ^= 0x0100
    checked = apply_and_check([payload], params, expected, base=base)
    assert checked.mismatched == ("p1",)


def test_a_stray_write_elsewhere_is_seen_by_the_full_check_only() -> None:
    generator = torch.Generator().manual_seed(8)
    params = _named(generator)
    base = checksums(params)
    payload, expected = _one_change(params, "p1", [10, 500])
    as_bits(params["p1"])[600] ^= 0x0100  # an element no payload writes
    kept = {n: p.clone() for n, p in params.items()}
    checked = apply_and_check([payload], params, expected, base=base)
    # What "changes" documents: the derived checksum still says the base's value there.
    assert checked.check == "changes" and not checked.mismatched
    assert checked.checksums["p1"] == expected["p1"] != checksums(params)["p1"]
    full = apply_and_check([payload], kept, expected, base=base, check="full")
    assert full.check == "full" and full.mismatched == ("p1",)
    assert full.checksums == checksums(kept)


def test_parameters_without_a_base_are_read_in_full() -> None:
    params = _named(torch.Generator().manual_seed(9))
    base = checksums(params)
    payload, expected = _one_change(params, "p3", [1, 2, 3])
    partial = {n: v for n, v in base.items() if n not in ("p3", "p0")}
    checked = apply_and_check([payload], params, expected, base=partial)
    assert checked.check == "changes" and checked.recomputed == ("p0", "p3")
    assert not checked.mismatched and checked.checksums == checksums(params)
    # A wrong value is still seen there.
    params = _named(torch.Generator().manual_seed(9))
    payload[-8] ^= 0x01
    checked = apply_and_check([payload], params, expected, base=partial)
    assert checked.mismatched == ("p3",)
    # Without any base the whole check is the full pass.
    params = _named(torch.Generator().manual_seed(9))
    payload, expected = _one_change(params, "p3", [1, 2, 3])
    checked = apply_and_check([payload], params, expected)
    assert checked.check == "full" and checked.recomputed == () and not checked.mismatched


def test_a_repeated_element_cannot_hide_behind_a_doubled_change() -> None:
    params = _named(torch.Generator().manual_seed(10))
    base = checksums(params)
    bits = as_bits(params["p1"])
    elements = torch.tensor([7, 7, 9], dtype=torch.int64)
    new = bits[elements] ^ 0x22
    # A sender that counted element 7 twice: its expected checksum moves twice as far.
    expected = dict(base)
    expected["p1"] = base["p1"] + int(
        checksum_change(elements, bits[elements], new, numel=bits.numel())
    )
    expected["p1"] = (expected["p1"] + (1 << 63)) % (1 << 64) - (1 << 63)
    payload = encode_payload([Section(param_index=1, elements=elements, values=new)], "cpu")
    checked = apply_and_check([payload], params, expected, base=base)
    assert checked.recomputed == ("p1",)
    assert checked.mismatched == ("p1",)
    assert checked.checksums == checksums(params)


def test_an_unknown_check_is_refused_before_anything_is_written() -> None:
    params = _named(torch.Generator().manual_seed(11))
    payload, expected = _one_change(params, "p1", [1])
    kept = {n: p.clone() for n, p in params.items()}
    with pytest.raises(ValueError, match="check must be one of"):
        apply_and_check([payload], params, expected, base=checksums(params), check="some")
    assert all(torch.equal(as_bits(params[n]), as_bits(kept[n])) for n in params)


def two_params_payload():
    """A payload of a sparse and a dense section into two parameters, and the parameters."""
    params = [torch.zeros(BLOCK_ELEMENTS * 2 + 10, dtype=torch.int16), torch.zeros(64)]
    sections = [
        Section(
            param_index=0,
            elements=torch.tensor([1, 7, BLOCK_ELEMENTS + 3, BLOCK_ELEMENTS * 2 + 9]),
            values=torch.tensor([1, 2, 3, 4], dtype=torch.int16),
        ),
        Section(param_index=1, elements=None, values=as_bits(torch.ones(5)), start=50),
    ]
    return params, encode_payload(sections, "cpu")


# Values a careless or hostile writer might leave in a table word: off by one or a word,
# negative, past the payload, or large enough to wrap int64 arithmetic.
EDGES = [-(1 << 62), -9, -8, -1, 0, 1, 2, 3, 4, 7, 8, 64, 1 << 16, (1 << 16) + 1, 1 << 40, 1 << 62]


# Up to three edits of the table words of `two_params_payload` (2 section rows of 8 words,
# then 4 block rows of 2): ``(word, value, whether it is added to the word or replaces it)``.
TABLE_EDITS = st.lists(
    st.tuples(st.integers(0, 2 * 8 + 4 * 2 - 1), st.sampled_from(EDGES), st.booleans()),
    min_size=1,
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(edits=TABLE_EDITS)
def test_the_section_checks_at_once_refuse_what_one_by_one_refuses(edits) -> None:
    """Tables checked all at once (`_sections_fit`) pass exactly where every section passes
    its own check, whatever words a careless or hostile writer left in them; a payload either
    applies or changes nothing."""
    params, payload = two_params_payload()
    table = payload[64:].view(torch.int64)  # 2 section rows of 8 words, then 4 block rows
    for word, value, relative in edits:
        table[word] = table[word] + value if relative else value
    total, sections, blocks = _payload_tables(payload)
    numels = np.array([p.numel() for p in params])
    sizes = np.array([p.element_size() for p in params])
    at_once = _sections_fit(sections, blocks, numels, sizes, total)
    try:
        for row in sections.tolist():
            _check_section(row, blocks, params, total)
        one_by_one = True
    except DeltaFormatError:
        one_by_one = False
    assert at_once == one_by_one
    before = [p.clone() for p in params]
    try:
        apply_payload(payload, params)
    except DeltaFormatError:
        assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
