"""The same protocol checks (tests/conformance.py) against the reference server and against
real SGLang 0.5.23 on this CPU: what one passes, the other must pass too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import conformance
from conformance import Endpoint
from conftest import SGLANG_API_KEY
from servers import serve_replicas

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(sglang_checkpoint, tmp_path_factory) -> Iterator[Endpoint]:
    logs = tmp_path_factory.mktemp("reference-logs")
    with serve_replicas(
        sglang_checkpoint, tp=1, dtype="fp32", api_key=SGLANG_API_KEY, log_dir=logs
    ) as (replica,):
        yield Endpoint(
            kind="reference",
            url=replica.url,
            bootstrap_url=replica.bootstrap_url,
            api_key=SGLANG_API_KEY,
            tp=1,
            checkpoint=sglang_checkpoint,
        )


@pytest.fixture(scope="module")
def sglang(sglang_servers, sglang_checkpoint) -> Endpoint:
    server = sglang_servers[0]
    return Endpoint(
        kind="sglang",
        url=server.url,
        bootstrap_url=server.bootstrap_url,
        api_key=SGLANG_API_KEY,
        tp=server.tp,
        checkpoint=sglang_checkpoint,
    )


@pytest.fixture(params=["reference", pytest.param("sglang", marks=pytest.mark.sglang)])
def server(request) -> Endpoint:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__)
def test_both_servers_answer_alike(server: Endpoint, check) -> None:
    check(server)


def test_weights_checker_and_push_restore_every_byte(server: Endpoint, tmp_path) -> None:
    conformance.check_weights_checker_and_push(server, tmp_path)
