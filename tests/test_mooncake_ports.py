"""Where a Mooncake engine really listens, against what weightsync's warning and docs say.

Mooncake 0.3.13 takes ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT`` only when the range is one it
accepts (both ends in 1024-65535, outside 32768-60999) and only as the process had them when
Mooncake loaded; any other range binds in 15000-17000. Each case starts a real engine in a
fresh process (Mooncake reads the variables once per process) and reads the ports it bound
from the process's own listening sockets."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from weightsync.transport.mooncake.ports import DEFAULT_PORTS, EPHEMERAL_PORTS, port_range

ROOT = Path(__file__).resolve().parent.parent
PORT_VARIABLES = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT", "MC_MIN_PRC_PORT", "MC_MAX_PRC_PORT")

_ENGINE = textwrap.dedent(
    """
    import json, logging, os, sys

    late = json.loads(sys.argv[1])
    if late:  # Mooncake loaded before the variables are set
        import mooncake.engine
        os.environ.update(late)

    from weightsync.transport import MooncakeConfig, MooncakeTransport
    from weightsync.transport.mooncake.engine import _own_listeners

    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("weightsync.transport.mooncake.engine").addHandler(Keep())
    before = _own_listeners()
    with MooncakeTransport(MooncakeConfig()) as transport:
        bound = sorted(port for _, port in _own_listeners() - before)
        session_port = int(transport.session_id.rsplit(":", 1)[1])
    print(json.dumps({"bound": bound, "session_port": session_port, "warnings": warnings}))
    """
)


def _engine(env_ports: dict[str, str], *, late: bool = False) -> dict:
    env = {name: value for name, value in os.environ.items() if name not in PORT_VARIABLES}
    if not late:
        env.update(env_ports)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _ENGINE, json.dumps(env_ports if late else {})],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["bound"]) == 2 and result["session_port"] in result["bound"], result
    (warning,) = [w for w in result["warnings"] if "listens on every interface" in w]
    result["warning"] = warning
    return result


def test_a_range_in_the_ephemeral_ports_is_ignored_and_the_warning_says_so():
    result = _engine({"MC_MIN_RPC_PORT": "42000", "MC_MAX_RPC_PORT": "42999"})
    low, high = DEFAULT_PORTS
    assert all(low <= port <= high for port in result["bound"]), result
    warning = result["warning"]
    assert f"Mooncake picks them in {low}-{high}, its default" in warning, warning
    assert "ignored MC_MIN_RPC_PORT..MC_MAX_RPC_PORT = 42000-42999" in warning, warning
    assert f"outside {EPHEMERAL_PORTS[0]}-{EPHEMERAL_PORTS[1]}" in warning, warning
    for port in result["bound"]:
        assert str(port) in warning


def test_a_range_mooncake_takes_moves_both_ports_and_the_warning_names_it():
    # A random range below the ephemeral ports, so parallel runs rarely meet.
    low = random.randrange(20000, 32000, 200)
    high = low + 199
    result = _engine({"MC_MIN_RPC_PORT": str(low), "MC_MAX_RPC_PORT": str(high)})
    assert all(low <= port <= high for port in result["bound"]), result
    assert (
        f"Mooncake picks them in {low}-{high} (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)"
        in (result["warning"])
    )


def test_variables_set_after_mooncake_loaded_move_nothing_and_the_warning_says_so():
    result = _engine({"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "20099"}, late=True)
    low, high = DEFAULT_PORTS
    assert all(low <= port <= high for port in result["bound"]), result
    warning = result["warning"]
    assert "picked them outside 20000-20099" in warning, warning
    assert "it reads them once, when it is loaded" in warning, warning


def test_the_docs_say_where_mooncake_binds():
    # What the three tests above measured, as the docs state it.
    readme = (ROOT / "README.md").read_text()
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    for text in (readme, troubleshooting):
        flat = " ".join(text.split())
        assert "15000-17000" in flat and "1024-65535 and outside 32768-60999" in flat
    assert "42000-42999 still binds in 15000-17000" in " ".join(readme.split())


@pytest.mark.parametrize(
    ("environ", "expected", "refused"),
    [
        ({}, (15000, 17000), False),
        ({"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "20099"}, (20000, 20099), False),
        ({"MC_MIN_PRC_PORT": "20000", "MC_MAX_PRC_PORT": "20099"}, (20000, 20099), False),
        ({"MC_MIN_RPC_PORT": "20000", "MC_MAX_PRC_PORT": "20099"}, (20000, 20099), False),
        ({"MC_MIN_RPC_PORT": "16500"}, (16500, 17000), False),
        ({"MC_MIN_RPC_PORT": "20000"}, (15000, 17000), True),  # min > the default max
        ({"MC_MIN_RPC_PORT": "42000", "MC_MAX_RPC_PORT": "42999"}, (15000, 17000), True),
        ({"MC_MIN_RPC_PORT": "32700", "MC_MAX_RPC_PORT": "32768"}, (15000, 17000), True),
        ({"MC_MIN_RPC_PORT": "60999", "MC_MAX_RPC_PORT": "61100"}, (15000, 17000), True),
        ({"MC_MIN_RPC_PORT": "61000", "MC_MAX_RPC_PORT": "61100"}, (61000, 61100), False),
        ({"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "62000"}, (20000, 62000), False),
        ({"MC_MIN_RPC_PORT": "1023", "MC_MAX_RPC_PORT": "1100"}, (15000, 17000), True),
        ({"MC_MIN_RPC_PORT": "65500", "MC_MAX_RPC_PORT": "65536"}, (15000, 17000), True),
        ({"MC_MIN_RPC_PORT": "abc", "MC_MAX_RPC_PORT": "20099"}, (15000, 17000), True),
        ({"MC_MIN_RPC_PORT": " 20000", "MC_MAX_RPC_PORT": "20099x"}, (20000, 20099), False),
    ],
)
def test_port_range_follows_mooncakes_rules(environ, expected, refused):
    # Each row was measured against mooncake-transfer-engine 0.3.13 (where its engine bound).
    ports = port_range(environ)
    assert (ports.low, ports.high) == expected
    assert ports.refused is refused
