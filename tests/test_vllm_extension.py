"""weightsync's receiver inside real vLLM 0.32.0 (its CPU build): `WorkerExtension` loaded with
``--worker-extension-cls`` and driven through ``POST /collective_rpc``, with the bytes written
one-sidedly over real Mooncake (TCP on loopback) from this test process into the addresses the
workers publish.

The session's tp1 server (`vllm_cpu.fixtures`, shared with other modules) serves the
module's tp1 tests in order (init, a verified sync of its own checkpoint, a sync of a second
checkpoint that generation follows, a wrong digest, a delta); the session's tp2 server runs
one sync on both ranks. The refusals are checked without a server, on the
extension's methods with a stand-in worker.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_cpu.fixtures import DELTA_REGION_MB, TINY_HEAD_DIM
from vllm_cpu.launch import VLLMServer
from weightsync.integrations.vllm import WorkerExtension
from weightsync.layout import rank_layout
from weightsync.receiver import shard_state_dict
from weightsync.receiver.digest import ParameterDigests
from weightsync.testing.reference import greedy_tokens
from weightsync.transport import MooncakeConfig, MooncakeTransport

EXTENSION = "weightsync.integrations.vllm.WorkerExtension"
PROMPTS = ((1, 2, 3, 4), (100, 200, 300, 400, 500))
NEW_TOKENS = 8
DELTA_REGION_BYTES = DELTA_REGION_MB << 20
# What vLLM's CPU post-processing repacks into oneDNN handles (tests/test_layout_vllm.py).
_REPACKED = re.compile(r"\.(qkv_proj|o_proj|gate_up_proj|down_proj)\.weight$")


# -- helpers ---------------------------------------------------------------------------------


def rpc(server: VLLMServer, method: str, request: Mapping[str, Any] | None = None) -> list[dict]:
    """Call `method` on every worker with one JSON request; the replies in rank order."""
    reply = server.post(
        "/collective_rpc",
        {"method": method, "args": [json.dumps(dict(request or {}))]},
        timeout=300,
    )
    assert reply.status == 200, reply.body
    return reply.body["results"]


def load_checkpoint(path: Path) -> Any:
    """The transformers model of a checkpoint, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def rank_shards(model: Any, tp: int) -> list[dict[str, torch.Tensor]]:
    """What each of `tp` ranks holds of `model`, in weightsync's layout (float32)."""
    state = model.state_dict()
    return [
        shard_state_dict(state, model.config, {"tp_size": tp, "tp_rank": rank}, torch.float32)
        for rank in range(tp)
    ]


def write_rank(writer: MooncakeTransport, info: dict, shards: Mapping[str, torch.Tensor]) -> None:
    """Write `shards` one-sidedly into the rank `info` (its init reply) describes."""
    names = list(info["weights_info"])
    assert set(names) == set(shards)
    flat = torch.cat([shards[name].reshape(-1).view(torch.uint8) for name in names])
    writer.register(flat.data_ptr(), flat.numel())
    try:
        src, dst, lengths, offset = [], [], [], 0
        for name in names:
            ptr, numel, element_size = info["weights_info"][name]
            num_bytes = numel * element_size
            assert num_bytes == shards[name].nbytes, name
            src.append(flat.data_ptr() + offset)
            dst.append(ptr)
            lengths.append(num_bytes)
            offset += num_bytes
        writer.wait(writer.write(info["session_id"], src, dst, lengths), 30.0)
    finally:
        writer.unregister(flat.data_ptr())


def sync(
    server: VLLMServer,
    writer: MooncakeTransport,
    infos: list[dict],
    shards: list[dict[str, torch.Tensor]],
    *,
    digests: list[dict[str, int]] | None = None,
    version: str = "v",
) -> list[dict]:
    """One session on every rank: begin, write each rank's shards, end with their digests
    (`digests`, else the shards' own); the end replies."""
    for begun in rpc(server, "weightsync_begin", {"selector": "target"}):
        assert begun["success"], begun
    for info, rank in zip(infos, shards, strict=True):
        write_rank(writer, info, rank)
    if digests is None:
        digests = [ParameterDigests(rank).compute() for rank in shards]
    # Every worker gets the same request: the digests of all ranks, indexed by tp rank.
    return rpc(server, "weightsync_end", {"digests": digests, "weight_version": version})


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory) -> Path:
    """Another tiny random Qwen3 (same config as `vllm_checkpoint`, other weights)."""
    from weightsync.testing.presets import preset_config, write_random_checkpoint

    path = tmp_path_factory.mktemp("vllm-qwen3-second")
    config = preset_config("tiny", head_dim=TINY_HEAD_DIM)
    return write_random_checkpoint(path, config, dtype=torch.float32, seed=12)


@pytest.fixture(scope="module")
def writer() -> Iterator[MooncakeTransport]:
    """The test process's Mooncake transport (the trainer's side)."""
    transport = MooncakeTransport(MooncakeConfig(protocol="tcp", timeout_s=10))
    try:
        yield transport
    finally:
        transport.close()


@pytest.fixture(scope="module")
def server(vllm_tp1) -> VLLMServer:
    """The session's tp1 vLLM with the extension in its worker (`vllm_cpu.fixtures`)."""
    return vllm_tp1


@pytest.fixture(scope="module")
def init_reply(server) -> dict:
    """The tp1 worker's first init reply."""
    request = {"host": "127.0.0.1", "delta_region_bytes": DELTA_REGION_BYTES}
    (reply,) = rpc(server, "weightsync_init", request)
    assert reply["success"], reply
    return reply


@pytest.fixture(scope="module")
def models(vllm_checkpoint, second_checkpoint) -> dict[str, Any]:
    """The two checkpoints' transformers models."""
    return {"first": load_checkpoint(vllm_checkpoint), "second": load_checkpoint(second_checkpoint)}


# -- tp 1 ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_init_measures_what_vllm_repacks(server, init_reply, vllm_checkpoint) -> None:
    """The linear weights vLLM's CPU build repacks are staged, the rest (embeddings, norms,
    lm_head) written in place; ``weights_info`` is weightsync's layout of the rank; a second
    init answers the first one's reply (same instance)."""
    reply = init_reply
    config = json.loads((vllm_checkpoint / "config.json").read_text())
    layout = rank_layout(config, {"tp_size": 1, "tp_rank": 0}, "float32")
    assert set(reply["weights_info"]) == set(layout)  # vLLM's order, not the layout's
    for name, (ptr, numel, element_size) in reply["weights_info"].items():
        assert ptr > 0 and numel == layout[name].numel and element_size == 4, name
    assert set(reply["staged"]) == {name for name in layout if _REPACKED.search(name)}
    assert set(reply["in_place"]) == set(layout) - set(reply["staged"])
    # vLLM's CPU build computes the logits from a oneDNN copy of lm_head (and sets one up for
    # the embedding too): written in place, processed again at each end.
    assert set(reply["reprocessed"]) == {"lm_head.weight", "model.embed_tokens.weight"}
    assert reply["reprocessed_layers"] == len(reply["staged"]) + 2
    assert reply["staged_bytes"] == sum(layout[name].numel * 4 for name in reply["staged"])
    assert reply["layout_checked"] is True
    assert reply["rank"] == 0 and reply["dtype"] == "float32"
    assert reply["parallelism_config"]["tp_size"] == 1
    assert reply["delta_region"][1] == DELTA_REGION_BYTES
    assert reply["vllm_version"] == "0.32.0"
    assert set(reply["checker"]) == {"in_place", "staged"}
    (again,) = rpc(server, "weightsync_init", {})
    assert again == reply
    print(
        f"capture {reply['capture_s'] * 1e3:.1f} ms; {len(reply['staged'])} staged "
        f"({reply['staged_bytes']} bytes), {len(reply['in_place'])} in place, "
        f"{len(reply['registered_regions'])} regions"
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_sync_of_the_served_checkpoint_verifies(server, init_reply, writer, models) -> None:
    """Snapshot, scramble every parameter (reset_tensors), write the checkpoint's own shards
    one-sidedly inside a session: the end verifies the digests, and the checker finds every
    parameter as snapshotted."""
    # The server is the session's: first make it hold the checkpoint, whatever it held.
    (end,) = sync(server, writer, [init_reply], rank_shards(models["first"], 1), version="0")
    assert end["success"], end
    (snap,) = rpc(server, "weightsync_checker", {"action": "snapshot"})
    assert snap["success"], snap
    (reset,) = rpc(server, "weightsync_checker", {"action": "reset_tensors"})
    assert reset["success"], reset
    (end,) = sync(server, writer, [init_reply], rank_shards(models["first"], 1), version="first")
    assert end["success"] and end["verified"] and end["mismatched"] == [], end
    assert end["applied_params"] == len(init_reply["staged"])
    assert end["weight_version"] == "first"
    (same,) = rpc(server, "weightsync_checker", {"action": "compare"})
    assert same["success"], same
    expected = greedy_tokens(models["first"], torch.float32, PROMPTS[:1], NEW_TOKENS)
    assert [server.greedy(PROMPTS[0], NEW_TOKENS)] == expected
    print(f"apply {end['apply_s'] * 1e3:.1f} ms for {end['applied_params']} parameters")


@pytest.mark.slow
@pytest.mark.vllm
def test_sync_of_another_checkpoint_changes_generation(server, init_reply, writer, models) -> None:
    """After a verified sync of a second checkpoint's shards, vLLM's greedy tokens are
    transformers' on that checkpoint (vLLM took the staged bytes too), not the first's."""
    start = time.monotonic()
    (end,) = sync(server, writer, [init_reply], rank_shards(models["second"], 1), version="second")
    sync_s = time.monotonic() - start
    assert end["success"] and end["verified"], end
    expected = greedy_tokens(models["second"], torch.float32, PROMPTS, NEW_TOKENS)
    served = [server.greedy(prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert served == expected
    assert expected != greedy_tokens(models["first"], torch.float32, PROMPTS, NEW_TOKENS)
    print(f"sync over HTTP + Mooncake in {sync_s:.2f} s; apply {end['apply_s'] * 1e3:.1f} ms")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_wrong_digest_fails_the_end(server, init_reply, writer, models) -> None:
    """An end whose digest of one parameter differs answers success false naming it; the
    session is closed all the same (a new one begins)."""
    shards = rank_shards(models["second"], 1)
    digests = ParameterDigests(shards[0]).compute()
    wrong = "model.layers.1.self_attn.qkv_proj.weight"
    digests[wrong] += 1
    (end,) = sync(server, writer, [init_reply], shards, digests=[digests])
    assert not end["success"] and not end["verified"], end
    assert end["mismatched"] == [wrong]
    assert wrong in end["message"]
    (begun,) = rpc(server, "weightsync_begin", {})
    assert begun["success"] and begun["changed"] == [], begun
    (end,) = rpc(server, "weightsync_end", {"digests": None})
    assert end["success"] and not end["verified"], end
    (twice,) = rpc(server, "weightsync_end", {"digests": None})
    assert not twice["success"] and "no weight-update session" in twice["message"]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_delta_sync_applies_verifies_and_generation_follows(
    server, init_reply, writer, models
) -> None:
    """Inside a session: the base's checksums are the second checkpoint's; a delta back to
    the first checkpoint (every element, a dense section per parameter) written into the
    delta region applies and verifies; the end without digests is verified by it; greedy
    tokens are the first checkpoint's again."""
    from weightsync.delta_codec import Section, as_bits, checksums, encode_payload

    (second,) = rank_shards(models["second"], 1)
    (first,) = rank_shards(models["first"], 1)
    # The base is the second checkpoint whatever ran before (a selection of tests may not
    # have synced it).
    (end,) = sync(server, writer, [init_reply], [second], version="second")
    assert end["success"] and end["verified"], end
    (begun,) = rpc(server, "weightsync_begin", {})
    assert begun["success"], begun
    (base,) = rpc(server, "weightsync_delta_checksums", {})
    assert base["success"] and base["checksums"] == checksums(second), base
    order = sorted(first)  # payloads number parameters by their sorted names
    sections = [
        Section(param_index=index, elements=None, values=as_bits(first[name]).reshape(-1))
        for index, name in enumerate(order)
    ]
    payload = encode_payload(sections, "cpu")
    addr, num_bytes = init_reply["delta_region"]
    assert payload.numel() <= num_bytes
    writer.register(payload.data_ptr(), payload.numel())
    try:
        handle = writer.write(
            init_reply["session_id"], [payload.data_ptr()], [addr], [payload.numel()]
        )
        writer.wait(handle, 30.0)
    finally:
        writer.unregister(payload.data_ptr())
    request = {
        "ranks": {"0": {"payloads": [[0, payload.numel()]], "expected": checksums(first)}},
        "check": "changes",
    }
    (applied,) = rpc(server, "weightsync_apply_delta", request)
    assert applied["success"] and applied["verified"], applied
    (end,) = rpc(server, "weightsync_end", {"digests": None, "weight_version": "delta"})
    assert end["success"] and end["verified"], end
    expected = greedy_tokens(models["first"], torch.float32, PROMPTS[:1], NEW_TOKENS)
    assert [server.greedy(PROMPTS[0], NEW_TOKENS)] == expected
    (missing,) = rpc(server, "weightsync_apply_delta", {"ranks": {"1": {}}})
    assert not missing["success"] and "tp rank 0" in missing["message"]


# -- tp 2 ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_tp2_sync_writes_both_ranks(vllm_tp2, writer, models) -> None:
    """Two tensor-parallel workers each publish their rank's layout; writing both ranks'
    shards of the second checkpoint verifies on both and generation follows it."""
    server = vllm_tp2
    infos = rpc(server, "weightsync_init", {})
    assert [info["success"] for info in infos] == [True, True], infos
    assert [info["rank"] for info in infos] == [0, 1]
    assert infos[0]["instance"] != infos[1]["instance"]
    config = models["second"].config
    for rank, info in enumerate(infos):
        layout = rank_layout(config, {"tp_size": 2, "tp_rank": rank}, "float32")
        assert set(info["weights_info"]) == set(layout)
        assert set(info["staged"]) == {name for name in layout if _REPACKED.search(name)}
    ends = sync(server, writer, infos, rank_shards(models["second"], 2))
    assert all(end["success"] and end["verified"] for end in ends), ends
    expected = greedy_tokens(models["second"], torch.float32, PROMPTS[:1], NEW_TOKENS)
    assert [server.greedy(PROMPTS[0], NEW_TOKENS)] == expected


# -- without a server --------------------------------------------------------------------------


def _worker(**overrides: Any) -> SimpleNamespace:
    """A stand-in vLLM worker whose config has the settings the extension checks."""
    parallel = {"pipeline_parallel_size": 1, "data_parallel_size": 1, "tensor_parallel_size": 1}
    parallel["enable_expert_parallel"] = False
    model = {"enable_sleep_mode": False, "quantization": None}
    load = {"load_format": "auto"}
    for key, value in overrides.items():
        for group in (parallel, model, load):
            if key in group:
                group[key] = value
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(**parallel),
        model_config=SimpleNamespace(**model),
        load_config=SimpleNamespace(**load),
    )
    return SimpleNamespace(vllm_config=config)


@pytest.mark.parametrize(
    ("setting", "flag"),
    [
        ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
        ({"data_parallel_size": 2}, "--data-parallel-size"),
        ({"enable_sleep_mode": True}, "--enable-sleep-mode"),
        ({"quantization": "fp8"}, "--quantization"),
        ({"load_format": "dummy"}, "--load-format dummy"),
    ],
)
def test_init_refuses_what_it_does_not_take(setting: dict, flag: str) -> None:
    """An unsupported vLLM setting makes init answer success false naming the flag; it
    never raises into vLLM's worker."""
    worker = _worker(**setting)
    reply = WorkerExtension.weightsync_init(worker, json.dumps({}))
    assert reply["success"] is False
    assert flag in reply["message"], reply["message"]


def test_rpcs_before_init_and_bad_requests_answer_failures() -> None:
    """Begin, end and the checker before init, and a request that is not JSON, answer
    success false with the reason instead of raising."""
    worker = _worker()
    for method in ("weightsync_begin", "weightsync_end", "weightsync_checker"):
        reply = getattr(WorkerExtension, method)(worker, json.dumps({"action": "compare"}))
        assert reply["success"] is False and "weightsync_init" in reply["message"], reply
    reply = WorkerExtension.weightsync_begin(worker, "{not json")
    assert reply["success"] is False and "JSON" in reply["message"]
