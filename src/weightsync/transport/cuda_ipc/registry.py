"""Where a CUDA IPC receiver publishes its exported allocations: a loopback HTTP server.

The receiver's session id is ``"ipc:<host>:<port>"``; ``GET /regions`` on that address
answers a JSON document with the receiver's pid, the PCI bus id of its GPU, every exported
allocation (``base``, ``size``, hex ``handle``) and every registered region
(``[addr, num_bytes]``). Addresses are the receiver's own, as it publishes them in
``weights_info``; the writer maps them onto its own mapping of each allocation.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SESSION_PREFIX = "ipc:"
_PATH = "/regions"


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    """One exported allocation, in the receiver's address space."""

    base: int
    size: int
    handle: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrySnapshot:
    """What a receiver publishes."""

    pid: int
    pci_bus_id: str
    allocations: tuple[Allocation, ...]
    regions: tuple[tuple[int, int], ...]

    def to_json(self) -> bytes:
        """The JSON body ``GET /regions`` answers."""
        return json.dumps(
            {
                "pid": self.pid,
                "pci_bus_id": self.pci_bus_id,
                "allocations": [
                    {"base": a.base, "size": a.size, "handle": a.handle.hex()}
                    for a in self.allocations
                ],
                "regions": [list(region) for region in self.regions],
            }
        ).encode()

    @classmethod
    def from_json(cls, body: bytes) -> RegistrySnapshot:
        """Parse a ``GET /regions`` body.

        Raises:
            ValueError: the body is not such a document.
        """
        try:
            data = json.loads(body)
            return cls(
                pid=int(data["pid"]),
                pci_bus_id=str(data["pci_bus_id"]),
                allocations=tuple(
                    Allocation(
                        base=int(a["base"]), size=int(a["size"]), handle=bytes.fromhex(a["handle"])
                    )
                    for a in data["allocations"]
                ),
                regions=tuple((int(addr), int(size)) for addr, size in data["regions"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed CUDA IPC registry document: {exc}") from exc


def parse_session_id(session_id: str) -> tuple[str, int]:
    """``(host, port)`` of an ``"ipc:<host>:<port>"`` session id.

    Raises:
        ValueError: it is not one.
    """
    if not session_id.startswith(SESSION_PREFIX):
        raise ValueError(f"not a CUDA IPC session id: {session_id!r}")
    host, _, port = session_id[len(SESSION_PREFIX) :].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a CUDA IPC session id: {session_id!r}")
    return host.strip("[]"), int(port)


def fetch_snapshot(session_id: str, timeout_s: float) -> RegistrySnapshot:
    """Ask the receiver behind `session_id` for its registry.

    Raises:
        ValueError: malformed session id or answer.
        OSError: the receiver could not be reached (``urllib.error.URLError`` included).
    """
    host, port = parse_session_id(session_id)
    host = f"[{host}]" if ":" in host else host
    with urllib.request.urlopen(f"http://{host}:{port}{_PATH}", timeout=timeout_s) as response:
        return RegistrySnapshot.from_json(response.read())


class _Handler(BaseHTTPRequestHandler):
    server_version = "weightsync-ipc/1"

    def do_GET(self) -> None:
        if self.path != _PATH:
            self.send_error(404)
            return
        body = self.server.body  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Keep request lines out of the process's stderr."""


class RegistryServer:
    """Serves the latest `RegistrySnapshot` on ``(host, port)`` from a daemon thread."""

    def __init__(self, host: str, port: int, snapshot: RegistrySnapshot) -> None:
        """Bind and start serving.

        Args:
            host: the address to bind (loopback unless the writer is elsewhere on the host).
            port: the port, 0 for any free one.
            snapshot: the first document to serve.
        """
        self._server = ThreadingHTTPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self._server.body = snapshot.to_json()  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="weightsync-ipc-registry", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self._server.server_address[1])

    def publish(self, snapshot: RegistrySnapshot) -> None:
        """Serve `snapshot` from now on."""
        self._server.body = snapshot.to_json()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
