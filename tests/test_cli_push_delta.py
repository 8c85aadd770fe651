"""`weightsync push NEW --delta-from BASE`: the delta between two checkpoints, written only
into replicas that prove they serve BASE.

Real processes throughout: `weightsync serve` replicas (tp 2 and tp 1) with a delta region,
and the command line in a subprocess. After each push the test reads every rank's checksum of
every parameter from the replicas and compares it with the checkpoint it must now hold, as
the replica lays it out (`shard_state_dict`), and checks greedy generation against the
checkpoint's model; a refused push must leave every byte as it was and the replicas serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from servers import laid_out_checksums, serve_replicas, served_checksums
from weightsync.cli.main import app
from weightsync.testing.presets import preset_config, write_random_checkpoint
from weightsync.testing.reference import greedy_tokens, served_tokens

TINY = preset_config("tiny")
API_KEY = "push-delta-key"
PROMPTS = ((1, 17, 42, 7), (600, 2, 31, 99, 5))
NEW_TOKENS = 4
CHANGED = 0.02  # the share of elements the fine-tune step changes


def _push(*args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WEIGHTSYNC_API_KEY": API_KEY, "MC_LOG_LEVEL": "ERROR"}
    return subprocess.run(
        [sys.executable, "-m", "weightsync", "push", *map(str, args), "--transport", "tcp"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _json(done: subprocess.CompletedProcess) -> dict:
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    return json.loads(lines[-1])


def _derived(base: Path, path: Path, change) -> Path:
    """A checkpoint at `path`: `base`'s config, and its tensors as ``change(name, tensor)``
    returns them."""
    path.mkdir()
    shutil.copy(base / "config.json", path / "config.json")
    tensors = {name: change(name, t) for name, t in load_file(base / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    base = write_random_checkpoint(root / "base", TINY, seed=11)
    generator = torch.Generator().manual_seed(5)

    def fine_tune(name: str, tensor: torch.Tensor) -> torch.Tensor:
        # A step that moves a few elements by far more than a bf16 rounding.
        picked = torch.rand(tensor.shape, generator=generator) < CHANGED
        return torch.where(picked, tensor + 0.5, tensor)

    def one_element(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "model.layers.1.mlp.down_proj.weight":
            tensor[3, 5] += 1.0
        return tensor

    def longer_norm(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return torch.ones(tensor.numel() + 1) if name == "model.norm.weight" else tensor

    return {
        "base": base,
        "new": _derived(base, root / "new", fine_tune),
        "other": _derived(base, root / "other", one_element),
        "other_shape": _derived(base, root / "other_shape", longer_norm),
    }


def _state(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model.safetensors")


def _assert_serves(checkpoint: Path, replicas) -> None:
    """Every byte of every rank is `checkpoint`'s, and greedy generation is its model's (so
    the replicas also serve: none is left paused)."""
    for replica in replicas:
        assert served_checksums(replica.url, API_KEY) == laid_out_checksums(
            _state(checkpoint), TINY, replica.tp
        ), replica.url
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    expected = greedy_tokens(model, torch.bfloat16, PROMPTS, NEW_TOKENS)
    served = asyncio.run(
        served_tokens(
            [r.url for r in replicas],
            PROMPTS,
            max_new_tokens=NEW_TOKENS,
            api_key=API_KEY,
            timeout_s=30.0,
        )
    )
    for url, tokens in served.items():
        assert tokens == expected, url


@pytest.mark.slow
def test_a_delta_between_checkpoints_lands_only_on_replicas_that_serve_the_base(
    checkpoints, tmp_path
) -> None:
    base, new, other = checkpoints["base"], checkpoints["new"], checkpoints["other"]
    with (
        serve_replicas(
            base, tp=2, dtype="bf16", api_key=API_KEY, log_dir=tmp_path / "a", delta_region_mb=4
        ) as (a,),
        serve_replicas(
            other, tp=1, dtype="bf16", api_key=API_KEY, log_dir=tmp_path / "b", delta_region_mb=4
        ) as (b,),
    ):
        # b serves a checkpoint one element away from the base: the push is refused before
        # any write, on both replicas, and both serve on what they held.
        refused = _push(new, "--delta-from", base, "--replica", a.url, "--replica", b.url)
        assert refused.returncode == 1, refused.stderr
        assert "push failed" in refused.stderr and b.url in refused.stderr
        assert "'model.layers.1.mlp.down_proj.weight'" in refused.stderr
        assert a.url not in refused.stderr.split("cannot take one")[1]
        _assert_serves(base, [a])
        _assert_serves(other, [b])

        # A full push makes b serve the base; a serves it as it loaded it from the file.
        full = _json(_push(base, "--replica", b.url, "--json"))
        assert full["ok"] and full["mode"] == "full" and full["full_bytes"] == full["bytes"]

        done = _push(new, "--delta-from", base, "--replica", a.url, "--replica", b.url, "--json")
        assert done.returncode == 0, done.stderr
        result = _json(done)
        assert result["ok"] is True and result["mode"] == "delta"
        assert set(result["verified"]) == {a.url, b.url}
        assert result["bytes"] == sum(w["bytes"] for w in result["writes"].values())
        assert result["bytes"] < result["full_bytes"] / 4
        for url, write in result["writes"].items():
            assert write["mode"] == "delta", url
            assert 0 < write["bytes"] < write["full_bytes"] / 4, url
            # bf16 rounds a few of the changed float32 elements back to their old value.
            assert CHANGED / 2 < write["density"] < CHANGED * 1.5, url
        _assert_serves(new, [a, b])

        # With --full-fallback a replica that does not hold the base (a serves the new
        # checkpoint now) takes every byte instead of refusing.
        fallback = _json(
            _push(new, "--delta-from", base, "--full-fallback", "--replica", a.url, "--json")
        )
        assert fallback["ok"] is True and fallback["mode"] == "full"
        assert "not its verified base" in fallback["writes"][a.url]["why_full"]
        assert fallback["writes"][a.url]["bytes"] == fallback["writes"][a.url]["full_bytes"]
        _assert_serves(new, [a])


def _push_here(*args: str | Path):
    """`weightsync push ARGS` in this process, for input refused before any replica is
    contacted (the pushes above run the command in a process of its own)."""
    env = {"WEIGHTSYNC_API_KEY": API_KEY, "MC_LOG_LEVEL": "ERROR", "COLUMNS": "500"}
    args = (*map(str, args), "--transport", "tcp")
    return CliRunner().invoke(app, ["push", *args], env=env)


def test_checkpoints_that_differ_exit_2_before_any_replica_is_contacted(checkpoints) -> None:
    unreachable = "http://127.0.0.1:1"
    new, other_shape = checkpoints["new"], checkpoints["other_shape"]
    shaped = _push_here(new, "--delta-from", other_shape, "--replica", unreachable)
    assert shaped.exit_code == 2, shaped.stderr
    assert "'model.norm.weight'" in shaped.stderr and "[64]" in shaped.stderr
    assert unreachable not in shaped.stderr
    empty = _push_here(new, "--delta-from", new.parent, "--replica", unreachable)
    assert empty.exit_code == 2 and "no *.safetensors files" in empty.stderr
    fallback = _push_here(new, "--full-fallback", "--replica", unreachable)
    assert fallback.exit_code == 2 and "--full-fallback is for a push with --delta-from" in (
        fallback.stderr
    )
    checked = _push_here(
        new, "--delta-from", checkpoints["base"], "--check-weight-update-equal",
        "--replica", unreachable,
    )  # fmt: skip
    assert checked.exit_code == 2 and "cannot be combined with --delta-from" in checked.stderr
