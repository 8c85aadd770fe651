"""weightsync as verl 0.9.1's checkpoint-engine backend, on stock verl and on verl with
weightsync's patch (real verl + Ray 2.60 on 127.0.0.1, from the venv scripts/setup-verl
builds; real `weightsync serve` replicas; real Mooncake TCP writes).

verl's ``CheckpointEngineManager``, ``CheckpointEngineWorker``s and ``ActorRolloutRefWorker``
run unmodified (tests/verl_host/standins.py says exactly what stands in for the training
engine and for SGLang); the scenario (tests/verl_host/scenario.py) raises on any check, and
these tests check what it reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import serve_replicas
from verl_host.cluster import HERE, RayCluster, start_ray, venv_if_built, verl_env

pytestmark = [pytest.mark.slow, pytest.mark.verl]


@pytest.fixture(scope="module")
def verl_venv() -> Path:
    venv = venv_if_built()
    if venv is None:
        pytest.skip("verl's venv is not built here: run scripts/setup --tests")
    return venv


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3 in float32 (the replicas compute in it, as the trainer does)."""
    import torch

    from weightsync.testing.presets import preset_config, write_random_checkpoint

    path = tmp_path_factory.mktemp("verl-qwen3")
    return write_random_checkpoint(path, preset_config("tiny"), dtype=torch.float32, seed=3)


@pytest.fixture(scope="module")
def ray_cluster(verl_venv) -> Iterator[RayCluster]:
    """One Ray head node on 127.0.0.1 for every scenario of this module."""
    cluster = start_ray(verl_venv)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def replica_sets(ray_cluster, checkpoint, tmp_path_factory) -> Iterator[dict]:
    """Three fresh `weightsync serve` replicas per scenario, all started at once while the
    Ray head node comes up."""
    logs = tmp_path_factory.mktemp("verl-replicas")
    with serve_replicas(checkpoint, num_replicas=6, log_dir=logs) as replicas:
        ray_cluster.wait_ready()
        yield {"stock": replicas[:3], "patched": replicas[3:]}


def run_in_verl(
    venv: Path,
    args: list[str],
    *,
    patched: bool,
    timeout_s: float,
    cluster: RayCluster | None = None,
) -> str:
    env = verl_env(venv, patched=patched)
    if cluster is not None:
        env.update(cluster.env)
    done = subprocess.run(
        [str(venv / "bin" / "python"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def scenario(
    venv: Path,
    cluster: RayCluster,
    replicas: list,
    checkpoint: Path,
    tmp_path: Path,
    *,
    patched: bool,
) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    args = [str(HERE / "scenario.py"), "--ray-address", cluster.address]
    args += ["--checkpoint", str(checkpoint), "--out", str(out)]
    for r in replicas:
        args += ["--replica", f"{r.url},{r.bootstrap_port}"]
    if patched:
        args.append("--patched")
    t0 = time.perf_counter()
    log = run_in_verl(venv, args, patched=patched, timeout_s=400, cluster=cluster)
    result = json.loads(out.read_text())
    result["timings"]["subprocess"] = round(time.perf_counter() - t0, 3)
    # Shown when a test fails: what the scenario saw.
    print(json.dumps(result, default=str)[:8000], file=sys.stderr)
    return result, log


def test_stock_verl_drives_weightsync(
    verl_venv, ray_cluster, replica_sets, checkpoint, tmp_path
) -> None:
    result, log = scenario(
        verl_venv, ray_cluster, replica_sets["stock"], checkpoint, tmp_path, patched=False
    )
    assert "site-packages/verl/" in result["verl_base"]
    assert result["backend_class"].endswith("integrations.verl.backend.WeightsyncCheckpointEngine")
    updates = result["updates"]
    assert sorted(updates) == ["1", "2", "3"]
    assert updates["1"]["metrics"]["weightsync/bit_exact"] == 1.0
    assert all(u["tokens_equal"] for u in updates.values())
    assert [u["metrics"]["weightsync/num_replicas"] for u in updates.values()] == [2.0, 3.0, 2.0]
    assert result["removed_replica_version"] == "2"
    assert result["mode_patched_hook"] == 0.0
    assert "stock verl mode" in log
    # Stock verl hands every actor rank the whole model.
    assert {e["pp_local"] for e in result["exports"]} == {False}
    assert len({e["num_tensors"] for e in result["exports"]}) == 1


def test_patched_verl_runs_the_p2p_lifecycle(
    verl_venv, ray_cluster, replica_sets, checkpoint, tmp_path
) -> None:
    result, log = scenario(
        verl_venv, ray_cluster, replica_sets["patched"], checkpoint, tmp_path, patched=True
    )
    assert "verl-patched/verl/" in result["verl_base"]
    updates = result["updates"]
    assert sorted(updates) == ["1", "2", "3", "5"]
    assert updates["1"]["metrics"]["weightsync/bit_exact"] == 1.0
    assert result["mode_patched_hook"] == 1.0
    assert "patched verl mode" in log
    assert result["removed_replica_version"] == "2"
    # Each actor rank exported only its pipeline stage, and the stages make the model.
    exports = result["exports"]
    assert {e["pp_local"] for e in exports} == {True}
    assert len(exports) == 2 and all(e["num_tensors"] > 0 for e in exports)
    # The sender failure reached the trainer, every session ended, and a replica written to
    # part-way stays paused with its weights marked incomplete (it refuses to generate).
    assert "injected sender failure" in result["failure"]["message"]
    assert "paused, weights incomplete" in result["after_failure"].values()
    assert "incomplete" in result["generate_after_failure"]
    assert "stay paused" in log
    assert updates["5"]["tokens_equal"]


def test_weightsync_verl_installs_beside_verls_requirements(verl_venv) -> None:
    """setup-verl resolved ``pip install -e .[verl,mooncake]`` against the pinned verl set
    with nothing fetched; the set stays consistent."""
    check = (verl_venv / "pip-check.txt").read_text()
    assert "No broken requirements found." in check, check
    done = subprocess.run(
        [str(verl_venv / "bin" / "python"), "-m", "pip", "check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "No broken requirements found." in done.stdout, done.stdout


def test_backend_registration_options_and_patch(verl_venv, tmp_path) -> None:
    out = run_in_verl(
        verl_venv, [str(HERE / "checks.py"), str(tmp_path)], patched=False, timeout_s=180
    )
    report = json.loads(out.strip().splitlines()[-1])
    failed = {name: why for name, why in report.items() if why != "ok"}
    assert not failed, failed
