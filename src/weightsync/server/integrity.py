"""`WeightIntegrity`: whether the weights a replica holds are a complete, verified update.

The replica decides it from its own parameters' digests (`weightsync.receiver.digest`),
trusting no client: a session that ended without a complete update (its lease expired, it
ended labelled but unverified, the trainers' digests did not match what arrived), bytes that
changed outside any session, or ``reset_tensors`` leave the weights incomplete, and the
replica refuses to generate until a complete update lands.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.control.models import WeightsCheckerRequest
from weightsync.receiver.agent import SessionCheck
from weightsync.server.engine_calls import RunOnRanks
from weightsync.server.http import ControlError
from weightsync.server.ranks.commands import CheckWeights

logger = logging.getLogger(__name__)


class WeightIntegrity:
    """The verdict on the weights a replica holds, and what its sessions' digests cost."""

    def __init__(self) -> None:
        self.incomplete: str | None = None
        """Why the weights are not a complete update, or None."""
        self.verified = False
        """The last complete update's digests were verified."""
        self.digest_s = 0.0
        """Seconds the last session's digests took (its slowest rank's, begin and end)."""

    def describe(self) -> dict[str, Any]:
        """``/server_info``'s ``weightsync.weights``: complete, why not, verified."""
        return {
            "complete": self.incomplete is None,
            "incomplete_reason": self.incomplete,
            "verified": self.verified,
        }

    def refusal(self) -> str | None:
        """Why generation may not run for incomplete weights, or None."""
        if self.incomplete is None:
            return None
        return (
            f"the weights are incomplete ({self.incomplete}); the replica serves again once a "
            "complete weight update lands"
        )

    def complete(self, *, verified: bool) -> None:
        """A complete update landed (`verified`: its digests matched the trainers')."""
        if self.incomplete is not None:
            logger.info("a complete weight update landed; the weights are complete again")
        self.incomplete = None
        self.verified = verified

    def mark_incomplete(self, reason: str) -> None:
        """The weights are not a complete update (`reason` says why) until one lands."""
        logger.error(
            "weights incomplete: %s; generation is refused until a complete update", reason
        )
        self.incomplete = reason
        self.verified = False

    def found_changed_outside(self, changed: Mapping[int, Sequence[str]]) -> None:
        """Bytes changed outside any session (`changed`, by tp rank): incomplete weights,
        until a complete update lands."""
        if changed:
            self.mark_incomplete(
                f"parameters changed outside a weight-update session ({names(changed)}): "
                "bytes were written into the replica without a session"
            )

    def judge_end(
        self,
        checks: Sequence[SessionCheck],
        *,
        reason: str,
        verifying: bool,
        versioned: bool,
        leased: bool,
        unverified: bool,
        abandoned: str | None = None,
    ) -> tuple[str | None, tuple[str, ...]]:
        """Decide what the weights are once every rank ended a session (`checks`, by tp
        rank): incomplete when a delta the session applied did not verify on a rank,
        whatever else; complete when the trainers' digests matched (`verifying`), when
        every rank verified the deltas it applied and the holder's ``end_weight_update``
        (`reason`) sent no digests and is not `unverified` (verified then), or when a
        labelled (`versioned`) session ended by ``end_weight_update`` is unleased or
        `unverified`; incomplete when the session was `abandoned` (by its holder, or its
        lease expired: writes may land after the end, so what the ranks saw proves
        nothing), when the digests differ, when a labelled leased session sent none, or
        when an unlabelled one changed bytes; else as before.

        Returns:
            The problem found (None when the update is complete or nothing changed) and,
            after a fenced begin, ``"tp rank r: name"`` of the parameters that had changed
            outside a session before it.
        """
        outside = by_rank(checks, "changed_outside")
        # What a fenced begin would have said first: the verdict on this session follows.
        self.found_changed_outside(outside)
        changed = by_rank(checks, "changed")
        failed_delta = [rank for rank, check in enumerate(checks) if check.delta is False]
        problem: str | None = None
        if abandoned is not None:
            written = f" after writing {names(changed)}" if changed else ""
            problem = (
                f"the weight-update session was abandoned ({abandoned}){written}: writes "
                "may still land after its end, so the weights are not what any update "
                "meant; a complete update must land"
            )
        elif failed_delta:
            problem = (
                f"a delta applied in the weight-update session did not verify on tp rank(s) "
                f"{failed_delta}: the weights are not what the trainers meant, whatever the "
                "end says; a complete update (a full sync) must land"
            )
        elif verifying:
            mismatched = by_rank(checks, "mismatched")
            if mismatched:
                problem = (
                    f"the weights that arrived differ from what the trainers wrote: "
                    f"{names(mismatched)} (digest mismatch; bytes missing, misplaced or "
                    "written from outside the session)"
                )
            else:
                self.complete(verified=True)
        elif (
            reason == "end_weight_update"
            and not unverified
            and checks
            and all(check.delta and check.verified for check in checks)
        ):
            # Every rank checked every byte of the deltas it applied against the trainers'
            # checksums: as good as matching digests.
            self.complete(verified=True)
        elif versioned and reason == "end_weight_update":
            if not leased or unverified:
                self.complete(verified=False)
            else:
                problem = (
                    "the labelled weight-update session ended without digests: nothing "
                    "verified what arrived; end it with the trainers' digests, or with "
                    "unverified=true where the trainers compute none"
                )
        elif changed:
            problem = (
                f"the weight-update session ended ({reason}) without a complete update after "
                f"writing {names(changed)}"
            )
        if problem is not None:
            self.mark_incomplete(problem)
        return problem, named(outside)


def expected_digests(
    digests: Mapping[int, Mapping[str, int]] | None, num_ranks: int
) -> tuple[dict[str, int] | None, ...]:
    """The trainers' digests per tp rank (``{}`` for a rank they sent none for), as a
    session's end takes them; empty when they sent none.

    Raises:
        ControlError: 400 for digests of a tp rank the replica does not have.
    """
    if digests is None:
        return ()
    unknown = sorted(set(digests) - set(range(num_ranks)))
    if unknown:
        raise ControlError(
            f"digests for tp ranks {unknown}: this replica has ranks 0..{num_ranks - 1}",
            status_code=400,
        )
    return tuple(dict(digests[r]) if r in digests else {} for r in range(num_ranks))


async def run_weights_checker(
    run: RunOnRanks, request: WeightsCheckerRequest
) -> tuple[bool, str, dict[str, Any]]:
    """Run a checker action on every rank (the caller decided it may run now).

    Returns:
        ``(success, message, extra)``: for ``compare`` the message lists every differing
        parameter per rank; for ``checksum`` the message is JSON ``{"ranks": [{"tp_rank",
        "checksums": {name: {"sha256", "sum"}}}]}`` and `extra` holds SGLang's fields
        (``ranks``: per rank ``checksums`` ``{name: sha256}`` and ``parallelism_info``).

    Raises:
        ControlError: a rank refused (400 for a bad skip list) or failed.
    """
    results = await run(
        CheckWeights(
            action=request.action,
            allow_quant_error=request.allow_quant_error,
            skip_tensor_list=tuple(request.skip_tensor_list),
        )
    )
    success = all(r.success for r in results)
    if request.action == "checksum":
        ranks = [
            {"tp_rank": rank, "checksums": r.details["checksums"]} for rank, r in enumerate(results)
        ]
        tp_size = len(results)
        sglang_ranks = [
            {
                "checksums": {
                    name: entry["sha256"] for name, entry in r.details["checksums"].items()
                },
                "parallelism_info": [
                    {"role": "target", "tp_rank": rank, "tp_size": tp_size, "rank": rank}
                ],
            }
            for rank, r in enumerate(results)
        ]
        return success, json.dumps({"ranks": ranks}), {"ranks": sglang_ranks}
    message = "\n".join(f"tp rank {rank}: {r.message}" for rank, r in enumerate(results))
    log = logger.info if success else logger.warning
    log("weights_checker %s: %s", request.action, message)
    return success, message, {}


def by_rank(checks: Sequence[SessionCheck], field: str) -> dict[int, tuple[str, ...]]:
    """``{tp_rank: names}`` of the ranks whose `SessionCheck` lists names in `field`."""
    return {rank: getattr(c, field) for rank, c in enumerate(checks) if getattr(c, field)}


def named(by_rank: Mapping[int, Sequence[str]]) -> tuple[str, ...]:
    """``"tp rank r: name"`` for every name of `by_rank`."""
    return tuple(f"tp rank {rank}: {name}" for rank, listed in by_rank.items() for name in listed)


def names(by_rank: Mapping[int, Sequence[str]]) -> str:
    """At most five names per rank of `by_rank`, with how many there are, for a message."""
    parts = []
    for rank, listed in sorted(by_rank.items()):
        more = f" and {len(listed) - 5} more" if len(listed) > 5 else ""
        parts.append(f"tp rank {rank}: {len(listed)} parameter(s) ({', '.join(listed[:5])}{more})")
    return "; ".join(parts)
