"""`WeightSender` over real Mooncake TCP into receiver processes on 127.0.0.1.

One receiver process (tests/sender_peer.py) holds three rollout layouts with one transport per
rank: tiny qwen3 at tp=2, tiny qwen3-moe at tp=2/ep=2 and a ~120 MB qwen3 at tp=1. Senders
push fp32 trainer tensors into the bf16 rollout parameters; the receiver compares them with
`shard_state_dict` of the same seeded model, bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from faults import HookedTransport, StallingExport
from weightsync.errors import TensorChangedError, TransferError
from weightsync.export import ModelExport, TensorsExport
from weightsync.plan import SourceHolding, TargetRank, build_plan
from weightsync.sender import CheckedPush, SenderConfig, WeightSender
from weightsync.sender.pins import PushPins, counted
from weightsync.testing.presets import preset_config, random_model
from weightsync.transport import (
    HOST_ONLY,
    MooncakeConfig,
    MooncakeTransport,
    TransportCapabilities,
)

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

PEER = Path(__file__).with_name("sender_peer.py")
TINY = preset_config("tiny")
MOE = preset_config("tiny-moe", num_experts=32)
# ~58M parameters: 232 MB of fp32 trainer tensors, 116 MB of bf16 rollout parameters.
LARGE = preset_config("small", num_hidden_layers=16)
GROUPS = [
    {"name": "tiny", "model": TINY, "tp": 2, "ep": 1},
    {"name": "moe", "model": MOE, "tp": 2, "ep": 2},
    {"name": "large", "model": LARGE, "tp": 1, "ep": 1},
]
MODELS = {group["name"]: group["model"] for group in GROUPS}
STARTUP_S = 120.0
REPLY_S = 60.0


def _peer_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Receiver:
    """A receiver process and its JSON line protocol (see tests/sender_peer.py)."""

    def __init__(self, groups: list[dict[str, Any]], *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "receive", "--groups", json.dumps(groups), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_peer_env(),
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._next(STARTUP_S)
        self._targets: list[dict[str, Any]] = ready["targets"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"receiver sent nothing within {timeout_s} s") from None
        if not line:
            raise AssertionError(f"receiver exited with {self.proc.wait()}")
        return json.loads(line)

    def target_ranks(self, group: str) -> list[TargetRank]:
        """The `TargetRank`s the receiver published for `group`."""
        return [
            TargetRank(**{k: v for k, v in t.items() if k != "group"})
            for t in self._targets
            if t["group"] == group
        ]

    def target_dicts(self, group: str) -> list[dict[str, Any]]:
        """The same, as the JSON the receiver printed (for sender processes)."""
        return [
            {k: v for k, v in t.items() if k != "group"}
            for t in self._targets
            if t["group"] == group
        ]

    def call(self, **command: Any) -> dict[str, Any]:
        """Send one command and return its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._next(REPLY_S)

    def close(self) -> None:
        """Ask the process to quit; kill it if it does not."""
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, BrokenPipeError):
                self.call(cmd="quit")
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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


def _config(**overrides: Any) -> SenderConfig:
    return SenderConfig(**{"bucket_bytes": 64 << 20, "num_workers": 2, **overrides})


def _plan_for(sender: WeightSender, export: Any, receiver: Receiver, group: str):
    holdings = sender.gather_holdings(export)
    return build_plan(
        hf_config=MODELS[group],
        targets=receiver.target_ranks(group),
        sources=holdings,
        dtype="bfloat16",
    )


def _assert_exact(receiver: Receiver, group: str, seed: int) -> None:
    reply = receiver.call(cmd="check", group=group, seed=seed)
    assert reply["mismatched"] == [], reply


def test_push_fp32_into_bf16_tp2_is_bit_exact(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="tiny", value=7.0)
    sender = WeightSender(_config(), transport=transport)
    export = ModelExport(random_model(TINY, seed=1))
    plan = _plan_for(sender, export, receiver, "tiny")
    stats = sender.push(sender.preflight(plan.for_source(0), export))
    _assert_exact(receiver, "tiny", seed=1)

    source_plan = plan.for_source(0)
    assert stats.bytes_written == source_plan.num_bytes_written
    assert stats.bytes_staged == source_plan.num_bytes_staged
    assert stats.bytes_per_target == {
        t.session_id: stats.bytes_written // 2 for t in receiver.target_ranks("tiny")
    }
    assert 0 < stats.num_writes <= stats.num_regions
    assert sender.staging_bytes == 2 * (64 << 20)
    assert sender.staging_device == torch.device("cpu")

    # New weights through the same plan and staging ring.
    model = random_model(TINY, seed=2)
    sender.push(sender.preflight(plan.for_source(0), ModelExport(model)))
    _assert_exact(receiver, "tiny", seed=2)

    # Around a checkpoint save: the staging memory goes away and comes back.
    sender.release()
    assert sender.staging_bytes == 0
    sender.restore()
    assert sender.staging_bytes == 2 * (64 << 20)
    receiver.call(cmd="fill", group="tiny", value=7.0)
    sender.push(sender.preflight(plan.for_source(0), ModelExport(model)))
    _assert_exact(receiver, "tiny", seed=2)
    sender.close()
    with pytest.raises(ValueError, match="closed"):
        sender.push(sender.preflight(plan.for_source(0), ModelExport(model)))


def test_a_push_takes_the_latest_preflight_of_its_own_sender_once(
    receiver: Receiver, transport
) -> None:
    receiver.call(cmd="fill", group="tiny", value=7.0)
    sender = WeightSender(_config(), transport=transport)
    other = WeightSender(_config(), transport=transport)
    export = ModelExport(random_model(TINY, seed=3))
    plan = _plan_for(sender, export, receiver, "tiny").for_source(0)
    checked = sender.preflight(plan, export)
    assert isinstance(checked, CheckedPush) and checked.sender is sender
    assert checked.plan is plan and checked.export is export and not checked.cached
    assert len(checked.programs) == 1
    with pytest.raises(ValueError, match="another WeightSender"):
        other.push(checked)
    with pytest.raises(ValueError, match="takes the CheckedPush"):
        sender.push(plan)
    sender.push(checked)
    _assert_exact(receiver, "tiny", seed=3)
    with pytest.raises(ValueError, match="pushed already"):
        sender.push(checked)
    stale = sender.preflight(plan, export)
    fresh = sender.preflight(plan, export)
    assert fresh.cached and fresh.programs[0] is checked.programs[0]
    with pytest.raises(ValueError, match="a later preflight"):
        sender.push(stale)
    assert sender.push(fresh).cached_program
    sender.close()
    other.close()


def test_a_transport_that_says_it_maps_memory_must_map_it(transport) -> None:
    class Claims:
        session_id = transport.session_id
        write_cost = transport.write_cost
        capabilities = TransportCapabilities(reads_cuda=True, device=0, maps_device_memory=True)

    with pytest.raises(ValueError, match="maps_device_memory, but it has no local_address"):
        WeightSender(_config(), transport=Claims())


@pytest.mark.parametrize(
    ("group", "bucket_bytes", "num_sources"),
    [("tiny", 4096, 1), ("moe", 64 << 20, 2), ("large", 8 << 20, 1)],
)
def test_the_senders_digests_are_what_the_receiver_holds(
    receiver: Receiver, transport, group: str, bucket_bytes: int, num_sources: int
) -> None:
    # Small buckets cut parameters into many runs (and chunks); two sources split the
    # MoE model's layers, so each parameter's digest is the sum of two partial ones.
    receiver.call(cmd="fill", group=group, value=3.0)
    model = random_model(MODELS[group], seed=9)
    sender = WeightSender(_config(bucket_bytes=bucket_bytes), transport=transport)
    plans, exports = _split_sources(sender, model, receiver, group, num_sources)
    totals: dict[str, dict[str, int]] = {}
    for plan, export in zip(plans, exports, strict=True):
        stats = sender.push(sender.preflight(plan, export))
        for session_id, digests in stats.digests.items():
            for name, value in digests.items():
                totals.setdefault(session_id, {})[name] = (
                    totals.get(session_id, {}).get(name, 0) + value
                )
    held = receiver.call(cmd="digests", group=group)
    assert totals == held
    sender.close()


def _split_sources(sender, model, receiver, group, num_sources):
    """One export per source rank (layers split between them), and each one's plan."""
    from weightsync.export import TensorsExport

    state = dict(ModelExport(model))
    names = list(state)
    shares = [names[i::num_sources] for i in range(num_sources)]
    exports = [TensorsExport({n: state[n] for n in share}) for share in shares]
    holdings = [
        SourceHolding(rank=rank, tensors=export.holding()) for rank, export in enumerate(exports)
    ]
    plan = build_plan(
        hf_config=MODELS[group],
        targets=receiver.target_ranks(group),
        sources=holdings,
        dtype="bfloat16",
    )
    return [plan.for_source(rank) for rank in range(num_sources)], exports


def _sliced_sources(model: torch.nn.Module, num_sources: int) -> list[Any]:
    """One export per source rank, each holding slices of every tensor, as a sharded trainer
    does: 2-D tensors alternately cut into row halves and column thirds (column slices stay
    strided views of the model's tensors), 1-D tensors into halves; a source beyond a
    tensor's number of boxes holds a copy of one (a data-parallel replica)."""
    from weightsync.export import TensorsExport

    tensors: list[dict[str, torch.Tensor]] = [{} for _ in range(num_sources)]
    slices: list[dict[str, Any]] = [{} for _ in range(num_sources)]
    for index, (name, full) in enumerate(ModelExport(model)):
        dim = 1 if full.dim() == 2 and index % 2 else 0
        parts = 3 if dim == 1 else 2
        size = full.shape[dim]
        edges = [size * k // parts for k in range(parts + 1)]
        for rank in range(num_sources):
            start, stop = edges[rank % parts], edges[rank % parts + 1]
            box = [(0, n) for n in full.shape]
            box[dim] = (start, stop)
            tensors[rank][name] = full.narrow(dim, start, stop - start)
            slices[rank][name] = (tuple(full.shape), tuple(box))
    return [TensorsExport(t, slices=b) for t, b in zip(tensors, slices, strict=True)]


@pytest.mark.parametrize("group", ["tiny", "moe"])
def test_sources_holding_slices_write_them_bit_exact(
    receiver: Receiver, transport, group: str
) -> None:
    receiver.call(cmd="fill", group=group, value=7.0)
    model = random_model(MODELS[group], seed=4)
    exports = _sliced_sources(model, num_sources=4)
    holdings = [
        SourceHolding(rank=rank, tensors=export.holding()) for rank, export in enumerate(exports)
    ]
    assert holdings[0].tensors["model.layers.0.self_attn.q_proj.weight"].box is not None
    plan = build_plan(
        hf_config=MODELS[group],
        targets=receiver.target_ranks(group),
        sources=holdings,
        dtype="bfloat16",
    )
    sender = WeightSender(_config(bucket_bytes=1 << 20), transport=transport)
    written = 0
    for rank, export in enumerate(exports):
        stats = sender.push(sender.preflight(plan.for_source(rank), export))
        assert stats.bytes_written == plan.for_source(rank).num_bytes_written
        written += stats.bytes_written
    assert written == plan.num_bytes_written
    assert sum(1 for rank in range(4) if plan.for_source(rank).num_bytes_written) >= 3
    _assert_exact(receiver, group, seed=4)
    sender.close()


def test_small_buckets_split_items_over_many_slots(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="tiny", value=7.0)
    sender = WeightSender(
        _config(bucket_bytes=4096, num_slots=3, num_workers=2), transport=transport
    )
    export = ModelExport(random_model(TINY, seed=4))
    plan = _plan_for(sender, export, receiver, "tiny")
    stats = sender.push(sender.preflight(plan.for_source(0), export))
    _assert_exact(receiver, "tiny", seed=4)
    # Every slot but the last per layout is full; the embedding shard alone is 64 KiB.
    assert stats.num_buckets >= stats.bytes_staged // 4096
    assert sender.staging_bytes == 3 * 4096
    sender.close()


def test_moe_experts_go_out_as_few_large_writes(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="moe", value=7.0)
    sender = WeightSender(_config(), transport=transport)
    export = ModelExport(random_model(MOE, seed=5))
    plan = _plan_for(sender, export, receiver, "moe")
    stats = sender.push(sender.preflight(plan.for_source(0), export))
    _assert_exact(receiver, "moe", seed=5)
    targets = receiver.target_ranks("moe")
    num_params = sum(len(t.weights_info) for t in targets)
    num_expert_tensors = sum(1 for name in plan.for_source(0).work if ".experts." in name)
    # One write per parameter (w13 / w2 of all local experts in one), not one per expert.
    assert num_params <= stats.num_writes <= num_params * 5 // 4, (stats, num_params)
    assert num_expert_tensors > 3 * num_params
    # Staging fills are batched too: an expert block's views of one fused parameter are
    # copied with one strided copy per layout, not one per expert.
    assert stats.num_copies < num_expert_tensors // 2, (stats, num_expert_tensors)
    sender.close()


def _without(export: ModelExport, skipped: str) -> ModelExport:
    return ModelExport({name: tensor for name, tensor in export if name != skipped})


def _reshaped(export: ModelExport, name: str, rows: int) -> ModelExport:
    tensors = dict(export)
    tensor = tensors[name]
    tensors[name] = torch.zeros(tensor.shape[0] + rows, *tensor.shape[1:])
    return ModelExport(tensors)


class _LyingExport(ModelExport):
    """An export whose stream yields one tensor laid out otherwise than its geometry says."""

    def __init__(self, export: ModelExport, name: str) -> None:
        super().__init__(dict(export))
        self._name = name
        self._honest_geometry = ModelExport(dict(export)).geometry()

    def geometry(self):
        return self._honest_geometry

    def __iter__(self):
        for hf_name, tensor in super().__iter__():
            yield hf_name, (tensor.t().contiguous().t() if hf_name == self._name else tensor)


def test_bad_stream_fails_before_any_write(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="tiny", value=5.0)
    sender = WeightSender(_config(), transport=transport)
    export = ModelExport(random_model(TINY, seed=6))
    plan = _plan_for(sender, export, receiver, "tiny").for_source(0)

    missing = "model.layers.2.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"stream lacks '{missing}'"):
        sender.push(sender.preflight(plan, _without(export, missing)))
    wrong = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=rf"'{wrong}' has shape \(65, 64\).*\(64, 64\)"):
        sender.push(sender.preflight(plan, _reshaped(export, wrong, rows=1)))
    with pytest.raises(ValueError, match=rf"'{wrong}' has shape \(63, 64\).*\(64, 64\)"):
        sender.push(sender.preflight(plan, _reshaped(export, wrong, rows=-1)))
    with pytest.raises(ValueError, match="takes a WeightExport"):
        sender.holding([("x", torch.zeros(1))])
    assert receiver.call(cmd="unchanged", group="tiny", value=5.0)["changed"] == []
    sender.close()


def test_plan_boxes_are_checked_against_the_geometry(receiver: Receiver, transport) -> None:
    sender = WeightSender(_config(), transport=transport)
    export = ModelExport(random_model(TINY, seed=6))
    plan = _plan_for(sender, export, receiver, "tiny").for_source(0)
    wrong = "model.layers.1.self_attn.q_proj.weight"
    # A plan built without declared shapes still refuses a tensor too small for its boxes.
    bare = dataclasses.replace(plan, shapes={})
    with pytest.raises(ValueError, match=rf"'{wrong}' has shape \(63, 64\).*reads box"):
        sender.push(sender.preflight(bare, _reshaped(export, wrong, rows=-1)))
    sender.close()


def test_an_export_that_lies_about_its_geometry_is_stopped_at_that_tensor(
    receiver: Receiver, transport
) -> None:
    receiver.call(cmd="fill", group="tiny", value=5.0)
    sender = WeightSender(_config(bucket_bytes=8 << 10), transport=transport)
    export = ModelExport(random_model(TINY, seed=6))
    plan = _plan_for(sender, export, receiver, "tiny").for_source(0)
    name = "model.layers.3.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=rf"'{name}' lies in memory as .* must match its geometry"):
        sender.push(sender.preflight(plan, _LyingExport(export, name)))
    # The sender is fine afterwards.
    sender.push(sender.preflight(plan, export))
    _assert_exact(receiver, "tiny", seed=6)
    sender.close()


def test_dead_receiver_raises_transfer_error_naming_it(receiver: Receiver, transport) -> None:
    doomed = Receiver([{"name": "doomed", "model": TINY, "tp": 1, "ep": 1}])
    targets = doomed.target_ranks("doomed")
    doomed.proc.kill()
    doomed.proc.wait()
    sender = WeightSender(_config(timeout_s=10.0), transport=transport)
    export = ModelExport(random_model(TINY, seed=7))
    holdings = sender.gather_holdings(export)
    plan = build_plan(hf_config=TINY, targets=targets, sources=holdings, dtype="bfloat16")
    with pytest.raises(TransferError) as caught:
        sender.push(sender.preflight(plan.for_source(0), export))
    session = targets[0].session_id
    assert caught.value.target_session == session
    assert f"replica doomed rank 0 (session {session})" in str(caught.value)
    assert caught.value.param_name is not None and caught.value.param_name in str(caught.value)

    # The sender is still usable for live targets.
    receiver.call(cmd="fill", group="tiny", value=7.0)
    live = _plan_for(sender, export, receiver, "tiny")
    sender.push(sender.preflight(live.for_source(0), export))
    _assert_exact(receiver, "tiny", seed=7)
    sender.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_senders(
    tmp_path: Path, receiver: Receiver, group: str, world_size: int, *extra: str
) -> list[dict[str, Any]]:
    spec = tmp_path / "targets.json"
    spec.write_text(json.dumps({"model": MODELS[group], "targets": receiver.target_dicts(group)}))
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(PEER), "send", "--targets", str(spec), *extra],
            stdout=subprocess.PIPE,
            text=True,
            env={
                **_peer_env(),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for rank in range(world_size)
    ]
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=STARTUP_S)
        assert proc.returncode == 0, out
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


def test_two_pipeline_stages_push_from_a_gloo_group(tmp_path: Path, receiver: Receiver) -> None:
    receiver.call(cmd="fill", group="tiny", value=7.0)
    results = _run_senders(tmp_path, receiver, "tiny", 2, "--pp", "2", "--seed", "8")
    _assert_exact(receiver, "tiny", seed=8)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["pushes"][0]["bytes_written"] > 0 for r in results)


def test_host_memory_stays_within_two_buckets(tmp_path: Path, receiver: Receiver) -> None:
    bucket = 8 << 20
    (result,) = _run_senders(
        tmp_path, receiver, "large", 1,
        "--bucket-bytes", str(bucket), "--repeats", "2", "--seed", "9", "--measure-memory",
    )  # fmt: skip
    _assert_exact(receiver, "large", seed=9)
    bound = 2 * bucket + (16 << 20)
    first, second = result["pushes"]
    assert first["staging_bytes"] == 2 * bucket
    assert first["bytes_written"] > 100e6
    # A bf16 copy of the model would be far above the bound.
    assert result["model_bytes"] // 2 > 3 * bound
    assert first["peak_rss_growth_bytes"] <= bound, first
    # The second push reuses the ring: no new staging memory.
    assert second["peak_rss_growth_bytes"] <= 16 << 20, second


def test_holding_is_what_the_export_holds(transport) -> None:
    sender = WeightSender(_config(), transport=transport)
    model = random_model(TINY)
    from_export = sender.holding(ModelExport(model))
    from_mapping = sender.holding(ModelExport(dict(ModelExport(model))))
    assert isinstance(from_export, SourceHolding) and from_export.rank == 0
    assert from_export == from_mapping
    assert sender.gather_holdings(ModelExport(model)) == [from_export]
    with pytest.raises(ValueError, match="WeightExport"):
        sender.holding({"x": torch.zeros(1)})
    sender.close()


class _StagingProbe:
    """A transport that hands every call to a real one and, at the first write, notes which
    bytes of the staging ring the sender had not filled yet.

    The ring is set to 0xFF when the sender registers it; a run of 4 KiB still all 0xFF at
    the first write was not filled by then (no bf16 weight of a seeded model is 0xFFFF).
    """

    BLOCK = 4096

    def __init__(self, inner: MooncakeTransport) -> None:
        self._inner = inner
        self.ring: tuple[int, int] | None = None
        self.unfilled_at_first_write: np.ndarray | None = None
        self.num_write_calls = 0

    @property
    def session_id(self) -> str:
        return self._inner.session_id

    @property
    def write_cost(self):
        return self._inner.write_cost

    @property
    def capabilities(self):
        return HOST_ONLY

    def register(self, addr: int, num_bytes: int) -> None:
        self._inner.register(addr, num_bytes)
        ctypes.memset(addr, 0xFF, num_bytes)
        self.ring = (addr, num_bytes)

    def unregister(self, addr: int) -> None:
        self._inner.unregister(addr)

    def write(self, target_session, src_addrs, dst_addrs, lengths):
        if self.unfilled_at_first_write is None:
            assert self.ring is not None
            addr, num_bytes = self.ring
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * num_bytes).from_address(addr))
            blocks = raw[: num_bytes - num_bytes % self.BLOCK].reshape(-1, self.BLOCK)
            self.unfilled_at_first_write = (blocks == 0xFF).all(axis=1)
        self.num_write_calls += 1
        return self._inner.write(target_session, src_addrs, dst_addrs, lengths)

    def wait(self, handle, timeout_s: float) -> None:
        self._inner.wait(handle, timeout_s)

    def close(self) -> None:
        """The wrapped transport belongs to the test module."""


def test_one_bucket_push_writes_its_first_chunk_before_the_rest_is_filled(
    receiver: Receiver, transport
) -> None:
    export = ModelExport(random_model(LARGE, seed=10))
    bucket = 128 << 20  # the whole ~116 MB bf16 shard fits one bucket
    chunk = 8 << 20
    results = {}
    for chunk_bytes in (chunk, bucket):
        receiver.call(cmd="fill", group="large", value=7.0)
        probe = _StagingProbe(transport)
        sender = WeightSender(
            _config(bucket_bytes=bucket, chunk_bytes=chunk_bytes), transport=probe
        )
        plan = _plan_for(sender, export, receiver, "large")
        stats = sender.push(sender.preflight(plan.for_source(0), export))
        _assert_exact(receiver, "large", seed=10)
        sender.close()
        assert stats.num_buckets == 1 and stats.bytes_staged > 100e6
        # Which 4 KiB blocks of the bucket's slot were still empty when the first write went.
        used = stats.bytes_staged // probe.BLOCK
        assert probe.unfilled_at_first_write is not None
        results[chunk_bytes] = (stats, probe.unfilled_at_first_write[:used])

    streamed, unfilled = results[chunk]
    # Only the first chunk (at most twice the chunk size) was filled: everything after it was
    # still empty when its writes were submitted.
    first_empty = int(unfilled.argmax())
    assert unfilled[first_empty:].all()
    assert 0 < first_empty * probe.BLOCK <= 2 * chunk
    assert streamed.num_chunks >= streamed.bytes_staged // (2 * chunk)
    # Chunk cuts fall between parameters unless a run is longer than twice the chunk size.
    whole, unfilled_whole = results[bucket]
    assert whole.num_chunks == 1
    assert not unfilled_whole.any()  # the contrast: the slot was full before any write
    assert whole.num_writes <= streamed.num_writes <= whole.num_writes + streamed.num_chunks


def test_streamed_bucket_with_a_bad_last_tensor_writes_nothing(
    receiver: Receiver, transport
) -> None:
    receiver.call(cmd="fill", group="large", value=5.0)
    sender = WeightSender(_config(bucket_bytes=128 << 20, chunk_bytes=1 << 20), transport=transport)
    export = ModelExport(random_model(LARGE, seed=11))
    plan = _plan_for(sender, export, receiver, "large").for_source(0)
    last, tensor = list(export)[-1]
    rows = tensor.shape[0]
    with pytest.raises(ValueError, match=rf"'{last}' has shape \({rows + 1}, "):
        sender.push(sender.preflight(plan, _reshaped(export, last, rows=1)))
    meta = ModelExport({n: t.to("meta") if n == last else t for n, t in export})
    with pytest.raises(ValueError, match=rf"'{last}' .* is a torch.strided tensor on meta"):
        sender.push(sender.preflight(plan, meta))
    assert receiver.call(cmd="unchanged", group="large", value=5.0)["changed"] == []
    # The same sender streams the good tensors afterwards.
    stats = sender.push(sender.preflight(plan, export))
    assert stats.num_buckets == 1 and stats.num_chunks > 50
    _assert_exact(receiver, "large", seed=11)
    sender.close()


# ---------------------------------------------------------------- cached programs
# A push runs a program lowered from the plan and the stream's geometry; a later push whose
# stream lies in memory the same way runs the cached program; one that changed gets a new
# program before anything is written. Bit-exact either way.


def _load(model: torch.nn.Module, seed: int, config: dict) -> None:
    """Give `model` the weights of `seed` in place (as an optimizer step would)."""
    fresh = random_model(config, seed=seed)
    with torch.no_grad():
        for param, new in zip(
            model.state_dict().values(), fresh.state_dict().values(), strict=True
        ):
            param.copy_(new)


@pytest.mark.parametrize("group", ["tiny", "moe"])
def test_second_push_runs_the_cached_program_and_lands_new_weights(
    receiver: Receiver, transport, group: str
) -> None:
    config = {"tiny": TINY, "moe": MOE}[group]
    receiver.call(cmd="fill", group=group, value=7.0)
    # Small slots: the push is many chunks over a ring that wraps around.
    sender = WeightSender(_config(bucket_bytes=16 << 10), transport=transport)
    model = random_model(config, seed=31)
    export = ModelExport(model)
    plan = _plan_for(sender, export, receiver, group).for_source(0)
    first = sender.push(sender.preflight(plan, export))
    assert not first.cached_program
    _assert_exact(receiver, group, seed=31)
    for seed in (32, 33):
        _load(model, seed, config)
        stats = sender.push(sender.preflight(plan, export))
        assert stats.cached_program
        _assert_exact(receiver, group, seed=seed)
        for field in ("bytes_staged", "bytes_written", "num_writes", "num_chunks", "num_copies"):
            assert getattr(stats, field) == getattr(first, field), field
        assert stats.bytes_per_target == first.bytes_per_target
    # A new model object with the same shapes runs it too (other storage, same geometry).
    stats = sender.push(sender.preflight(plan, ModelExport(random_model(config, seed=34))))
    assert stats.cached_program
    _assert_exact(receiver, group, seed=34)
    sender.close()


def _swapped(model: torch.nn.Module) -> ModelExport:
    """The model's stream with its last two tensors in the other order."""
    stream = list(ModelExport(model))
    stream[-2], stream[-1] = stream[-1], stream[-2]
    return ModelExport(dict(stream))


def test_changed_geometry_gets_a_new_program_before_the_push(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="tiny", value=7.0)
    sender = WeightSender(_config(bucket_bytes=8 << 10), transport=transport)
    model = random_model(TINY, seed=41)
    plan = _plan_for(sender, ModelExport(model), receiver, "tiny").for_source(0)
    sender.push(sender.preflight(plan, ModelExport(model)))

    # The last two tensors swapped: a new program, then cached.
    for seed, cached in ((42, False), (43, True)):
        _load(model, seed, TINY)
        stats = sender.push(sender.preflight(plan, _swapped(model)))
        assert stats.cached_program is cached
        _assert_exact(receiver, "tiny", seed=seed)
    # The original order's program is still cached.
    _load(model, 44, TINY)
    assert sender.push(sender.preflight(plan, ModelExport(model))).cached_program
    _assert_exact(receiver, "tiny", seed=44)

    # Same values, one tensor with other strides (a transposed copy viewed back).
    _load(model, 45, TINY)
    stream = dict(ModelExport(model))
    name = next(n for n, t in stream.items() if t.dim() == 2)
    stream[name] = stream[name].t().contiguous().t()
    stats = sender.push(sender.preflight(plan, ModelExport(stream)))
    assert not stats.cached_program
    _assert_exact(receiver, "tiny", seed=45)
    sender.close()


def test_repeated_tensors_are_refused(transport) -> None:
    class Twice(ModelExport):
        def __iter__(self):
            items = list(super().__iter__())
            yield from items[:3] + items[2:]

    with pytest.raises(ValueError, match="twice"):
        Twice(random_model(TINY, seed=51)).geometry()


def test_non_finite_values_are_refused_on_the_first_push(receiver: Receiver, transport) -> None:
    receiver.call(cmd="fill", group="tiny", value=5.0)
    sender = WeightSender(_config(bucket_bytes=8 << 10), transport=transport)
    model = random_model(TINY, seed=61)
    plan = _plan_for(sender, ModelExport(model), receiver, "tiny").for_source(0)
    name = "model.layers.2.self_attn.o_proj.weight"
    for bad in (float("nan"), 3.4e38):  # a finite float32 that is infinite in bf16
        tensors = dict(ModelExport(model))
        tensors[name] = tensors[name].clone()
        tensors[name][3, 5] = bad
        with pytest.raises(ValueError, match=r"o_proj.weight. holds values that are not finite"):
            sender.push(sender.preflight(plan, ModelExport(tensors)))
    assert receiver.call(cmd="unchanged", group="tiny", value=5.0)["changed"] == []
    sender.push(sender.preflight(plan, ModelExport(model)))
    _assert_exact(receiver, "tiny", seed=61)
    # After a good push the check is off (check_finite="first"); "always" keeps it.
    sender.push(sender.preflight(plan, ModelExport(tensors)))
    always = WeightSender(_config(check_finite="always"), transport=transport)
    sender.push(sender.preflight(plan, ModelExport(model)))
    always.push(always.preflight(plan, ModelExport(model)))
    with pytest.raises(ValueError, match="not finite"):
        always.push(always.preflight(plan, ModelExport(tensors)))
    always.close()
    sender.close()


# ---------------------------------------------------------------- direct writes
# Trainer tensors already in the rollout's dtype are written from their own memory,
# registered with Mooncake, with no staging copy; a push that wrote everything directly is
# captured and replayed without reading the stream while the tensors stay where they are.


def _bf16_model(config: dict, seed: int) -> torch.nn.Module:
    """The seeded model in bfloat16: the values the receiver expects, in the rollout dtype."""
    return random_model(config, seed=seed).to(torch.bfloat16)


@pytest.mark.parametrize("group", ["tiny", "moe"])
def test_tensors_in_the_rollout_dtype_go_direct_from_registered_memory(
    receiver: Receiver, transport, group: str
) -> None:
    config = MODELS[group]
    receiver.call(cmd="fill", group=group, value=7.0)
    sender = WeightSender(_config(), transport=transport)
    export = ModelExport(_bf16_model(config, seed=51))
    plan = _plan_for(sender, export, receiver, group).for_source(0)
    stats = sender.push(sender.preflight(plan, export))
    _assert_exact(receiver, group, seed=51)
    # Over TCP, rows of a row-parallel slice are staged (a write each would cost more than
    # the copy saves), and so are small pieces that continue a neighbour's destination (an
    # expert's slice after the expert before: one write for them all); the large whole
    # tensors are written from the trainer's tensors.
    assert stats.bytes_direct + stats.bytes_staged == plan.num_bytes_staged
    assert stats.bytes_direct > 0 and stats.bytes_staged > 0
    assert stats.bytes_written == plan.num_bytes_written
    assert stats.digests == receiver.call(cmd="digests", group=group)

    # The same push staged: the same bytes land, the digests agree.
    receiver.call(cmd="fill", group=group, value=7.0)
    staged = WeightSender(_config(direct="never"), transport=transport)
    again = staged.push(staged.preflight(plan, export))
    _assert_exact(receiver, group, seed=51)
    assert (again.bytes_direct, again.bytes_staged) == (0, plan.num_bytes_staged)
    assert again.digests == stats.digests
    # Every piece that can go direct does: a row-parallel slice goes out as a write per row.
    receiver.call(cmd="fill", group=group, value=7.0)
    rows = WeightSender(_config(direct="always"), transport=transport)
    every = rows.push(rows.preflight(plan, export))
    _assert_exact(receiver, group, seed=51)
    assert every.bytes_direct > stats.bytes_direct and every.digests == stats.digests
    assert every.num_writes > stats.num_writes
    rows.close()
    staged.close()
    sender.close()


def test_a_direct_push_is_replayed_and_captured_again_after_a_parameter_moved(
    receiver: Receiver, transport
) -> None:
    # tp=1: every tensor is written whole and directly, so the push can be captured.
    receiver.call(cmd="fill", group="large", value=7.0)
    sender = WeightSender(_config(), transport=transport)
    model = _bf16_model(LARGE, seed=61)
    export = ModelExport(model)
    plan = _plan_for(sender, export, receiver, "large").for_source(0)
    first = sender.push(sender.preflight(plan, export))
    assert not first.replayed and first.bytes_staged == 0
    assert sender.staging_bytes == 0  # nothing staged: no ring was allocated
    _assert_exact(receiver, "large", seed=61)

    _load(model, 62, LARGE)
    receiver.call(cmd="fill", group="large", value=7.0)
    replayed = sender.push(sender.preflight(plan, export))
    assert replayed.replayed and replayed.cached_program
    _assert_exact(receiver, "large", seed=62)
    assert replayed.digests == receiver.call(cmd="digests", group="large")
    assert replayed.bytes_written == first.bytes_written

    # A parameter moves (the trainer gave it new memory): the next push checks the export's
    # memory before it starts, reads the stream again and captures anew ...
    param = model.get_parameter("model.layers.0.mlp.down_proj.weight")
    old_address = param.data_ptr()
    param.data = param.data.clone()
    assert param.data_ptr() != old_address
    _load(model, 63, LARGE)
    receiver.call(cmd="fill", group="large", value=7.0)
    moved = sender.push(sender.preflight(plan, export))
    assert moved.cached_program and not moved.replayed
    _assert_exact(receiver, "large", seed=63)
    # ... and that capture is what the following push replays, from the new address.
    _load(model, 64, LARGE)
    receiver.call(cmd="fill", group="large", value=7.0)
    again = sender.push(sender.preflight(plan, export))
    assert again.replayed
    _assert_exact(receiver, "large", seed=64)
    assert again.digests == receiver.call(cmd="digests", group="large")

    # Without replay every push reads the stream.
    plain = WeightSender(_config(replay=False), transport=transport)
    assert not plain.push(plain.preflight(plan, export)).replayed
    assert not plain.push(plain.preflight(plan, export)).replayed
    _assert_exact(receiver, "large", seed=64)
    plain.close()
    sender.close()


# ---------------------------------------------------------------- pinned tensors
# The trainer's tensors are pinned for the push (`weightsync.sender.pins`): one changed while
# the push reads it fails the push, naming it; a push after it (no change) lands bit-exact.


@pytest.mark.parametrize(
    ("group", "dtype", "path"),
    [("tiny", torch.float32, "staged"), ("large", torch.bfloat16, "direct")],
)
def test_a_tensor_changed_while_the_push_reads_it_fails_the_push_naming_it(
    receiver: Receiver, transport, group: str, dtype: torch.dtype, path: str
) -> None:
    # fp32 into bf16: every byte staged (cast); bf16 at tp=1: every byte written straight
    # from the trainer's memory while the writes are in flight.
    config = MODELS[group]
    receiver.call(cmd="fill", group=group, value=7.0)
    sender = WeightSender(_config(bucket_bytes=64 << 10), transport=transport)
    model = random_model(config, seed=91).to(dtype)
    export = ModelExport(model)
    plan = _plan_for(sender, export, receiver, group).for_source(0)
    stream = dict(export)
    name = list(stream)[4]

    def step() -> None:  # an optimizer's in-place update of tensor 4, after tensor 9 was yielded
        with torch.no_grad():
            stream[name].mul_(0.5)

    with pytest.raises(
        TensorChangedError, match=f"'{name}' changed while a push read it"
    ) as caught:
        sender.push(sender.preflight(plan, StallingExport(export, after=10, hook=step)))
    assert caught.value.hf_name == name and caught.value.rank == 0

    _load(model, 92, config)
    stats = sender.push(sender.preflight(plan, export))
    _assert_exact(receiver, group, seed=92)
    if path == "staged":
        assert stats.bytes_direct == 0 and stats.bytes_staged > 0
    else:
        assert stats.bytes_staged == 0 and stats.bytes_direct > 0
    sender.close()


def test_a_tensor_changed_on_another_thread_during_a_replay_fails_it(receiver: Receiver) -> None:
    # tp=1 in bf16: every byte direct, so from the second push on the push is replayed from
    # bound write lists, without reading the stream.
    receiver.call(cmd="fill", group="large", value=7.0)
    engine = MooncakeTransport(MooncakeConfig(timeout_s=5.0))
    hooked = HookedTransport(engine)
    try:
        sender = WeightSender(_config(), transport=hooked)
        model = _bf16_model(LARGE, seed=93)
        export = ModelExport(model)
        plan = _plan_for(sender, export, receiver, "large").for_source(0)
        assert not sender.push(sender.preflight(plan, export)).replayed
        _load(model, 94, LARGE)
        assert sender.push(sender.preflight(plan, export)).replayed
        _assert_exact(receiver, "large", seed=94)

        name = "model.layers.3.mlp.down_proj.weight"
        tensor = model.get_parameter(name)

        def step_elsewhere() -> None:  # at the replay's first write: a step on another thread
            def step() -> None:
                with torch.no_grad():
                    tensor.add_(1.0)

            thread = threading.Thread(target=step)
            thread.start()
            thread.join()

        hooked.arm(step_elsewhere)
        with pytest.raises(TensorChangedError, match=f"'{name}' changed") as caught:
            sender.push(sender.preflight(plan, export))
        assert hooked.fired == 1 and caught.value.hf_name == name

        _load(model, 95, LARGE)
        again = sender.push(sender.preflight(plan, export))
        assert again.replayed
        _assert_exact(receiver, "large", seed=95)
        sender.close()
    finally:
        engine.close()


def test_inference_tensors_are_pushed_unpinned(receiver: Receiver, transport) -> None:
    # They count no versions (and change only inside inference_mode): nothing to check.
    receiver.call(cmd="fill", group="tiny", value=7.0)
    with torch.inference_mode():
        state = {n: t.clone() for n, t in ModelExport(random_model(TINY, seed=96))}
    assert next(iter(state.values())).is_inference()
    sender = WeightSender(_config(), transport=transport)
    export = TensorsExport(state)
    plan = _plan_for(sender, export, receiver, "tiny").for_source(0)
    sender.push(sender.preflight(plan, export))
    _assert_exact(receiver, "tiny", seed=96)
    sender.close()


def test_a_replay_reads_one_counter_per_trainer_tensor() -> None:
    fused = torch.zeros(8, 4, 4)  # a fused expert tensor, streamed as per-expert views
    alone = torch.zeros(3)
    with torch.inference_mode():
        frozen = torch.zeros(2)
    named = [(f"expert.{e}", fused[e]) for e in range(8)] + [("alone", alone), ("frozen", frozen)]
    names, tensors = counted(named)
    assert names == ["expert.0", "alone"] and tensors[0] is fused and tensors[1] is alone

    pins = PushPins(rank=3)
    pins.take(names, tensors)
    pins.check()
    fused[5].add_(1.0)  # an in-place op on one view moves the counter they all share
    with pytest.raises(TensorChangedError, match=r"'expert\.0' changed .* from 0 to 1") as caught:
        pins.check()
    assert (caught.value.hf_name, caught.value.rank) == ("expert.0", 3)
