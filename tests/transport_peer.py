"""A receiving peer process for the transport tests, and the test-side handle on it.

Run as a script, it allocates a buffer, registers it with one transport and prints one JSON
line ``{"session_id": ..., "addr": ..., "num_bytes": ...}`` (the readiness signal). Then it
answers commands on stdin, one reply line each, until ``quit`` or end of input:

- ``sha OFFSET LENGTH``: sha256 hex of those bytes of the buffer;
- ``eqrand SEED``: ``1`` if the buffer equals `random_bytes` of that seed, else ``0``;
- ``zero``: zero the buffer, reply ``ok``.

Buffers: ``--file PATH`` maps a file the test maps too (host memory, so the test reads the
destination directly); ``--device cuda:N`` allocates GPU memory with torch.
Transports: ``--transport mooncake`` (TCP) or ``--transport ipc`` (`CudaIpcTransport`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

SCRIPT = Path(__file__).resolve()
SRC = SCRIPT.parent.parent / "src"


def random_bytes(num_bytes: int, seed: int, device: str) -> Any:
    """`num_bytes` seeded random bytes as a torch uint8 tensor on `device`."""
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.randint(
        0, 256, (num_bytes,), dtype=torch.uint8, device=device, generator=generator
    )


class PeerProcess:
    """A running peer: its session id and buffer address, and its command pipe."""

    def __init__(
        self,
        *,
        num_bytes: int,
        transport: str = "mooncake",
        file: Path | None = None,
        device: str = "cpu",
        env: dict[str, str] | None = None,
    ) -> None:
        """Start the peer and wait for its readiness line.

        Raises:
            RuntimeError: the peer exited before it was ready.
        """
        command = [sys.executable, str(SCRIPT), "--num-bytes", str(num_bytes)]
        command += ["--transport", transport, "--device", device]
        if file is not None:
            command += ["--file", str(file)]
        full_env = dict(os.environ if env is None else env)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SRC), full_env.get("PYTHONPATH", "")) if p
        )
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=full_env,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"peer exited with {self.process.returncode} before it was ready")
        ready = json.loads(line)
        self.session_id: str = ready["session_id"]
        self.addr: int = ready["addr"]
        self.num_bytes: int = ready["num_bytes"]

    def command(self, line: str) -> str:
        """Send one command and return the reply line."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"peer exited with {self.process.poll()} during {line!r}")
        return reply.strip()

    def kill(self) -> None:
        """SIGKILL the peer and reap it."""
        self.process.kill()
        self.process.wait()

    def pause(self) -> None:
        """SIGSTOP the peer: it stays alive but answers nothing."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused peer."""
        self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Ask the peer to quit (kill it if it does not within 30 s)."""
        if self.process.poll() is None:
            self.resume()
            with contextlib.suppress(BrokenPipeError, OSError):
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _serve(args: argparse.Namespace) -> None:
    from weightsync.transport import (
        CudaIpcConfig,
        CudaIpcTransport,
        MooncakeConfig,
        MooncakeTransport,
    )

    tensor = None
    if args.device == "cpu":
        buffer = np.memmap(args.file, dtype=np.uint8, mode="r+", shape=(args.num_bytes,))
        addr = buffer.ctypes.data
    else:
        import torch

        torch.set_num_threads(1)
        tensor = torch.zeros(args.num_bytes, dtype=torch.uint8, device=args.device)
        addr = tensor.data_ptr()
    if args.transport == "ipc":
        transport: Any = CudaIpcTransport(
            CudaIpcConfig(device=torch.device(args.device).index or 0)
        )
    else:
        transport = MooncakeTransport(MooncakeConfig(timeout_s=5.0))
    transport.register(addr, args.num_bytes)
    ready = {"session_id": transport.session_id, "addr": addr, "num_bytes": args.num_bytes}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "sha":
            offset, length = int(words[1]), int(words[2])
            if tensor is not None:
                data = tensor[offset : offset + length].cpu().numpy().tobytes()
            else:
                data = buffer[offset : offset + length].tobytes()
            print(hashlib.sha256(data).hexdigest(), flush=True)
        elif words[0] == "eqrand":
            assert tensor is not None
            expected = random_bytes(args.num_bytes, int(words[1]), args.device)
            print(int(bool((tensor == expected).all().item())), flush=True)
            del expected
        elif words[0] == "zero":
            if tensor is not None:
                tensor.zero_()
                torch.cuda.synchronize(tensor.device)
            else:
                buffer[:] = 0
            print("ok", flush=True)
        else:
            print(f"unknown command {words[0]!r}", flush=True)
    transport.unregister(addr)
    transport.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-bytes", type=int, required=True)
    parser.add_argument("--transport", choices=("mooncake", "ipc"), default="mooncake")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--file", type=Path)
    _serve(parser.parse_args())
