"""Syncs of the DeepSeek-V3 family through `WeightSender` over real Mooncake TCP into a
receiver process: a bf16 rollout (its float32 router bias makes a plan of two dtype parts)
and a block-FP8 rollout fed by a float32 trainer through `Fp8Export` (three parts: e4m3
weights, float32 scales and bias, bf16 rest), every written byte equal to `shard_state_dict`
of the same seeded model, the FP8 weights and scales to the reference quantiser's."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from test_sender import Receiver
from weightsync.errors import LayoutMismatchError
from weightsync.export import Fp8Export, ModelExport
from weightsync.layout import hf_tensor_shapes, rank_layout
from weightsync.plan import SourceHolding, TargetRank, TensorMeta, build_plan
from weightsync.sender import SenderConfig, WeightSender
from weightsync.testing.presets import preset_config, random_model
from weightsync.transport import MooncakeConfig, MooncakeTransport

DEEPSEEK = preset_config("tiny-deepseek")
FP8_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
DEEPSEEK_FP8 = {**preset_config("tiny-deepseek-nolora"), "quantization_config": FP8_CONFIG}
GROUPS = [
    {"name": "ds", "model": DEEPSEEK, "tp": 2, "ep": 2},
    {"name": "ds8", "model": DEEPSEEK_FP8, "tp": 2, "ep": 1},
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


def _sender(transport) -> WeightSender:
    return WeightSender(SenderConfig(bucket_bytes=4 << 20, num_workers=1), transport=transport)


def test_bf16_deepseek_with_its_float32_router_bias(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="ds", value=7.0)
    sender = _sender(transport)
    export = ModelExport(random_model(DEEPSEEK, seed=3))
    plan = build_plan(
        hf_config=DEEPSEEK,
        targets=receiver.target_ranks("ds"),
        sources=[sender.holding(export)],
        dtype="bfloat16",
    )
    assert [part.dtype for part in plan.parts] == ["bfloat16", "float32"]
    source = plan.for_source(0)
    stats = sender.push(sender.preflight(source, export))
    assert receiver.call(cmd="check", group="ds", seed=3)["mismatched"] == []
    assert stats.bytes_written == source.num_bytes_written == plan.num_bytes_written
    assert not stats.cached_program
    again = sender.push(sender.preflight(source, export))
    assert again.cached_program
    sender.close()


def test_fp8_rollout_from_a_float32_trainer(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="ds8", value=7)
    sender = _sender(transport)
    model = random_model(DEEPSEEK_FP8, seed=5)
    export = Fp8Export(ModelExport(model), block=128)
    plan = build_plan(
        hf_config=DEEPSEEK_FP8,
        targets=receiver.target_ranks("ds8"),
        sources=[sender.holding(export)],
        dtype="bfloat16",
    )
    assert [part.dtype for part in plan.parts] == ["bfloat16", "float8_e4m3fn", "float32"]
    sender.push(sender.preflight(plan.for_source(0), export))
    assert receiver.call(cmd="check", group="ds8", seed=5)["mismatched"] == []

    # The trainer steps: its weights change in place; the next push quantises them again.
    with torch.no_grad():
        for name, tensor in random_model(DEEPSEEK_FP8, seed=6).state_dict().items():
            model.state_dict()[name].copy_(tensor)
    stats = sender.push(sender.preflight(plan.for_source(0), export))
    assert stats.cached_program
    assert receiver.call(cmd="check", group="ds8", seed=6)["mismatched"] == []
    sender.close()


def test_unquantised_weights_are_refused_by_an_fp8_plan() -> None:
    parallelism = {"tp_size": 1, "tp_rank": 0}
    layout = rank_layout(DEEPSEEK_FP8, parallelism, "bfloat16")
    addresses = itertools.count(1 << 32, 1 << 24)
    target = TargetRank(
        replica="r",
        rank=0,
        session_id="127.0.0.1:1",
        parallelism=parallelism,
        weights_info={n: (next(addresses), p.numel, p.element_size) for n, p in layout.items()},
    )
    # A float32 trainer's tensors, not quantised.
    tensors = {
        name: TensorMeta(shape=shape, dtype="float32")
        for name, shape in hf_tensor_shapes(preset_config("tiny-deepseek-nolora")).items()
    }
    with pytest.raises(LayoutMismatchError, match=r"is float32, but .* float8_e4m3fn .*Fp8Export"):
        build_plan(
            hf_config=DEEPSEEK_FP8,
            targets=[target],
            sources=[SourceHolding(rank=0, tensors=tensors)],
            dtype="bfloat16",
        )
