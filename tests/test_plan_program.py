"""Lowering a push: box ranges, bucket packing, chunks, fused copies, coalesced writes, whole
programs; and the sender's filler and config that run them."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.export.geometry import stream_geometry
from weightsync.plan import CopyItem, SourceHolding
from weightsync.plan.chunks import chunk_bounds, split_bucket
from weightsync.plan.copies import fuse_copies
from weightsync.plan.packing import BucketPacker, Region, SourceBox, box_range
from weightsync.plan.writes import coalesce
from weightsync.sender import SenderConfig
from weightsync.sender.fill import SlotFiller
from weightsync.torch_dtypes import storage_bytes


def _read(tensor: torch.Tensor, box) -> torch.Tensor:
    return tensor[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)


@st.composite
def _box_and_range(draw):
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    box = []
    for dim in shape:
        lo = draw(st.integers(0, dim - 1))
        box.append((lo, draw(st.integers(lo + 1, dim))))
    numel = math.prod(hi - lo for lo, hi in box)
    start = draw(st.integers(0, numel))
    return shape, tuple(box), start, draw(st.integers(start, numel))


@settings(max_examples=300, deadline=None)
@given(_box_and_range())
def test_box_range_covers_exactly_the_elements(case) -> None:
    shape, box, start, stop = case
    tensor = torch.arange(math.prod(shape)).reshape(shape)
    boxes = box_range(box, start, stop)
    assert len(boxes) <= 2 * len(box) - 1
    got = (
        torch.cat([_read(tensor, b) for b in boxes]) if boxes else torch.empty(0, dtype=torch.long)
    )
    assert torch.equal(got, _read(tensor, box)[start:stop])


def _geometry(tensors):
    return stream_geometry((f"t{i}", t) for i, t in enumerate(tensors)).tensors


def _fill(
    parts, tensors, staging: torch.Tensor, *, slot_start: int = 0, num_workers: int = 1
) -> None:
    """Fill `staging` with buckets or chunks (`parts`) read from `tensors`, as a program's
    steps do: fused copies from the geometry, zero runs, then the filler."""
    geometry = _geometry(tensors)
    filler = SlotFiller(num_workers=num_workers)
    size = staging.element_size()
    for part in parts:
        copies = fuse_copies(
            part.sources, geometry, slot_base=slot_start // size, element_size=size
        )
        zeros = [(slot_start + o, n) for o, n in part.zeros]
        filler.run(
            copies, tensors, zeros, staging_bytes=staging.view(torch.uint8), staging_typed=staging
        )
    filler.close()


def _ops_result(sources, tensors, numel: int, dtype=torch.bfloat16) -> torch.Tensor:
    staging = torch.zeros(numel, dtype=dtype)
    copies = fuse_copies(
        sources, _geometry(tensors), slot_base=0, element_size=staging.element_size()
    )
    SlotFiller(num_workers=1).run(
        copies, tensors, [], staging_bytes=staging.view(torch.uint8), staging_typed=staging
    )
    return staging


def test_fused_copies_of_expert_halves_are_one_copy() -> None:
    experts, inter, hidden = 16, 6, 4
    fused = torch.randn(experts, 2 * inter, hidden)
    half = inter // 2  # tensor-parallel rank 1 of 2: rows [half, inter) of gate and of up
    sources, expected, tensors, offset = [], [], [], 0
    for e in range(experts):
        for part in (fused[e, :inter], fused[e, inter:]):  # per-expert views, as the export makes
            box = ((half, inter), (0, hidden))
            sources.append(SourceBox(source=len(tensors), box=box, slot_offset=offset * 2))
            tensors.append(part)
            expected.append(_read(part, box))
            offset += half * hidden
    ops = fuse_copies(sources, _geometry(tensors), slot_base=0, element_size=2)
    assert len(ops) == 1
    got = _ops_result(sources, tensors, offset)
    assert torch.equal(got, torch.cat(expected).to(torch.bfloat16))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 3)), max_size=12))
def test_fused_copies_equal_box_by_box_copies(spec) -> None:
    # Boxes of rows from a few tensors (two sharing one storage), in any order.
    base = torch.randn(4, 8, 3)
    tensors = [base[0], base[1], torch.randn(8, 3), base[3].t()]
    sources, expected, offset = [], [], 0
    for which, row, rows in spec:
        tensor = tensors[which]
        row = min(row, tensor.shape[0] - 1)
        rows = min(rows, tensor.shape[0] - row)
        box = ((row, row + rows), (0, tensor.shape[1]))
        sources.append(SourceBox(source=which, box=box, slot_offset=offset * 4))
        expected.append(_read(tensor, box))
        offset += rows * tensor.shape[1]
    got = _ops_result(sources, tensors, offset, torch.float32)
    want = torch.cat(expected) if expected else torch.empty(0)
    assert torch.equal(got, want)


@settings(max_examples=100, deadline=None)
@given(st.integers(8, 200), st.sampled_from([1, 2, 3]))
def test_packer_splits_items_across_slots(slot_elements: int, num_workers: int) -> None:
    element_size = 2
    a, b = torch.randn(10, 7), torch.randn(3, 5, 4)
    items_a = [
        CopyItem(
            hf_name="a", src_box=((2, 10), (1, 7)), param_name="p", dst_offset_bytes=0, num_bytes=96
        ),
        CopyItem(hf_name=None, src_box=(), param_name="p", dst_offset_bytes=96, num_bytes=10),
    ]
    items_b = [
        CopyItem(
            hf_name="b",
            src_box=((0, 3), (1, 5), (0, 4)),
            param_name="q",
            dst_offset_bytes=4,
            num_bytes=96,
        )
    ]
    dst = {
        "p": torch.full((53,), 7.0, dtype=torch.bfloat16),
        "q": torch.full((50,), 7.0, dtype=torch.bfloat16),
    }
    expected = {k: v.clone() for k, v in dst.items()}
    expected["p"][:48] = _read(a, items_a[0].src_box).to(torch.bfloat16)
    expected["p"][48:53] = 0
    expected["q"][2:50] = _read(b, items_b[0].src_box).to(torch.bfloat16)
    packer = BucketPacker(
        layout_id=0,
        slot_bytes=slot_elements * element_size,
        element_size=element_size,
        dst_address=lambda p, o: (0 if p == "p" else 1 << 20) + o,
    )
    buckets = packer.add(0, items_a) + packer.add(1, items_b)
    last = packer.flush()
    buckets += [last] if last else []
    for bucket in buckets:
        assert bucket.num_bytes <= slot_elements * element_size
        assert sum(r.num_bytes for r in bucket.regions) == bucket.num_bytes
        staging = torch.full((slot_elements,), 3.0, dtype=torch.bfloat16)
        _fill([bucket], [a, b], staging, num_workers=num_workers)
        raw = staging.view(torch.uint8)
        for region in bucket.regions:
            target = dst[region.param_name].view(torch.uint8)
            target[region.dst_offset_bytes : region.dst_offset_bytes + region.num_bytes] = raw[
                region.slot_offset : region.slot_offset + region.num_bytes
            ]
    assert all(torch.equal(dst[k], expected[k]) for k in dst)


def test_coalesce_merges_runs_of_one_parameter_adjacent_in_slot_and_target() -> None:
    regions = [
        Region(slot_offset=0, num_bytes=8, param_name="w13", dst_offset_bytes=0, hf_name="g0"),
        Region(slot_offset=8, num_bytes=8, param_name="w13", dst_offset_bytes=8, hf_name="u0"),
        Region(slot_offset=16, num_bytes=4, param_name="w2", dst_offset_bytes=0, hf_name="d0"),
        Region(slot_offset=20, num_bytes=4, param_name="w2", dst_offset_bytes=4, hf_name="d1"),
        Region(slot_offset=24, num_bytes=4, param_name="w2", dst_offset_bytes=12, hf_name="d2"),
    ]
    # w2 right after w13 in memory: still two writes, one per registered parameter.
    info = {"w13": (1000, 8, 2), "w2": (1016, 8, 2)}
    writes = coalesce(regions, slot_offset=50, weights_info=info)
    assert [(w.src_offset, w.dst_addr, w.num_bytes, w.param_name) for w in writes] == [
        (50, 1000, 16, "w13"),
        (66, 1016, 8, "w2"),
        (74, 1028, 4, "w2"),
    ]
    with pytest.raises(ValueError, match="'w2'"):
        coalesce(regions, slot_offset=50, weights_info={"w13": (1000, 8, 2)})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"bucket_bytes": 32}, "at least 64"),
        ({"num_workers": 0}, "num_workers"),
        ({"num_slots": 0}, "num_slots"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"staging": "disk"}, "staging"),
        ({"max_outstanding_per_peer": 0}, "max_outstanding"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": 63}, "chunk_bytes must be at least 64"),
    ],
)
def test_config_rejects_bad_values(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SenderConfig(**kwargs)


def test_config_defaults() -> None:
    config = SenderConfig()
    assert (config.bucket_bytes, config.num_workers, config.timeout_s, config.num_slots) == (
        1 << 30,
        4,
        30.0,
        2,
    )
    assert config.pin_memory == torch.cuda.is_available()
    assert SenderConfig(bucket_bytes=1000).slot_bytes == 960
    assert config.chunk_bytes is None
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert config.slot_chunk_bytes(cpu) == 64 << 20
    assert config.slot_chunk_bytes(gpu) == 256 << 20
    assert SenderConfig(chunk_bytes=1000).slot_chunk_bytes(cpu) == 960
    assert SenderConfig(chunk_bytes=1000).slot_chunk_bytes(gpu) == 960
    with pytest.raises(ValueError, match="chunk_bytes"):
        SenderConfig(chunk_bytes=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            SenderConfig(pin_memory=True)
    with pytest.raises(TypeError):
        SenderConfig(1024)  # type: ignore[misc]  # keyword-only


def test_worker_threads_fill_large_slots_like_one_thread() -> None:
    # 8 MiB of bf16 in one slot: large enough for the fill to be split across threads.
    fused = torch.randn(4, 1024, 1024)
    items = [
        CopyItem(
            hf_name="w",
            src_box=((e, e + 1), (0, 1024), (0, 1024)),
            param_name="p",
            dst_offset_bytes=e * (2 << 20),
            num_bytes=2 << 20,
        )
        for e in range(4)
    ] + [CopyItem(hf_name=None, src_box=(), param_name="p", dst_offset_bytes=8 << 20, num_bytes=64)]
    packer = BucketPacker(
        layout_id=0, slot_bytes=16 << 20, element_size=2, dst_address=lambda p, o: o
    )
    assert packer.add(0, items) == []
    bucket = packer.flush()
    results = []
    for num_workers in (1, 3):
        staging = torch.full(((16 << 20) // 2,), 5.0, dtype=torch.bfloat16)
        _fill([bucket], [fused], staging, num_workers=num_workers)
        results.append(staging)
    expected = torch.cat(
        [fused.reshape(-1).to(torch.bfloat16), torch.zeros(32, dtype=torch.bfloat16)]
    )
    assert all(torch.equal(r[: expected.numel()], expected) for r in results)


@st.composite
def _params_and_items(draw):
    """Items of a few parameters: rows of 2-D tensors and padding, with gaps in between."""
    tensors = {f"t{i}": torch.randn(draw(st.integers(1, 12)), 5) for i in range(3)}
    items = []
    for param in ("p0", "p1", "p2"):
        offset = 0
        for _ in range(draw(st.integers(1, 5))):
            offset += draw(st.sampled_from([0, 0, 0, 6]))  # mostly contiguous
            if draw(st.booleans()):
                name = draw(st.sampled_from(sorted(tensors)))
                rows = tensors[name].shape[0]
                lo = draw(st.integers(0, rows - 1))
                hi = draw(st.integers(lo + 1, rows))
                items.append(
                    CopyItem(
                        hf_name=name,
                        src_box=((lo, hi), (0, 5)),
                        param_name=param,
                        dst_offset_bytes=offset,
                        num_bytes=(hi - lo) * 5 * 2,
                    )
                )
                offset += (hi - lo) * 10
            else:
                num_bytes = 2 * draw(st.integers(1, 20))
                items.append(
                    CopyItem(
                        hf_name=None,
                        src_box=(),
                        param_name=param,
                        dst_offset_bytes=offset,
                        num_bytes=num_bytes,
                    )
                )
                offset += num_bytes
    return tensors, items, 2 * draw(st.integers(1, 200))


def _apply(writes, memory: dict[int, int], staging: bytes) -> None:
    for w in writes:
        for i in range(w.num_bytes):
            memory[w.dst_addr + i] = staging[w.src_offset + i]


@settings(max_examples=150, deadline=None)
@given(_params_and_items())
def test_chunks_stage_and_write_exactly_what_the_bucket_does(case) -> None:
    tensors, items, chunk_bytes = case
    base = {"p0": 0, "p1": 1 << 20, "p2": 2 << 20}
    info = {p: (addr, 1 << 19, 2) for p, addr in base.items()}
    packer = BucketPacker(
        layout_id=0, slot_bytes=1 << 16, element_size=2, dst_address=lambda p, o: base[p] + o
    )
    names = sorted(tensors)
    for item in items:
        source = names.index(item.hf_name) if item.hf_name is not None else 0
        assert packer.add(source, [item]) == []
    bucket = packer.flush()
    assert bucket is not None
    chunks = split_bucket(bucket, chunk_bytes=chunk_bytes, element_size=2)

    # The chunks tile the bucket, each at most twice the target, their parts inside them.
    starts = itertools.accumulate((c.num_bytes for c in chunks[:-1]), initial=0)
    assert [c.start for c in chunks] == list(starts)
    assert sum(c.num_bytes for c in chunks) == bucket.num_bytes
    for chunk in chunks:
        assert 0 < chunk.num_bytes <= 2 * chunk_bytes
        stop = chunk.start + chunk.num_bytes
        assert sum(r.num_bytes for r in chunk.regions) == chunk.num_bytes
        assert all(chunk.start <= r.slot_offset < stop for r in chunk.regions)
        assert all(chunk.start <= off and off + n <= stop for off, n in chunk.zeros)
        for s in chunk.sources:
            size = math.prod(hi - lo for lo, hi in s.box) * 2
            assert chunk.start <= s.slot_offset and s.slot_offset + size <= stop

    # Filling chunk by chunk leaves the slot as filling the bucket at once does.
    slots = []
    for parts in ([bucket], chunks):
        staging = torch.full((1 << 15,), 3.0, dtype=torch.bfloat16)
        _fill(parts, [tensors[name] for name in names], staging)
        slots.append(staging)
    assert torch.equal(slots[0].view(torch.int16), slots[1].view(torch.int16))

    # The chunks' writes land the same bytes; a cut costs a write only inside a long run.
    raw = slots[0].view(torch.uint8).tolist()
    whole = coalesce(bucket.regions, slot_offset=0, weights_info=info)
    parts = [w for c in chunks for w in coalesce(c.regions, slot_offset=0, weights_info=info)]
    landed: list[dict[int, int]] = [{}, {}]
    _apply(whole, landed[0], raw)
    _apply(parts, landed[1], raw)
    assert landed[0] == landed[1]
    inner_cuts = [
        c.start
        for c in chunks[1:]
        if any(w.src_offset < c.start < w.src_offset + w.num_bytes for w in whole)
    ]
    assert len(parts) == len(whole) + len(inner_cuts)
    for cut in inner_cuts:
        (run,) = [w for w in whole if w.src_offset < cut < w.src_offset + w.num_bytes]
        assert run.num_bytes > 2 * chunk_bytes


def test_chunk_bounds_follow_parameters_and_cut_only_long_runs() -> None:
    # (param, num_bytes, dst_offset_bytes), in slot order.
    spec = [
        ("a", 10, 0),
        ("b", 10, 0),
        ("c", 30, 0),
        ("c", 40, 30),  # contiguous with the run before: one run of 70
        ("d", 5, 0),
        ("e", 20, 0),
        ("e", 20, 64),  # a gap in the destination: a run of its own
        ("f", 3, 0),
    ]
    regions, offset = [], 0
    for param, size, dst in spec:
        regions.append(
            Region(
                slot_offset=offset,
                num_bytes=size,
                param_name=param,
                dst_offset_bytes=dst,
                hf_name=param,
            )
        )
        offset += size
    # a+b (20) would pass 64 with c, so it closes first; c (70) alone is cut once at 32;
    # d+e+e (45) reaches 32 at a run boundary; f is what is left.
    assert chunk_bounds(regions, chunk_bytes=32) == [
        (0, 20),
        (20, 52),
        (52, 90),
        (90, 135),
        (135, 138),
    ]
    assert chunk_bounds(regions, chunk_bytes=1 << 20) == [(0, 138)]
    assert chunk_bounds([], chunk_bytes=32) == []
    # Without long runs, every cut falls between runs: no extra write.
    assert chunk_bounds(regions[:2], chunk_bytes=8) == [(0, 10), (10, 20)]


def test_split_bucket_cuts_a_long_source_box_into_row_boxes() -> None:
    item = CopyItem(
        hf_name="w", src_box=((1, 6), (0, 8)), param_name="p", dst_offset_bytes=0, num_bytes=80
    )
    packer = BucketPacker(layout_id=0, slot_bytes=1024, element_size=2, dst_address=lambda p, o: o)
    packer.add(0, [item])
    bucket = packer.flush()
    # 80 bytes in one run, cut every 24 bytes (12 elements, one and a half rows).
    chunks = split_bucket(bucket, chunk_bytes=24, element_size=2)
    assert [(c.start, c.num_bytes) for c in chunks] == [(0, 24), (24, 24), (48, 32)]
    assert [s.box for s in chunks[0].sources] == [((1, 2), (0, 8)), ((2, 3), (0, 4))]
    assert [s.box for s in chunks[1].sources] == [((2, 3), (4, 8)), ((3, 4), (0, 8))]
    assert [s.box for s in chunks[2].sources] == [((4, 6), (0, 8))]
    assert [(r.slot_offset, r.dst_offset_bytes) for c in chunks for r in c.regions] == [
        (0, 0),
        (24, 24),
        (48, 48),
    ]


# ---------------------------------------------------------------- whole programs


def _run_program(program, stream) -> dict[str, dict[str, torch.Tensor]]:
    """Execute `program` by hand: fill a host ring step by step and apply every write into
    per-target parameter memory (by session id), as a transport would."""
    ring = torch.zeros(program.staging.ring_bytes, dtype=torch.uint8)
    typed = ring.view(getattr(torch, program.dtype))
    index = {key: i for i, key in enumerate(program.keys)}
    held: list = [None] * len(program.keys)
    for key, tensor in stream:
        if key in index:
            held[index[key]] = tensor
    memory: dict[str, dict[int, int]] = {}
    filler = SlotFiller(num_workers=1)
    for step in program.steps:
        filler.run(step.copies, held, step.zeros, staging_bytes=ring, staging_typed=typed)
        raw = ring.numpy()
        for target_writes in step.writes:
            landed = memory.setdefault(target_writes.target.session_id, {})
            for w in target_writes.writes:
                landed[w.dst_addr] = raw[w.src_offset : w.src_offset + w.num_bytes].tobytes()
    filler.close()
    for step in program.direct:
        source = held[step.source]
        storage = storage_bytes(source).numpy()
        for target_writes in step.writes:
            landed = memory.setdefault(target_writes.target.session_id, {})
            by_writes: dict[int, int] = {}
            for w in target_writes.writes:
                landed[w.dst_addr] = storage[w.src_offset : w.src_offset + w.num_bytes].tobytes()
                by_writes.update(_bytes_at(w.dst_addr, landed[w.dst_addr]))
            # The same copies as pitched blocks (copies into mapped memory) land the same.
            by_blocks: dict[int, int] = {}
            for b in target_writes.blocks:
                for row in range(b.rows):
                    start = b.src_offset + row * b.src_pitch
                    data = storage[start : start + b.row_bytes].tobytes()
                    by_blocks.update(_bytes_at(b.dst_addr + row * b.row_bytes, data))
            assert by_blocks == by_writes
    return memory


def _bytes_at(addr: int, data: bytes) -> dict[int, int]:
    return {addr + i: byte for i, byte in enumerate(data)}


@settings(max_examples=16, deadline=None)
@given(
    st.sampled_from(["tiny", "tiny-moe"]),
    st.sampled_from([(1, 1), (2, 1), (2, 2)]),
    st.sampled_from([256, 4096, 1 << 20]),
    st.sampled_from([64, 1024]),
    st.integers(1, 3),
    st.sampled_from([None, "always", "auto-ipc", "auto-tcp", "never"]),
)
def test_a_lowered_program_writes_exactly_the_rank_layouts(
    preset, parallel, slot_bytes, chunk_bytes, num_slots, policy
) -> None:
    # policy None: everything staged (a float32 trainer); otherwise a bfloat16 trainer whose
    # tensors go direct as the policy says (auto: by a pitched or a per-row write cost).
    from weightsync.export import ModelExport
    from weightsync.plan import build_plan, simulate_targets
    from weightsync.plan.direct import DirectSpec
    from weightsync.plan.program import StagingSpec, lower_push
    from weightsync.receiver import shard_state_dict
    from weightsync.testing.presets import preset_config, random_model

    tp, ep = parallel
    if ep > 1 and preset != "tiny-moe":
        ep = 1
    config = preset_config(preset)
    model = random_model(config, seed=3)
    direct = DirectSpec()
    if policy is not None:
        model = model.to(torch.bfloat16)
        direct = DirectSpec(
            devices=("cpu",),
            policy=policy.partition("-")[0],
            # CUDA IPC's copies cost the host nothing of their own; TCP's writes do.
            write_s=25e-6 if policy == "auto-tcp" else 0.0,
            stage_bytes_per_s=5e9,
            pitched=policy == "auto-ipc",
        )
    export = ModelExport(model)
    targets = simulate_targets(config, tp=tp, ep=ep, replicas=2, dtype="bfloat16")
    plan = build_plan(
        hf_config=config,
        targets=targets,
        sources=[SourceHolding(rank=0, tensors=export.holding())],
        dtype="bfloat16",
    )
    staging = StagingSpec(
        device="cpu",
        num_slots=num_slots,
        slot_bytes=slot_bytes,
        chunk_bytes=chunk_bytes,
        direct=direct,
    )
    program = lower_push(plan.for_source(0), export.geometry(), staging)
    counters = program.counters
    assert counters.bytes_written == plan.num_bytes_written
    assert counters.bytes_staged + counters.bytes_direct == plan.for_source(0).num_bytes_staged
    if policy in (None, "never"):
        assert counters.bytes_direct == 0
    elif policy in ("always", "auto-ipc"):
        # No transposed view: only the padding needs the ring (it has no source memory).
        padding = sum(
            item.num_bytes
            for works in plan.for_source(0).work.values()
            for work in works
            for item in work.items
            if item.is_padding
        )
        assert counters.bytes_staged == padding
        assert program.all_direct is (padding == 0)
    memory = _run_program(program, export)
    state = model.state_dict()
    for target in targets:
        expected = shard_state_dict(state, config, target.parallelism, "bfloat16")
        landed = memory[target.session_id]
        runs = sorted(landed.items())
        got = bytearray()
        for param, tensor in expected.items():
            addr = target.weights_info[param][0]
            want = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            got = bytearray(len(want))
            covered = 0
            for start, data in runs:
                if addr <= start < addr + len(want):
                    got[start - addr : start - addr + len(data)] = data
                    covered += len(data)
            assert covered == len(want), (param, covered, len(want))
            assert bytes(got) == want, param


def test_lowering_refuses_a_stream_without_a_needed_tensor() -> None:
    from weightsync.export import ModelExport
    from weightsync.plan import build_plan, simulate_targets
    from weightsync.plan.program import StagingSpec, lower_push
    from weightsync.testing.presets import preset_config, random_model

    config = preset_config("tiny")
    export = ModelExport(random_model(config, seed=3))
    plan = build_plan(
        hf_config=config,
        targets=simulate_targets(config, tp=2),
        sources=[SourceHolding(rank=0, tensors=export.holding())],
    ).for_source(0)
    partial = ModelExport({k: v for k, v in export if k != "model.norm.weight"})
    staging = StagingSpec(device="cpu", num_slots=2, slot_bytes=4096, chunk_bytes=1024)
    with pytest.raises(ValueError, match=r"lacks 'model\.norm\.weight'"):
        lower_push(plan, partial.geometry(), staging)
    with pytest.raises(ValueError, match="multiple of 64"):
        StagingSpec(device="cpu", num_slots=2, slot_bytes=100, chunk_bytes=64)


def test_direct_copies_are_long_runs_of_the_tensor_or_nothing() -> None:
    from weightsync.plan.direct import DirectSpec, direct_copy

    tensor = torch.zeros(8, 4096, dtype=torch.bfloat16)
    (geometry,) = _geometry([tensor])
    # A write costs what a copy of 4 KiB into the ring does (beside the write staging costs).
    spec = DirectSpec(devices=("cpu",), write_s=1e-6, stage_bytes_per_s=4096e6)

    def item(box, dst=0):
        numel = math.prod(hi - lo for lo, hi in box)
        return CopyItem(
            hf_name="w", src_box=box, param_name="p", dst_offset_bytes=dst, num_bytes=2 * numel
        )

    def copy(box, geometry=geometry, dtype="bfloat16", spec=spec):
        return direct_copy(item(box), 0, 0, geometry, dtype=dtype, element_size=2, spec=spec)

    assert copy(((0, 8), (0, 4096))).runs == ((0, 0, 8 * 4096 * 2),)
    assert copy(((2, 4), (0, 4096))).runs == ((2 * 8192, 0, 2 * 8192),)  # a block of rows
    # A row-parallel slice: one run per row, pitched by the tensor's row.
    columns = copy(((0, 8), (2048, 4096)))
    assert columns.runs == tuple((r * 8192 + 4096, r * 4096, 4096) for r in range(8))
    # Rows too short to pay a write each, a cast, another device, a transposed view: staged.
    assert copy(((0, 8), (0, 1024))) is None
    assert copy(((0, 8), (0, 4096)), dtype="float32") is None
    assert copy(((0, 8), (0, 4096)), spec=DirectSpec(devices=("cuda:0",))) is None
    (transposed,) = _geometry([tensor.t()])
    assert copy(((0, 4096), (0, 8)), geometry=transposed) is None
    # A single element run of anything is one run.
    assert copy(((3, 4), (5, 6))).runs == ((2 * (3 * 4096 + 5), 0, 2),)
    padding = CopyItem(hf_name=None, src_box=(), param_name="p", dst_offset_bytes=0, num_bytes=64)
    assert direct_copy(padding, 0, 0, geometry, dtype="bfloat16", element_size=2, spec=spec) is None


def test_direct_blocks_are_a_pitched_copy_per_row_parallel_slice() -> None:
    from weightsync.plan.direct import DirectCopy
    from weightsync.plan.writes import PitchedRun, direct_blocks, direct_writes

    info = {"p": (1 << 20, 4096, 2), "q": (1 << 24, 64, 2)}
    rows = DirectCopy(
        source=0,
        layout_id=0,
        param_name="p",
        dst_offset_bytes=0,
        num_bytes=4 * 512,
        runs=tuple((r * 2048 + 1024, r * 512, 512) for r in range(4)),
    )
    halves = [
        DirectCopy(
            source=1,
            layout_id=0,
            param_name="q",
            dst_offset_bytes=o,
            num_bytes=64,
            runs=((o, o, 64),),
        )
        for o in (0, 64)
    ]
    assert direct_blocks([rows, *halves], info) == [
        PitchedRun(1024, 1 << 20, 4, 512, 2048, "p"),
        PitchedRun(0, 1 << 24, 1, 128, 128, "q"),  # the two halves, merged
    ]
    # A list transport gets the same bytes as single runs.
    assert len(direct_writes([rows, *halves], info)) == 4 + 1


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_copies_into_mapped_memory_land_what_the_writes_do(preset, monkeypatch) -> None:
    # The sender's copies into a receiver's mapped memory (CUDA IPC) follow the program's
    # pitched blocks; here the "mapped" parameters are host tensors, the copies the same.
    from weightsync.export import ModelExport
    from weightsync.plan import build_plan, simulate_targets
    from weightsync.plan.direct import DirectSpec
    from weightsync.plan.program import StagingSpec, lower_push
    from weightsync.sender.direct import MappedDirect
    from weightsync.testing.presets import preset_config, random_model

    config = preset_config(preset)
    export = ModelExport(random_model(config, seed=5).to(torch.bfloat16))
    targets = simulate_targets(
        config, tp=2, ep=2 if preset == "tiny-moe" else 1, replicas=2, dtype="bfloat16"
    )
    plan = build_plan(
        hf_config=config,
        targets=targets,
        sources=[SourceHolding(rank=0, tensors=export.holding())],
        dtype="bfloat16",
    ).for_source(0)
    staging = StagingSpec(
        device="cpu",
        num_slots=2,
        slot_bytes=1 << 20,
        chunk_bytes=1 << 16,
        direct=DirectSpec(devices=("cpu",), policy="always"),
    )
    program = lower_push(plan, export.geometry(), staging)
    assert any(b.rows > 1 for s in program.direct for t in s.writes for b in t.blocks)
    params: dict[tuple[str, str, int], torch.Tensor] = {}

    def host_param(self, target, name):
        addr, numel, size = target.weights_info[name]
        return params.setdefault(
            (target.session_id, name, addr), torch.zeros(numel * size, dtype=torch.uint8)
        )

    monkeypatch.setattr(MappedDirect, "_param", host_param)
    writer = MappedDirect(None, failed={}, params={})
    index = {key: i for i, key in enumerate(program.keys)}
    stream = {index[k]: t for k, t in export if k in index}
    for step in program.direct:
        tensors = {c.source: stream[c.source] for c in step.copies}
        writer.run(step, tensors, storage_bytes(stream[step.source]))
    # What the writes land (addresses as the target published them) is what was copied.
    memory = _run_program(dataclasses.replace(program, steps=()), export)
    for target in targets:
        for start, data in memory.get(target.session_id, {}).items():
            name = next(
                n
                for n, (addr, numel, size) in target.weights_info.items()
                if addr <= start < addr + numel * size
            )
            addr = target.weights_info[name][0]
            param = params[(target.session_id, name, addr)]
            offset = start - addr
            assert param[offset : offset + len(data)].numpy().tobytes() == data, name


def test_source_memory_registers_each_storage_once_and_drops_stale_ones() -> None:
    from weightsync.sender.direct import SourceMemory
    from weightsync.transport.base import RegionTable

    class Recording:
        def __init__(self) -> None:
            self.table = RegionTable()
            self.calls: list[tuple[str, int]] = []

        def register(self, addr: int, num_bytes: int) -> None:
            self.table.add(addr, num_bytes)  # raises ValueError on an overlap
            self.calls.append(("register", addr))

        def unregister(self, addr: int) -> None:
            self.table.remove(addr)
            self.calls.append(("unregister", addr))

    transport = Recording()
    memory = SourceMemory.of(transport)
    assert SourceMemory.of(transport) is memory  # the senders of one transport share it
    memory.start()
    memory.ensure(0x1000, 0x1000)
    memory.ensure(0x1000, 0x1000)  # registered once
    memory.ensure(0x4000, 0x100)
    assert transport.calls == [("register", 0x1000), ("register", 0x4000)]
    # The next push reads new memory where the first storage was: the stale one goes.
    memory.start()
    memory.ensure(0x4000, 0x100)
    memory.ensure(0x1800, 0x1000)
    assert transport.calls[2:] == [("unregister", 0x1000), ("register", 0x1800)]
    # A storage that grew in place is registered again at its new size.
    memory.ensure(0x4000, 0x200)
    assert transport.calls[4:] == [("unregister", 0x4000), ("register", 0x4000)]
    memory.release()
    assert len(transport.table) == 0
