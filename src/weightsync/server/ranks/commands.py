"""The commands rank 0 sends to every rank of the reference engine, and their replies.

Commands and replies are frozen dataclasses: rank 0 pickles them over the replica's control
group (``broadcast_object_list`` / ``gather_object`` on gloo), every rank executes the same
command in the same order, so collectives inside a command (the TP forward pass) line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate:
    """Generate tokens; every rank gets the same arguments, so the same tokens."""

    input_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    seed: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class BeginUpdate:
    """Open a weight-update session on every rank (`fence`: queue each rank's begin digest
    and answer with the event it completes at, `RolloutAgent.begin_update`)."""

    selector: str
    fence: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class EndUpdate:
    """End the weight-update session on every rank: label the weights, verify what arrived
    against the trainers' digests, run post-load processing and close the session.

    Where the trainers' writes may still be landing, the caller sends the command twice:
    first with ``landed=False``, and each rank does now what its end can do before the
    bytes are in (`RolloutAgent.prepare_end`: read a fenced begin's digest, put `expected`
    in the rank's order, with `gated` queue the end's digest behind a gate it replies
    with); then, once they landed (and the gates are open), the same command with
    ``landed=True``, which ends the session with the digests the first one carried.

    Attributes:
        version: the weight version to label the weights with first (a fused
            ``end_weight_sync`` labels them in the same round trip), or None; taken when
            the session ends.
        expected: per tp rank, ``{param_name: digest}`` of what the trainers wrote, or None
            (and an empty tuple) when they sent none: the session then ends unverified.
        gated: with ``landed=False``, each rank queues its end digest behind a gate and
            replies with it, for the caller to open once the writes landed: for a tp=1
            replica, whose one rank replies in the caller's process (a gate is not sent
            between processes).
        landed: the session's bytes are in: end it. False: only prepare the end.
    """

    version: str | None = None
    expected: tuple[dict[str, int] | None, ...] = ()
    gated: bool = False
    landed: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class SetWeightVersion:
    """Label the weights every rank holds."""

    version: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckWeights:
    """One weights-checker action on every rank."""

    action: str
    allow_quant_error: bool
    skip_tensor_list: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaChecksums:
    """Every rank's delta checksums of its parameters (`RolloutAgent.delta_checksums`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyDelta:
    """Apply the delta payloads trainers wrote into each rank's delta region, inside the
    open session, and check them (`RolloutAgent.apply_delta`).

    Attributes:
        payloads: per tp rank, the ``(offset, num_bytes)`` of its payloads in its region.
        expected: per tp rank, ``{param_name: checksum}`` its changed parameters must hold.
        check: how every rank checks them: ``"changes"`` or ``"full"``
            (`weightsync.delta_codec.apply_and_check`).
    """

    payloads: tuple[tuple[tuple[int, int], ...], ...]
    expected: tuple[dict[str, int], ...]
    check: str = "changes"


@dataclass(frozen=True, slots=True, kw_only=True)
class FlushCache:
    """Drop caches; with ``empty_device_cache``, return cached device memory too."""

    empty_device_cache: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown:
    """Leave the command loop, unregister memory and close the transport."""


Command = (
    Generate
    | BeginUpdate
    | EndUpdate
    | SetWeightVersion
    | CheckWeights
    | DeltaChecksums
    | ApplyDelta
    | FlushCache
    | Shutdown
)
"""The reference engine's own commands; server extensions add theirs
(`weightsync.server.extensions`)."""

# Why a rank could not execute a command; the HTTP layer turns kinds into status codes.
REFUSED = "refused"  # not now (a session is open): retry later
CONFLICT = "conflict"  # the call contradicts the state (begin twice, end without begin)
INVALID = "invalid"  # bad arguments
INTERNAL = "internal"  # a bug or a broken rank
OUT_OF_MEMORY = "out_of_memory"  # an allocation failed; the error says what and how much


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReply:
    """What one rank returns for one command.

    Attributes:
        tp_rank: the rank that replied.
        value: the command's result when it succeeded.
        error: why it failed, ``None`` on success.
        error_kind: ``refused``, ``conflict``, ``invalid``, ``internal`` or
            ``out_of_memory`` when it failed.
    """

    tp_rank: int
    value: Any = None
    error: str | None = None
    error_kind: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the command succeeded on this rank."""
        return self.error is None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """What each rank reports to rank 0 once it is ready to serve.

    Attributes:
        tp_rank: the rank.
        session_id: its transport session id.
        weights_info: ``{param_name: [data_ptr, numel, element_size]}``.
        parallelism: its parallelism config dict.
        device: the device its parameters live on.
        dtype: the parameters' dtype name.
        regions: the ``[addr, num_bytes]`` memory regions registered with its transport.
        scratch_region: ``[addr, num_bytes]`` of the scratch buffer registered beside them
            for test writes (never a parameter), or None.
        delta_region: ``[addr, num_bytes]`` of the region trainers write delta payloads
            into, or None.
    """

    tp_rank: int
    session_id: str
    weights_info: dict[str, list[int]]
    parallelism: dict[str, int]
    device: str
    dtype: str
    regions: list[list[int]]
    scratch_region: list[int] | None = None
    delta_region: list[int] | None = None
