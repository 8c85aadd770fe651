"""Where a replica listens and who may read its addresses, on a real tp=2 replica: every
listening socket of its processes is on 127.0.0.1 but Mooncake's (which listens on every
interface and says so in the log), the API key is in no command line, and the bootstrap
server's reads need the key too. `weightsync serve --api-key-file` and its refusals."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import struct
from pathlib import Path

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from servers import serve_replicas
from weightsync.cli.main import app
from weightsync.control import BootstrapClient
from weightsync.errors import RemoteReplicaError
from weightsync.testing.presets import preset_config, write_random_checkpoint

pytestmark = pytest.mark.faults

API_KEY = "dataplane-key-3f9c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TP = 2
_MOONCAKE_WARNING = re.compile(
    r"tp(\d) weightsync\.transport\.mooncake\.engine: Mooncake TransferEngine listens on every "
    r"interface, not only 127\.0\.0\.1: ([^ ]+(?:, [^ ]+)*)\. Mooncake"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"))


@pytest.fixture(scope="module")
def replica(checkpoint, tmp_path_factory):
    with serve_replicas(
        checkpoint, tp=TP, api_key=API_KEY, log_dir=tmp_path_factory.mktemp("logs")
    ) as (served,):
        yield served


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    return inodes


def _address(hex_address: str) -> str:
    # The kernel prints each 32-bit word of the address in host order.
    words = [int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8)]
    packed = b"".join(struct.pack("=I", word) for word in words)
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, packed)


def _listeners(pid: int) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process `pid` listens on."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add((_address(address), int(port, 16)))
    return found


def _mooncake_ports(log: str) -> dict[int, set[int]]:
    """The ports each rank's Mooncake warning names, by tp rank."""
    ports: dict[int, set[int]] = {}
    for match in _MOONCAKE_WARNING.finditer(log):
        named = {int(entry.rsplit(":", 1)[1]) for entry in match.group(2).split(", ")}
        ports.setdefault(int(match.group(1)), set()).update(named)
    return ports


def test_every_listener_is_on_loopback_but_mooncakes(replica):
    processes = _tree(replica.process.pid)
    assert len(processes) == TP
    listeners = {p.pid: _listeners(p.pid) for p in processes}
    rank0 = listeners[replica.process.pid]
    follower = next(p for p in processes if p.pid != replica.process.pid)
    store_port = int(follower.cmdline()[follower.cmdline().index("--store-port") + 1])
    # Both HTTP servers and the TP group's rendezvous store, on loopback.
    for port in (replica.port, replica.bootstrap_port, store_port):
        assert ("127.0.0.1", port) in rank0, (port, rank0)

    # Mooncake binds 0.0.0.0 and [::] whatever it is told; each rank names its two ports.
    mooncake = _mooncake_ports(replica.log_path.read_text())
    assert sorted(mooncake) == list(range(TP)), replica.log_tail()
    assert all(len(ports) == 2 for ports in mooncake.values()), mooncake
    sessions = []
    for rank in range(TP):
        info = httpx.get(
            f"{replica.bootstrap_url}/get_transfer_engine_info?rank={rank}", headers=AUTH
        ).json()
        sessions.append(int(info["remote_instance_transfer_engine_info"][0].rsplit(":", 1)[1]))
    for rank, session_port in enumerate(sessions):
        assert session_port in mooncake[rank], (rank, session_port, mooncake)

    allowed = set().union(*mooncake.values())
    for pid, found in listeners.items():
        for address, port in found:
            if address != "127.0.0.1":
                assert port in allowed, f"pid {pid} listens on {address}:{port}"
                assert address in ("0.0.0.0", "::")
    # Every Mooncake port the warning names is really open, and nothing else is wide.
    wide = {
        port for found in listeners.values() for address, port in found if address != "127.0.0.1"
    }
    assert wide == allowed


def test_the_api_key_is_in_no_command_line(replica):
    for process in _tree(replica.process.pid):
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert API_KEY.encode() not in cmdline, process.cmdline()
    # ... and the replica requires it.
    assert httpx.get(f"{replica.url}/server_info").status_code == 401
    assert httpx.get(f"{replica.url}/server_info", headers=AUTH).status_code == 200


def test_bootstrap_reads_need_the_key(replica):
    routes = ("/get_transfer_engine_info?rank=0", "/get_parallelism_config?rank=0")
    for route in routes:
        url = f"{replica.bootstrap_url}{route}"
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.get(url, headers=headers)
            assert refused.status_code == 401, (route, headers, refused.text)
            assert "message" in refused.json()["error"]
            assert "127.0.0.1:" not in refused.text
        assert httpx.get(url, headers=AUTH).status_code == 200, route
    assert httpx.get(f"{replica.bootstrap_url}/health").text == "OK"

    async def read(api_key: str | None) -> tuple:
        async with BootstrapClient(replica.bootstrap_url, api_key=api_key) as client:
            return (
                await client.get_transfer_engine_info(1),
                await client.get_parallelism_config(1),
            )

    (session_id, weights_info), parallelism = asyncio.run(read(API_KEY))
    assert session_id.startswith("127.0.0.1:") and weights_info
    assert parallelism.tp_rank == 1 and parallelism.tp_size == TP
    with pytest.raises(RemoteReplicaError) as refused:
        asyncio.run(read(None))
    assert refused.value.status_code == 401


def test_serve_reads_the_key_from_a_file(checkpoint, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text("  file-key-81d2\n")
    key_file.chmod(0o644)
    with serve_replicas(
        checkpoint, extra_args=["--api-key-file", str(key_file)], log_dir=tmp_path / "logs"
    ) as (served,):
        assert httpx.get(f"{served.url}/server_info").status_code == 401
        authorized = {"Authorization": "Bearer file-key-81d2"}
        assert httpx.get(f"{served.url}/server_info", headers=authorized).status_code == 200
        log = served.log_path.read_text()
    assert f"--api-key-file {key_file} is readable by other users (mode 644)" in log
    assert "file-key-81d2" not in log


def test_serve_refuses_key_options_it_cannot_use(checkpoint, tmp_path):
    runner = CliRunner()
    serve = ["serve", "--model", str(checkpoint), "--port", "0", "--bootstrap-port", "0"]
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    result = runner.invoke(app, [*serve, "--api-key-file", str(empty)])
    assert result.exit_code == 2
    assert f"--api-key-file {empty} is empty" in result.output
    result = runner.invoke(app, [*serve, "--api-key-file", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "--api-key-file" in result.output
    key_file = tmp_path / "key"
    key_file.write_text("k")
    result = runner.invoke(app, [*serve, "--api-key", "k", "--api-key-file", str(key_file)])
    assert result.exit_code == 2 and "not both" in result.output
    spaced = tmp_path / "spaced"
    spaced.write_text("two words")
    result = runner.invoke(app, [*serve, "--api-key-file", str(spaced)])
    assert result.exit_code == 2 and "whitespace" in result.output
    # --api-key still works, with a warning that it shows in the process list.
    result = runner.invoke(app, [*serve, "--api-key", "k", "--ep", "3"])
    assert result.exit_code == 2 and "process list" in result.output
