"""The sender's delta push, whole: encode against the reference, map into every layout, lay
out, write, apply on the rank and check every byte and every checksum.

The rollout ranks here are `shard_state_dict` of the trainer's weights (exactly what SGLang's
loader leaves on a rank) in this process, and the transport copies bytes with ``memmove``
between registered regions of this process: the sender's code runs as it does over
Mooncake (which the end-to-end tests use), and every layout and holding can be tried in a
second. Bit-exactness is checked against `shard_state_dict` of the new weights, and the
checksum each rank would reach against the sum of its base and the pushed changes.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence

import pytest
import torch

from weightsync.delta_codec import apply_payload, as_bits, checksums
from weightsync.errors import TransferError
from weightsync.export import ModelExport, TensorsExport
from weightsync.layout import ParallelismConfig
from weightsync.plan import SourceHolding, TargetRank, TensorMeta, build_plan
from weightsync.receiver.loader import shard_state_dict
from weightsync.sender.delta import PAYLOAD_BUFFER_FRACTION, DeltaPush, wrap_int64
from weightsync.sender.delta_reference import DeltaReference
from weightsync.testing.presets import preset_config, random_model
from weightsync.transport import HOST_ONLY, TransportCapabilities, WriteCost
from weightsync.transport.base import WriteHandle

TINY = preset_config("tiny")
MOE = preset_config("tiny-moe", num_experts=8)


class MemmoveTransport:
    """Writes by ``memmove`` inside this process, from registered regions only."""

    session_id = "local:0"
    write_cost = WriteCost(write_s=1e-6, bytes_per_s=1e10)
    capabilities: TransportCapabilities = HOST_ONLY

    def __init__(self) -> None:
        self.regions: dict[int, int] = {}
        self.fail_sessions: set[str] = set()
        self.num_writes = 0

    def register(self, addr: int, num_bytes: int) -> None:
        self.regions[addr] = num_bytes

    def unregister(self, addr: int) -> None:
        del self.regions[addr]

    def write(self, target_session, src_addrs, dst_addrs, lengths) -> WriteHandle:
        for src, length in zip(src_addrs, lengths, strict=True):
            if not any(a <= src and src + length <= a + n for a, n in self.regions.items()):
                raise ValueError(f"source {src:#x}+{length} is not registered")
        if target_session in self.fail_sessions:
            raise TransferError("injected", target_session=target_session)
        for src, dst, length in zip(src_addrs, dst_addrs, lengths, strict=True):
            ctypes.memmove(dst, src, length)
        self.num_writes += len(lengths)
        return WriteHandle(
            target_session=target_session, num_regions=len(lengths), num_bytes=sum(lengths)
        )

    def wait(self, handle: WriteHandle, timeout_s: float) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class Rank:
    """One rollout rank: its parameters, its delta region, what it published."""

    params: dict[str, torch.Tensor]
    region: torch.Tensor
    target: TargetRank


def _ranks(hf_state, hf_config, replica: str, tp: int, ep: int, region_bytes: int) -> list[Rank]:
    ranks = []
    for tp_rank in range(tp):
        parallelism = ParallelismConfig(tp_size=tp, tp_rank=tp_rank, ep_size=ep)
        params = shard_state_dict(hf_state, hf_config, parallelism, "bfloat16")
        region = torch.zeros(region_bytes, dtype=torch.uint8)
        target = TargetRank(
            replica=replica,
            rank=tp_rank,
            session_id=f"{replica}-{tp_rank}",
            parallelism=parallelism,
            weights_info={
                n: (p.data_ptr(), p.numel(), p.element_size()) for n, p in params.items()
            },
            delta_region=(region.data_ptr(), region.numel()),
        )
        ranks.append(Rank(params, region, target))
    return ranks


def _sources(hf_state, num_sources: int, split: str) -> list[dict[str, torch.Tensor]]:
    """Each source's held tensors: whole (one source) or row/column boxes of 2-D weights."""
    if num_sources == 1:
        return [dict(hf_state)]
    held: list[dict[str, torch.Tensor]] = [{} for _ in range(num_sources)]
    for name, tensor in hf_state.items():
        dim = 0 if split == "rows" else tensor.dim() - 1
        if tensor.dim() < 2 or tensor.shape[dim] % num_sources:
            for source in held:
                source[name] = tensor
            continue
        for index, piece in enumerate(tensor.chunk(num_sources, dim=dim)):
            held[index][name] = piece
    return held


def _holdings(hf_state, sources) -> list[SourceHolding]:
    out = []
    for rank, held in enumerate(sources):
        tensors = {}
        for name, piece in held.items():
            full = hf_state[name]
            box = None
            if piece.shape != full.shape:
                dim = next(d for d in range(full.dim()) if piece.shape[d] != full.shape[d])
                per = piece.shape[dim]
                index = next(
                    i
                    for i, c in enumerate(full.chunk(full.shape[dim] // per, dim=dim))
                    if c.data_ptr() == piece.data_ptr()
                )
                box = tuple(
                    (index * per, (index + 1) * per) if d == dim else (0, full.shape[d])
                    for d in range(full.dim())
                )
            tensors[name] = TensorMeta(shape=tuple(full.shape), dtype=str(piece.dtype), box=box)
        out.append(SourceHolding(rank=rank, tensors=tensors))
    return out


def _hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under HF checkpoint names (per-expert views of fused experts)."""
    return {name: tensor.detach() for name, tensor in ModelExport(model)}


def _step(model: torch.nn.Module, generator: torch.Generator, fraction: float) -> None:
    """Change about `fraction` of every weight's elements (as an optimizer step would)."""
    with torch.no_grad():
        for param in model.parameters():
            mask = torch.rand(param.shape, generator=generator) < fraction
            param.add_(mask * torch.randn(param.shape, generator=generator) * 0.01)


def _sync_rounds(
    hf_config,
    layouts: Sequence[tuple[int, int]],
    *,
    num_sources: int = 1,
    split: str = "rows",
    rounds: int = 3,
    fraction: float = 0.05,
) -> None:
    model = random_model(hf_config, seed=3)
    state = _hf_state(model)
    ranks = []
    for index, (tp, ep) in enumerate(layouts):
        ranks += _ranks(state, hf_config, f"replica{index}", tp, ep, 1 << 22)
    transport = MemmoveTransport()
    for rank in ranks:
        transport.register(rank.region.data_ptr(), rank.region.numel())
    sources = _sources(state, num_sources, split)
    plan = build_plan(
        hf_config=hf_config,
        targets=[r.target for r in ranks],
        sources=_holdings(state, sources),
        dtype="bfloat16",
    )
    pushers = [
        DeltaPush(
            transport,
            rank=source,
            world_size=num_sources,
            timeout_s=5.0,
            reference=DeltaReference("device"),
        )
        for source in range(num_sources)
    ]
    for pusher, held in zip(pushers, sources, strict=True):
        # The first push is full: it only records the reference.
        stats = pusher.push(plan.for_source(pusher.rank), TensorsExport(held), [], token=1)
        assert stats.token == 1 and not stats.written
    generator = torch.Generator().manual_seed(5)
    registered = None
    for token in range(2, 2 + rounds):
        _step(model, generator, fraction)
        state = _hf_state(model)
        sources = _sources(state, num_sources, split)
        base = {r.target.session_id: checksums(r.params) for r in ranks}
        changes: dict[str, dict[str, int]] = {r.target.session_id: {} for r in ranks}
        payloads: dict[str, list[tuple[int, int]]] = {r.target.session_id: [] for r in ranks}
        for pusher, held in zip(pushers, sources, strict=True):
            stats = pusher.push(
                plan.for_source(pusher.rank),
                TensorsExport(held),
                [r.target for r in ranks],
                token=token,
            )
            assert not stats.failed and stats.token == token
            assert 0 < stats.density < 1
            for session, write in stats.written.items():
                payloads[session] += write.payloads
                for name, change in write.changes.items():
                    changes[session][name] = wrap_int64(changes[session].get(name, 0) + change)
        # Each pusher lays its payloads out in one registered buffer, kept from push to
        # push while they fit (steps of one size).
        assert len(transport.regions) == len(ranks) + num_sources
        registered = registered or set(transport.regions)
        assert set(transport.regions) == registered
        for rank in ranks:
            session = rank.target.session_id
            order = [rank.params[n] for n in sorted(rank.params)]
            for offset, num_bytes in payloads[session]:
                apply_payload(rank.region[offset : offset + num_bytes], order)
            expected = shard_state_dict(state, hf_config, rank.target.parallelism, "bfloat16")
            for name, param in rank.params.items():
                assert torch.equal(as_bits(param), as_bits(expected[name])), (session, name)
            after = checksums(rank.params)
            for name, value in after.items():
                predicted = wrap_int64(base[session][name] + changes[session].get(name, 0))
                assert value == predicted, (session, name)


@pytest.mark.parametrize(
    "layouts", [[(1, 1)], [(2, 1)], [(4, 1), (1, 1)]], ids=["tp1", "tp2", "tp4+tp1"]
)
def test_delta_pushes_are_bit_exact_into_dense_layouts(layouts) -> None:
    _sync_rounds(TINY, layouts)


@pytest.mark.parametrize("split", ["rows", "columns"])
def test_sharded_sources_each_write_their_part_of_a_delta(split) -> None:
    _sync_rounds(TINY, [(2, 1), (1, 1)], num_sources=2, split=split)


def test_delta_pushes_into_moe_with_expert_parallelism() -> None:
    _sync_rounds(MOE, [(2, 2), (2, 1)])


def test_dense_changes_still_round_trip() -> None:
    _sync_rounds(TINY, [(2, 1)], rounds=1, fraction=0.9)


def _two_targets(region_bytes: tuple[int, int], fraction: float, *, fail: str | None = None):
    """Two tp1 replicas (regions of `region_bytes`), a pusher whose reference holds the
    model, and the model after a step changing `fraction` of it: ``(pusher, plan, ranks,
    export, transport)``; writes to the replica named `fail` fail."""
    model = random_model(TINY, seed=3)
    state = _hf_state(model)
    ranks = _ranks(state, TINY, "a", 1, 1, region_bytes[0]) + _ranks(
        state, TINY, "b", 1, 1, region_bytes[1]
    )
    transport = MemmoveTransport()
    if fail is not None:
        transport.fail_sessions.add(f"{fail}-0")
    plan = build_plan(
        hf_config=TINY,
        targets=[r.target for r in ranks],
        sources=_holdings(state, [state]),
        dtype="bfloat16",
    )
    pusher = DeltaPush(
        transport,
        rank=0,
        world_size=1,
        timeout_s=5.0,
        reference=DeltaReference(),
    )
    pusher.push(plan.for_source(0), TensorsExport(state), [], token=1)
    _step(model, torch.Generator().manual_seed(1), fraction)
    return pusher, plan.for_source(0), ranks, TensorsExport(_hf_state(model)), transport


def test_a_delta_without_a_reference_is_refused_before_any_write() -> None:
    pusher, plan, ranks, export, transport = _two_targets((1 << 20, 1 << 20), 0.05)
    pusher.reference.free()
    with pytest.raises(ValueError, match="no complete delta reference"):
        pusher.push(plan, export, [ranks[0].target], token=2)
    assert transport.num_writes == 0 and pusher.reference.token is None


def test_a_recording_push_sets_aside_the_host_buffer_the_first_delta_takes() -> None:
    """The first push of a sync that keeps a reference registers a host payload buffer of
    `PAYLOAD_BUFFER_FRACTION` of the reference, zeroed; the first delta that fits takes it
    as it is (no new registration)."""
    pusher, plan, (a, b), export, transport = _two_targets((1 << 22, 1 << 22), 0.01)
    buffer = pusher._buffer
    assert buffer is not None and buffer.device.type == "cpu"
    assert buffer.numel() >= pusher.reference.num_bytes * PAYLOAD_BUFFER_FRACTION
    assert transport.regions[buffer.data_ptr()] == buffer.numel()
    assert not buffer.any()
    stats = pusher.push(plan, export, [a.target, b.target], token=2)
    assert set(stats.written) == {a.target.session_id, b.target.session_id}
    assert pusher._buffer is buffer and buffer.data_ptr() in transport.regions
    sent = sum(write.num_bytes for write in stats.written.values()) // 2
    assert 0 < sent <= buffer.numel()
    # A later push that only records keeps the buffer it has.
    pusher.push(plan, export, [], token=3)
    assert pusher._buffer is buffer


def test_a_payload_larger_than_the_slot_fails_that_target_only() -> None:
    pusher, plan, (small, big), export, _ = _two_targets((4096, 1 << 22), 0.2)
    stats = pusher.push(plan, export, [small.target, big.target], token=2)
    assert set(stats.failed) == {small.target.session_id}
    assert "does not fit its slot" in stats.failed[small.target.session_id]
    assert set(stats.written) == {big.target.session_id}
    assert stats.token == 2  # the reference is whole: the small target takes full bytes next


def test_a_failed_write_fails_that_target_and_keeps_the_reference() -> None:
    pusher, plan, (a, b), export, _ = _two_targets((1 << 22, 1 << 22), 0.05, fail="a")
    stats = pusher.push(plan, export, [a.target, b.target], token=2)
    assert set(stats.failed) == {a.target.session_id}
    assert set(stats.written) == {b.target.session_id}
    assert stats.token == 2


def test_delta_pushes_into_a_layout_of_two_dtypes() -> None:
    # DeepSeek-V3 keeps its router bias in float32 beside bf16 weights: a plan of two parts,
    # whose targets each publish one dtype's parameters; payloads number every parameter.
    deepseek = preset_config("tiny-deepseek", num_hidden_layers=2)
    _sync_rounds(deepseek, [(2, 2), (1, 1)], rounds=2)


def test_the_host_and_device_run_maps_agree() -> None:
    from weightsync.plan.delta import DeltaTarget, RunFamily
    from weightsync.sender.delta import _Runs

    # A column slice (runs with a step), a row block, and an interleaved second family.
    target = DeltaTarget(
        layout_id=0,
        param_name="p",
        element_size=2,
        families=(
            RunFamily(src_start=3, src_step=10, dst_start=0, dst_step=4, count=50, length=4),
            RunFamily(src_start=8, src_step=10, dst_start=200, dst_step=2, count=50, length=2),
            RunFamily(src_start=600, src_step=0, dst_start=300, dst_step=0, count=1, length=40),
        ),
    )
    runs = _Runs(target)
    elements = torch.unique(
        torch.randint(0, 700, (300,), generator=torch.Generator().manual_seed(1))
    )
    positions, destinations = runs._map_host(elements)
    host = (torch.arange(len(elements))[positions], destinations)
    device = runs._map_device(elements)
    expected = {}
    for family in target.families:
        for src, dst, length in family.runs():
            for k in range(length):
                expected[src + k] = dst + k
    pairs = {int(elements[p]): int(d) for p, d in zip(*host, strict=True)}
    assert pairs == {e: expected[e] for e in elements.tolist() if e in expected}
    host_pairs = sorted(zip(host[0].tolist(), host[1].tolist(), strict=True))
    assert host_pairs == sorted(zip(device[0].tolist(), device[1].tolist(), strict=True))


def test_runs_map_the_same_on_device_ops_with_one_search_for_several() -> None:
    """`_Runs.map`: the device path (torch ops, here run on the host), with the bounds of
    several runs searched at once, maps the same elements as the host path; runs over a
    whole tensor are a shift."""
    from types import SimpleNamespace

    from weightsync.sender.delta import _Runs

    def runs(*families):
        return _Runs(
            SimpleNamespace(
                families=[
                    SimpleNamespace(
                        src_start=s, src_step=st, dst_start=d, dst_step=ds, count=c, length=n
                    )
                    for s, st, d, ds, c, n in families
                ]
            )
        )

    numel = 64 * 48
    elements = torch.randperm(numel, generator=torch.Generator().manual_seed(3))[:500].sort()[0]
    split = [
        runs((0, 48, 0, 24, 64, 24)),  # the first half of every row (tp 2, dim 1)
        runs((24, 48, 0, 24, 64, 24)),  # the second half
        runs((0, 0, 0, 0, 1, 1536), (1536, 0, 7, 0, 1, 100)),  # two contiguous runs
    ]
    bounds = [b for r in split for b in r.bounds(numel)]
    found = iter(torch.searchsorted(elements, torch.tensor(bounds)).tolist())
    for r in split:
        host_pos, host_dst = r._map_host(elements)
        dev_pos, dev_dst = r._map_device(elements, found)
        assert torch.equal(torch.arange(len(elements))[host_pos], dev_pos)
        assert torch.equal(host_dst, dev_dst)
    whole = runs((0, 0, 5, 0, 1, numel))
    assert whole.whole(numel) and whole.bounds(numel) == []
    positions, destinations = whole.map(elements, numel, iter(()))
    assert positions == slice(None) and torch.equal(destinations, elements + 5)
