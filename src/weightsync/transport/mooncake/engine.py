"""Creating a Mooncake TransferEngine: metadata mode, protocol choice and environment.

Mooncake's Python ``initialize(hostname, metadata, protocol, device)`` does not pick the
transport from its `protocol` argument: the engine discovers the local RDMA devices and
installs RDMA when it finds one, TCP otherwise (CUDA builds may install an NVLink transport
instead), unless ``MC_FORCE_TCP`` is set. Its write timeout is read from
``MC_TRANSFER_TIMEOUT`` when the engine object is constructed. So the protocol and timeout of
a `MooncakeConfig` reach Mooncake through those two variables, set around the engine's
creation under a lock and restored afterwards.

Mooncake listens on every interface, whatever hostname it is given: its P2P handshake port
binds 0.0.0.0 (``findAvailableTcpPort``, ``transfer_metadata_plugin.cpp``) and its TCP data
port binds [::] dual-stack (``TcpContext``, ``tcp_transport_session_impl.h``); no setting
changes either (``MC_TCP_BIND_ADDRESS`` only names the address advertised outside P2P
handshake mode). Both ports come from ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT`` as the process
had them when Mooncake was loaded, and only for a range Mooncake takes (`ports`). The first
engine of a process logs a warning naming both ports and the range they come from.

Mooncake logs through glog, to the process's stderr, and its lowest level
(``MC_LOG_LEVEL=ERROR``) still prints lines that are not failures while an engine starts
(``E... transfer_metadata.cpp] Local segment descriptor not found``, glog's own ``WARNING:
Logging before InitGoogleLogging()``). So what the native code writes to stderr while an
engine is created and initialized is captured (file descriptor 2, under the same lock) and
logged line by line at DEBUG on ``weightsync.transport.mooncake.native``; when the engine
fails to initialize, the lines are part of the error. What Mooncake logs after start-up (a
failed write's ``E...`` lines, from its own threads) is taken off stderr by the capture the
first engine installs for the rest of the process (`native_log`) and logged there too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.errors import WeightSyncError
from weightsync.transport.base import WriteCost
from weightsync.transport.mooncake.native_log import (
    NATIVE_LOGGER,
    capture_native_logs,
    is_native_line,
)
from weightsync.transport.mooncake.ports import PORT_VARIABLES, PortRange, port_range

_LOG = logging.getLogger(__name__)
_NATIVE_LOG = logging.getLogger(NATIVE_LOGGER)

PROTOCOLS = ("tcp", "rdma", "auto")

DEFAULT_WRITE_COSTS: dict[str, WriteCost] = {
    # Every region is one transfer_submit_write from Python, polled from Python, and over TCP
    # each request is also a message of Mooncake's own protocol on a socket. Fitted from
    # bench/transport.py's region sweep (1 to 10,000 regions of one 256 MiB write) between
    # two processes over loopback on a 2-core host: 25-30 us per write (27.9 fitted), 1.9-2.3
    # GB/s; the sender's choice moves only for pieces near the break-even, tens of KiB.
    "tcp": WriteCost(write_s=25e-6, bytes_per_s=1.9e9),
    # RDMA posts a work request per slice and the NIC moves the bytes; the request's Python
    # calls (submit and poll) are most of its fixed cost. 50 GB/s: one 400 Gb/s NIC.
    "rdma": WriteCost(write_s=5e-6, bytes_per_s=50e9),
}
"""What one write costs each protocol Mooncake runs (`MooncakeConfig.write_cost` overrides)."""
_METADATA_SERVER = "P2PHANDSHAKE"
_RDMA_SYSFS = Path("/sys/class/infiniband")
_ENV_LOCK = threading.Lock()
# Engines made before one binds its port (see `_initialize`).
_BIND_ATTEMPTS = 5
_TCP_LISTEN = "0A"
_warned_listeners = False
# The port range Mooncake took when this module loaded it; None until then (or where
# something else loaded it first: then the environment as it is now is the best guess).
_loaded_ports: PortRange | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeConfig:
    """How a `MooncakeTransport` sets up its engine.

    Attributes:
        hostname: the address peers reach this engine at; part of the session id. It is not
            where the engine listens: Mooncake listens on every interface (see the module
            docstring), so keep its ports behind a firewall: 15000-17000, unless
            ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT`` name another range when the process
            starts, with both ends in 1024-65535 and outside 32768-60999 (Mooncake ignores
            any other range; `weightsync.transport.mooncake.ports`). The first engine of a
            process logs its ports and their range.
        protocol: ``"tcp"``, ``"rdma"`` or ``"auto"`` (RDMA when an RDMA device is present
            and usable, TCP otherwise).
        device_name: RDMA devices to use, comma-separated (``"mlx5_0,mlx5_1"``); empty for all.
        timeout_s: Mooncake's own per-write timeout, passed as ``MC_TRANSFER_TIMEOUT`` (whole
            seconds, at least 5, which is Mooncake's floor). `wait` takes its own timeout.
        max_outstanding_per_peer: most writes in flight to one peer over all threads; more
            can wedge Mooncake's TCP connection.
        write_cost: what one write costs on your link (`weightsync.transport.WriteCost`, as
            ``bench/transport.py`` measures it); None: `DEFAULT_WRITE_COSTS` of the protocol
            the engine runs (``"auto"`` resolves to ``"tcp"`` or ``"rdma"`` first).
        capture_native_logs: take Mooncake's native log lines off the process's stderr and
            into Python logging for the rest of the process, from the first engine on
            (`weightsync.transport.mooncake.native_log`, which says what that costs); False
            leaves file descriptor 2 alone, and the lines of failed writes print there.
    """

    hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    timeout_s: float = 30.0
    max_outstanding_per_peer: int = 1000
    write_cost: WriteCost | None = None
    capture_native_logs: bool = True

    def __post_init__(self) -> None:
        if not self.hostname:
            raise ValueError("hostname must not be empty")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s}")
        if self.max_outstanding_per_peer < 1:
            raise ValueError(
                f"max_outstanding_per_peer must be at least 1, got {self.max_outstanding_per_peer}"
            )
        if self.write_cost is not None and not isinstance(self.write_cost, WriteCost):
            raise ValueError(
                f"write_cost must be a weightsync.transport.WriteCost or None, "
                f"got {self.write_cost!r}"
            )

    @property
    def engine_timeout_s(self) -> int:
        """The ``MC_TRANSFER_TIMEOUT`` value: whole seconds, at least 5."""
        return max(5, math.ceil(self.timeout_s))


def rdma_devices(device_name: str = "") -> list[str]:
    """The RDMA devices the kernel lists, filtered by a comma-separated `device_name`."""
    if not _RDMA_SYSFS.is_dir():
        return []
    found = sorted(entry.name for entry in _RDMA_SYSFS.iterdir())
    wanted = {name.strip() for name in device_name.split(",") if name.strip()}
    return [name for name in found if not wanted or name in wanted]


def topology_devices(topology_json: str) -> list[str]:
    """The RDMA devices named in Mooncake's ``get_local_topology()`` JSON."""
    try:
        topology = json.loads(topology_json)
    except json.JSONDecodeError:
        return []
    names: set[str] = set()
    for entry in topology.values() if isinstance(topology, dict) else ():
        for group in entry if isinstance(entry, list) else ():
            names.update(name for name in group if isinstance(name, str))
    return sorted(names)


def create_engine(config: MooncakeConfig) -> tuple[Any, str]:
    """Create and initialize a TransferEngine as `config` says.

    Returns:
        ``(engine, protocol)`` with the protocol actually in use (``"tcp"`` or ``"rdma"``).

    Raises:
        WeightSyncError: Mooncake is not installed, or the engine did not initialize (with
            ``protocol="rdma"``: no usable RDMA device).
    """
    if config.protocol != "auto":
        return _initialize(config, config.protocol), config.protocol
    if not rdma_devices(config.device_name):
        return _initialize(config, "tcp"), "tcp"
    try:
        return _initialize(config, "rdma"), "rdma"
    except WeightSyncError as exc:
        _LOG.warning("Mooncake RDMA did not initialize (%s); falling back to TCP", exc)
        return _initialize(config, "tcp"), "tcp"


def _initialize(config: MooncakeConfig, protocol: str) -> Any:
    with _ENV_LOCK:
        # Before Mooncake loads, so that the lines it prints while loading are captured too.
        if config.capture_native_logs:
            capture_native_logs()
        TransferEngine = _load_engine_class()
    env = {"MC_TRANSFER_TIMEOUT": str(config.engine_timeout_s)}
    # Without MC_FORCE_TCP Mooncake installs RDMA (or, in CUDA builds without a NIC, its
    # NVLink transport) whatever protocol it is given.
    env["MC_FORCE_TCP"] = "1" if protocol == "tcp" else ""
    native: list[str] = []
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in env}
        try:
            for name, value in env.items():
                if value:
                    os.environ[name] = value
                else:
                    os.environ.pop(name, None)
            with _captured_stderr(native):
                for attempt in range(_BIND_ATTEMPTS):
                    engine = TransferEngine()
                    before = _own_listeners()
                    try:
                        return_code = engine.initialize(
                            config.hostname, _METADATA_SERVER, protocol, config.device_name
                        )
                    except RuntimeError as exc:
                        # Mooncake picks a free port, then binds it: another process may
                        # bind it in between. Another engine picks another port.
                        if "Address already in use" not in str(exc):
                            raise
                        if attempt == _BIND_ATTEMPTS - 1:
                            raise WeightSyncError(
                                f"Mooncake TransferEngine could not bind a port after "
                                f"{_BIND_ATTEMPTS} tries ({exc}); it picks them in "
                                f"{_ports().describe()}. Widen that range or start fewer "
                                "engines on this host at once"
                            ) from exc
                        _LOG.debug("Mooncake's port was taken (%s); trying another", exc)
                        continue
                    break
                opened = sorted(_own_listeners() - before)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    _emit_captured(native)
    if return_code != 0:
        said = "".join(f"\n  {line}" for line in native[-20:])
        raise WeightSyncError(
            f"Mooncake TransferEngine.initialize({config.hostname!r}, {_METADATA_SERVER!r}, "
            f"{protocol!r}, {config.device_name!r}) returned {return_code}"
            + (f"; Mooncake said:{said}" if said else "")
        )
    _warn_of_wildcard_listeners(config.hostname, opened)
    if protocol == "rdma":
        devices = topology_devices(engine.get_local_topology())
        if not devices:
            raise WeightSyncError(
                "protocol 'rdma' was asked for but Mooncake found no RDMA device"
                + (f" among {config.device_name!r}" if config.device_name else "")
                + "; use protocol 'tcp' or 'auto'"
            )
    return engine


def _warn_of_wildcard_listeners(hostname: str, opened: list[tuple[str, int]]) -> None:
    """Say once per process where Mooncake listens when that is more than `hostname`."""
    global _warned_listeners
    wide = [(address, port) for address, port in opened if address in ("0.0.0.0", "::")]
    if _warned_listeners or not wide:
        return
    _warned_listeners = True
    where = ", ".join(
        f"[{address}]:{port}" if ":" in address else f"{address}:{port}" for address, port in wide
    )
    _LOG.warning(
        "Mooncake TransferEngine listens on every interface, not only %s: %s. Mooncake "
        "has no setting to bind one interface; whoever reaches these ports can write into "
        "the memory registered with it, so firewall them: %s",
        hostname,
        where,
        _where_ports_lie(_ports(), [port for _, port in wide]),
    )


def _where_ports_lie(ports: PortRange, bound: list[int]) -> str:
    """Which range `bound` (the ports an engine listens on) come from, as far as `ports`
    (the range Mooncake was loaded with) says."""
    if all(port in ports for port in bound):
        return f"Mooncake picks them in {ports.describe()}"
    # Mooncake was loaded before the environment took its present value.
    return (
        f"Mooncake picked them outside {ports.low}-{ports.high}, the range "
        "MC_MIN_RPC_PORT..MC_MAX_RPC_PORT name now: it reads them once, when it is loaded, "
        "so set them before the process starts"
    )


def _load_engine_class() -> Any:
    """Mooncake's TransferEngine class; the first load also fixes its port range."""
    global _loaded_ports
    loading = "mooncake.engine" not in sys.modules
    environ = {name: os.environ[name] for name in PORT_VARIABLES if name in os.environ}
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise WeightSyncError(
            "Mooncake is not installed: pip install 'weightsync[mooncake]' (host memory) or "
            "'weightsync[mooncake-cuda]' (GPU memory too)"
        ) from exc
    if loading and _loaded_ports is None:
        _loaded_ports = port_range(environ)
    return TransferEngine


def _ports() -> PortRange:
    """The range Mooncake picks ports from in this process (see `_loaded_ports`)."""
    return _loaded_ports if _loaded_ports is not None else port_range(os.environ)


def _emit_captured(lines: list[str]) -> None:
    """Log glog's lines at DEBUG; write the others (another thread's, written to stderr while
    it was captured) back to stderr."""
    for line in lines:
        if is_native_line(line):
            _NATIVE_LOG.debug("%s", line)
        else:
            sys.stderr.write(line + "\n")


@contextlib.contextmanager
def _captured_stderr(lines: list[str]) -> Iterator[None]:
    """Send what this process writes to file descriptor 2 into `lines` while the block runs.

    Native code writes to the descriptor, not to ``sys.stderr``, so the descriptor itself is
    pointed at a temporary file and restored afterwards. Other threads writing to stderr
    during the block (it lasts milliseconds) are captured as well; the caller writes lines
    that are not glog's back to stderr.
    """
    try:
        sys.stderr.flush()
        saved_fd = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            lines.extend(line for line in text.splitlines() if line.strip())


def _own_listeners() -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket this process listens on (Linux; else empty)."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    except OSError:
        return set()
    found = set()
    for table, family in (
        ("/proc/self/net/tcp", socket.AF_INET),
        ("/proc/self/net/tcp6", socket.AF_INET6),
    ):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN or fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            found.add((_proc_address(address, family), int(port, 16)))
    return found


def _proc_address(hex_address: str, family: int) -> str:
    # /proc/net/tcp{,6} print addresses as 32-bit words in host byte order.
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if sys.byteorder == "big":
        words = raw
    return socket.inet_ntop(family, words)
