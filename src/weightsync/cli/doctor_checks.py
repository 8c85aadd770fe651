"""The checks of `weightsync doctor`: this host's transport, and each replica, as rows.

Each check is a `CheckRow`: what was checked, for whom (``"this host"`` or a replica URL),
whether it passed, what was found, and what to do when it did not. Local checks run first
(they open the Mooncake engine the replica checks write through); each replica's checks run
in order and stop at the first failure a later check depends on (an unreachable replica has
no protocol to read).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import resource
import socket
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from weightsync.control import RolloutClient
from weightsync.control.protocol import (
    WEIGHT_SYNC_DELTA,
    ReplicaProtocol,
    num_ranks,
    refusal,
)
from weightsync.control.vllm import VLLMClient, is_vllm_server_info
from weightsync.delta_wire import LOAD_FORMAT, serves_delta_loader
from weightsync.errors import RemoteReplicaError, WeightSyncError
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.manager.replicas import parallelism_of
from weightsync.transport.mooncake.engine import PROTOCOLS, MooncakeConfig, rdma_devices

OK, WARN, FAIL = "ok", "warn", "fail"
HOST = "this host"
# The rows, in the order they are checked (the guide's troubleshooting page has one entry each).
HOST_CHECKS = ("mooncake", "transfer engine", "rdma devices", "cuda", "ulimit -l")
REPLICA_CHECKS = (
    "reachable",
    "auth",
    "protocol",
    "weights stay in place",
    "bootstrap info",
    "parallelism",
    "delta syncs",
    "transfer",
)
# SGLang versions the control protocol was checked against (tests/conformance.py).
TESTED_SGLANG = ("0.5.23",)
TESTED_VLLM = ("0.32.0",)
# The engines whose control protocol was checked, by `ReplicaProtocol.kind`: their name and
# the versions checked.
_TESTED = {"sglang": ("SGLang", TESTED_SGLANG), "vllm": ("vLLM", TESTED_VLLM)}
# Below this, registering a large model's memory for RDMA fails (the NIC pins it).
_MEMLOCK_FLOOR_BYTES = 1 << 30
_MOONCAKE_DISTRIBUTIONS = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckRow:
    """One row of the doctor's report.

    Attributes:
        subject: ``"this host"`` or the replica's URL.
        name: what was checked (``"reachable"``, ``"auth"``, ...).
        status: ``"ok"``, ``"warn"`` (works, but not as well as it could) or ``"fail"``.
        detail: what was found.
        fix: what to do; empty when nothing needs doing.
    """

    subject: str
    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        """The row as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class DoctorOptions:
    """What `weightsync doctor` checks.

    Attributes:
        replicas: replica main-server URLs.
        api_key: the key sent to every replica, or None.
        transport: the Mooncake protocol a sync would ask for: ``tcp``, ``rdma`` or ``auto``.
        timeout_s: the timeout of each remote call.
    """

    replicas: tuple[str, ...] = ()
    api_key: str | None = None
    transport: str = "auto"
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://")
        if self.transport not in PROTOCOLS:
            raise ValueError(f"transport must be one of {PROTOCOLS}, not {self.transport!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


def run_checks(
    options: DoctorOptions, *, on_step: Callable[[str], None] | None = None
) -> list[CheckRow]:
    """Run every check and return the rows, local ones first.

    Args:
        options: what to check.
        on_step: called with a description before each slow step (for a progress line).
    """
    step = on_step or (lambda _: None)
    rows: list[CheckRow] = []
    step("opening the Mooncake transfer engine")
    transport, local_rows = _local_checks(options)
    rows += local_rows
    try:
        for url in options.replicas:
            step(f"checking {url}")
            rows += asyncio.run(_replica_checks(url.rstrip("/"), options, transport))
    finally:
        if transport is not None:
            transport.close()
    return rows


def _local_checks(options: DoctorOptions) -> tuple[Any, list[CheckRow]]:
    """The Mooncake build, its engine, RDMA devices, CUDA and the memory-lock limit; the open
    transport (None when Mooncake did not start) for the replicas' test writes."""
    rows: list[CheckRow] = []
    distribution = _mooncake_distribution()
    try:
        from mooncake import engine as mooncake_engine
    except ImportError as exc:
        rows.append(
            CheckRow(
                subject=HOST,
                name="mooncake",
                status=FAIL,
                detail=f"Mooncake does not import: {exc}",
                fix="pip install 'weightsync[mooncake]' (host memory) or "
                "'weightsync[mooncake-cuda]' (GPU memory too); it needs libibverbs1 "
                "(apt-get install libibverbs1)",
            )
        )
        return None, rows + _rdma_rows(options, None) + _cuda_rows() + _memlock_rows(None)
    cuda_build = bool(getattr(mooncake_engine, "SUPPORT_CUDA", False))
    rows.append(
        CheckRow(
            subject=HOST,
            name="mooncake",
            status=OK,
            detail=f"{distribution or 'mooncake'}"
            + (" (CUDA build: GPU memory can be written)" if cuda_build else " (host memory)"),
        )
    )
    from weightsync.transport.mooncake import MooncakeTransport

    transport = None
    try:
        transport = MooncakeTransport(MooncakeConfig(protocol=options.transport))
        rows.append(
            CheckRow(
                subject=HOST,
                name="transfer engine",
                status=OK,
                detail=f"started with protocol {transport.protocol} "
                f"(asked for {options.transport}), session {transport.session_id}",
            )
        )
    except WeightSyncError as exc:
        rows.append(
            CheckRow(
                subject=HOST,
                name="transfer engine",
                status=FAIL,
                detail=str(exc),
                fix="with --transport rdma an RDMA device must be usable; use --transport "
                "auto or tcp, or fix the device (ibv_devinfo)",
            )
        )
    protocol = transport.protocol if transport is not None else None
    return transport, rows + _rdma_rows(options, protocol) + _cuda_rows() + _memlock_rows(protocol)


def _mooncake_distribution() -> str | None:
    for name in _MOONCAKE_DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return None


def _rdma_rows(options: DoctorOptions, protocol: str | None) -> list[CheckRow]:
    devices = rdma_devices()
    if devices:
        fell_back = protocol == "tcp" and options.transport == "auto"
        return [
            CheckRow(
                subject=HOST,
                name="rdma devices",
                status=WARN if fell_back else OK,
                detail=", ".join(devices)
                + ("; Mooncake fell back to TCP anyway" if fell_back else ""),
                fix="see the log with --verbose for why RDMA did not initialize"
                if fell_back
                else "",
            )
        ]
    if options.transport == "rdma":
        return [
            CheckRow(
                subject=HOST,
                name="rdma devices",
                status=FAIL,
                detail="none in /sys/class/infiniband",
                fix="install the NIC's driver (rdma-core) or use --transport tcp",
            )
        ]
    return [
        CheckRow(
            subject=HOST,
            name="rdma devices",
            status=OK,
            detail="none: syncs use TCP"
            + (" (what --transport auto falls back to)" if options.transport == "auto" else ""),
        )
    ]


def _cuda_rows() -> list[CheckRow]:
    import torch

    if not torch.cuda.is_available():
        return [
            CheckRow(
                subject=HOST,
                name="cuda",
                status=OK,
                detail="no CUDA GPU visible: host memory only (no cuda_ipc transport)",
            )
        ]
    count = torch.cuda.device_count()
    missing = [
        (a, b)
        for a in range(count)
        for b in range(count)
        if a != b and not torch.cuda.can_device_access_peer(a, b)
    ]
    detail = f"{count} GPU(s): " + ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    if missing:
        pairs = ", ".join(f"{a}->{b}" for a, b in missing[:8])
        return [
            CheckRow(
                subject=HOST,
                name="cuda",
                status=WARN,
                detail=f"{detail}; no peer access {pairs}",
                fix="cuda_ipc between these GPUs goes through host memory at a fraction of "
                "the rate; check nvidia-smi topo -m, or use Mooncake",
            )
        ]
    return [
        CheckRow(
            subject=HOST,
            name="cuda",
            status=OK,
            detail=detail + ("; peer access between every pair" if count > 1 else ""),
        )
    ]


def _memlock_rows(protocol: str | None) -> list[CheckRow]:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"
    low = soft != resource.RLIM_INFINITY and soft < _MEMLOCK_FLOOR_BYTES
    if low and protocol == "rdma":
        return [
            CheckRow(
                subject=HOST,
                name="ulimit -l",
                status=FAIL,
                detail=f"{shown}: RDMA cannot register (pin) a model's memory",
                fix="raise it: ulimit -l unlimited (memlock in /etc/security/limits.conf; "
                "docker run --ulimit memlock=-1)",
            )
        ]
    return [
        CheckRow(
            subject=HOST,
            name="ulimit -l",
            status=OK,
            detail=shown + (" (matters for RDMA only)" if protocol != "rdma" else ""),
        )
    ]


async def _replica_checks(url: str, options: DoctorOptions, transport: Any) -> list[CheckRow]:
    rows: list[CheckRow] = []

    def row(name: str, status: str, detail: str, fix: str = "") -> None:
        rows.append(CheckRow(subject=url, name=name, status=status, detail=detail, fix=fix))

    async with contextlib.AsyncExitStack() as stack:
        client = RolloutClient(url, api_key=options.api_key, timeout_s=options.timeout_s)
        stack.push_async_callback(client.aclose)
        try:
            server_info = await client.get_server_info()
            if is_vllm_server_info(server_info):  # vLLM: its own routes, and its workers'
                client = VLLMClient.like(client)
                stack.push_async_callback(client.aclose)
                server_info = await client.get_server_info()
        except RemoteReplicaError as exc:
            if exc.status_code is None:
                row(
                    "reachable",
                    FAIL,
                    f"nothing answers: {exc}",
                    "start the replica (weightsync serve, or SGLang with "
                    "--remote-instance-weight-loader-start-seed-via-transfer-engine) or fix "
                    "--replica",
                )
                return rows
            row("reachable", OK, f"answers HTTP (GET /server_info: {exc.status_code})")
            if exc.status_code in (401, 403):
                row(
                    "auth",
                    FAIL,
                    "the replica refused "
                    + ("the API key" if options.api_key else "a request without an API key"),
                    "pass the key the replica was started with: --api-key or $WEIGHTSYNC_API_KEY",
                )
            elif exc.status_code == 404:
                row(
                    "protocol",
                    FAIL,
                    f"/server_info failed: {exc}",
                    "a vLLM replica serves it only with VLLM_SERVER_DEV_MODE=1 set; else check "
                    "--replica and the replica's log",
                )
            else:
                row("protocol", FAIL, f"/server_info failed: {exc}", "check the replica's log")
            return rows
        row("reachable", OK, "answers HTTP")
        row(
            "auth",
            OK,
            "the API key is accepted" if options.api_key else "no API key needed for reads",
        )
        protocol = ReplicaProtocol.from_server_info(server_info)
        row(*_protocol_row(protocol))
        why = refusal(server_info)
        row(
            "weights stay in place",
            FAIL if why else OK,
            why or "memory saver, weight offload and CPU backup off",
            (why.split("; ", 1)[-1] if why else ""),
        )
        try:
            ranks = range(num_ranks(server_info))
        except ValueError as exc:
            row("bootstrap info", FAIL, str(exc), "the replica's /server_info is incomplete")
            return rows
        replies = await asyncio.gather(
            *(client.get_transfer_engine_reply(r) for r in ranks), return_exceptions=True
        )
        missing = [
            r for r, reply in zip(ranks, replies, strict=True) if isinstance(reply, Exception)
        ]
        if missing:
            first = replies[missing[0]]
            row(
                "bootstrap info",
                FAIL,
                f"rank(s) {missing} of {len(ranks)} published no transfer-engine info ({first})",
                "every rank must register its weights: for SGLang pass "
                "--remote-instance-weight-loader-start-seed-via-transfer-engine and "
                "--engine-info-bootstrap-port; check the rank's log",
            )
            return rows
        num_params = {len(reply.remote_instance_transfer_engine_info[1]) for reply in replies}
        row(
            "bootstrap info",
            OK,
            f"{len(ranks)} rank(s) published, {'/'.join(map(str, sorted(num_params)))} "
            "parameter(s) each",
        )
        row(*await _parallelism_row(client, protocol, server_info, ranks))
        row(*_delta_row(protocol, server_info, replies))
        rows.append(await _write_row(url, server_info, replies, transport, options))
    return rows


def _protocol_row(protocol: ReplicaProtocol) -> tuple[str, str, str, str]:
    if protocol.kind not in _TESTED:
        return ("protocol", OK, protocol.describe(), "")
    engine, versions = _TESTED[protocol.kind]
    tested = protocol.version in versions
    return (
        "protocol",
        OK if tested else WARN,
        protocol.describe()
        + ("" if tested else f"; checked against {engine} {', '.join(versions)}"),
        "" if tested else f"use {engine} {versions[-1]}, or check with a test sync",
    )


def _delta_row(
    protocol: ReplicaProtocol, server_info: dict[str, Any], replies: Sequence[Any]
) -> tuple[str, str, str, str]:
    """Whether the replica takes delta syncs (``SyncConfig(delta=True)``), and how; a
    replica that does not takes full bytes, which is no fault."""
    if serves_delta_loader(server_info):
        detail = f"through SGLang's custom weight loader {LOAD_FORMAT}"
    elif protocol.serves(WEIGHT_SYNC_DELTA) and all(r.delta_region for r in replies):
        sizes = sorted({r.delta_region[1] for r in replies})
        detail = f"into delta regions of {'/'.join(str(n >> 20) for n in sizes)} MiB per rank"
    elif protocol.kind == "vllm":
        detail = (
            "no: full bytes every sync; start vLLM with WEIGHTSYNC_DELTA_REGION_MB=N in its "
            "environment for deltas"
        )
    elif protocol.kind == "sglang":
        detail = (
            f"no: full bytes every sync; start SGLang with --custom-weight-loader "
            f"{LOAD_FORMAT} (weightsync installed beside it) for deltas"
        )
    else:
        detail = "no: full bytes every sync; serve with --delta-region-mb N for deltas"
    return ("delta syncs", OK, detail, "")


async def _parallelism_row(
    client: RolloutClient, protocol: ReplicaProtocol, server_info: dict[str, Any], ranks: range
) -> tuple[str, str, str, str]:
    try:
        configs, source = await parallelism_of(client, protocol, server_info, ranks)
    except (RemoteReplicaError, ValueError) as exc:
        return ("parallelism", FAIL, str(exc), "check the replica's server arguments and log")
    problem = _parallelism_problem(configs, server_info)
    first = configs[0]
    detail = f"tp={first.tp_size} ep={first.ep_size} pp={first.pp_size} ({source})"
    if problem:
        return ("parallelism", FAIL, f"{detail}: {problem}", "restart the replica")
    return ("parallelism", OK, detail, "")


def _parallelism_problem(
    configs: Sequence[ParallelismConfig], server_info: dict[str, Any]
) -> str | None:
    tp_ranks = sorted(c.tp_rank for c in configs)
    if tp_ranks != list(range(len(configs))):
        return f"the ranks report tp_rank {tp_ranks}, not 0..{len(configs) - 1}"
    sizes = {c.tp_size for c in configs}
    if sizes != {server_info.get("tp_size")}:
        return (
            f"the ranks report tp_size {sorted(sizes)}, /server_info {server_info.get('tp_size')}"
        )
    return None


async def _write_row(
    url: str,
    server_info: dict[str, Any],
    replies: Sequence[Any],
    transport: Any,
    options: DoctorOptions,
) -> CheckRow:
    """Write a pattern into every rank's scratch region and read it back, through the real
    transport; on a replica that offers none (SGLang), connect to each rank's handshake port
    instead, which writes nothing. A CUDA IPC replica is written by GPU processes of its own
    host only: the row says whether this host can."""
    if server_info.get("transport") == "cuda_ipc":
        return _cuda_ipc_row(url)
    sessions = [reply.remote_instance_transfer_engine_info[0] for reply in replies]
    scratch = [reply.scratch_region for reply in replies]
    if any(region is None for region in scratch):
        refused = await asyncio.gather(
            *(asyncio.to_thread(_connect, s, options.timeout_s) for s in sessions)
        )
        failed = [f"{s} ({why})" for s, why in zip(sessions, refused, strict=True) if why]
        if failed:
            return CheckRow(
                subject=url,
                name="transfer",
                status=FAIL,
                detail=f"cannot connect to transfer engine(s) {', '.join(failed)}",
                fix="the ranks' addresses must be reachable from here (SGLANG_HOST_IP; a "
                "firewall must let the ranks' Mooncake ports through: each rank logs them)",
            )
        return CheckRow(
            subject=url,
            name="transfer",
            status=OK,
            detail=f"the transfer engines of {len(sessions)} rank(s) accept connections "
            "(no test write: the replica offers no scratch region)",
        )
    if transport is None:
        return CheckRow(
            subject=url,
            name="transfer",
            status=FAIL,
            detail="no test write: the local transfer engine did not start",
            fix="fix the transfer engine row above",
        )
    try:
        await asyncio.to_thread(_write_and_read_back, transport, sessions, scratch, options)
    except (WeightSyncError, ValueError) as exc:
        return CheckRow(
            subject=url,
            name="transfer",
            status=FAIL,
            detail=f"test write failed: {exc}",
            fix="the ranks' transfer engines must be reachable from here (their Mooncake "
            "ports, which each rank logs, open between trainer and replica)",
        )
    return CheckRow(
        subject=url,
        name="transfer",
        status=OK,
        detail=f"wrote {scratch[0][1]} bytes into each of {len(sessions)} rank(s)' scratch "
        f"region over {transport.protocol} and read them back intact",
    )


def _cuda_ipc_row(url: str) -> CheckRow:
    import torch

    if torch.cuda.is_available():
        return CheckRow(
            subject=url,
            name="transfer",
            status=OK,
            detail="CUDA IPC replica: written from GPU processes on its host (no test write)",
        )
    return CheckRow(
        subject=url,
        name="transfer",
        status=FAIL,
        detail="CUDA IPC replica, and this host has no CUDA GPU to write from",
        fix="run the trainer on the replica's host with GPUs, or serve with --transport mooncake",
    )


def _connect(session_id: str, timeout_s: float) -> str | None:
    host, _, port = session_id.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as exc:
        return str(exc)


def _write_and_read_back(
    transport: Any,
    sessions: Sequence[str],
    scratch: Sequence[tuple[int, int]],
    options: DoctorOptions,
) -> None:
    import torch

    for session, (addr, num_bytes) in zip(sessions, scratch, strict=True):
        pattern = torch.frombuffer(bytearray(os.urandom(num_bytes)), dtype=torch.uint8)
        back = torch.zeros(num_bytes, dtype=torch.uint8)
        src, _ = _register(transport, pattern)
        dst, _ = _register(transport, back)
        try:
            handle = transport.write(session, [src], [addr], [num_bytes])
            transport.wait(handle, options.timeout_s)
            transport.read(session, dst, addr, num_bytes)
        finally:
            transport.unregister(src)
            transport.unregister(dst)
        if not torch.equal(pattern, back):
            changed = int((pattern != back).sum())
            raise WeightSyncError(
                f"rank at {session}: {changed} of {num_bytes} bytes read back differ from "
                "what was written"
            )


def _register(transport: Any, tensor: Any) -> tuple[int, int]:
    from weightsync.transport import register_tensor

    return register_tensor(transport, tensor)
