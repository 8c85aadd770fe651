"""The colocated baseline end to end: a trainer shares flattened buckets by reference with a
`weightsync serve` replica at tp=2 over SGLang's ``update_weights_from_tensor`` (on CPU as
shared-memory files), as verl's ``naive`` backend does; every rank rebuilds the bucket and
loads it through the engine's loader. The first sync runs the bit-exact check; a second,
after the trainer's weights changed, must serve the trainer model's greedy tokens."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from servers import serve_replicas
from weightsync.baseline import BroadcastConfig, TensorSync
from weightsync.baseline.shared_tensors import deserialize, named_tensors, serialize
from weightsync.checkpoint import load_config_dict
from weightsync.export import ModelExport
from weightsync.manager import ControlConfig, SyncManager
from weightsync.testing.presets import preset_config, write_random_checkpoint
from weightsync.testing.reference import greedy_tokens

API_KEY = "from-tensor-key"
PROMPT = (1, 17, 42, 7)
MAX_NEW_TOKENS = 6  # the body above asks for as many


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"), seed=5)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_shared_tensors_round_trip_and_refuse_code() -> None:
    tensor = torch.arange(12, dtype=torch.float32).view(3, 4)
    pairs = named_tensors(deserialize(serialize([("w", tensor)])), None)
    assert pairs[0][0] == "w" and torch.equal(pairs[0][1], tensor)
    # A payload that would run a callable on load is refused before it runs.
    evil = base64.b64encode(pickle.dumps(_RunsCode())).decode()
    with pytest.raises(ValueError, match="may not name"):
        deserialize(evil)
    with pytest.raises(ValueError, match="load_format"):
        named_tensors([("w", tensor)], "direct")


def test_update_weights_from_tensor_is_bit_exact_and_serves_the_new_weights(
    checkpoint, tmp_path
) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    hf_config = load_config_dict(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with serve_replicas(
        checkpoint, tp=2, dtype="bf16", api_key=API_KEY, log_dir=tmp_path / "logs"
    ) as (replica,):
        manager = SyncManager(
            [replica.url], ControlConfig(api_key=API_KEY, check_weight_update_equal=True)
        )
        sync = TensorSync(
            hf_config=hf_config,
            config=BroadcastConfig(bucket_bytes=64 << 10),
            manager=manager,
            dtype="bfloat16",
        )
        try:
            first = sync.sync(ModelExport(model))
            assert first.bit_exact is True and len(sync.buckets) > 2
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(1.5)
            second = sync.sync(ModelExport(model))
            body = {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 6}}
            reply = httpx.post(
                f"{replica.url}/generate",
                json=body,
                headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=60.0,
            )
            reply.raise_for_status()
        finally:
            sync.close()
    assert second.push.bytes_staged == first.push.bytes_staged > 0
    expected = greedy_tokens(model, torch.bfloat16, (PROMPT,), MAX_NEW_TOKENS)[0]
    assert second.version != first.version and reply.json()["output_ids"] == expected
