"""What a reference replica does with input it must not take: bodies over its limits (413,
with and without a Content-Length), token counts beyond the model's context, numbers that
are not finite, and a request the engine fails on (500 naming the route, nothing of the
failure). After each, the replica still serves. One tp=1 replica serves the module."""

from __future__ import annotations

import re

import httpx
import pytest

from servers import app_in_thread, logged, serve_replicas
from weightsync.testing.presets import preset_config, write_random_checkpoint

pytestmark = pytest.mark.faults

API_KEY = "bounded-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
MAX_BODY_BYTES = 1 << 20
MAX_BOOTSTRAP_BODY_BYTES = 2 << 20
CONTEXT_LENGTH = preset_config("tiny")["max_position_embeddings"]
PROMPT = [3, 14, 15, 92]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset_config("tiny"))
    limits = ["--max-body-bytes", str(MAX_BODY_BYTES)]
    limits += ["--max-bootstrap-body-bytes", str(MAX_BOOTSTRAP_BODY_BYTES)]
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
    # Sampling at a subnormal temperature divides the logits into infinities, and torch's
    # sampler raises: a real failure inside a rank, whose text must stay in the log.
    reply = http.post("/generate", json=_sampling(temperature=1e-320), headers=AUTH)
    assert reply.status_code == 500
    assert reply.json() == {
        "error": {
            "message": "internal error in POST /generate: the engine failed; see the server log"
        }
    }
    assert logged(replica, "probability tensor contains")
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


def test_the_replica_still_serves_after_all_of_it(replica, http):
    _still_serves(http)
    assert replica.process.poll() is None
    assert not re.search(r"tp rank \d+ exited", replica.log_path.read_text())
