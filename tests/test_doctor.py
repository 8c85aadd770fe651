"""`weightsync doctor` against real replicas: healthy, wrong key, a rank missing, stopped, a
memory saver on, and real SGLang."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import aiohttp
import httpx
import pytest
from fastapi import FastAPI, Request, Response
from typer.testing import CliRunner

from servers import app_in_thread, start_replicas
from weightsync.cli.doctor_checks import (
    FAIL,
    HOST,
    HOST_CHECKS,
    OK,
    REPLICA_CHECKS,
    DoctorOptions,
    run_checks,
)
from weightsync.cli.main import app
from weightsync.testing.presets import preset_config, write_random_checkpoint

pytestmark = pytest.mark.slow
API_KEY = "doctor-test-key"


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """One reference replica at tp 2 with an API key."""
    root = tmp_path_factory.mktemp("doctor")
    checkpoint = write_random_checkpoint(root / "ckpt", preset_config("tiny"), seed=3)
    (served,) = start_replicas(checkpoint, tp=2, api_key=API_KEY, log_dir=root / "logs")
    try:
        yield served
    finally:
        served.stop()


def _rows(url: str, **options) -> dict[str, dict]:
    rows = run_checks(DoctorOptions(replicas=(url,), transport="tcp", timeout_s=10, **options))
    return {row.name: row.to_dict() for row in rows if row.subject == url}


def _fronted(replica_url: str, *, server_info: dict) -> FastAPI:
    """A real HTTP server in front of a real replica that forwards every call and changes
    what ``/server_info`` says by `server_info` (what a differently started server reports)."""
    app = FastAPI()

    @app.api_route("/{route:path}", methods=["GET", "POST"])
    async def forward(route: str, request: Request) -> Response:
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method,
                f"{replica_url}/{route}",
                params=dict(request.query_params),
                data=await request.body(),
                headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
            ) as reply,
        ):
            body = await reply.read()
            if route == "server_info" and reply.status == 200:
                body = json.dumps({**json.loads(body), **server_info}).encode()
            return Response(body, status_code=reply.status, media_type="application/json")

    return app


def test_a_healthy_replica_passes_every_check_and_the_command_exits_0(replica):
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync", "doctor", "--replica", replica.url,
         "--transport", "tcp", "--json"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "WEIGHTSYNC_API_KEY": API_KEY},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["ok"] is True
    checks = {(c["subject"], c["name"]): c for c in report["checks"]}
    assert all(c["status"] == OK for c in checks.values()), checks
    assert [name for subject, name in checks if subject == replica.url] == list(REPLICA_CHECKS)
    assert [name for subject, name in checks if subject == HOST] == list(HOST_CHECKS)
    assert "weightsync" in checks[(replica.url, "protocol")]["detail"]
    assert "2 rank(s)" in checks[(replica.url, "bootstrap info")]["detail"]
    assert "read them back intact" in checks[(replica.url, "transfer")]["detail"]
    assert "--delta-region-mb" in checks[(replica.url, "delta syncs")]["detail"]
    # Mooncake's own start-up lines stay out of the output.
    assert "transfer_metadata.cpp" not in proc.stderr
    assert "InitGoogleLogging" not in proc.stderr
    # The test writes touched no weight: the replica still serves, its weights complete.
    assert httpx.get(f"{replica.url}/ready", timeout=30).status_code == 200
    info = httpx.get(
        f"{replica.url}/server_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    ).json()
    assert info["weightsync"]["weights"]["complete"] is True, info["weightsync"]


def test_a_wrong_api_key_fails_auth_and_the_command_exits_1(replica):
    rows = _rows(replica.url, api_key="not-the-key")
    assert rows["reachable"]["status"] == OK
    assert rows["auth"]["status"] == FAIL and "--api-key" in rows["auth"]["fix"]
    assert "transfer" not in rows
    result = CliRunner().invoke(
        app, ["doctor", "--replica", replica.url, "--transport", "tcp"],
        env={"WEIGHTSYNC_API_KEY": "not-the-key"},
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "✗" in result.output and "auth" in result.output


def test_a_replica_whose_bootstrap_info_lacks_a_rank_fails(replica):
    # /server_info says three ranks; the replica behind it published two.
    with app_in_thread(_fronted(replica.url, server_info={"tp_size": 3})) as url:
        rows = _rows(url, api_key=API_KEY)
    assert rows["bootstrap info"]["status"] == FAIL
    assert "rank(s) [2] of 3" in rows["bootstrap info"]["detail"]
    assert "transfer" not in rows


def test_a_memory_saver_fails_with_the_flag_to_change(replica):
    with app_in_thread(_fronted(replica.url, server_info={"enable_memory_saver": True})) as url:
        rows = _rows(url, api_key=API_KEY)
    row = rows["weights stay in place"]
    assert row["status"] == FAIL
    assert "enable_memory_saver" in row["detail"] and "--enable-memory-saver" in row["fix"]


@pytest.mark.skipif(
    os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband")),
    reason="this host has RDMA devices",
)
def test_rdma_asked_for_on_a_host_without_rdma_fails_with_what_to_do():
    rows = {row.name: row for row in run_checks(DoctorOptions(transport="rdma"))}
    assert rows["transfer engine"].status == FAIL and "--transport" in rows["transfer engine"].fix
    assert rows["rdma devices"].status == FAIL and "--transport tcp" in rows["rdma devices"].fix
    assert rows["mooncake"].status == OK


@pytest.mark.parametrize(
    ("args", "named"),
    [(["--transport", "infiniband"], "--transport"), (["--replica", "host:30000"], "http://")],
)
def test_bad_options_are_usage_errors(args, named):
    result = CliRunner().invoke(app, ["doctor", *args])
    assert result.exit_code == 2 and named in result.output, result.output


@pytest.mark.sglang
def test_doctor_on_real_sglang(sglang_servers):
    from conftest import SGLANG_API_KEY

    url = sglang_servers[0].url
    rows = _rows(url, api_key=SGLANG_API_KEY)
    assert all(row["status"] == OK for row in rows.values()), rows
    assert rows["protocol"]["detail"].startswith("SGLang 0.5.23")
    assert "derived from /server_info" in rows["parallelism"]["detail"]
    assert "accept connections" in rows["transfer"]["detail"]
    # Started without the delta loader: full bytes, and the flag that takes deltas.
    assert "--custom-weight-loader" in rows["delta syncs"]["detail"]
    assert _rows(url, api_key="wrong")["auth"]["status"] == FAIL


def test_a_stopped_replica_is_unreachable(replica):
    # Last of the file: it stops the module's replica.
    replica.stop()
    rows = _rows(replica.url, api_key=API_KEY)
    assert rows["reachable"]["status"] == FAIL
    assert "start the replica" in rows["reachable"]["fix"]
    assert set(rows) == {"reachable"}
