"""The fused bucket encode (`weightsync.delta_kernels.find_changes_bucket`) against torch's
encoder, bit for bit: every tensor of a bucket in one pass, mixed dtypes, odd sizes,
densities from none to all, and the payloads laid out from both byte for byte.

It runs on a CUDA device where there is one, else in Triton's interpreter on the host
(which emulates float casts its own way, so the in-kernel cast is checked on CUDA only).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Read when Triton is imported: its kernels then run in its interpreter, on the host.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from weightsync import delta_kernels
from weightsync.delta_codec import Section, as_bits, encode_payload

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TILE = delta_kernels.BUCKET_TILE


@pytest.fixture(autouse=True)
def kernels():
    """The kernels, compiled for the device or defined for the interpreter."""
    delta_kernels._kernels.cache_clear()
    yield
    delta_kernels._kernels.cache_clear()


def _torch_encode(new_bits: torch.Tensor, ref: torch.Tensor):
    """torch's encoder (`weightsync.sender.delta_reference`'s device path), on copies."""
    elements = torch.ne(new_bits, ref).nonzero().reshape(-1)
    return elements, new_bits[elements], ref[elements]


def _bucket(specs, seed: int):
    """``(news, refs, dtypes)`` of `specs` (``(dtype, numel, density)``): random references
    and new tensors whose `density` of elements differ (lowest bit flipped)."""
    generator = torch.Generator().manual_seed(seed)
    news, refs, dtypes = [], [], []
    for dtype, numel, density in specs:
        ref = as_bits(torch.randn(numel, generator=generator).to(dtype))
        new = ref.clone()
        mask = torch.rand(numel, generator=generator) < density
        new[mask] ^= 1
        news.append(new.to(DEVICE).view(dtype))
        refs.append(ref.to(DEVICE))
        dtypes.append(dtype)
    return news, refs, dtypes


def _check(news, refs, dtypes) -> None:
    expected = [_torch_encode(as_bits(n), r.clone()) for n, r in zip(news, refs, strict=True)]
    work = [r.clone() for r in refs]
    got = delta_kernels.find_changes_bucket(news, work, dtypes)
    assert len(got) == len(news)
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), f"tensor {index}"
        assert torch.equal(work[index].cpu(), as_bits(news[index]).cpu()), f"reference {index}"
    # The payloads laid out from both are the same bytes.
    for name, found in (("fused", got), ("torch", expected)):
        sections = [
            Section(param_index=i, elements=e.cpu(), values=v.cpu())
            for i, (e, v, _) in enumerate(found)
        ]
        if name == "fused":
            mine = encode_payload(sections, "cpu")
        else:
            assert torch.equal(mine, encode_payload(sections, "cpu"))
    again = delta_kernels.find_changes_bucket(news, work, dtypes)
    assert all(t.numel() == 0 for found in again for t in found)


@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 1.0])
def test_a_bucket_of_mixed_dtypes_and_odd_sizes_equals_torch(density) -> None:
    specs = [
        (torch.bfloat16, 2 * TILE + 77, density),
        (torch.float32, 9_999, density),
        (torch.float8_e4m3fn, TILE + 1, density),
        (torch.bfloat16, 1, density),
        (torch.float64, 1_001, density),
        (torch.bfloat16, 0, density),
        (torch.float16, TILE, density),
        (torch.bfloat16, 3 * 32 + 5, density),
    ]
    _check(*_bucket(specs, seed=int(density * 100)))


def test_unaligned_views_in_one_bucket() -> None:
    """Tensors and references at odd element offsets of larger buffers (loads not
    16-byte aligned), sharing a kind with aligned ones."""
    news, refs, dtypes = _bucket(
        [(torch.bfloat16, 3 * TILE + 9, 0.03), (torch.bfloat16, 5_000, 0.03)], seed=9
    )
    big_new = torch.zeros(news[1].numel() + 3, dtype=torch.bfloat16, device=DEVICE)
    big_ref = torch.zeros(refs[1].numel() + 1, dtype=refs[1].dtype, device=DEVICE)
    big_new[3:].copy_(news[1])
    big_ref[1:].copy_(refs[1])
    _check([news[0], big_new[3:]], [refs[0], big_ref[1:]], dtypes)


def test_many_tensors_find_their_tiles() -> None:
    """Tensors of one tile and less, many of them: the search over the table."""
    generator = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, TILE + 300, (37,), generator=generator).tolist()
    _check(*_bucket([(torch.bfloat16, n, 0.05) for n in sizes], seed=5))


@pytest.mark.parametrize("slots", [(0, 1), (0, 0)], ids=["two-slots", "one-slot"])
def test_a_bucket_started_before_the_last_one_finished_keeps_its_own_changes(slots) -> None:
    """Two buckets in flight: the second's first pass runs before the first's second pass
    (in the interpreter, at once), in its own scratch slot; each finishes equal to torch.
    In one slot the second's bitmap would overwrite the first's: refused there."""
    first = _bucket([(torch.bfloat16, 3 * TILE + 7, 0.05), (torch.float32, 999, 0.3)], seed=21)
    # Fewer tiles than the first: a shared slot's scratch is not reallocated, but reused.
    second = _bucket([(torch.bfloat16, 2 * TILE + 1, 0.02), (torch.bfloat16, 77, 0.5)], seed=22)
    expected = [
        [_torch_encode(as_bits(n), r.clone()) for n, r in zip(news, refs, strict=True)]
        for news, refs, _ in (first, second)
    ]
    started = [
        delta_kernels.start_bucket(news, refs, dtypes, slot=slot)
        for (news, refs, dtypes), slot in zip((first, second), slots, strict=True)
    ]
    found = [bucket.finish() for bucket in started]
    matches = all(
        torch.equal(a.cpu(), b.cpu())
        for bucket, theirs in zip(found, expected, strict=True)
        for index, torch_found in enumerate(theirs)
        for a, b in zip(bucket.found(index), torch_found, strict=True)
    )
    # The interpreter runs each pass as it is queued, so sharing a slot is always caught.
    assert matches == (slots == (0, 1))
    with pytest.raises(ValueError, match="scratch slot is 0 or 1"):
        delta_kernels.start_bucket(*first, slot=2)


@pytest.mark.parametrize("mode", ["bitmap", "full"])
@pytest.mark.parametrize("slots", [32, 256])
def test_the_other_second_passes_equal_torch(monkeypatch, mode, slots) -> None:
    """The second pass by every element of the bitmap, or comparing again; and the select
    pass taking a few changes at a time (many rounds a tile)."""
    monkeypatch.setattr(delta_kernels, "BUCKET_SECOND_PASS", mode if slots == 256 else "select")
    monkeypatch.setattr(delta_kernels, "BUCKET_SLOTS", slots)
    specs = [(torch.bfloat16, 2 * TILE + 77, 0.02), (torch.float32, 9_999, 0.5)]
    _check(*_bucket(specs, seed=11))


def test_refuses_a_cast_it_does_not_make() -> None:
    ref = torch.zeros(8, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="float dtypes only"):
        delta_kernels.find_changes_bucket(
            [torch.zeros(8, device=DEVICE)], [ref], [torch.float8_e4m3fn]
        )


@pytest.mark.skipif(not ON_GPU, reason="the interpreter emulates float casts its own way")
def test_casts_in_the_bucket_as_torch_does() -> None:
    """fp32 weights cast to bf16 and fp16 in the kernel, beside bf16 ones, in one bucket."""
    generator = torch.Generator().manual_seed(3)
    weights = torch.randn(50_000, generator=generator) * 3
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3.4e38, 1 + 2**-8]
    )
    weights[: specials.numel()] = specials
    weights = weights.to(DEVICE)
    other = torch.randn(TILE + 5, generator=generator).to(torch.bfloat16).to(DEVICE)
    news = [weights, weights, other]
    dtypes = [torch.bfloat16, torch.float16, torch.bfloat16]
    refs = [
        as_bits(torch.zeros(n.numel(), dtype=d, device=DEVICE))
        for n, d in zip(news, dtypes, strict=True)
    ]
    got = delta_kernels.find_changes_bucket(news, refs, dtypes)
    for (elements, new, _), tensor, dtype, ref in zip(got, news, dtypes, refs, strict=True):
        cast = as_bits(tensor.to(dtype))
        assert torch.equal(ref, cast)
        assert torch.equal(elements, torch.ne(cast, 0).nonzero().reshape(-1))
        assert torch.equal(new, cast[elements])


def _bucket_pushes(monkeypatch) -> None:
    """Make `test_delta_sender`'s pushes encode by buckets: on CUDA, its trainer's tensors
    moved to the device (the rollout ranks stay on the host); on the host, the interpreter
    standing in for CUDA, the (float32) tensors cast by torch first (it casts its own way)."""
    import test_delta_sender
    from weightsync.sender import delta

    monkeypatch.setattr(delta, "BUCKET_MIN_TENSOR_BYTES", 0)  # the tests' tensors are tiny
    if ON_GPU:
        sources = test_delta_sender._sources

        def on_device(*args):
            return [{n: t.to(DEVICE) for n, t in held.items()} for held in sources(*args)]

        monkeypatch.setattr(test_delta_sender, "_sources", on_device)
        return
    from weightsync.torch_dtypes import torch_dtype

    start_encode_bucket = delta.start_encode_bucket

    def cast_first(reference, entries, **kwargs):
        cast = [(dtype, name, t.to(torch_dtype(dtype))) for dtype, name, t in entries]
        return start_encode_bucket(reference, cast, **kwargs)

    monkeypatch.setattr(delta, "_fused", lambda device: True)
    monkeypatch.setattr(delta, "start_encode_bucket", cast_first)


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 30], ids=["a-tensor-a-bucket", "one-bucket"])
def test_delta_pushes_through_buckets_are_bit_exact(monkeypatch, bucket_bytes) -> None:
    """`DeltaPush` encoding by buckets: every sync bit-exact into tp layouts, checksums as
    predicted (`test_delta_sender`)."""
    from test_delta_sender import TINY, _sync_rounds
    from weightsync.sender import delta

    _bucket_pushes(monkeypatch)
    calls = []
    start_encode_bucket = delta.start_encode_bucket

    def counted(reference, entries, **kwargs):
        calls.append(len(entries))
        return start_encode_bucket(reference, entries, **kwargs)

    monkeypatch.setattr(delta, "BUCKET_BYTES", bucket_bytes)
    monkeypatch.setattr(delta, "start_encode_bucket", counted)
    _sync_rounds(TINY, [(2, 1), (1, 1)], rounds=2)
    assert calls and (max(calls) == 1 if bucket_bytes == 1 else max(calls) > 1)


def test_moe_delta_pushes_through_one_bucket_are_bit_exact(monkeypatch) -> None:
    """A MoE's per-expert tensors, taken whole by fused experts parameters, are filed as
    spans of the bucket's outputs and gathered per parameter at once; every sync stays
    bit-exact, into expert- and tensor-parallel layouts beside."""
    from test_delta_sender import MOE, _sync_rounds
    from weightsync.sender import delta

    _bucket_pushes(monkeypatch)
    gathered = []
    gather = delta._gathered

    def counted(spans):
        gathered.append(len(spans))
        return gather(spans)

    monkeypatch.setattr(delta, "_gathered", counted)
    _sync_rounds(MOE, [(1, 1), (2, 2)], rounds=2)
    assert gathered and max(gathered) > 1


def test_a_tensor_the_bucket_cannot_take_is_encoded_alone(monkeypatch) -> None:
    """Where the bucket refuses some tensors, they are encoded alone, in the stream's order,
    and the pushes stay bit-exact."""
    from test_delta_sender import TINY, _sync_rounds
    from weightsync.sender import delta

    _bucket_pushes(monkeypatch)
    fuses = delta.fuses_bucket
    monkeypatch.setattr(
        delta,
        "fuses_bucket",
        lambda ref, dtype, name, t, **kw: "mlp" not in name and fuses(ref, dtype, name, t, **kw),
    )
    buckets, pushes = [], []
    start, push = delta.start_encode_bucket, delta.DeltaPush.push
    monkeypatch.setattr(
        delta,
        "start_encode_bucket",
        lambda ref, entries, **kw: buckets.append(entries) or start(ref, entries, **kw),
    )
    monkeypatch.setattr(
        delta.DeltaPush, "push", lambda self, *a, **k: pushes.append(1) or push(self, *a, **k)
    )
    _sync_rounds(TINY, [(2, 1)], rounds=2)
    # A tensor encoded alone does not cut the bucket before it short: one bucket a push.
    assert buckets and len(buckets) <= len(pushes)


def test_tensors_below_the_bucket_minimum_are_encoded_alone(monkeypatch) -> None:
    """Tensors smaller than `BUCKET_MIN_TENSOR_BYTES` (where the per-tensor path is the faster
    one) never join a bucket; the pushes stay bit-exact."""
    from test_delta_sender import TINY, _sync_rounds
    from weightsync.sender import delta

    _bucket_pushes(monkeypatch)
    monkeypatch.setattr(delta, "BUCKET_MIN_TENSOR_BYTES", 1 << 40)
    calls = []
    start = delta.start_encode_bucket
    monkeypatch.setattr(
        delta,
        "start_encode_bucket",
        lambda ref, entries, **kw: calls.append(entries) or start(ref, entries, **kw),
    )
    _sync_rounds(TINY, [(2, 1)], rounds=2)
    assert calls == []


def test_encode_bucket_refuses_a_tensor_named_twice() -> None:
    from weightsync.sender.delta import encode_bucket
    from weightsync.sender.delta_reference import DeltaReference

    reference = DeltaReference("device")
    tensor = torch.zeros(8, dtype=torch.bfloat16)
    reference.record("bfloat16", "w", tensor)
    with pytest.raises(ValueError, match="names a tensor twice"):
        encode_bucket(reference, [("bfloat16", "w", tensor), ("bfloat16", "w", tensor)])


def test_fuses_bucket_admits_only_what_the_kernels_take(monkeypatch) -> None:
    """A tensor joins a bucket only with a reference of its length and dtype size on its own
    device where the kernels run; a push's cache asks whether they run once per device, and
    `encode_bucket` refuses what was not admitted unless told it was."""
    from weightsync.sender import delta
    from weightsync.sender.delta_reference import DeltaReference

    asked = []
    monkeypatch.setattr(delta, "_fused", lambda device: asked.append(device) or True)
    reference = DeltaReference("device")
    tensor = torch.zeros(64, dtype=torch.float32, device=DEVICE)
    reference.record("bfloat16", "w", tensor.to(torch.bfloat16))
    fused: dict[int, bool] = {}
    assert delta.fuses_bucket(reference, "bfloat16", "w", tensor, fused=fused)
    assert delta.fuses_bucket(reference, "bfloat16", "w", tensor * 2, fused=fused)
    assert len(asked) == 1 and list(fused.values()) == [True]
    assert not delta.fuses_bucket(reference, "bfloat16", "other", tensor)  # no reference
    assert not delta.fuses_bucket(reference, "bfloat16", "w", tensor[:32])  # another length
    assert not delta.fuses_bucket(reference, "float32", "w", tensor)  # another dtype's
    if ON_GPU:  # on another device
        assert not delta.fuses_bucket(reference, "bfloat16", "w", tensor.cpu())
    monkeypatch.setattr(delta, "_fused", lambda device: False)
    assert not delta.fuses_bucket(reference, "bfloat16", "w", tensor)
    with pytest.raises(ValueError, match="cannot be encoded in a fused bucket"):
        delta.encode_bucket(reference, [("bfloat16", "w", tensor)])
