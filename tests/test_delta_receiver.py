"""`RolloutAgent`'s delta syncs: the registered delta region (real Mooncake TCP writes into
it), payloads applied bit-exact and checked against the trainers' checksums, and every way
a delta can be wrong: a wrong checksum, a payload that is no delta, one outside the region,
a parameter the rank does not have, a session that is not open. The session remembers a
delta's verdict for its end."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import torch

from delta_cases import changed
from weightsync.delta_codec import BLOCK_ELEMENTS, as_bits, checksums, encode_payload
from weightsync.errors import TransferError
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.receiver import DeltaResult, RolloutAgent, UpdateSessionError
from weightsync.transport import MooncakeConfig, MooncakeTransport

PARALLELISM = ParallelismConfig(tp_size=2, tp_rank=1)
REGION_BYTES = 1 << 20


def _params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(48, generator=generator)
    # Not in sorted order: payloads number parameters by their sorted names.
    return {
        "z.weight": torch.randn(BLOCK_ELEMENTS + 300, generator=generator),
        "a.weight": flat[:32].view(4, 8),
        "b.weight": flat[32:].view(16),
        "m.weight": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
def transports() -> Iterator[tuple[MooncakeTransport, MooncakeTransport]]:
    receiver = MooncakeTransport(MooncakeConfig(timeout_s=10.0))
    sender = MooncakeTransport(MooncakeConfig(timeout_s=10.0))
    yield receiver, sender
    sender.close()
    receiver.close()


@pytest.fixture
def rank(transports) -> Iterator[tuple[RolloutAgent, dict[str, torch.Tensor]]]:
    """An agent with a delta region, and its parameters (the engine's tensors)."""
    receiver, _ = transports
    params = _params()
    with RolloutAgent(
        params=params,
        parallelism=PARALLELISM,
        transport=receiver,
        delta_region_bytes=REGION_BYTES,
    ) as agent:
        yield agent, params


def _place(agent: RolloutAgent, offset: int, payload: torch.Tensor) -> None:
    """Put `payload` into the agent's delta region with a plain copy (same process)."""
    addr, num_bytes = agent.delta_region
    assert offset + payload.numel() <= num_bytes
    ctypes.memmove(addr + offset, payload.data_ptr(), payload.numel())


def _write(sender: MooncakeTransport, agent: RolloutAgent, offset: int, payload) -> None:
    """Write `payload` into the agent's delta region over Mooncake, as a trainer does."""
    addr, _ = agent.delta_region
    sender.register(payload.data_ptr(), payload.numel())
    try:
        handle = sender.write(
            agent.session_id, [payload.data_ptr()], [addr + offset], [payload.numel()]
        )
        sender.wait(handle, 10.0)
    finally:
        sender.unregister(payload.data_ptr())


def _snapshot(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in params.items()}


def _same(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    """Every tensor of `expected` bitwise equal to the parameter of its name."""
    return all(torch.equal(as_bits(params[n]), as_bits(t)) for n, t in expected.items())


def test_the_delta_region_is_registered_published_and_released(transports):
    receiver, sender = transports
    with RolloutAgent(params=_params(), parallelism=PARALLELISM, transport=receiver) as plain:
        assert plain.delta_region is None
        assert "delta_region" not in plain.transfer_engine_info()
    agent = RolloutAgent(
        params=_params(), parallelism=PARALLELISM, transport=receiver, delta_region_bytes=4096
    )
    with agent:
        addr, num_bytes = agent.delta_region
        assert num_bytes == 4096
        assert agent.transfer_engine_info()["delta_region"] == [addr, 4096]
        spans = [(a, a + n) for a, n in agent.regions]
        assert all(addr + num_bytes <= start or end <= addr for start, end in spans)
        payload = torch.arange(256, dtype=torch.uint8)
        _write(sender, agent, 1024, payload)
        landed = (ctypes.c_uint8 * 256).from_address(addr + 1024)
        assert bytes(landed) == bytes(payload.tolist())
    # Closed: the region is unregistered, so a trainer's write is refused.
    with pytest.raises(TransferError):
        _write(sender, agent, 0, torch.zeros(8, dtype=torch.uint8))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="delta_region_bytes"):
            RolloutAgent(
                params=_params(),
                parallelism=PARALLELISM,
                transport=receiver,
                delta_region_bytes=bad,
            )


def test_payloads_over_mooncake_apply_bit_exact_and_the_end_is_verified(transports, rank):
    _, sender = transports
    agent, params = rank
    assert agent.delta_checksums() == checksums(params)
    base = _snapshot(params)
    # Two source ranks' payloads, one touching a parameter the other also touches.
    first, after_first = changed(
        params, {"z.weight": [0, 5, BLOCK_ELEMENTS + 7], "m.weight": [3]}, seed=1
    )
    second, after = changed(
        {**params, **after_first}, {"a.weight": [1, 2, 31], "z.weight": [9]}, seed=2
    )
    after = {**after_first, **after}
    one, two = encode_payload(first, "cpu"), encode_payload(second, "cpu")
    _write(sender, agent, 0, one)
    _write(sender, agent, 4096, two)
    # Written outside the parameters: nothing changed yet.
    assert _same(params, base)
    expected = checksums(after)
    agent.begin_update("target")
    result = agent.apply_delta([(0, one.numel()), (4096, two.numel())], expected)
    assert isinstance(result, DeltaResult)
    assert result.verified and result.error is None and result.mismatched == ()
    assert result.num_elements == 4 + 4
    assert _same(params, after)
    assert _same(params, {"b.weight": base["b.weight"]})
    assert result.checksums == checksums(params) == agent.delta_checksums()
    check = agent.end_update()
    assert check.verified and check.delta is True
    assert set(check.changed) == {"z.weight", "m.weight", "a.weight"}


def test_a_wrong_expected_checksum_fails_and_the_end_cannot_verify(rank):
    agent, params = rank
    sections, after = changed(params, {"b.weight": [0, 15]}, seed=1)
    payload = encode_payload(sections, "cpu")
    _place(agent, 0, payload)
    expected = checksums(after)
    expected["b.weight"] += 1
    agent.begin_update("target")
    result = agent.apply_delta([(0, payload.numel())], expected)
    assert not result.verified and result.error is None
    assert result.mismatched == ("b.weight",)
    assert _same(params, after)  # the payload was applied: its bytes are not what was meant
    # Even digests that match what the parameters hold do not turn the session verified.
    check = agent.end_update(agent.digests())
    assert not check.verified and check.delta is False
    # The next session starts without a verdict.
    agent.begin_update("target")
    check = agent.end_update()
    assert not check.verified and check.delta is None


def test_a_parameter_written_without_an_expected_checksum_is_a_mismatch(rank):
    agent, params = rank
    sections, after = changed(params, {"a.weight": [4], "m.weight": [0, 1]}, seed=1)
    payload = encode_payload(sections, "cpu")
    _place(agent, 64, payload)
    expected = checksums(after)
    del expected["m.weight"]
    agent.begin_update("target")
    result = agent.apply_delta([(64, payload.numel())], expected)
    assert result.mismatched == ("m.weight",) and not result.verified
    assert not agent.end_update().verified


def test_a_payload_that_is_no_delta_stops_the_apply(rank):
    agent, params = rank
    base = _snapshot(params)
    sections, after = changed(params, {"z.weight": [100, 200]}, seed=1)
    good = encode_payload(sections, "cpu")
    bad = good.clone()
    bad[0] ^= 1  # its magic
    _place(agent, 0, bad)
    _place(agent, 4096, good)
    expected = checksums(after)
    agent.begin_update("target")
    # First: nothing applied, the weights untouched.
    result = agent.apply_delta([(0, bad.numel()), (4096, good.numel())], expected)
    assert not result.verified and "payload 0 of 2" in result.error
    assert "nothing was applied" in result.error and "not a weightsync delta" in result.error
    assert _same(params, base) and result.num_elements == 0
    assert result.mismatched == ("z.weight",)
    # Later: the ones before it stay applied, and the result is still a failure.
    result = agent.apply_delta([(4096, good.numel()), (0, bad.numel())], expected)
    assert "payload 1 of 2" in result.error and "the 1 payload(s) before it were applied" in (
        result.error
    )
    assert _same(params, after) and not result.verified and result.mismatched == ()
    assert not agent.end_update(agent.digests()).verified


def test_a_payload_outside_the_region_changes_nothing(rank):
    agent, params = rank
    base = _snapshot(params)
    sections, after = changed(params, {"b.weight": [3]}, seed=1)
    payload = encode_payload(sections, "cpu")
    _place(agent, 0, payload)
    expected = checksums(after)
    agent.begin_update("target")
    size = payload.numel()
    for spans, message in [
        ([(0, size), (REGION_BYTES - 8, 16)], f"delta region of {REGION_BYTES} bytes"),
        ([(-8, size)], f"delta region of {REGION_BYTES} bytes"),
        ([(0, 0)], "not inside"),
        ([(REGION_BYTES, 8)], "not inside"),
        ([(4, size)], "not a multiple of 8"),
    ]:
        with pytest.raises(ValueError, match=message):
            agent.apply_delta(spans, expected)
        assert _same(params, base)
    with pytest.raises(
        ValueError, match=r"tp rank 1: .* 1 parameter\(s\) it does not have \(x\.weight"
    ):
        agent.apply_delta([(0, size)], {**expected, "x.weight": 1})
    assert _same(params, base)
    # Refused requests leave no verdict: a good apply then verifies the session.
    assert agent.apply_delta([(0, size)], expected).verified
    assert agent.end_update().verified


def test_apply_delta_needs_an_open_session_and_a_region(transports, rank):
    receiver, _ = transports
    agent, params = rank
    with pytest.raises(UpdateSessionError, match="no weight-update session is open"):
        agent.apply_delta([], {})
    agent.begin_update("target")
    agent.prepare_end(None)
    with pytest.raises(UpdateSessionError, match="end is being prepared"):
        agent.apply_delta([], {})
    agent.end_update(prepared=True)
    # Checksums are read-only and answer any time.
    assert agent.delta_checksums() == checksums(params)
    with RolloutAgent(params=_params(), parallelism=PARALLELISM, transport=receiver) as plain:
        plain.begin_update("target")
        with pytest.raises(ValueError, match="tp rank 1 has no delta region"):
            plain.apply_delta([], {})
        plain.end_update()


def test_every_delta_of_a_session_must_verify(rank):
    agent, params = rank
    sections, after = changed(params, {"a.weight": [0]}, seed=1)
    payload = encode_payload(sections, "cpu")
    _place(agent, 0, payload)
    agent.begin_update("target")
    assert agent.apply_delta([(0, payload.numel())], checksums(after)).verified
    # An empty delta (a rank no trainer rank wrote to) verifies against no expectations...
    assert agent.apply_delta([], {}).verified
    # ...but one wrong checksum in a later apply decides the session.
    assert not agent.apply_delta([], {"b.weight": 0}).verified
    assert agent.apply_delta([], {}).verified
    check = agent.end_update()
    assert not check.verified and check.delta is False


def test_a_session_that_read_its_base_derives_the_check_from_it(rank):
    agent, params = rank
    sections, after = changed(
        params, {"z.weight": [1, BLOCK_ELEMENTS + 2], "m.weight": [4]}, seed=3
    )
    payload = encode_payload(sections, "cpu")
    _place(agent, 0, payload)
    agent.begin_update("target")
    agent.delta_checksums()  # the proof of the base, inside the session
    # A request refused before any write keeps the base for the next one.
    with pytest.raises(ValueError, match="does not have"):
        agent.apply_delta([(0, payload.numel())], {"x.weight": 1})
    result = agent.apply_delta([(0, payload.numel())], checksums(after))
    assert result.verified and result.check == "changes" and result.recomputed == ()
    assert _same(params, after)
    assert result.checksums == checksums(params)
    # A second delta of the session derives from the first's result.
    more, later = changed(params, {"a.weight": [5]}, seed=4)
    extra = encode_payload(more, "cpu")
    _place(agent, 4096, extra)
    result = agent.apply_delta([(4096, extra.numel())], checksums(later))
    assert result.verified and result.check == "changes"
    assert result.checksums == checksums(params)
    assert agent.end_update().verified


def test_without_a_base_read_in_the_session_the_check_reads_every_byte(rank):
    agent, params = rank
    sections, after = changed(params, {"b.weight": [2]}, seed=5)
    payload = encode_payload(sections, "cpu")
    _place(agent, 0, payload)
    agent.delta_checksums()  # before the session: not this session's base
    agent.begin_update("target")
    result = agent.apply_delta([(0, payload.numel())], checksums(after))
    assert result.verified and result.check == "full"
    agent.end_update()
    # A rank that wrote its own parameters inside the session drops the base it read.
    agent.begin_update("target")
    agent.delta_checksums()
    agent.weights_checker("reset_tensors", seed=0)
    sections, after = changed(params, {"b.weight": [3]}, seed=6)
    payload = encode_payload(sections, "cpu")
    _place(agent, 0, payload)
    result = agent.apply_delta([(0, payload.numel())], checksums(after))
    assert result.check == "full" and result.verified
    agent.end_update()


def test_a_stray_write_after_the_base_into_a_changed_element_is_caught(rank):
    agent, params = rank
    sections, after = changed(params, {"z.weight": [10, 20]}, seed=7)
    payload = encode_payload(sections, "cpu")
    _place(agent, 0, payload)
    agent.begin_update("target")
    agent.delta_checksums()
    as_bits(params["z.weight"])[20] ^= 0x40  # not through any session call
    result = agent.apply_delta([(0, payload.numel())], checksums(after))
    assert not result.verified and result.mismatched == ("z.weight",)
    assert not agent.end_update().verified


@pytest.mark.parametrize("check", ["changes", "full"])
def test_a_stray_write_elsewhere_is_caught_by_the_full_check(rank, check):
    agent, params = rank
    sections, after = changed(params, {"z.weight": [10, 20]}, seed=8)
    payload = encode_payload(sections, "cpu")
    _place(agent, 0, payload)
    agent.begin_update("target")
    agent.delta_checksums()
    as_bits(params["z.weight"])[30] ^= 0x40  # an element the delta does not write
    result = agent.apply_delta([(0, payload.numel())], checksums(after), check=check)
    assert result.check == check
    if check == "full":
        assert result.mismatched == ("z.weight",) and not result.verified
    else:
        # What the default check cannot see: the checksum it reports for the next base is
        # the one the trainers expect, and the next proof of the base reads every byte.
        assert result.verified and result.checksums["z.weight"] == checksums(after)["z.weight"]
        assert agent.delta_checksums()["z.weight"] != result.checksums["z.weight"]
    agent.end_update()
    with pytest.raises(ValueError, match="check must be one of"):
        agent.begin_update("target")
        try:
            agent.apply_delta([(0, payload.numel())], {}, check="some")
        finally:
            agent.end_update()
