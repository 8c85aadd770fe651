"""An engine pushed past what it can do answers with the cause, and its native noise stays off
the terminal: a rank that runs out of memory answers 507 with the sizes (not a bare 500), a
temperature the sampler cannot use is a 400 naming the field and its range (not a 500 from
inside the engine), and a write to a dead peer leaves no Mooncake ``E...`` line on stderr
(they reach the ``weightsync.transport.mooncake.native`` logger instead).

Real processes: a tp=1 replica of `weightsync serve` (dummy weights, fp32, a vocabulary big
enough that one parameter is 64 MiB), and a writer process with a Mooncake peer."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import torch

from faults import Stopwatch, record
from servers import serve_replicas
from weightsync.testing.presets import preset_config
from weightsync.transport.mooncake.native_log import is_native_line

pytestmark = pytest.mark.faults

API_KEY = "engine-faults-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# 262144 x 64 fp32: the embedding and the LM head are 64 MiB each.
VOCAB_SIZE = 1 << 18
PARAM_BYTES = VOCAB_SIZE * 64 * 4
PROMPT = [3, 14, 15, 92]
TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
# A glog line (Mooncake's) at the start of a line of output.
NATIVE_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.MULTILINE)


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    config = preset_config("tiny", vocab_size=VOCAB_SIZE, torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(config))
    with serve_replicas(
        folder,
        dtype="fp32",
        api_key=API_KEY,
        extra_args=["--load-format", "dummy"],
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as (served,):
        yield served


@pytest.fixture
def http(replica):
    with httpx.Client(base_url=replica.url, timeout=120.0, headers=AUTH) as client:
        yield client


def _generate(http: httpx.Client, **sampling) -> httpx.Response:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, **sampling}}
    return http.post("/generate", json=body)


def _still_serves(http: httpx.Client) -> None:
    reply = _generate(http)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["output_ids"]) == 2


def _address_space_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmSize for process {pid}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_rank_out_of_memory_answers_507_with_the_sizes(replica, http):
    # A real allocation failure: the replica may map only 32 MiB more than it has mapped
    # (RLIMIT_AS), and the snapshot copies parameters of 64 MiB. Nothing is faked.
    pid = replica.process.pid
    clock = Stopwatch()
    limit = _address_space_bytes(pid) + (32 << 20)
    saved = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, saved[1]))
    try:
        reply = http.post("/weights_checker", json={"action": "snapshot"})
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, saved)
    assert reply.status_code == 507, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith("out of memory on tp rank 0 (cpu) in weights_checker snapshot"), (
        message
    )
    assert f"asked for {PARAM_BYTES} bytes (64.00 MiB) of host memory" in message, message
    assert "available now (MemAvailable)" in message and "RLIMIT_AS" in message, message
    for word in ("Traceback", "DefaultCPUAllocator", "enforce fail", "internal error"):
        assert word not in message, message
    record("a rank runs out of memory (weights_checker)", "507 with the sizes", clock.seconds)

    # With the memory back, the same snapshot is taken (in host memory, and it says so).
    taken = http.post("/weights_checker", json={"action": "snapshot"})
    assert taken.status_code == 200, taken.text
    assert "taken in host memory for cpu" in taken.json()["message"]
    compared = http.post("/weights_checker", json={"action": "compare"})
    assert compared.status_code == 200 and compared.json()["success"], compared.text
    _still_serves(http)


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [
        (1e-320, "must be 0 (greedy) or in [1e-05, 100] (sampling), got 1e-320"),
        (5e-324, "must be 0 (greedy) or in [1e-05, 100] (sampling), got 5e-324"),
        (1e-6, "must be 0 (greedy) or in [1e-05, 100] (sampling), got 1e-06"),
        (100.5, "less than or equal to 100"),
        (1e300, "less than or equal to 100"),
        (-1e-320, "greater than or equal to 0"),
    ],
)
def test_a_temperature_the_sampler_cannot_use_is_a_400_naming_its_range(
    http, temperature, expected
):
    clock = Stopwatch()
    reply = _generate(http, temperature=temperature)
    assert reply.status_code == 400, reply.text
    message = reply.json()["message"]
    assert "body.sampling_params.temperature" in message and expected in message, message
    record(f"temperature {temperature!r}", "400 naming the field and range", clock.seconds)


@pytest.mark.parametrize("temperature", [0.0, -0.0, 1e-5, 1.0, 100.0])
def test_temperatures_in_range_are_served(http, temperature):
    reply = _generate(http, temperature=temperature, sampling_seed=3)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["output_ids"]) == 2


def test_the_engine_refuses_a_subnormal_temperature_too():
    # Callers of the engine that are not the HTTP server get a ValueError, not NaNs.
    from weightsync.engine import ReferenceModel, generate
    from weightsync.layout import ParallelismConfig

    model = ReferenceModel(
        preset_config("tiny"),
        ParallelismConfig(tp_size=1, tp_rank=0),
        dtype=torch.float32,
        device="cpu",
    )
    for temperature in (1e-320, 1e-6):
        with pytest.raises(ValueError, match=r"0 \(greedy\) or at least 1e-05"):
            generate(model, PROMPT, max_new_tokens=1, temperature=temperature)
    assert len(generate(model, PROMPT, max_new_tokens=1, temperature=1e-5, seed=1)) == 1


_DEAD_PEER_WRITER = textwrap.dedent(
    """
    import json, logging, os, sys, tempfile
    from pathlib import Path

    import numpy as np

    from transport_peer import PeerProcess
    from weightsync.errors import TransferError
    from weightsync.transport import MooncakeConfig, MooncakeTransport
    from weightsync.transport.mooncake.native_log import NATIVE_LOGGER, flush_native_logs

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    native = logging.getLogger(NATIVE_LOGGER)
    native.addHandler(Keep())
    native.setLevel(logging.DEBUG)
    native.propagate = False
    num_bytes = 1 << 20
    with tempfile.NamedTemporaryFile(dir=sys.argv[1], delete=False) as f:
        f.truncate(num_bytes)
    peer = PeerProcess(num_bytes=num_bytes, file=Path(f.name))
    source = np.ones(num_bytes, dtype=np.uint8)
    writer = MooncakeTransport(MooncakeConfig(timeout_s=5.0))
    writer.register(source.ctypes.data, num_bytes)
    ok = writer.write(peer.session_id, [source.ctypes.data], [peer.addr], [num_bytes])
    writer.wait(ok, 30.0)
    peer.kill()
    failed = []
    for _ in range(3):
        try:
            handle = writer.write(peer.session_id, [source.ctypes.data], [peer.addr], [num_bytes])
            writer.wait(handle, 30.0)
        except TransferError as exc:
            failed.append(str(exc))
    # Other output still reaches stderr, native (written to the descriptor) or Python's.
    os.write(2, b"a native line that is not glog's\\n")
    print("a Python line on stderr", file=sys.stderr, flush=True)
    # Mooncake's I/O thread logs a failure as the writer sees it: wait for its lines.
    for _ in range(100):
        if any(level == "DEBUG" and line.startswith("E") for level, line in records):
            break
        flush_native_logs(1.0)
    writer.close()
    os.unlink(f.name)
    flush_native_logs()
    print(json.dumps({"failed": failed, "records": records}), flush=True)
    """
)


def test_a_failed_write_logs_mooncakes_lines_instead_of_printing_them(tmp_path):
    clock = Stopwatch()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(TESTS), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _DEAD_PEER_WRITER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["failed"]) == 3, result
    assert not NATIVE_LINE.search(proc.stderr), proc.stderr
    assert "a native line that is not glog's\n" in proc.stderr, proc.stderr
    assert "a Python line on stderr\n" in proc.stderr, proc.stderr
    native = [line for _, line in result["records"]]
    errors = [line for level, line in result["records"] if line.startswith("E")]
    assert errors, native
    assert all(is_native_line(line) for line in native), native
    assert any("tcp_transport" in line for line in errors), errors
    assert all(level == "DEBUG" for level, line in result["records"] if line[0] in "IWE")
    record("write to a dead peer", "TransferError; native lines logged, not printed", clock.seconds)
