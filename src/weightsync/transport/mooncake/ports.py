"""Which ports a Mooncake TransferEngine listens on, and what moves them.

Mooncake (0.3.x) picks both ports of an engine, its P2P handshake (RPC) port and its TCP
data port, at random from ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT`` (each falling back to its
misspelt alias ``MC_MIN_PRC_PORT`` / ``MC_MAX_PRC_PORT``), 15000-17000 by default. Two rules
make a range in the environment not the one it uses, silently but for one glog line:

- it reads the variables once per process, when its library is loaded (the first ``import
  mooncake.engine``); setting them later in the process moves nothing;
- it takes a range only when both ends lie in 1024-65535 and outside 32768-60999 (Linux's
  default ephemeral ports, fixed in Mooncake's ``ValidatePortRange``) and min <= max; any
  other range it replaces by 15000-17000 ("Invalid port range [...], falling back to default").

Measured with mooncake-transfer-engine 0.3.13 (tests/test_mooncake_ports.py): 42000-42999
binds in 15000-17000, while 20000-20099 and 61000-61100 bind where they say. `port_range`
applies the same rules to an environment, so the warning about where an engine listens names
the range it really binds in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORTS = (15000, 17000)
"""Mooncake's own port range, used when the environment names none it takes."""
EPHEMERAL_PORTS = (32768, 60999)
"""Ports Mooncake refuses as either end of a range (the kernel hands them to clients)."""
_ALLOWED_PORTS = (1024, 65535)
# Per end of the range: the variable and the misspelt alias Mooncake also reads.
_VARIABLES = (("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT"), ("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT"))
PORT_VARIABLES = tuple(name for pair in _VARIABLES for name in pair)
"""The environment variables Mooncake reads its port range from."""
_ATOI = re.compile(r"\s*([+-]?\d+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class PortRange:
    """The range Mooncake picks an engine's ports from.

    Attributes:
        low: the lowest port it may pick.
        high: the highest port it may pick.
        asked: the range the environment named, or None where it named none.
    """

    low: int
    high: int
    asked: tuple[int, int] | None = None

    @property
    def refused(self) -> bool:
        """Whether the environment named a range Mooncake does not take."""
        return self.asked is not None and self.asked != (self.low, self.high)

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.low <= port <= self.high

    def describe(self) -> str:
        """Where the ports lie and why (``"15000-17000, its default (...)"``), to follow
        "Mooncake picks them in" in a warning or an error."""
        where = f"{self.low}-{self.high}"
        if self.asked is None:
            return (
                f"{where}, its default (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT move it when set "
                f"before the process starts, {_RULE})"
            )
        asked = f"{self.asked[0]}-{self.asked[1]}"
        if self.refused:
            return (
                f"{where}, its default: it ignored MC_MIN_RPC_PORT..MC_MAX_RPC_PORT = {asked}, "
                f"as it takes only a range with {_RULE}"
            )
        return f"{where} (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)"


_RULE = (
    f"both ends in {_ALLOWED_PORTS[0]}-{_ALLOWED_PORTS[1]} and outside "
    f"{EPHEMERAL_PORTS[0]}-{EPHEMERAL_PORTS[1]}, the kernel's ephemeral ports"
)


def port_range(environ: Mapping[str, str]) -> PortRange:
    """The range Mooncake picks its ports from when its library is loaded with `environ`."""
    values = []
    for (name, alias), default in zip(_VARIABLES, DEFAULT_PORTS, strict=True):
        text = environ.get(name, environ.get(alias))
        values.append(default if text is None else _atoi(text))
    asked = (values[0], values[1])
    named = any(name in environ for name in PORT_VARIABLES)
    low, high = asked
    if all(_takes(port) for port in asked) and low <= high:
        return PortRange(low=low, high=high, asked=asked if named else None)
    return PortRange(low=DEFAULT_PORTS[0], high=DEFAULT_PORTS[1], asked=asked)


def _takes(port: int) -> bool:
    """Whether Mooncake takes `port` as an end of its range."""
    allowed = _ALLOWED_PORTS[0] <= port <= _ALLOWED_PORTS[1]
    return allowed and not EPHEMERAL_PORTS[0] <= port <= EPHEMERAL_PORTS[1]


def _atoi(text: str) -> int:
    """C's ``atoi``, as Mooncake parses the variables: leading digits, else 0."""
    match = _ATOI.match(text)
    return int(match.group(1)) if match else 0
