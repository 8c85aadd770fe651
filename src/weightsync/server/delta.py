"""Delta syncs on a reference replica: checking a request to apply one before any rank
touches its weights, and saying what a delta that did not verify got wrong.

A trainer writes each rank's delta payloads into the rank's delta region, then asks the
replica to apply them inside the open session (``POST /weightsync/apply_delta``); every
rank applies its own and checks its checksums (`RolloutAgent.apply_delta`). What can be
judged from the request alone (a rank missing, a payload outside its rank's region, a
parameter a rank does not have) is refused here, for every rank at once, so that a bad
request changes no rank's weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightsync.delta_codec import CHECKS
from weightsync.receiver.delta import PAYLOAD_ALIGNMENT, DeltaResult
from weightsync.server.http import ControlError
from weightsync.server.integrity import names
from weightsync.server.ranks.commands import ApplyDelta
from weightsync.server.replica_info import ReplicaInfo

RankDelta = tuple[Sequence[tuple[int, int]], Mapping[str, int]]
"""One rank's part of a delta: its payloads' ``(offset, num_bytes)`` in its delta region,
and ``{param_name: checksum}`` its changed parameters must hold after them."""


def delta_command(
    info: ReplicaInfo, ranks: Mapping[int, RankDelta], *, check: str = "changes"
) -> ApplyDelta:
    """The command that applies `ranks`' deltas on every rank, checked against what each
    rank published, each rank checking them by `check` (``"changes"`` or ``"full"``,
    `weightsync.delta_codec.apply_and_check`).

    Raises:
        ControlError: 400 for a rank missing or unknown, a payload outside its rank's delta
            region (or not at an 8-byte offset), a checksum of a parameter its rank does
            not have, or an unknown `check`.
    """
    if check not in CHECKS:
        raise ControlError(
            f"apply_delta: check must be one of {list(CHECKS)}, got {check!r}; nothing was applied",
            status_code=400,
        )
    num_ranks = info.num_ranks
    missing = sorted(set(range(num_ranks)) - set(ranks))
    unknown = sorted(set(ranks) - set(range(num_ranks)))
    if missing or unknown:
        raise ControlError(
            f"apply_delta needs every tp rank of this replica (0..{num_ranks - 1}) in ranks, "
            f"once each; missing {missing}, unknown {unknown}. A rank without payloads is "
            'given {"payloads": [], "expected": {}}',
            status_code=400,
        )
    payloads = []
    expected = []
    for rank in range(num_ranks):
        spans, sums = ranks[rank]
        size = info.delta_region_bytes(rank)
        for index, (offset, num_bytes) in enumerate(spans):
            if num_bytes <= 0 or offset < 0 or offset + num_bytes > size:
                raise ControlError(
                    f"apply_delta: tp rank {rank}'s payload {index} [{offset}, +{num_bytes}) "
                    f"is not inside its delta region of {size} bytes; nothing was applied. "
                    "Payloads must lie in the delta_region the rank publishes "
                    "(/remote_instance_transfer_engine_info)",
                    status_code=400,
                )
            if offset % PAYLOAD_ALIGNMENT:
                raise ControlError(
                    f"apply_delta: tp rank {rank}'s payload {index} starts at offset {offset}, "
                    f"not a multiple of {PAYLOAD_ALIGNMENT}; nothing was applied",
                    status_code=400,
                )
        strangers = sorted(set(sums) - info.param_names(rank))
        if strangers:
            raise ControlError(
                f"apply_delta: the expected checksums of tp rank {rank} name "
                f"{len(strangers)} parameter(s) it does not have ({', '.join(strangers[:5])}); "
                "nothing was applied",
                status_code=400,
            )
        payloads.append(tuple((int(o), int(n)) for o, n in spans))
        expected.append(dict(sums))
    return ApplyDelta(payloads=tuple(payloads), expected=tuple(expected), check=check)


def delta_problem(results: Sequence[DeltaResult]) -> str | None:
    """What went wrong where the ranks' `results` (by tp rank) did not all verify: the
    ranks, their errors and the first parameters that differ; None when all verified."""
    failed = {rank: r for rank, r in enumerate(results) if not r.verified}
    if not failed:
        return None
    parts = []
    for rank, result in sorted(failed.items()):
        if result.error is not None:
            parts.append(f"tp rank {rank}: {result.error}")
        if result.mismatched:
            parts.append(
                f"{names({rank: result.mismatched})} do not hold the checksum the trainers expect"
            )
    return (
        f"the delta did not verify on tp rank(s) {sorted(failed)}: {'; '.join(parts)}. The "
        "weights are not what the trainers meant and stay incomplete until a complete update "
        "lands: end the session and write full bytes"
    )
