"""`ServeConfig` and `weightsync serve` options for GPUs: the transport, the first GPU, and
what the CLI refuses before a replica starts; the baseline's backend choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from weightsync.baseline import BroadcastConfig
from weightsync.cli.main import app
from weightsync.server.config import ServeConfig
from weightsync.server.ranks.runtime import rank_transport
from weightsync.testing.presets import preset_config
from weightsync.transport import MooncakeTransport


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(preset_config("tiny")))
    return folder


def test_gpu_of_each_rank_starts_at_base_gpu_id():
    config = ServeConfig(model_path="m", tp_size=2, device="cuda", base_gpu_id=3)
    assert [config.gpu_id(rank) for rank in range(2)] == [3, 4]
    assert ServeConfig(**config.to_dict()) == config
    assert ServeConfig(model_path="m", device="cuda").gpu_id(1) == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"transport": "cuda_ipc"}, "transport cuda_ipc writes GPU memory; it needs device cuda"),
        ({"transport": "nvlink"}, "transport must be one of mooncake, cuda_ipc"),
        ({"device": "cuda", "base_gpu_id": -1}, "base_gpu_id must be a non-negative int"),
        ({"base_gpu_id": 1}, "base_gpu_id picks GPUs; it needs device cuda"),
    ],
)
def test_bad_gpu_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(model_path="m", **fields)


def test_cuda_ipc_with_cuda_is_accepted():
    config = ServeConfig(model_path="m", device="cuda", transport="cuda_ipc", base_gpu_id=1)
    assert config.transport == "cuda_ipc" and config.gpu_id(0) == 1


def test_mooncake_transport_for_a_cpu_rank():
    config = ServeConfig(model_path="m")
    transport = rank_transport(config, torch.device("cpu"))
    try:
        assert isinstance(transport, MooncakeTransport)
        assert transport.capabilities.reads("cpu")
    finally:
        transport.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without GPUs")
def test_mooncake_without_cuda_refuses_gpu_memory():
    config = ServeConfig(model_path="m", device="cuda")
    with pytest.raises(ValueError, match="--transport cuda_ipc"):
        rank_transport(config, torch.device("cuda", 0))


def test_cli_refuses_gpu_options_it_cannot_serve(model_dir):
    runner = CliRunner()
    serve = ["serve", "--model", str(model_dir), "--port", "0", "--bootstrap-port", "0"]
    result = runner.invoke(app, [*serve, "--transport", "cuda_ipc"])
    assert result.exit_code == 2
    assert "transport cuda_ipc writes GPU memory; it needs device cuda" in result.output
    result = runner.invoke(app, [*serve, "--base-gpu-id", "1"])
    assert result.exit_code == 2 and "base_gpu_id picks GPUs" in result.output
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args = ["--device", "cuda", "--transport", "cuda_ipc", "--base-gpu-id", str(visible)]
    result = runner.invoke(app, [*serve, *args])
    assert result.exit_code == 2
    assert f"needs {visible + 1} visible GPUs, found {visible}" in result.output
    help_text = runner.invoke(app, ["serve", "--help"]).output
    assert "--base-gpu-id" in help_text and "cuda_ipc" in help_text


def test_baseline_backend_follows_the_trainer_tensors():
    auto = BroadcastConfig()
    assert auto.backend == "auto"
    assert auto.backend_for(torch.device("cpu")) == "gloo"
    assert auto.backend_for(torch.device("cuda", 0)) == "nccl"
    assert BroadcastConfig(backend="gloo").backend_for(torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError, match="backend must be one of"):
        BroadcastConfig(backend="mpi")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_connections": 0}, "max_connections must be a positive int"),
        ({"unauthenticated_timeout_s": 0}, "unauthenticated_timeout_s must be a positive"),
        ({"unauthenticated_timeout_s": float("inf")}, "unauthenticated_timeout_s must be"),
    ],
)
def test_connection_limits_are_positive(fields, message):
    from weightsync.server.connections import ConnectionLimits

    with pytest.raises(ValueError, match=message):
        ServeConfig(model_path="m", **fields)
    with pytest.raises(ValueError, match=message):
        ConnectionLimits(**fields)
