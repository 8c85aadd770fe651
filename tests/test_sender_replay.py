"""Replayed pushes (`weightsync.sender.replay`): the second push of a plan replays the first,
and a stream that changes falls back to a normal push, bit-exact either way (real Mooncake
TCP into a receiver process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from test_sender import MOE, TINY, Receiver, _assert_exact, _config, _plan_for
from weightsync.checkpoint import random_model
from weightsync.sender import ModelExport, WeightSender
from weightsync.transport import MooncakeConfig, MooncakeTransport

GROUPS = [
    {"name": "tiny", "model": TINY, "tp": 2, "ep": 1},
    {"name": "moe", "model": MOE, "tp": 2, "ep": 2},
]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    peer = Receiver(GROUPS)
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def transport() -> Iterator[MooncakeTransport]:
    engine = MooncakeTransport(MooncakeConfig(timeout_s=5.0))
    yield engine
    engine.close()


def _load(model: torch.nn.Module, seed: int, config: dict) -> None:
    """Give `model` the weights of `seed` in place (as an optimizer step would)."""
    fresh = random_model(config, seed=seed)
    with torch.no_grad():
        for param, new in zip(
            model.state_dict().values(), fresh.state_dict().values(), strict=True
        ):
            param.copy_(new)


@pytest.mark.parametrize("group", ["tiny", "moe"])
def test_second_push_replays_and_lands_new_weights(
    receiver: Receiver, transport, group: str
) -> None:
    config = {"tiny": TINY, "moe": MOE}[group]
    receiver.call(cmd="fill", group=group, value=7.0)
    # Small slots: the push is many chunks over a ring that wraps around.
    sender = WeightSender(_config(bucket_bytes=16 << 10), transport=transport)
    model = random_model(config, seed=31)
    export = ModelExport(model)
    plan = _plan_for(sender, export, receiver, group).for_source(0)
    first = sender.push(plan, export)
    assert not first.replayed
    _assert_exact(receiver, group, seed=31)
    for seed in (32, 33):
        _load(model, seed, config)
        sender.holding(export)  # what TrainerSync does before every sync: same shapes
        stats = sender.push(plan, export)
        assert stats.replayed
        _assert_exact(receiver, group, seed=seed)
        for field in ("bytes_staged", "bytes_written", "num_writes", "num_chunks", "num_copies"):
            assert getattr(stats, field) == getattr(first, field), field
        assert stats.bytes_per_target == first.bytes_per_target
    # A new model object with the same shapes replays too (other storage, same geometry).
    stats = sender.push(plan, ModelExport(random_model(config, seed=34)))
    assert stats.replayed
    _assert_exact(receiver, group, seed=34)
    sender.close()


def _stream(export: ModelExport) -> list[tuple[str, torch.Tensor]]:
    return list(export)


def test_changed_streams_fall_back_and_stay_exact(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="tiny", value=7.0)
    sender = WeightSender(_config(bucket_bytes=8 << 10), transport=transport)
    model = random_model(TINY, seed=41)
    plan = _plan_for(sender, ModelExport(model), receiver, "tiny").for_source(0)
    sender.push(plan, _stream(ModelExport(model)))

    # The last two tensors swapped: the replay writes the chunks before them, then stops.
    _load(model, 42, TINY)
    stream = _stream(ModelExport(model))
    stream[-2], stream[-1] = stream[-1], stream[-2]
    stats = sender.push(plan, stream)
    assert not stats.replayed
    _assert_exact(receiver, "tiny", seed=42)
    assert stats.bytes_written >= plan.num_bytes_written

    # The next push in the new order records it; the one after replays it.
    for seed, replayed in ((43, False), (44, True)):
        _load(model, seed, TINY)
        stream = _stream(ModelExport(model))
        stream[-2], stream[-1] = stream[-1], stream[-2]
        assert sender.push(plan, stream).replayed is replayed
        _assert_exact(receiver, "tiny", seed=seed)

    # Same values, one tensor with other strides (a transposed copy viewed back).
    _load(model, 45, TINY)
    stream = _stream(ModelExport(model))
    stream[-2], stream[-1] = stream[-1], stream[-2]
    index = next(i for i, (_, t) in enumerate(stream) if t.dim() == 2)
    name, tensor = stream[index]
    stream[index] = (name, tensor.t().contiguous().t())
    assert not sender.push(plan, stream).replayed
    _assert_exact(receiver, "tiny", seed=45)
    sender.close()


def test_replay_refuses_missing_and_repeated_tensors(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="tiny", value=7.0)
    sender = WeightSender(_config(bucket_bytes=8 << 10), transport=transport)
    model = random_model(TINY, seed=51)
    plan = _plan_for(sender, ModelExport(model), receiver, "tiny").for_source(0)
    sender.push(plan, ModelExport(model))
    stream = _stream(ModelExport(model))
    missing = stream[len(stream) // 2][0]
    with pytest.raises(ValueError, match=f"stream ended without '{missing}'"):
        sender.push(plan, stream[: len(stream) // 2] + stream[len(stream) // 2 + 1 :])
    sender.push(plan, ModelExport(model))  # records again
    with pytest.raises(ValueError, match="twice"):
        sender.push(plan, stream[:3] + stream[2:])
    # After the failures the sender still pushes correctly.
    _load(model, 52, TINY)
    sender.push(plan, ModelExport(model))
    _assert_exact(receiver, "tiny", seed=52)
    sender.close()
