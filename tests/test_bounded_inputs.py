"""What a reference replica does with input it must not take: bodies over its limits (413,
with and without a Content-Length), token counts beyond the model's context, numbers that
are not finite, and a request the engine fails on (500 naming the route, nothing of the
failure); and callers without the key, who are answered from the head before their body is
read (401), get a second to send each request (408), and a bounded number of connections,
while `/health` keeps answering and a sync completes. After each, the replica still serves.
One tp=1 replica serves the module."""

from __future__ import annotations

import asyncio
import json
import re
import selectors
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import torch

import weightsync as ws
from faults import Stopwatch, record
from servers import app_in_thread, logged, serve_replicas
from weightsync.export import ModelExport
from weightsync.testing.presets import preset_config, random_model, write_random_checkpoint

pytestmark = pytest.mark.faults

API_KEY = "bounded-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
MAX_BODY_BYTES = 1 << 20
MAX_BOOTSTRAP_BODY_BYTES = 2 << 20
UNAUTHENTICATED_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 64
TINY = preset_config("tiny")
CONTEXT_LENGTH = TINY["max_position_embeddings"]
PROMPT = [3, 14, 15, 92]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY)
    limits = ["--max-body-bytes", str(MAX_BODY_BYTES)]
    limits += ["--max-bootstrap-body-bytes", str(MAX_BOOTSTRAP_BODY_BYTES)]
    limits += ["--max-connections", str(MAX_CONNECTIONS)]
    limits += ["--unauthenticated-timeout-s", str(UNAUTHENTICATED_TIMEOUT_S)]
    with serve_replicas(
        checkpoint, api_key=API_KEY, extra_args=limits, log_dir=tmp_path_factory.mktemp("logs")
    ) as (served,):
        yield served


@pytest.fixture
def http(replica):
    with httpx.Client(base_url=replica.url, timeout=60.0) as client:
        yield client


def _sampling(**params) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, **params}}


def _check_no_internals(reply: httpx.Response) -> None:
    for word in ("Traceback", "torch", 'File "'):
        assert word not in reply.text, reply.text


def _still_serves(http: httpx.Client) -> None:
    reply = http.post("/generate", json=_sampling(max_new_tokens=2), headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["output_ids"]) == 2


def _chunks(num_bytes: int, chunk_bytes: int = 64 << 10):
    yield b'{"input_ids": [1], "pad": "'
    for _ in range(num_bytes // chunk_bytes):
        yield b"a" * chunk_bytes
    yield b'"}'


def test_bodies_over_the_limit_are_refused_with_413(replica, http):
    declared = http.post("/generate", content=b" " * (2 * MAX_BODY_BYTES), headers=JSON)
    assert declared.status_code == 413
    message = declared.json()["error"]["message"]
    assert f"limit of {MAX_BODY_BYTES} bytes" in message and "--max-body-bytes" in message
    # No Content-Length: the bytes are counted as they arrive.
    streamed = http.post("/generate", content=_chunks(2 * MAX_BODY_BYTES), headers=JSON)
    assert streamed.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in streamed.request.headers
    assert streamed.status_code == 413, streamed.text
    assert "--max-body-bytes" in streamed.json()["error"]["message"]
    # The limit holds on routes that take no body, before auth, and on the bootstrap server.
    assert http.post("/flush_cache", content=b" " * (2 * MAX_BODY_BYTES)).status_code == 413
    boot = httpx.put(
        f"{replica.bootstrap_url}/register_transfer_engine_info",
        content=_chunks(2 * MAX_BOOTSTRAP_BODY_BYTES),
        headers=JSON,
    )
    assert boot.status_code == 413, boot.text
    boot_message = boot.json()["error"]["message"]
    assert f"limit of {MAX_BOOTSTRAP_BODY_BYTES} bytes" in boot_message
    assert "--max-bootstrap-body-bytes" in boot_message
    # Under the limit is served, padded or not.
    padded = {**_sampling(), "pad": "a" * (MAX_BODY_BYTES // 2)}
    assert http.post("/generate", json=padded, headers=AUTH).status_code == 200
    for reply in (declared, streamed, boot):
        _check_no_internals(reply)
    _still_serves(http)


@pytest.mark.parametrize(
    ("max_new_tokens", "expected"),
    [
        (10**9, f"over this server's limit of {CONTEXT_LENGTH}"),
        (10**30, f"over this server's limit of {CONTEXT_LENGTH}"),
        (1e9, "valid integer"),
        (0, "greater than or equal to 1"),
        (-1, "greater than or equal to 1"),
        (1.5, "valid integer"),
        ("16", "valid integer"),
        (True, "valid integer"),
        (None, "valid integer"),
    ],
)
def test_max_new_tokens_is_a_bounded_positive_int(http, max_new_tokens, expected):
    reply = http.post("/generate", json=_sampling(max_new_tokens=max_new_tokens), headers=AUTH)
    assert reply.status_code == 400, reply.text
    body = reply.json()
    message = body["error"]["message"] if "error" in body else body["message"]
    assert expected in message and "max_new_tokens" in message, message
    _check_no_internals(reply)


def test_prompt_and_new_tokens_stay_within_the_context(http):
    prompt = [5] * (CONTEXT_LENGTH - 4)
    over = http.post(
        "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 5}},
        headers=AUTH,
    )
    assert over.status_code == 400
    message = over.json()["error"]["message"]
    assert f"context length of {CONTEXT_LENGTH}" in message
    assert f"({len(prompt)} tokens)" in message and f"{CONTEXT_LENGTH + 1} tokens" in message
    longer = http.post(
        "/generate",
        json={"input_ids": [5] * (CONTEXT_LENGTH + 1), "sampling_params": {"max_new_tokens": 1}},
        headers=AUTH,
    )
    assert longer.status_code == 400 and "context length" in longer.json()["error"]["message"]
    # Exactly the context is served.
    full = http.post(
        "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}},
        headers=AUTH,
    )
    assert full.status_code == 200, full.text
    assert len(full.json()["output_ids"]) == 4


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('"temperature": NaN', "body.sampling_params.temperature"),
        ('"temperature": Infinity', "body.sampling_params.temperature"),
        ('"temperature": -Infinity', "body.sampling_params.temperature"),
        ('"temperature": 1e309', "body.sampling_params.temperature"),
        # A field the server ignores is refused too: nothing non-finite is parsed anywhere.
        ('"top_p": NaN', "body.sampling_params.top_p"),
    ],
)
def test_numbers_that_are_not_finite_are_refused(http, raw, field):
    body = '{"input_ids": [3, 14], "sampling_params": {"max_new_tokens": 1, ' + raw + "}}"
    reply = http.post("/generate", content=body, headers=JSON)
    assert reply.status_code == 400, reply.text
    assert f"{field}: must be a finite number" in reply.json()["message"]
    _check_no_internals(reply)


def test_negative_temperature_is_refused(http):
    reply = http.post("/generate", json=_sampling(temperature=-0.5), headers=AUTH)
    assert reply.status_code == 400
    message = reply.json()["message"]
    assert "body.sampling_params.temperature" in message and "greater than or equal to 0" in message


def test_a_failure_in_the_engine_is_answered_without_its_details(replica, http):
    # Weights with a NaN, written by a trainer that skipped the finite check, make torch's
    # sampler raise at temperature 1: a real failure inside a rank, whose text must stay in
    # the log. Finite weights synced after it serve again.
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20, timeout_s=5.0, check_finite="never"),
        control=ws.ControlConfig(api_key=API_KEY, lease_s=5.0, lifecycle_timeout_s=5.0),
        transport=ws.MooncakeConfig(timeout_s=5.0),
    )
    model = random_model(TINY, seed=31)
    with ws.TrainerSync(config, hf_config=TINY, replicas=[replica.url]) as sync:
        with torch.no_grad():
            model.lm_head.weight[7, 3] = float("nan")
        sync.sync(ModelExport(model))
        reply = http.post("/generate", json=_sampling(temperature=1.0), headers=AUTH)
        assert reply.status_code == 500
        assert reply.json() == {
            "error": {
                "message": "internal error in POST /generate: the engine failed; see the server log"
            }
        }
        assert logged(replica, "probability tensor contains")
        sync.sync(ModelExport(random_model(TINY, seed=32)))
    _still_serves(http)


def test_an_unhandled_exception_is_a_500_naming_the_route(caplog):
    from fastapi import FastAPI

    from weightsync.server.http import install_error_handler

    app = FastAPI()
    install_error_handler(app)

    @app.post("/explode")
    async def explode() -> None:
        raise MemoryError("DefaultCPUAllocator: can't allocate memory: you tried 8 GB")

    with app_in_thread(app) as url:
        reply = httpx.post(f"{url}/explode")
    assert reply.status_code == 500
    assert reply.json() == {
        "error": {"message": "internal error in POST /explode: MemoryError; see the server log"}
    }
    assert "Allocator" not in reply.text
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "internal error in POST /explode" in logged
    assert any(record.exc_info for record in caplog.records), "the traceback was not logged"


# Callers without the key: answered from the head, timed, and counted.


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _json_array(num_bytes: int, chunk_bytes: int = 64 << 10) -> Iterator[bytes]:
    """A JSON array of ones, `num_bytes` long, in chunks (sent chunked: no Content-Length,
    so no limit on a declared size refuses it first)."""
    yield b"["
    chunk = b"1," * (chunk_bytes // 2)
    for _ in range(num_bytes // chunk_bytes):
        yield chunk
    yield b"1]"


def _chunked_head(path: str, *, method: str = "POST") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()


def _read_reply(sock: socket.socket, timeout_s: float) -> tuple[int, dict]:
    """One whole reply from `sock`: its status and JSON body."""
    sock.settimeout(timeout_s)
    data = b""
    while True:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            lines = data[:end].decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:])
            size = end + 4 + int(headers["content-length"])
            if len(data) >= size:
                return int(lines[0].split()[1]), json.loads(data[end + 4 : size])
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed before a whole reply")
        data += chunk


def _is_closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock`, reading (and dropping) whatever it wrote first."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def _wait_closed(socks: list[socket.socket], *, at_least: int, timeout_s: float) -> int:
    """Wait until the server closed `at_least` of `socks` or `timeout_s` passed; how many
    it closed."""
    clock = Stopwatch()
    closed = 0
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while closed < at_least and clock.seconds < timeout_s:
            for key, _ in selector.select(timeout=timeout_s - clock.seconds):
                if _is_closed(key.fileobj):  # type: ignore[arg-type]
                    selector.unregister(key.fileobj)
                    closed += 1
    return closed


class _HealthProbe:
    """GET ``/health`` on a fresh connection, over and over in a thread, until the block
    ends (at most 500 times): how many answered, and the slowest."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.num_answered = 0
        self.slowest_s = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def _run(self) -> None:
        while not self._stop.is_set() and self.num_answered < 500:
            clock = Stopwatch()
            try:
                reply = httpx.get(f"{self.url}/health", timeout=5.0)
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
                return
            if reply.status_code != 200:
                self.failures.append(f"{reply.status_code} {reply.text}")
            self.slowest_s = max(self.slowest_s, clock.seconds)
            self.num_answered += 1


@pytest.mark.serial  # wall-clock bounds: not beside another test
def test_a_large_body_without_the_key_is_refused_from_its_head(replica):
    # The head alone is answered: no byte of the body is sent before the reply.
    with socket.create_connection(_address(replica.url)) as sock:
        sock.sendall(_chunked_head("/begin_weight_update"))
        status, body = _read_reply(sock, timeout_s=1.0)
    assert status == 401
    assert "needs 'Authorization: Bearer <api key>'" in body["error"]["message"]
    # A client that sends 16 MiB of JSON anyway gets its 401 at once, five times over, and
    # /health answers meanwhile.
    with _HealthProbe(replica.url) as probe:
        clock = Stopwatch()
        for _ in range(5):
            reply = httpx.post(
                f"{replica.url}/begin_weight_update",
                content=_json_array(16 << 20),
                headers={"Content-Type": "application/json"},
                timeout=10.0,
            )
            assert reply.status_code == 401, reply.text
        took = clock.seconds
        probe_answered = probe.num_answered
    assert took < 5 * 1.0, took
    assert not probe.failures, probe.failures
    assert probe_answered >= 1 and probe.slowest_s < 0.5, (probe_answered, probe.slowest_s)
    record("16 MiB JSON body without the key", "401 from its head; /health answers", took / 5)


def test_a_large_put_to_the_bootstrap_server_without_the_key_is_refused_from_its_head(replica):
    clock = Stopwatch()
    reply = httpx.put(
        f"{replica.bootstrap_url}/register_transfer_engine_info",
        content=_json_array(64 << 20),
        headers={"Content-Type": "application/json"},
        timeout=10.0,
    )
    took = clock.seconds
    assert reply.status_code == 401, reply.text
    assert "Authorization: Bearer" in reply.json()["error"]["message"]
    assert took < 1.0, took
    assert httpx.get(f"{replica.bootstrap_url}/health", timeout=5.0).status_code == 200
    record("64 MiB PUT to the bootstrap server without the key", "401 from its head", took)


@pytest.mark.parametrize("server", ["main", "bootstrap"])
def test_half_a_head_is_answered_408_within_the_timeout(replica, server):
    url = replica.url if server == "main" else replica.bootstrap_url
    with socket.create_connection(_address(url)) as sock:
        clock = Stopwatch()
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Ty")
        status, body = _read_reply(sock, timeout_s=UNAUTHENTICATED_TIMEOUT_S + 2.0)
        took = clock.seconds
        assert _wait_closed([sock], at_least=1, timeout_s=2.0) == 1
    assert status == 408
    message = body["error"]["message"]
    assert f"within {UNAUTHENTICATED_TIMEOUT_S:g} s" in message, message
    assert "--unauthenticated-timeout-s" in message, message
    assert UNAUTHENTICATED_TIMEOUT_S * 0.8 < took < UNAUTHENTICATED_TIMEOUT_S + 1.5, took
    record(f"half a request head ({server} server)", "408 naming the limit, closed", took)


def test_idle_sockets_are_bounded_and_closed_after_the_timeout(replica, http):
    num_sockets = 200
    address = _address(replica.url)
    clock = Stopwatch()
    socks = [socket.create_connection(address) for _ in range(num_sockets)]
    try:
        # Past the limit, the oldest idle connections made room for the newest ones.
        evicted = _wait_closed(socks, at_least=num_sockets - MAX_CONNECTIONS, timeout_s=5.0)
        assert evicted >= num_sockets - MAX_CONNECTIONS
        health = Stopwatch()
        assert httpx.get(f"{replica.url}/health", timeout=5.0).status_code == 200
        assert health.seconds < 0.5, health.seconds
        _still_serves(http)
        # And none of them is held past the unauthenticated timeout.
        wait_s = UNAUTHENTICATED_TIMEOUT_S + 3.0
        closed = _wait_closed(socks, at_least=num_sockets, timeout_s=wait_s)
        took = clock.seconds
    finally:
        for sock in socks:
            sock.close()
    assert closed == num_sockets, (evicted, closed)
    record(f"{num_sockets} idle sockets", f"at most {MAX_CONNECTIONS} held; all closed", took)


def _flood(url: str, stop: threading.Event, counts: list[int]) -> None:
    """Send 16 MiB JSON bodies without the key to /begin_weight_sync, one after another,
    until `stop` (at most 200, for at most 60 s)."""
    clock = Stopwatch()
    head = _chunked_head("/begin_weight_sync")
    chunk = b"4000\r\n" + b"1," * (1 << 13) + b"\r\n"  # a 16 KiB chunk of the array
    while not stop.is_set() and counts[0] < 200 and clock.seconds < 60.0:
        try:
            with socket.create_connection(_address(url), timeout=5.0) as sock:
                sock.sendall(head + b"1\r\n[\r\n")
                for _ in range(1024):
                    sock.sendall(chunk)
        except OSError:
            pass  # closed by the server once it dropped a mebibyte
        counts[0] += 1


def test_a_sync_completes_while_unauthenticated_large_requests_arrive(replica, http):
    stop = threading.Event()
    counts = [[0] for _ in range(4)]
    floods = [threading.Thread(target=_flood, args=(replica.url, stop, n)) for n in counts]
    config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=1 << 20, timeout_s=10.0),
        control=ws.ControlConfig(api_key=API_KEY, lifecycle_timeout_s=5.0),
        transport=ws.MooncakeConfig(timeout_s=10.0),
    )
    for flood in floods:
        flood.start()
    try:
        with ws.TrainerSync(config, hf_config=TINY, replicas=[replica.url]) as sync:
            clock = Stopwatch()
            report = sync.sync(ModelExport(random_model(TINY, seed=3)), version="flooded")
            took = clock.seconds
    finally:
        stop.set()
        for flood in floods:
            flood.join(30.0)
    assert len(report.replicas) == 1 and report.verified == report.replicas, report
    assert all(n[0] >= 1 for n in counts), counts
    # Not left paused: it serves generation again, under the new label.
    assert httpx.get(f"{replica.url}/health", timeout=5.0).status_code == 200
    assert http.get("/get_weight_version", headers=AUTH).json() == {"weight_version": "flooded"}
    _still_serves(http)
    refused = sum(n[0] for n in counts)
    outcome = f"completes; {refused} requests without the key refused meanwhile; replica serves"
    record("sync under four unauthenticated 16 MiB floods", outcome, took)


def test_an_authenticated_connection_outlives_the_unauthenticated_timeout(replica):
    address = _address(replica.url)
    request = (
        f"GET /get_weight_version HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n\r\n"
    )
    with socket.create_connection(address) as keyed, socket.create_connection(address) as bare:
        clock = Stopwatch()
        keyed.sendall(request.encode())
        assert _read_reply(keyed, timeout_s=5.0)[0] == 200
        # The connection without the key is closed after the timeout; the keyed one stays
        # open past it, and answers again.
        assert _wait_closed([bare], at_least=1, timeout_s=UNAUTHENTICATED_TIMEOUT_S + 2.0) == 1
        assert _wait_closed([keyed], at_least=1, timeout_s=UNAUTHENTICATED_TIMEOUT_S) == 0
        keyed.setblocking(True)
        keyed.sendall(request.encode())
        assert _read_reply(keyed, timeout_s=5.0)[0] == 200
        took = clock.seconds
    assert took > 2 * UNAUTHENTICATED_TIMEOUT_S * 0.8, took
    record("authenticated keep-alive connection", "open past the unauthenticated timeout", took)


@pytest.mark.serial  # wall-clock bounds: not beside another test
def test_a_large_body_parses_while_the_event_loop_answers():
    from weightsync.server.http import PARSE_INLINE_BYTES, parse_json

    # Integers: the C parser would hold the GIL from the first to the last of them.
    body = b"[" + b"1," * (4 << 20) + b"1]"
    assert len(body) > PARSE_INLINE_BYTES

    async def parse_while_ticking() -> tuple[list, float]:
        stalls: list[float] = []
        parsed = asyncio.Event()

        async def tick() -> None:
            while not parsed.is_set():
                clock = Stopwatch()
                await asyncio.sleep(0.005)
                stalls.append(clock.seconds)

        ticker = asyncio.create_task(tick())
        value = await parse_json(body)
        parsed.set()
        await ticker
        return value, max(stalls)

    value, slowest_s = asyncio.run(parse_while_ticking())
    assert value == json.loads(body)
    assert slowest_s < 0.3, slowest_s


def test_the_replica_still_serves_after_all_of_it(replica, http):
    _still_serves(http)
    assert replica.process.poll() is None
    assert not re.search(r"tp rank \d+ exited", replica.log_path.read_text())
