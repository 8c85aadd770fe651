"""The fused delta kernels (`weightsync.delta_kernels`) against the torch and numpy paths
they replace, bit for bit.

They run on a CUDA device where there is one, else in Triton's interpreter on the host
(which emulates float casts its own way, so the in-kernel cast is checked on CUDA only).
Skipped where Triton is not installed (it is not a dependency: the kernels run only where
a GPU build of torch brings it).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings

if not torch.cuda.is_available():
    # Read when Triton is imported: its kernels then run in its interpreter, on the host.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from test_delta_codec import TABLE_EDITS, _named, _one_change, _payloads, two_params_payload
from weightsync import delta_kernels
from weightsync.delta_codec import (
    BLOCK_ELEMENTS,
    CHECK_ROW_WORDS,
    DeltaFormatError,
    Section,
    _host_checksum,
    _scatter_payload,
    _words,
    apply_and_check,
    apply_payload,
    as_bits,
    checksum_change,
    checksums,
    encode_payload,
)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(autouse=True)
def kernels():
    """The kernels, compiled for the device or defined for the interpreter."""
    delta_kernels._kernels.cache_clear()
    yield
    delta_kernels._kernels.cache_clear()


def _torch_changes(new_bits: torch.Tensor, ref: torch.Tensor):
    elements = torch.ne(new_bits, ref).nonzero().reshape(-1)
    return elements, new_bits[elements], ref[elements].clone()


def _changed(ref_bits: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    """`ref_bits` with a random `density` of its elements' lowest bit flipped."""
    generator = torch.Generator().manual_seed(seed)
    new = ref_bits.cpu().clone()
    mask = torch.rand(new.numel(), generator=generator) < density
    new[mask] ^= 1
    return new.to(DEVICE)


@pytest.mark.parametrize(
    ("dtype", "numel", "density"),
    [
        (torch.bfloat16, 10_000, 0.02),
        (torch.bfloat16, 4096 * 3, 0.0),
        (torch.bfloat16, 4097, 1.0),
        (torch.float32, 9_999, 0.1),
        (torch.float8_e4m3fn, 12_345, 0.05),
        (torch.bfloat16, 1, 1.0),
    ],
)
def test_find_changes_equals_torch(dtype, numel, density) -> None:
    generator = torch.Generator().manual_seed(numel)
    ref = as_bits(torch.randn(numel, generator=generator).to(dtype)).to(DEVICE)
    new_bits = _changed(ref, density, seed=1)
    expected = _torch_changes(new_bits, ref)
    work = ref.clone()
    elements, new, old = delta_kernels.find_changes(new_bits.view(dtype), work, dtype)
    assert torch.equal(elements, expected[0])
    assert torch.equal(new, expected[1]) and torch.equal(old, expected[2])
    assert torch.equal(work, new_bits)  # the reference now holds the new bits
    again = delta_kernels.find_changes(new_bits.view(dtype), work, dtype)
    assert all(t.numel() == 0 for t in again)


def test_find_changes_across_chunks(monkeypatch) -> None:
    monkeypatch.setattr(delta_kernels, "CHANGE_CHUNK", 3 * delta_kernels.CHANGE_BLOCK)
    ref = as_bits(torch.randn(40_000).to(torch.bfloat16)).to(DEVICE)
    new_bits = _changed(ref, 0.03, seed=2)
    expected = _torch_changes(new_bits, ref)
    work = ref.clone()
    elements, new, old = delta_kernels.find_changes(
        new_bits.view(torch.bfloat16), work, torch.bfloat16
    )
    assert torch.equal(elements, expected[0]) and torch.equal(new, expected[1])
    assert torch.equal(old, expected[2]) and torch.equal(work, new_bits)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter emulates float casts its own way")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_find_changes_casts_as_torch_does(dtype) -> None:
    """fp32 weights cast in the kernel give torch's bits, specials and rounding ties too."""
    generator = torch.Generator().manual_seed(3)
    weights = torch.randn(50_000, generator=generator) * 3
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3.4e38, 1 + 2**-8]
    )
    weights[: specials.numel()] = specials
    weights = weights.to(DEVICE)
    ref = as_bits(torch.zeros(weights.numel(), dtype=dtype, device=DEVICE))
    elements, new, _ = delta_kernels.find_changes(weights, ref, dtype)
    cast = as_bits(weights.to(dtype))
    assert torch.equal(ref, cast)
    assert torch.equal(new, cast[elements])


def test_find_changes_refuses_a_cast_it_does_not_make() -> None:
    ref = torch.zeros(8, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="float dtypes only"):
        delta_kernels.find_changes(torch.zeros(8, device=DEVICE), ref, torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "num_words",
    [
        CHECK_ROW_WORDS * 3,
        CHECK_ROW_WORDS * delta_kernels.TILE_ROWS + CHECK_ROW_WORDS,
        CHECK_ROW_WORDS * (2 * delta_kernels.TILE_ROWS + 7),
    ],
)
def test_checksum_words_equals_the_host_checksum(num_words) -> None:
    """Several tensors at once, one launch; each one's rows give the host's checksum."""
    generator = torch.Generator().manual_seed(num_words)
    tensors = [
        torch.randint(-(2**62), 2**62, (n,), generator=generator, dtype=torch.int64)
        for n in (num_words, CHECK_ROW_WORDS, num_words + 2 * CHECK_ROW_WORDS)
    ]
    got = delta_kernels.checksum_words([t.to(DEVICE) for t in tensors]).tolist()
    assert got == [_host_checksum(t) for t in tensors]


def test_a_tensor_shorter_than_a_row_adds_nothing() -> None:
    words = torch.arange(CHECK_ROW_WORDS - 1, dtype=torch.int64, device=DEVICE)
    assert delta_kernels.checksum_words([words]).tolist() == [0]


@pytest.mark.skipif(not ON_GPU, reason="the kernels serve CUDA tensors")
def test_checksums_on_the_device_equal_the_host() -> None:
    """`checksums` of CUDA parameters (the kernels, tails included) equals the host's."""
    assert delta_kernels.ready(DEVICE) or os.environ.get("WEIGHTSYNC_DELTA_KERNELS") == "0"
    generator = torch.Generator().manual_seed(5)
    params = {
        f"p{i}": torch.randn(n, generator=generator).to(torch.bfloat16)
        for i, n in enumerate((7, 4096, 4096 * 70 + 3, 123_457, 1 << 20))
    }
    on_device = {name: p.to(DEVICE) for name, p in params.items()}
    assert checksums(on_device) == {name: _host_checksum(_words(p)) for name, p in params.items()}


def _sections_and_params(seed: int):
    """Parameters of three element sizes (several blocks, a partial last one) and a payload
    of sparse and dense sections for them, built on the host."""
    generator = torch.Generator().manual_seed(seed)
    params = [
        as_bits(torch.randn(n, generator=generator).to(dtype))
        for n, dtype in (
            (200_000, torch.bfloat16),
            (70_000, torch.float32),
            (5_000, torch.float8_e4m3fn),
            (3_000, torch.bfloat16),
        )
    ]
    sections = []
    for index, bits in enumerate(params[:3]):
        elements = torch.nonzero(torch.rand(bits.numel(), generator=generator) < 0.03).flatten()
        values = bits[elements] ^ 1
        sections.append(Section(param_index=index, elements=elements, values=values))
    sections.append(Section(param_index=3, elements=None, values=params[3][10:400] ^ 1, start=10))
    return params, sections


NO_LOADED_BOUNDS = pytest.mark.skipif(
    not ON_GPU, reason="Triton's interpreter cannot bound a loop by a loaded value"
)


@NO_LOADED_BOUNDS
def test_the_fused_scatter_applies_as_torch_does() -> None:
    params, sections = _sections_and_params(seed=7)
    payload = encode_payload(sections, "cpu")
    expected = [p.clone() for p in params]
    applied = apply_payload(payload, expected)  # torch's ops (the host path)
    got = [p.clone().to(DEVICE) for p in params]
    scattered = _scatter_payload(payload.to(DEVICE), got)
    assert sorted(scattered.written) == list(applied.params)
    assert scattered.num_elements == applied.num_elements
    for mine, theirs in zip(got, expected, strict=True):
        assert torch.equal(mine.cpu(), theirs)


def test_the_fused_scatter_refuses_a_block_past_its_parameter_and_writes_nothing() -> None:
    params, sections = _sections_and_params(seed=8)
    payload = encode_payload(sections, "cpu")
    # The float32 parameter's last block starts at 65,536 of 70,000 elements: its last
    # offset set to 0xFFFF reaches element 131,071.
    section = sections[1]
    count = section.values.numel()
    head = payload[:64].view(torch.int64)
    sections_at = int(head[4])
    rows = payload[sections_at:].view(torch.int64)
    row = next(
        rows[i * 8 : i * 8 + 8].tolist()
        for i in range(len(sections))
        if int(rows[i * 8]) == section.param_index
    )
    offsets_at = row[4]
    last = offsets_at + 2 * (count - 1)
    payload[last : last + 2] = torch.tensor([0xFF, 0xFF], dtype=torch.uint8)
    before = [p.clone() for p in params]
    got = [p.clone().to(DEVICE) for p in params]
    with pytest.raises(DeltaFormatError, match="reaches past the end"):
        _scatter_payload(payload.to(DEVICE), got)
    for mine, theirs in zip(got, before, strict=True):
        assert torch.equal(mine.cpu(), theirs)


@NO_LOADED_BOUNDS
@settings(max_examples=60, deadline=None)
@given(edits=TABLE_EDITS)
def test_the_fused_scatter_refuses_what_the_host_refuses_and_writes_the_same(edits) -> None:
    """Whatever words a careless or hostile writer left in the tables, the fused scatter
    refuses the payload exactly where the host path does (writing nothing), and otherwise
    writes what the host path writes."""
    params, payload = two_params_payload()
    table = payload[64:].view(torch.int64)
    for word, value, relative in edits:
        table[word] = table[word] + value if relative else value
    on_host = [p.clone() for p in params]
    got = [p.clone().to(DEVICE) for p in params]
    try:
        apply_payload(payload, on_host)
    except DeltaFormatError:
        with pytest.raises(DeltaFormatError):
            _scatter_payload(payload.to(DEVICE), got)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, params, strict=True))
        return
    _scatter_payload(payload.to(DEVICE), got)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, on_host, strict=True))


def _on_device(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.to(DEVICE) for name, p in params.items()}


@NO_LOADED_BOUNDS
@pytest.mark.parametrize("density", [0.0, 0.01, 0.3])
@pytest.mark.parametrize("dense", [False, True])
def test_the_fused_scatter_derives_what_a_full_pass_reads(density, dense) -> None:
    """On the device the "changes" check is derived inside the scatter: the checksums it
    derives equal a full read's, over every element size, tails past the grid, sparse and
    dense sections, and two payloads applied one after the other."""
    generator = torch.Generator().manual_seed(5)
    params = _named(generator)
    payloads, target, expected = _payloads(params, generator, density, dense=dense)
    params = _on_device(params)
    base = checksums(params)
    payloads = [p.to(DEVICE) for p in payloads]
    checked = apply_and_check(payloads, params, expected, base=base)
    assert checked.check == "changes" and checked.recomputed == ()
    assert checked.refused is None and not checked.mismatched and not checked.unexpected
    assert checked.checksums == checksums(params) == expected
    assert all(torch.equal(as_bits(params[n]).cpu(), as_bits(target[n])) for n in params)


@NO_LOADED_BOUNDS
def test_the_fused_derive_sees_a_wrong_value_and_a_stray_write_into_a_changed_element() -> None:
    params = _named(torch.Generator().manual_seed(6))
    payload, expected = _one_change(params, "p2", [4, 70_000, 100_001])
    payload[-8] ^= 0x01  # a flipped bit on the wire
    params = _on_device(params)
    checked = apply_and_check([payload.to(DEVICE)], params, expected, base=checksums(params))
    assert checked.check == "changes" and checked.mismatched == ("p2",)
    assert checked.checksums["p2"] == checksums(params)["p2"]  # derived = what it holds
    params = _named(torch.Generator().manual_seed(7))
    payload, expected = _one_change(params, "p1", [10, 500])
    params = _on_device(params)
    base = checksums(params)
    as_bits(params["p1"])[500] ^= 0x0100  # after the base was read, where the delta writes
    checked = apply_and_check([payload.to(DEVICE)], params, expected, base=base)
    assert checked.mismatched == ("p1",)


@NO_LOADED_BOUNDS
@pytest.mark.parametrize("how", ["repeated", "blocks out of order", "two sections"])
def test_an_element_the_fused_derive_could_count_twice_is_read_in_full(how) -> None:
    """Where an element could be written twice in one scatter (a repeated offset, blocks
    out of order, two sections of one parameter), the parameter's checksum is read over all
    its bytes instead of derived: a doubled change cannot hide a wrong write."""
    params = _named(torch.Generator().manual_seed(10))
    bits = as_bits(params["p2"])
    if how == "repeated":
        elements = torch.tensor([7, 7, 9])
    elif how == "blocks out of order":
        elements = torch.tensor([BLOCK_ELEMENTS + 5, 3])
    else:
        elements = torch.tensor([3, BLOCK_ELEMENTS + 5])
    new = bits[elements] ^ 0x22
    base = checksums(params)
    expected = dict(base)
    moved = int(checksum_change(elements, bits[elements], new, numel=bits.numel()))
    expected["p2"] = (base["p2"] + moved + (1 << 63)) % (1 << 64) - (1 << 63)
    if how == "two sections":
        sections = [
            Section(param_index=2, elements=elements[:1], values=new[:1]),
            Section(param_index=2, elements=elements[1:], values=new[1:]),
        ]
    else:
        sections = [Section(param_index=2, elements=elements, values=new)]
    payload = encode_payload(sections, "cpu")
    params = _on_device(params)
    checked = apply_and_check([payload.to(DEVICE)], params, expected, base=base)
    assert checked.recomputed == ("p2",)
    assert checked.checksums == checksums(params)
    # The repeated element was written twice: what the sender counted is not what it holds.
    assert (checked.mismatched == ("p2",)) == (how == "repeated")


@pytest.mark.skipif(not ON_GPU, reason="the batched block search serves CUDA sections")
def test_a_payload_laid_out_on_the_device_equals_the_hosts_byte_for_byte() -> None:
    _, sections = _sections_and_params(seed=9)
    unsorted = Section(
        param_index=0,
        elements=torch.tensor([BLOCK_ELEMENTS * 2 + 5, 3, BLOCK_ELEMENTS + 1]),
        values=torch.tensor([1, 2, 3], dtype=torch.int16),
    )
    for case in (sections, [unsorted, *sections[1:]]):
        on_device = [
            Section(
                param_index=s.param_index,
                elements=None if s.elements is None else s.elements.to(DEVICE),
                values=s.values.to(DEVICE),
                start=s.start,
            )
            for s in case
        ]
        assert torch.equal(encode_payload(on_device, DEVICE).cpu(), encode_payload(case, "cpu"))


def _compiled(kernels) -> int:
    """Compiled variants of `kernels` (Triton `JITFunction`s) on every device."""
    return sum(len(caches[0]) for kernel in kernels for caches in kernel.device_caches.values())


def _bucket(generator: torch.Generator, num_tensors: int, extra: int):
    """`num_tensors` float32 tensors of varied lengths (`extra` more elements in each), cut
    from one buffer at 64-element offsets, and their bf16 references, lightly changed."""
    lengths = [5_000 + 977 * i + extra for i in range(num_tensors)]
    starts = [sum(-(-n // 64) * 64 for n in lengths[:i]) for i in range(num_tensors)]
    buffer = torch.randn(starts[-1] + lengths[-1] + 64, generator=generator).to(DEVICE)
    news = [buffer[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    refs = [_changed(as_bits(t.to(torch.bfloat16)), 0.02, i) for i, t in enumerate(news)]
    return news, refs, [torch.bfloat16] * num_tensors


@pytest.mark.skipif(not ON_GPU, reason="the interpreter compiles nothing")
def test_later_syncs_compile_nothing_whatever_their_sizes_and_table_offsets() -> None:
    """Sizes, counts and tables sliced at odd places change from sync to sync; none of that
    makes Triton compile a kernel again, so a long run never stops for a compile once its
    first syncs have run each kind of pass."""
    generator = torch.Generator().manual_seed(11)
    kernels = delta_kernels._kernels()

    def one_sync(num_tensors: int, extra: int, density: float, seed: int) -> None:
        # The bucket pass (one kind; 17, 18 and 32 tensors search in 5 steps alike), the
        # pass over one large tensor, and a delta's scatter with its derived check.
        news, refs, dtypes = _bucket(generator, num_tensors, extra)
        found = delta_kernels.find_changes_bucket(news, refs, dtypes)
        assert sum(f[0].numel() for f in found) > 0
        big = torch.randn(3_000_000 + 7 * extra, generator=generator).to(DEVICE)
        ref = _changed(as_bits(big.to(torch.bfloat16)), 0.02, seed)
        delta_kernels.find_changes(big, ref, torch.bfloat16)
        params = _named(torch.Generator().manual_seed(seed))
        payloads, _, expected = _payloads(params, torch.Generator().manual_seed(seed), density)
        params = _on_device(params)
        payloads = [p.to(DEVICE) for p in payloads]
        checked = apply_and_check(payloads, params, expected, base=checksums(params))
        assert checked.check == "changes" and not checked.mismatched

    one_sync(17, 0, 0.01, seed=1)
    first = _compiled(kernels)
    for num_tensors, extra, density, seed in (
        (18, 3, 0.02, 2),
        (32, 1, 0.005, 3),
        (17, 16, 0.03, 4),
    ):
        one_sync(num_tensors, extra, density, seed)
    assert _compiled(kernels) == first


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64]
)
def test_checksum_changes_equal_each_parts_checksum_change(dtype) -> None:
    """The batched kernel's change of each part equals `checksum_change` of it: parts of
    several tiles and of none, elements past the grid's full rows (tail words), unsorted
    elements, and parts that are strided views."""
    generator = torch.Generator().manual_seed(13)
    parts, expected, grids = [], [], []
    for numel, count in ((100_003, 2_500), (5_000, 0), (4_097, 700), (3 * 1024 + 7, 1024)):
        bits = as_bits(torch.randn(numel, generator=generator).to(dtype))
        elements = torch.randperm(numel, generator=generator)[:count]
        old = bits[elements]
        new = old ^ torch.randint(1, 100, (count,), generator=generator).to(old.dtype)
        expected.append(int(checksum_change(elements, old, new, numel=numel)))
        size = bits.element_size()
        num_words = -(-numel * size // 8)
        grids.append(num_words // CHECK_ROW_WORDS * CHECK_ROW_WORDS)
        parts.append((elements.to(DEVICE), old.to(DEVICE), new.to(DEVICE)))
    # A strided view: taken contiguous first.
    wide = torch.stack([parts[0][0], parts[0][0]], dim=1)
    parts[0] = (wide[:, 0], parts[0][1], parts[0][2])
    got = delta_kernels.checksum_changes(parts, grids).tolist()
    assert got == expected
    with pytest.raises(ValueError, match="part 1 has 0 elements, 3 old"):
        delta_kernels.checksum_changes(
            [parts[0], (parts[1][0], parts[0][1][:3], parts[1][2])], grids
        )
