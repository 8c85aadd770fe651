"""A trainer that syncs into one replica and stalls half-way through its push, for the fault
tests: it prints ``pushing`` once part of the weights were written and then waits to be
killed (the test SIGKILLs it there, as a crashed trainer).

Usage: ``python fault_trainer.py URL SEED LEASE_S``
"""

from __future__ import annotations

import sys
import time

import weightsync as ws
from weightsync.testing.presets import preset_config, random_model

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from faults import StallingExport


def main() -> None:
    url, seed, lease_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    config = preset_config("tiny")
    sync_config = ws.SyncConfig(
        # Small buckets: the first ones are written while the stream is still being read.
        # (No finite check: it would read the whole stream, and stall, before any write.)
        sender=ws.SenderConfig(bucket_bytes=64 << 10, num_slots=2, check_finite="never"),
        control=ws.ControlConfig(lease_s=lease_s),
        transport=ws.MooncakeConfig(timeout_s=10.0),
    )

    def stall() -> None:
        time.sleep(1.0)  # the writes of the buckets filled so far land
        print("pushing", flush=True)
        time.sleep(600)

    export = StallingExport(ws.ModelExport(random_model(config, seed=seed)), after=30, hook=stall)
    with ws.TrainerSync(sync_config, hf_config=config, replicas=[url]) as sync:
        sync.sync(export)


if __name__ == "__main__":
    main()
