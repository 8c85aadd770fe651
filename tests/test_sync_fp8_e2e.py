"""A float32 trainer synced into a block-FP8 DeepSeek-V3 replica (tp 2, ep 2) by
`TrainerSync`: the trainer learns the quantisation from the replica's ``/server_info``,
quantises through `Fp8Export` and writes codes and scales; the replica then generates the
tokens of transformers' model run on the dequantised weights."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import save_file

import weightsync as ws
from fp8_reference import reference_quantize
from servers import serve_replicas
from weightsync.layout.quant import is_quantized_hf_name
from weightsync.testing.presets import preset_config, random_model
from weightsync.testing.reference import greedy_tokens

pytestmark = pytest.mark.slow

BLOCK = 128
CONFIG = preset_config("tiny-deepseek")
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK] * 2}
PROMPT = (3, 14, 15, 92, 65)


def _quantised(model, *, dequantise: bool) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint of `model`; with `dequantise`, `model` then holds its values."""
    out = {}
    with torch.no_grad():
        for name, tensor in ws.ModelExport(model):
            if not is_quantized_hf_name(name):
                out[name] = tensor.detach().clone().contiguous()
                continue
            codes, scales = reference_quantize(tensor, BLOCK)
            out[name], out[name + "_scale_inv"] = codes, scales
            if dequantise:
                expanded = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                tensor.copy_(codes.float() * expanded[: tensor.shape[0], : tensor.shape[1]])
    return out


def _sharpened(seed: int):
    model = random_model(CONFIG, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(4.0)
    return model


def test_fp8_replica_is_fed_by_a_float32_trainer(tmp_path) -> None:
    checkpoint = tmp_path / "fp8"
    checkpoint.mkdir()
    config = {**CONFIG, "quantization_config": FP8, "dtype": "float32"}
    (checkpoint / "config.json").write_text(json.dumps(config))
    save_file(_quantised(_sharpened(1), dequantise=False), str(checkpoint / "model.safetensors"))
    trainer = _sharpened(2)
    with serve_replicas(checkpoint, num_replicas=1, tp=2, ep=2, dtype="fp32", log_dir=tmp_path) as (
        replicas
    ):
        url = replicas[0].url
        info = httpx.get(f"{url}/server_info", timeout=30).json()
        assert (info["quantization"], info["weight_block_size"]) == ("fp8", [BLOCK, BLOCK])
        # The trainer syncs an MLA model only into replicas that re-derive w_kc / w_vc.
        assert "post_load_at_update_end" in info["weightsync"]["capabilities"]
        sync_config = ws.SyncConfig(
            sender=ws.SenderConfig(bucket_bytes=4 << 20),
            transport=ws.MooncakeConfig(protocol="tcp", timeout_s=10),
        )
        with ws.TrainerSync(sync_config, hf_config=CONFIG, replicas=[url]) as sync:
            report = sync.sync(ws.ModelExport(trainer))
        reply = httpx.post(
            f"{url}/generate",
            json={"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 6}},
            timeout=60,
        ).json()
    # Codes (1 byte) and block scales, not float32 weights, went over the wire.
    assert report.bytes_written < 0.4 * 4 * sum(p.numel() for p in trainer.parameters())
    _quantised(trainer, dequantise=True)
    assert reply["output_ids"] == greedy_tokens(trainer, torch.float32, (PROMPT,), 6)[0]
