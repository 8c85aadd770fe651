"""`WeightSender` from CUDA tensors: GPU staging over CUDA IPC, pinned host staging over Mooncake.

Run on a GPU machine with ``pytest -m gpu tests/test_sender_gpu.py``; the receiver's
parameters live on the second GPU when there is one.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from faults import StallingExport
from test_sender import (
    LARGE,
    MODELS,
    MOE,
    TINY,
    Receiver,
    _assert_exact,
    _config,
    _load,
    _plan_for,
)
from weightsync.errors import TensorChangedError
from weightsync.export import ModelExport
from weightsync.sender import WeightSender
from weightsync.testing.presets import random_model
from weightsync.transport import CudaIpcConfig, CudaIpcTransport, MooncakeConfig, MooncakeTransport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GPU_GROUPS = [
    {"name": "tiny", "model": TINY, "tp": 2, "ep": 1},
    {"name": "moe", "model": MOE, "tp": 2, "ep": 2},
    {"name": "large", "model": LARGE, "tp": 1, "ep": 1},
]


@pytest.fixture(scope="module")
def gpu_receiver() -> Iterator[Receiver]:
    device = 1 if torch.cuda.device_count() > 1 else 0
    peer = Receiver(GPU_GROUPS, "--cuda-device", str(device))
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def ipc() -> Iterator[CudaIpcTransport]:
    transport = CudaIpcTransport(CudaIpcConfig(device=0))
    yield transport
    transport.close()


@pytest.mark.parametrize("group", ["tiny", "moe"])
def test_cuda_tensors_stage_on_the_gpu(gpu_receiver: Receiver, ipc, group: str) -> None:
    gpu_receiver.call(cmd="fill", group=group, value=7.0)
    # Chunks of 4 KiB: each slot is written while the GPU still copies its later chunks.
    sender = WeightSender(_config(bucket_bytes=1 << 16, chunk_bytes=4096), transport=ipc)
    export = ModelExport(random_model(MODELS[group], seed=11).to("cuda:0"))
    plan = _plan_for(sender, export, gpu_receiver, group)
    stats = sender.push(sender.preflight(plan.for_source(0), export))
    _assert_exact(gpu_receiver, group, seed=11)
    assert sender.staging_device == torch.device("cuda", 0)
    assert stats.num_buckets > 2  # small slots: the ring wraps around
    assert stats.num_chunks > 2 * stats.num_buckets
    sender.close()


def test_repeated_pushes_through_a_small_gpu_ring(gpu_receiver: Receiver, ipc) -> None:
    # Writes are queued behind the copies on the GPU (the transport is stream-ordered), so
    # only the slot waits keep a slot from being refilled while it is still read: each push
    # wraps the two-slot ring many times and must land every byte of its own weights.
    # The second and third pushes run the cached program (new tensors, same geometry).
    sender = WeightSender(_config(bucket_bytes=1 << 15, chunk_bytes=4096), transport=ipc)
    plan = None
    for seed in (21, 22, 23):
        gpu_receiver.call(cmd="fill", group="tiny", value=7.0)
        export = ModelExport(random_model(TINY, seed=seed).to("cuda:0"))
        if plan is None:
            plan = _plan_for(sender, export, gpu_receiver, "tiny").for_source(0)
        stats = sender.push(sender.preflight(plan, export))
        assert stats.num_buckets > 4
        assert stats.cached_program is (seed != 21)
        _assert_exact(gpu_receiver, "tiny", seed=seed)
    sender.close()


def test_host_staging_from_cuda_tensors(gpu_receiver: Receiver, ipc) -> None:
    gpu_receiver.call(cmd="fill", group="tiny", value=7.0)
    sender = WeightSender(
        _config(staging="host", bucket_bytes=1 << 16, chunk_bytes=4096), transport=ipc
    )
    export = ModelExport(random_model(TINY, seed=12).to("cuda:0"))
    plan = _plan_for(sender, export, gpu_receiver, "tiny").for_source(0)
    stats = sender.push(sender.preflight(plan, export))
    assert stats.num_chunks > stats.num_buckets
    _assert_exact(gpu_receiver, "tiny", seed=12)
    assert sender.staging_device == torch.device("cpu")
    # The cached program waits on the host for the device-to-host copies, as the first did.
    gpu_receiver.call(cmd="fill", group="tiny", value=7.0)
    stats = sender.push(
        sender.preflight(plan, ModelExport(random_model(TINY, seed=14).to("cuda:0")))
    )
    assert stats.cached_program
    _assert_exact(gpu_receiver, "tiny", seed=14)
    sender.close()


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="needs Mooncake")
def test_cuda_tensors_over_mooncake() -> None:
    receiver = Receiver([{"name": "tiny", "model": TINY, "tp": 2, "ep": 1}])
    transport = MooncakeTransport(MooncakeConfig(timeout_s=5.0))
    try:
        receiver.call(cmd="fill", group="tiny", value=7.0)
        sender = WeightSender(_config(), transport=transport)
        export = ModelExport(random_model(TINY, seed=13).to("cuda:0"))
        plan = _plan_for(sender, export, receiver, "tiny").for_source(0)
        sender.push(sender.preflight(plan, export))
        _assert_exact(receiver, "tiny", seed=13)
        receiver.call(cmd="fill", group="tiny", value=7.0)
        assert sender.push(
            sender.preflight(plan, ModelExport(random_model(TINY, seed=15).to("cuda:0")))
        ).cached_program
        _assert_exact(receiver, "tiny", seed=15)
        expected = "cuda" if transport.capabilities.reads("cuda", 0) else "cpu"
        assert sender.staging_device.type == expected
        sender.close()
    finally:
        transport.close()
        receiver.close()


def test_a_direct_push_is_a_cuda_graph_captured_again_after_a_parameter_moved(
    gpu_receiver: Receiver, ipc
) -> None:
    # bfloat16 CUDA tensors into a tp=1 layout: every byte is copied straight into the
    # receiver's mapped parameters, and from the second push on replayed as a CUDA graph.
    gpu_receiver.call(cmd="fill", group="large", value=7.0)
    sender = WeightSender(_config(), transport=ipc)
    model = random_model(LARGE, seed=71).to(device="cuda:0", dtype=torch.bfloat16)
    export = ModelExport(model)
    plan = _plan_for(sender, export, gpu_receiver, "large").for_source(0)
    first = sender.push(sender.preflight(plan, export))
    assert first.bytes_staged == 0 and first.bytes_direct == plan.num_bytes_staged
    assert not first.replayed and sender.staging_bytes == 0
    _assert_exact(gpu_receiver, "large", seed=71)
    for seed in (72, 73):
        _load(model, seed, LARGE)
        gpu_receiver.call(cmd="fill", group="large", value=7.0)
        stats = sender.push(sender.preflight(plan, export))
        assert stats.replayed
        _assert_exact(gpu_receiver, "large", seed=seed)
        assert stats.digests == gpu_receiver.call(cmd="digests", group="large")

    # A parameter moves: captured again from the new address, then replayed.
    param = model.get_parameter("model.layers.1.self_attn.o_proj.weight")
    param.data = param.data.clone()
    for seed, replayed in ((74, False), (75, True)):
        _load(model, seed, LARGE)
        gpu_receiver.call(cmd="fill", group="large", value=7.0)
        stats = sender.push(sender.preflight(plan, export))
        assert stats.replayed is replayed
        _assert_exact(gpu_receiver, "large", seed=seed)
        assert stats.digests == gpu_receiver.call(cmd="digests", group="large")
    sender.close()


def test_a_replayed_push_may_return_with_its_copies_in_flight(gpu_receiver: Receiver, ipc) -> None:
    # push(wait=False): a replayed graph returns once its copies are queued and its digests
    # read, naming the interprocess event the copies complete at; wait_landed waits for it.
    sender = WeightSender(_config(), transport=ipc)
    model = random_model(LARGE, seed=81).to(device="cuda:0", dtype=torch.bfloat16)
    export = ModelExport(model)
    plan = _plan_for(sender, export, gpu_receiver, "large").for_source(0)
    # Captured, not replayed: it waits.
    first = sender.push(sender.preflight(plan, export), wait=False)
    assert not first.in_flight and first.events == ()
    _assert_exact(gpu_receiver, "large", seed=81)
    for seed in (82, 83):
        _load(model, seed, LARGE)
        gpu_receiver.call(cmd="fill", group="large", value=7.0)
        stats = sender.push(sender.preflight(plan, export), wait=False)
        assert stats.replayed and stats.in_flight
        assert len(stats.events) == 1 and len(bytes.fromhex(stats.events[0])) == 64
        # The digests were read while the copies may still run; they are the landed bytes'.
        landed = sender.wait_landed()
        assert landed <= time.perf_counter()
        _assert_exact(gpu_receiver, "large", seed=seed)
        assert stats.digests == gpu_receiver.call(cmd="digests", group="large")
    # One event for the sender's device: its handle stays the same from push to push.
    _load(model, 84, LARGE)
    again = sender.push(sender.preflight(plan, export), wait=False)
    assert again.events == stats.events
    # Nothing waited for it: the next push does, and a push that waits leaves nothing.
    done = sender.push(sender.preflight(plan, export))
    assert done.replayed and not done.in_flight
    _assert_exact(gpu_receiver, "large", seed=84)
    sender.close()


def test_row_parallel_slices_are_pitched_copies_into_mapped_memory(
    gpu_receiver: Receiver, ipc
) -> None:
    # tp=2: o_proj and down_proj are column slices of the trainer's tensors; over CUDA IPC
    # each is one pitched copy into the receiver's parameter, so all of them go direct.
    gpu_receiver.call(cmd="fill", group="tiny", value=7.0)
    sender = WeightSender(_config(), transport=ipc)
    export = ModelExport(random_model(TINY, seed=81).to(device="cuda:0", dtype=torch.bfloat16))
    plan = _plan_for(sender, export, gpu_receiver, "tiny").for_source(0)
    stats = sender.push(sender.preflight(plan, export))
    _assert_exact(gpu_receiver, "tiny", seed=81)
    padding = sum(
        item.num_bytes
        for works in plan.work.values()
        for work in works
        for item in work.items
        if item.is_padding
    )
    assert stats.bytes_direct > 0 and stats.bytes_staged == padding
    assert stats.digests == gpu_receiver.call(cmd="digests", group="tiny")
    sender.close()


def test_a_tensor_changed_while_its_copies_run_fails_the_push_or_its_landing(
    gpu_receiver: Receiver, ipc
) -> None:
    # bfloat16 at tp=1 over CUDA IPC: every byte is a copy from the trainer's tensors into
    # the receiver's mapped memory. A tensor changed while they read it fails the push (a
    # streamed one) or, for a replay left in flight, `wait_landed`, naming the tensor.
    gpu_receiver.call(cmd="fill", group="large", value=7.0)
    sender = WeightSender(_config(), transport=ipc)
    model = random_model(LARGE, seed=101).to(device="cuda:0", dtype=torch.bfloat16)
    export = ModelExport(model)
    plan = _plan_for(sender, export, gpu_receiver, "large").for_source(0)
    name = "model.layers.2.mlp.up_proj.weight"
    tensor = model.get_parameter(name)
    index = [n for n, _ in export].index(name)

    def step() -> None:
        with torch.no_grad():
            tensor.mul_(0.5)

    with pytest.raises(TensorChangedError, match=f"'{name}' changed") as caught:
        sender.push(sender.preflight(plan, StallingExport(export, after=index + 6, hook=step)))
    assert caught.value.hf_name == name

    _load(model, 102, LARGE)
    assert not sender.push(sender.preflight(plan, export)).replayed  # streamed again, and captured
    _load(model, 103, LARGE)
    stats = sender.push(sender.preflight(plan, export), wait=False)
    assert stats.replayed and stats.in_flight
    thread = threading.Thread(target=step)  # a step on another thread, copies in flight
    thread.start()
    thread.join()
    with pytest.raises(TensorChangedError, match="and its copies being seen landed"):
        sender.wait_landed()

    # Steps between pushes are no fault, with or without the copies left in flight.
    for seed, wait in ((104, True), (105, False)):
        _load(model, seed, LARGE)
        stats = sender.push(sender.preflight(plan, export), wait=wait)
        assert stats.replayed and stats.in_flight is not wait
        sender.wait_landed()
        _assert_exact(gpu_receiver, "large", seed=seed)
    sender.close()
