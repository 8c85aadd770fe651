"""The conformance suite: one set of checks of the protocol as SGLang 0.5.23 serves it, run
against the reference server and against real SGLang (tests/test_conformance.py).

Each check takes a `Endpoint` (where the server listens, its key, which kind it is) and
asserts what both servers must answer alike: routes, fields, status codes and bodies. Where
they differ on purpose (the routes only the reference server serves), the check says so by
kind.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from weightsync.checkpoint import load_config_dict
from weightsync.layout import ParallelismConfig, rank_layout

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
GENERATE = {"input_ids": [1, 17, 42, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


class Reply(NamedTuple):
    """One reply: status, the JSON body (or the text when it is not JSON), headers."""

    status: int
    body: Any
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """A server under test.

    Attributes:
        kind: ``"reference"`` or ``"sglang"``.
        url: the main server.
        bootstrap_url: the engine-info bootstrap server.
        api_key: the key the server was started with.
        tp: its tensor-parallel size.
        checkpoint: the HF checkpoint it serves.
    """

    kind: str
    url: str
    bootstrap_url: str
    api_key: str
    tp: int
    checkpoint: Path

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        base: str | None = None,
        auth: bool = True,
        timeout: float = 60.0,
    ) -> Reply:
        """One request; any status comes back as a `Reply`. No body unless `body` is given."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if auth:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            (base or self.url) + path, data=data, headers=headers, method=method
        )
        try:
            with _OPENER.open(request, timeout=timeout) as reply:
                status, raw = reply.status, reply.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        text = raw.decode(errors="replace")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        return Reply(status, parsed, text)

    def get(self, path: str, **kwargs: Any) -> Reply:
        """``GET path``."""
        return self.request("GET", path, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Reply:
        """``POST path`` with a JSON `body`."""
        return self.request("POST", path, body, **kwargs)


def check_server_info_and_auth(server: Endpoint) -> None:
    info = server.get("/server_info")
    assert info.status == 200 and isinstance(info.body, dict)
    assert info.body["tp_size"] == server.tp and isinstance(info.body["version"], str)
    assert (info.body.get("weightsync") is not None) == (server.kind == "reference")
    for key in ("enable_memory_saver", "dp_size", "enable_dp_attention", "ep_size", "pp_size"):
        assert key in info.body, key
    # Every route but /health and /ready needs the key, reads included.
    for path in ("/server_info", "/model_info", "/remote_instance_transfer_engine_info?rank=0"):
        assert server.get(path, auth=False).status == 401, path
    assert server.get("/health", auth=False).status == 200
    model = server.get("/model_info")
    assert model.status == 200 and isinstance(model.body["weight_version"], str)


def check_transfer_engine_info(server: Endpoint) -> None:
    config = load_config_dict(server.checkpoint)
    for rank in range(server.tp):
        main = server.get(f"/remote_instance_transfer_engine_info?rank={rank}")
        boot = server.get(f"/get_transfer_engine_info?rank={rank}", base=server.bootstrap_url)
        assert main.status == boot.status == 200
        # SGLang's fields agree; the main server may add its own (registered_regions).
        fields = ("rank", "remote_instance_transfer_engine_info")
        assert {k: main.body[k] for k in fields} == {k: boot.body[k] for k in fields}
        assert main.body["rank"] == rank
        session_id, weights_info = main.body["remote_instance_transfer_engine_info"]
        assert session_id.startswith("127.0.0.1:")
        layout = rank_layout(config, ParallelismConfig(tp_size=server.tp, tp_rank=rank))
        assert set(weights_info) == set(layout)
        for name, (ptr, numel, element_size) in weights_info.items():
            assert ptr > 0 and numel == layout[name].numel
            assert element_size == layout[name].element_size, name
    beyond = server.get(f"/remote_instance_transfer_engine_info?rank={server.tp}")
    assert beyond.status == 400 and "rank" in beyond.body["error"]["message"]
    missing = server.get(f"/get_transfer_engine_info?rank={server.tp}", base=server.bootstrap_url)
    assert missing.status == 404
    assert missing.body == {"detail": f"No transfer engine info for rank {server.tp}"}
    assert server.get("/health", base=server.bootstrap_url).text == "OK"


def check_parallelism_as_the_client_learns_it(server: Endpoint) -> None:
    from weightsync.control import RolloutClient
    from weightsync.manager import ControlConfig, SyncManager

    served = server.get("/parallelism_config?rank=0")
    # The Miles route: the reference server serves it, SGLang as released does not.
    assert served.status == (200 if server.kind == "reference" else 404)

    async def targets():
        async with SyncManager([server.url], ControlConfig(api_key=server.api_key)) as manager:
            found = await manager.targets()
            return found, manager.protocols[server.url]

    found, protocol = asyncio.run(targets())
    assert protocol.kind == ("weightsync" if server.kind == "reference" else "sglang")
    assert [t.parallelism for t in found] == [
        ParallelismConfig(tp_size=server.tp, tp_rank=rank) for rank in range(server.tp)
    ]

    async def version():
        async with RolloutClient(server.url, api_key=server.api_key) as client:
            return await client.served_weight_version()

    assert asyncio.run(version()) == server.get("/model_info").body["weight_version"]


def check_generate(server: Endpoint) -> None:
    reply = server.post("/generate", GENERATE)
    assert reply.status == 200, reply.text
    assert len(reply.body["output_ids"]) == 4
    assert isinstance(reply.body["meta_info"]["weight_version"], str)


def check_update_lifecycle(server: Endpoint) -> None:
    paused = server.post("/pause_generation", {"mode": "abort"})
    assert paused.status == 200 and paused.body["status"] == "ok"
    assert server.post("/release_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    try:
        begun = server.post("/begin_weight_update", {"selector": "target"})
        assert begun.status == 200 and begun.body["success"] is True
        again = server.post("/begin_weight_update", {"selector": "target"})
        assert again.status == 400 and again.body["success"] is False
        assert "already open" in again.body["message"]
        label = server.post(
            "/update_weight_version", {"new_version": "c1", "abort_all_requests": False}
        )
        assert label.status == 200, label.text
        assert label.body["success"] is True and label.body["new_version"] == "c1"
        assert server.post("/end_weight_update").status == 400  # SGLang needs a JSON body
        ended = server.post("/end_weight_update", {})
        assert ended.status == 200 and ended.body["success"] is True
        after = server.post("/end_weight_update", {})
        assert after.status == 400 and after.body["success"] is False
    finally:
        server.post("/end_weight_update", {})
        assert server.post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status == 200
        assert server.post("/flush_cache").status == 200
        continued = server.post("/continue_generation", {"torch_empty_cache": False})
        assert continued.status == 200 and continued.body["status"] == "ok"
    assert server.get("/model_info").body["weight_version"] == "c1"
    reply = server.post("/generate", GENERATE)
    assert reply.status == 200 and reply.body["meta_info"]["weight_version"] == "c1"


def _checksums(server: Endpoint) -> list[dict]:
    reply = server.post("/weights_checker", {"action": "checksum"})
    assert reply.status == 200 and reply.body["success"] is True, reply.text
    ranks = reply.body["ranks"]
    assert len(ranks) == server.tp
    return [rank["checksums"] for rank in ranks]


def check_weights_checker_and_push(server: Endpoint, tmp_path: Path) -> None:
    # Whatever an earlier test synced, the checkpoint's bytes first.
    _push_checkpoint(server)
    before = _checksums(server)
    assert server.post("/weights_checker", {"action": "snapshot"}).body["success"] is True
    # Randomising a serving replica's weights is for a paused one (the reference refuses
    # it while serving).
    assert server.post("/pause_generation", {}).status == 200
    assert server.post("/weights_checker", {"action": "reset_tensors"}).body["success"] is True
    assert _checksums(server) != before
    differs = server.post("/weights_checker", {"action": "compare"})
    assert differs.status == 400 and differs.body["success"] is False
    assert server.post("/weights_checker", {"action": "nope"}).status == 400
    # `weightsync push` of the checkpoint restores every byte.
    result = _push_checkpoint(server)
    assert result["bytes"] > 0 and result["version"] is not None
    after = _checksums(server)
    differing = [
        (rank, name)
        for rank, sums in enumerate(after)
        for name in sums
        if sums[name] != before[rank].get(name)
    ]
    assert not differing, differing
    assert server.get("/model_info").body["weight_version"] == result["version"]
    assert server.get("/health").status == 200  # the push resumed it


def _push_checkpoint(server: Endpoint) -> dict:
    done = subprocess.run(
        [
            sys.executable, "-m", "weightsync", "push", str(server.checkpoint),
            "--replica", server.url, "--transport", "tcp", "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**_environ(), "WEIGHTSYNC_API_KEY": server.api_key},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["replicas"] == [server.url]
    return result


def _environ() -> dict[str, str]:
    import os

    return {**os.environ, "MC_LOG_LEVEL": "ERROR"}


CHECKS = (
    check_server_info_and_auth,
    check_transfer_engine_info,
    check_parallelism_as_the_client_learns_it,
    check_generate,
    check_update_lifecycle,
)
