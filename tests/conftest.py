"""Settings every test process (and the processes it starts) shares."""

from __future__ import annotations

import os

# Mooncake reads these when an engine is created: quiet logs, and a transfer timeout short
# enough that a test with a dead peer fails in seconds.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
# gloo on loopback only; the machines that run the tests may have no other usable interface.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
