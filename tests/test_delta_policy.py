"""`ControlConfig.delta_when="faster"`: a replica takes a delta only while its measured deltas
beat its measured full writes (over a same-GPU or NVLink link full bytes cost less than
encoding a delta), a full write timed while the plan was built is measured again, and a
replica held on full bytes tries a delta again after `RETRY_DELTA_AFTER` syncs.

The driver's side alone (`weightsync.manager.delta.DeltaSyncs`), with a replica that proves
its base as asked; the syncs end to end are `test_delta_sync`'s."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from weightsync.manager.config import ControlConfig
from weightsync.manager.delta import RETRY_DELTA_AFTER, DeltaSyncs

URL = "http://replica"
CHECKSUMS = {0: {"w": 7}}


class _Replica:
    """A replica serving deltas that proves its base whenever asked (and counts the asks)."""

    def __init__(self) -> None:
        self.proofs = 0

    async def delta_checksums(self, *, session_token, timeout_s):
        self.proofs += 1
        return CHECKSUMS


def _syncs(when: str) -> tuple[DeltaSyncs, _Replica]:
    replica = _Replica()
    replicas = SimpleNamespace(
        protocols={URL: SimpleNamespace(kind="weightsync", serves=lambda capability: True)},
        clients={URL: replica},
        server_infos={},
    )
    return DeltaSyncs(replicas, timeout_s=5.0, when=when), replica


class _Driver:
    """Runs updates through `DeltaSyncs` as the manager does: choose, then record the
    verified outcome with the push phase the sync took."""

    def __init__(self, syncs: DeltaSyncs) -> None:
        self.syncs = syncs
        self.reference: int | None = None
        self.pushes = 0

    def sync(self, *, full_s: float, delta_s: float, refreshed: bool = False) -> str:
        """One update; returns the mode chosen (the push took `full_s` or `delta_s`)."""
        self.pushes += 1
        target = SimpleNamespace(replica=URL, delta_region=(0, 1 << 20), rank=0)
        update = SimpleNamespace(
            replicas=(URL,),
            targets=[target],
            sessions=SimpleNamespace(tokens={}),
            delta=None,
            metadata_refreshed=refreshed,
        )
        choice = asyncio.run(self.syncs.choose(update, token=self.pushes, reference=self.reference))
        mode = choice.mode(URL)
        choice.after[URL] = CHECKSUMS
        self.reference = self.pushes
        self.syncs.record(
            update,
            [URL],
            reference=self.reference,
            push_s=delta_s if mode == "delta" else full_s,
        )
        return mode


def test_over_a_fast_link_the_replica_stays_on_full_bytes() -> None:
    """Deltas slower than full writes (a colocated replica): after one delta and one steady
    full write are timed, full bytes, without asking the replica to prove its base; a delta
    again after `RETRY_DELTA_AFTER` of them."""
    syncs, replica = _syncs("faster")
    driver = _Driver(syncs)
    # The first sync builds the plan (metadata fetched): its full write is not steady.
    assert driver.sync(full_s=1.4, delta_s=0.2, refreshed=True) == "full"
    assert driver.sync(full_s=0.02, delta_s=0.2) == "delta"
    proofs = replica.proofs
    assert driver.sync(full_s=0.02, delta_s=0.2) == "full"  # timed in a steady sync
    modes = [driver.sync(full_s=0.02, delta_s=0.2) for _ in range(RETRY_DELTA_AFTER + 1)]
    assert modes == ["full"] * RETRY_DELTA_AFTER + ["delta"]
    # Full writes the policy chose asked for no proof: only the retried delta did.
    assert replica.proofs == proofs + 1
    why = asyncio.run(_reason(driver))
    assert "0.0200 s" in why and "0.2000 s" in why and "delta_when='faster'" in why


async def _reason(driver: _Driver) -> str:
    target = SimpleNamespace(replica=URL, delta_region=(0, 1 << 20), rank=0)
    update = SimpleNamespace(
        replicas=(URL,), targets=[target], sessions=SimpleNamespace(tokens={}), delta=None
    )
    choice = await driver.syncs.choose(update, token=99, reference=driver.reference)
    return choice.full[URL]


def test_behind_a_slow_link_the_replica_keeps_taking_deltas() -> None:
    """Deltas faster than full writes (a replica behind a NIC): one steady full write is
    timed, then deltas from there on."""
    driver = _Driver(_syncs("faster")[0])
    modes = [driver.sync(full_s=1.2, delta_s=0.3, refreshed=True)]
    modes += [driver.sync(full_s=1.2, delta_s=0.3) for _ in range(2 * RETRY_DELTA_AFTER)]
    assert modes[:3] == ["full", "delta", "full"]
    assert modes[3:] == ["delta"] * (len(modes) - 3)


def test_always_takes_a_delta_whatever_the_times() -> None:
    """The default: every replica that proves its base takes a delta."""
    driver = _Driver(_syncs("always")[0])
    modes = [driver.sync(full_s=0.01, delta_s=1.0) for _ in range(4)]
    assert modes == ["full", "delta", "delta", "delta"]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="delta_when='sometimes'"):
        ControlConfig(delta_when="sometimes")
