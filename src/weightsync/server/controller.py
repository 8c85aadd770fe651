"""`ReplicaController`: the serving state of a reference replica and what each route does.

It lives on rank 0's event loop and turns route calls into engine commands. Its state:

- paused (``pause_generation`` .. ``continue_generation``): new generation requests are
  refused (503); ``abort`` mode aborts the queued ones, the other modes hold them;
- a weight-update session (``begin_weight_update`` .. ``end_weight_update``): generation is
  refused (503) and queued requests are held, so no token comes from half-written weights.
  A session begun with ``lease_s`` is a lease: its ``session_token`` must accompany the
  session's version, renew and end calls, and when it is not renewed in time the replica
  closes it itself;
- incomplete weights: a session that ended without a complete update (its lease expired,
  it ended without a version after bytes changed, the trainers' digests did not match what
  arrived), bytes that changed outside any session, or ``reset_tensors``: the replica refuses
  ``/generate`` (503) and ``continue_generation`` (400) until a complete update lands, and
  ``/server_info`` says why. The replica decides this from its own parameters' digests
  (`weightsync.receiver.digest`), trusting no client;
- released memory (``release_memory_occupation`` .. ``resume_memory_occupation``): allowed
  only when paused or idle; generation is refused meanwhile. Parameters are never released:
  they are registered with the transfer engine and never move.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync import __version__
from weightsync.control.labels import numeric_label
from weightsync.control.models import GenerateRequest, GenerateResponse, WeightsCheckerRequest
from weightsync.control.protocol import (
    GET_WEIGHT_VERSION,
    PARALLELISM_CONFIG,
    POST_LOAD_AT_UPDATE_END,
    WEIGHT_SYNC_EVENTS,
    WEIGHT_SYNC_FENCE,
    WEIGHT_SYNC_FUSED,
    WEIGHT_UPDATE_DIGEST,
    WEIGHT_UPDATE_LEASE,
)
from weightsync.cuda_events import IpcEvents
from weightsync.server.http import ControlError
from weightsync.server.limits import GenerationBounds
from weightsync.server.ranks.commands import (
    CONFLICT,
    INTERNAL,
    INVALID,
    OUT_OF_MEMORY,
    REFUSED,
    BeginUpdate,
    CheckWeights,
    Command,
    EndUpdate,
    FlushCache,
    Generate,
    PrepareEnd,
    SetWeightVersion,
)
from weightsync.server.ranks.driver import EngineDriver, EngineStoppedError
from weightsync.server.replica_info import ReplicaInfo
from weightsync.server.scheduler import GenerationQueue

logger = logging.getLogger(__name__)

# What the reference server serves beyond SGLang 0.5.23, advertised in /server_info.
CAPABILITIES = (
    PARALLELISM_CONFIG,
    GET_WEIGHT_VERSION,
    WEIGHT_UPDATE_LEASE,
    WEIGHT_UPDATE_DIGEST,
    POST_LOAD_AT_UPDATE_END,
)
# Advertised too unless the server was started with the fused lifecycle off.
FUSED_CAPABILITIES = (WEIGHT_SYNC_FUSED,)


class _NotLandedError(ControlError):
    """The trainers' events a fused end was to wait for cannot be, or were not, reached."""


# How long a fused end without a budget waits for the trainers' in-flight copies, and for
# how long of it the event loop looks at their events without sleeping.
_LANDING_TIMEOUT_S = 60.0
_SPIN_S = 0.05
# 507 Insufficient Storage: a rank ran out of memory; unlike a 500, its reply carries the
# sizes (`weightsync.server.ranks.memory`).
_STATUS_OF_KIND = {REFUSED: 503, CONFLICT: 400, INVALID: 400, INTERNAL: 500, OUT_OF_MEMORY: 507}
# Tags of SGLang's memory saver. Parameter memory is registered with the transfer engine and
# must never move, so "weights" cannot be released here.
_RELEASABLE_TAGS = frozenset({"kv_cache", "cuda_graph"})
_KNOWN_TAGS = _RELEASABLE_TAGS | {"weights"}
MAX_LEASE_S = 3600.0


@dataclass(slots=True)
class _Session:
    """An open weight-update session: its holder's token (leased sessions), its deadline."""

    selector: str
    token: str | None
    lease_s: float | None
    deadline: float | None = None  # time.monotonic() when the lease expires
    timer: asyncio.TimerHandle | None = None
    versioned: bool = False


class StepRefusedError(ControlError):
    """A step of a fused lifecycle call refused: the status and message are the step's own.

    Attributes:
        route: the step's route (``/pause_generation``, ...).
        completed: the routes of the steps that ran before it, in order.
    """

    def __init__(self, cause: ControlError, *, route: str, completed: Sequence[str]) -> None:
        super().__init__(str(cause), status_code=cause.status_code)
        self.route = route
        self.completed = tuple(completed)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionGrant:
    """What `ReplicaController.begin_weight_update` grants.

    Attributes:
        message: the reply's message.
        token: the session token its holder sends with the session's calls (leased only).
        lease_s: the lease, in seconds (leased only).
        changed_outside: ``"tp rank r: name"`` of the parameters whose bytes changed since
            the last session ended (written from outside any session); a fenced begin's are
            known at the end (`SessionEnd`).
        fences: a fenced begin's IPC handles (hex) of the CUDA events each tp rank's begin
            digest completes at, by tp rank: writes into a rank must follow its event.
        weight_version: the label of the weights the replica holds as the session begins.
        instance: the replica process's identity (`ReplicaController.instance`).
        highest_version: the largest numeric label (`weightsync.control.labels`) this
            process has held, or None.
    """

    message: str
    token: str | None = None
    lease_s: float | None = None
    changed_outside: tuple[str, ...] = ()
    fences: tuple[str, ...] = ()
    weight_version: str | None = None
    instance: str | None = None
    highest_version: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionEnd:
    """What `ReplicaController.end_weight_update` reports.

    Attributes:
        message: the reply's message.
        changed_outside: after a fenced begin, ``"tp rank r: name"`` of the parameters whose
            bytes had changed outside any session before it (the begin could not say).
    """

    message: str
    changed_outside: tuple[str, ...] = ()


class ReplicaController:
    """The semantics of the main server's routes over an `EngineDriver`.

    Every method raises `ControlError` (carrying the HTTP status to answer) when it refuses.

    Args:
        driver: rank 0's engine thread, started and ready.
        info: the replica's static description.
        weight_version: the label of the weights the replica starts with.
        bounds: how long a generation request may be; ``None``: the model's context length.
        fused_lifecycle: serve `begin_weight_sync` and `end_weight_sync` (and advertise
            ``weight_sync_fused``).
        events: opens the CUDA events a fused end may wait for (a replica on a GPU);
            with it and `fused_lifecycle`, ``weight_sync_events`` is advertised.
        fence: sessions may begin with a fence (``weight_sync_fence``, with
            `fused_lifecycle`): every rank's parameters are on a GPU and every writer on
            this host (the CUDA IPC transport), able to wait for the rank's event.
    """

    def __init__(
        self,
        driver: EngineDriver,
        *,
        info: ReplicaInfo,
        weight_version: str,
        bounds: GenerationBounds | None = None,
        fused_lifecycle: bool = True,
        events: IpcEvents | None = None,
        fence: bool = False,
    ) -> None:
        self._driver = driver
        fused = FUSED_CAPABILITIES + ((WEIGHT_SYNC_EVENTS,) if events is not None else ())
        fused += (WEIGHT_SYNC_FENCE,) if fence else ()
        self.capabilities = CAPABILITIES + (fused if fused_lifecycle else ())
        self._events = events
        self.info = info
        self._bounds = bounds or GenerationBounds.of_model(info.hf_config)
        self._weight_version = weight_version
        self._highest_version = numeric_label(weight_version)
        self.instance = uuid.uuid4().hex
        """This process's identity: a new one every start, so that a client can tell a
        restarted replica behind the same URL (metadata, plans and digests of the old one
        are void) from the one it wrote to."""
        self._paused_mode: str | None = None
        self._session = "closed"  # closed | opening | open | closing
        self._lease: _Session | None = None
        self._incomplete: str | None = None  # why the weights are not a complete update
        self._verified = False  # the last complete update's digests were verified
        # A fused end's label, sent to the ranks with the session's end (one round trip).
        self._label_with_end: str | None = None
        # Inside a fused call its steps log at debug and the call logs one line of them.
        self._fused_call = False
        self._digest_s = 0.0  # seconds the last session's digests took (slowest rank)
        self._released: set[str] = set()
        self._stopping = False
        self._queue = GenerationQueue(
            run=self._generate_on_ranks,
            blocked=self.generation_refusal,
            weight_version=lambda: self._weight_version,
        )

    def start(self) -> None:
        """Start handing queued generation requests to the engine."""
        self._queue.start()

    async def stop(self) -> None:
        """Refuse new work and abort the queued requests."""
        self._stopping = True
        await self._queue.stop("the server is shutting down")

    @property
    def healthy(self) -> bool:
        """Whether the replica serves (not shutting down, engine alive)."""
        return not self._stopping and not self._driver.stopped

    @property
    def weight_version(self) -> str:
        """The label of the weights the replica holds."""
        return self._weight_version

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Queue a generation request and return its tokens.

        Raises:
            ControlError: 503 while paused, in a weight-update session, with memory released
                or shutting down; 400 for bad input (more tokens than the bounds allow);
                500 if a rank failed.
        """
        refusal = self.generation_refusal()
        if refusal is not None:
            raise ControlError(f"generation refused: {refusal}", status_code=503)
        params = request.sampling_params
        self._bounds.check(
            num_prompt_tokens=len(request.input_ids), max_new_tokens=params.max_new_tokens
        )
        seed = params.sampling_seed
        if seed is None and params.temperature > 0:
            # Every rank must sample with the same seed; rank 0 draws it for all.
            seed = secrets.randbits(63)
        command = Generate(
            input_ids=tuple(request.input_ids),
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            seed=seed,
        )
        return await self._queue.submit(command, rid=request.rid or uuid.uuid4().hex)

    async def pause_generation(self, mode: str) -> str:
        """Stop starting requests; ``abort`` also aborts the queued ones (``retract`` and
        ``in_place`` hold them until `continue_generation`). Returns once none runs."""
        self._paused_mode = mode
        aborted = 0
        if mode == "abort":
            aborted = await self._queue.abort(lambda _: True, "aborted by pause_generation")
        waited = await self._queue.wait_idle()
        self._log_step("generation paused (mode=%s): %d queued request(s) aborted", mode, aborted)
        message = f"Generation paused (mode={mode}): {aborted} queued request(s) aborted"
        if self._queue.num_queued:
            message += f", {self._queue.num_queued} held until continue_generation"
        if waited:
            message += "; the running request finished first"
        return message

    async def continue_generation(self, torch_empty_cache: bool) -> str:
        """Serve requests again (``torch_empty_cache``: return cached device memory first).

        Raises:
            ControlError: 400 while a weight-update session is open (its holder ends it
                first) or the weights are incomplete (a complete update must land first).
        """
        if self._session != "closed":
            raise ControlError(
                f"continue_generation refused: a weight-update session is {self._session}; "
                "serving now would use half-written weights. The session's holder ends it "
                "with end_weight_update (a leased session also ends when its lease expires)",
                status_code=400,
            )
        if self._incomplete is not None:
            raise ControlError(
                f"continue_generation refused: the weights are incomplete ({self._incomplete});"
                " the replica serves again once a complete weight update lands",
                status_code=400,
            )
        if torch_empty_cache:
            await self._run(FlushCache(empty_device_cache=True))
        self._paused_mode = None
        await self._queue.notify()
        self._log_step("generation continued")
        return "Generation continued"

    async def abort_request(self, rid: str, abort_all: bool) -> str:
        """Abort queued request `rid`, or every queued request."""
        aborted = await self._queue.abort(
            lambda queued: abort_all or queued == rid, "aborted by abort_request"
        )
        logger.info("abort_request(rid=%r, abort_all=%s): %d aborted", rid, abort_all, aborted)
        message = f"{aborted} queued request(s) aborted"
        running = self._queue.running_rid
        if running is not None and (abort_all or running == rid):
            message += "; the running request finishes (generation is not interruptible)"
        return message

    async def release_memory_occupation(self, tags: Sequence[str] | None) -> str:
        """Release KV-cache memory while idle; generation is refused until it is resumed.

        Raises:
            ControlError: 400 when requests are in flight and generation is not paused, for
                the ``weights`` tag (parameters never move) and for unknown tags.
        """
        wanted = _tags(tags, default=_RELEASABLE_TAGS)
        if "weights" in wanted:
            raise ControlError(
                "releasing 'weights' is not supported: parameter memory is registered with "
                "the transfer engine and never moves (no memory saver / weight offload); "
                "release ['kv_cache'] instead",
                status_code=400,
            )
        busy = self._queue.num_queued + self._queue.num_running
        if self._paused_mode is None and busy:
            raise ControlError(
                f"release_memory_occupation refused: the server is not idle ({busy} "
                "request(s) in flight); call pause_generation first",
                status_code=400,
            )
        self._released |= wanted
        self._log_step("released memory %s; generation refused until resumed", sorted(wanted))
        return (
            f"Released {sorted(wanted)}; the reference engine keeps no KV cache between "
            "requests and its parameters stay registered in place"
        )

    async def resume_memory_occupation(self, tags: Sequence[str] | None) -> str:
        """Take back what `release_memory_occupation` released."""
        wanted = _tags(tags, default=_KNOWN_TAGS)
        self._released -= wanted
        await self._queue.notify()
        self._log_step("resumed memory %s", sorted(wanted))
        return f"Resumed {sorted(wanted)}"

    async def flush_cache(self) -> str:
        """Drop cached state computed with old weights: the reference engine keeps none (no
        prefix cache; each request's KV cache is its own), so nothing runs on the ranks."""
        return "Cache flushed."

    async def begin_weight_update(
        self, selector: str, *, lease_s: float | None = None, fence: bool = False
    ) -> SessionGrant:
        """Open a weight-update session on every rank; generation stops until it ends.

        With `lease_s` the session is a lease held by whoever gets the returned token: its
        other calls must carry the token, and unless renewed within `lease_s` the replica
        closes it itself (leaving the weights incomplete if anything changed). With
        `fence` each rank's begin digest is queued on its GPU, not waited for: the grant
        carries the events it completes at (every writer waits for its rank's before it
        writes), and the end says what changed outside a session.

        Raises:
            ControlError: 400 when a session is already open, `selector` is ``draft``, the
                lease is out of range, or `fence` where this replica cannot fence.
        """
        if self._session != "closed":
            raise ControlError(
                f"a weight-update session is already {self._session}; call "
                "end_weight_update before beginning another",
                status_code=400,
            )
        _check_lease(lease_s)
        if fence and WEIGHT_SYNC_FENCE not in self.capabilities:
            raise ControlError(
                "fence: this replica cannot fence a session (it takes writes from other hosts, "
                "or its weights are not on a GPU; it does not advertise weight_sync_fence)",
                status_code=400,
            )
        self._session = "opening"
        try:
            checks = await self._run(BeginUpdate(selector=selector, fence=fence), inline=True)
        except BaseException:
            self._session = "closed"
            await self._queue.notify()
            raise
        self._digest_s = max(c.seconds for c in checks)
        changed = _by_rank(checks, "changed")
        self._found_changed_outside(changed)
        token = secrets.token_urlsafe(24) if lease_s is not None else None
        session = self._lease = _Session(selector=selector, token=token, lease_s=lease_s)
        self._session = "open"
        if lease_s is not None:
            self._arm(session, lease_s)
        self._log_step(
            "weight-update session opened (selector=%s%s)",
            selector,
            f", lease {lease_s:g} s" if lease_s is not None else "",
        )
        return SessionGrant(
            message=f"Weight update session begun (selector={selector})",
            token=token,
            lease_s=lease_s,
            changed_outside=_named(changed),
            fences=tuple(c.fence for c in checks) if fence else (),
            weight_version=self._weight_version,
            instance=self.instance,
            highest_version=self._highest_version,
        )

    async def renew_weight_update(self, token: str | None, lease_s: float) -> float:
        """Extend the open session's lease by `lease_s` from now; returns the lease.

        Raises:
            ControlError: 400 when no leased session is open, for another holder's token or
                a lease out of range.
        """
        _check_lease(lease_s)
        session = self._holder(token, "renew_weight_update")
        if session.token is None:
            raise ControlError(
                "the open weight-update session has no lease (it was begun without lease_s)",
                status_code=400,
            )
        self._arm(session, lease_s)
        return lease_s

    async def end_weight_update(
        self,
        *,
        token: str | None = None,
        digests: Mapping[int, Mapping[str, int]] | None = None,
        unverified: bool = False,
        after_events: Sequence[str] = (),
        landing_timeout_s: float = _LANDING_TIMEOUT_S,
    ) -> SessionEnd:
        """Verify what arrived, run post-load processing and close the session.

        A leased session (a weightsync client's) that was labelled is complete only with
        `digests` that match, or where its holder says it sends none (`unverified`: the
        weights then serve as unverified); a labelled end with neither leaves the weights
        incomplete, since nothing checked what arrived. An unleased session keeps SGLang's
        rule: labelled, it is complete.

        Args:
            token: the session token (required for a leased session).
            digests: per tp rank, ``{param_name: digest}`` of what the trainers wrote; every
                rank's digests must be given and match, or the update is incomplete.
            unverified: the holder computed no digests and takes the weights unverified.
            after_events: IPC handles (hex) of the CUDA events the trainers' copies complete
                at: the end waits for them, up to `landing_timeout_s`, before it verifies
                (a replica that took `events`).
            landing_timeout_s: how long to wait for `after_events`.

        Returns:
            The reply's message (with a failed verification the error says what differs)
            and, after a fenced begin, what had changed outside a session.

        Raises:
            ControlError: 400 when no session is open, for another holder's token, for
                events this replica cannot wait for, or when the digests do not match what
                arrived (the session is closed and the weights are incomplete); 504 when
                the events were not reached in time (the session is closed and the weights
                are incomplete: bytes may still be on their way).
        """
        if self._session != "open":
            raise ControlError(
                f"no weight-update session is open (session {self._session}); call "
                "begin_weight_update first",
                status_code=400,
            )
        session = self._holder(token, "end_weight_update")
        expected: tuple[dict[str, int] | None, ...] = ()
        if digests is not None:
            num_ranks = self.info.num_ranks
            unknown = sorted(set(digests) - set(range(num_ranks)))
            if unknown:
                raise ControlError(
                    f"digests for tp ranks {unknown}: this replica has ranks 0..{num_ranks - 1}",
                    status_code=400,
                )
            expected = tuple(dict(digests[r]) if r in digests else {} for r in range(num_ranks))
        problem, outside = await self._close(
            session,
            expected,
            reason="end_weight_update",
            unverified=unverified,
            after_events=after_events,
            landing_timeout_s=landing_timeout_s,
        )
        if problem is not None:
            raise ControlError(problem, status_code=400)
        self._log_step("weight-update session ended (weight version %s)", self._weight_version)
        return SessionEnd(message="Weight update session ended", changed_outside=outside)

    async def _await_landing(self, handles: Sequence[str], timeout_s: float) -> None:
        """Wait until the trainers' events are reached, looking at them between the loop's
        other work: the end starts the moment the copies land (a worker thread would add a
        wake-up of this loop, a quarter of a millisecond, after them). The loop turns
        without sleeping for the first `_SPIN_S` (a colocated copy takes milliseconds),
        then a millisecond at a time.

        Raises:
            _NotLandedError: the events cannot be waited for here (400), or were not reached
                within `timeout_s` (504).
        """
        if self._events is None:
            raise _NotLandedError(
                "after_events: this replica cannot wait for CUDA events (its weights are not "
                "on a GPU; it does not advertise weight_sync_events)",
                status_code=400,
            )
        try:
            events = self._events.open(handles)
        except ValueError as exc:
            raise _NotLandedError(str(exc), status_code=400) from exc
        started = time.monotonic()
        while not self._events.reached(events):
            waited = time.monotonic() - started
            if waited > timeout_s:
                raise _NotLandedError(
                    f"the trainers' copies (after_events) did not finish within {timeout_s:g} s",
                    status_code=504,
                )
            await asyncio.sleep(0 if waited < _SPIN_S else 1e-3)
        logger.debug(
            "the trainers' copies landed (waited %.2f ms)", (time.monotonic() - started) * 1e3
        )

    async def update_weight_version(
        self,
        new_version: str,
        abort_all_requests: bool,
        *,
        token: str | None = None,
        with_end: bool = False,
    ) -> str:
        """Label the weights every rank holds (and abort queued requests if asked).

        Inside a leased session only its holder may; outside a session, not while the
        weights are incomplete (the label would name weights nobody verified). With
        `with_end` (a fused end, inside a session) the ranks take the label with the
        session's end, in the same round trip (see `end_weight_sync`).

        Raises:
            ControlError: 400 for another holder's token or incomplete weights.
        """
        if self._session != "closed":
            self._holder(token, "update_weight_version").versioned = True
        elif self._incomplete is not None:
            raise ControlError(
                f"update_weight_version refused: the weights are incomplete "
                f"({self._incomplete}); label them in the session of a complete update",
                status_code=400,
            )
        if abort_all_requests:
            await self.abort_request("", abort_all=True)
        if with_end and self._session == "open":
            self._label_with_end = new_version
        else:
            await self._run(SetWeightVersion(version=new_version), inline=True)
        self._label(new_version)
        self._log_step("weight version is now %s", new_version)
        return f"Weight version updated to {new_version}"

    async def begin_weight_sync(
        self,
        *,
        pause_mode: str | None,
        release_kv_cache: bool,
        selector: str,
        lease_s: float | None = None,
        budget_s: float | None = None,
        fence: bool = False,
    ) -> tuple[SessionGrant, tuple[str, ...]]:
        """`pause_generation` (unless `pause_mode` is None), `release_memory_occupation`
        of the KV cache (when `release_kv_cache`) and `begin_weight_update` (with `fence`),
        in that order, each with its own semantics: one round trip instead of three. The
        call stops where it runs past `budget_s` seconds (a pause stops waiting; it has taken
        effect, as a pause whose caller timed out).

        Returns:
            The session's grant and the routes of the steps that ran.

        Raises:
            StepRefusedError: a step refused (later ones did not run); it names the step,
                the steps before it, and carries the step's own status and message.
        """
        completed: list[str] = []
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
        if pause_mode is not None:
            steps.append(("/pause_generation", lambda: self.pause_generation(pause_mode)))
        if release_kv_cache:
            steps.append(
                ("/release_memory_occupation", lambda: self.release_memory_occupation(["kv_cache"]))
            )
        steps.append(
            (
                "/begin_weight_update",
                lambda: self.begin_weight_update(selector, lease_s=lease_s, fence=fence),
            )
        )
        grant = await self._fused("begin_weight_sync", steps, completed, budget_s)
        return grant, tuple(completed)

    async def end_weight_sync(
        self,
        *,
        new_version: str | None,
        token: str | None = None,
        digests: Mapping[int, Mapping[str, int]] | None = None,
        unverified: bool = False,
        resume: bool = True,
        resume_kv_cache: bool = True,
        torch_empty_cache: bool = False,
        after_events: Sequence[str] = (),
        budget_s: float | None = None,
    ) -> tuple[SessionEnd, tuple[str, ...]]:
        """`update_weight_version` (unless `new_version` is None), `end_weight_update` (with
        `digests` or `unverified`, after waiting for `after_events`, within the budget), then,
        with `resume`,
        `resume_memory_occupation` of the KV cache (when `resume_kv_cache`), `flush_cache`
        and `continue_generation`, in that order, each with its own semantics: one round
        trip instead of five. The call stops where it runs past `budget_s` seconds (the
        replica stays paused, as when a caller's deadline passed).

        Returns:
            The last step's message with what `end_weight_update` reported, and the routes
            of the steps that ran.

        Raises:
            StepRefusedError: a step refused (later ones did not run: a failed verification
                leaves the replica paused, as `end_weight_update` alone does).
        """
        completed: list[str] = []
        steps: list[tuple[str, Callable[[], Awaitable[str]]]] = []
        if new_version is not None:
            steps.append(
                (
                    "/update_weight_version",
                    lambda: self.update_weight_version(
                        new_version, False, token=token, with_end=True
                    ),
                )
            )
        landing_timeout_s = budget_s if budget_s is not None else _LANDING_TIMEOUT_S
        ended: list[SessionEnd] = []

        async def end() -> str:
            ended.append(
                await self.end_weight_update(
                    token=token,
                    digests=digests,
                    unverified=unverified,
                    after_events=after_events,
                    landing_timeout_s=landing_timeout_s,
                )
            )
            return ended[0].message

        steps.append(("/end_weight_update", end))
        if resume:
            if resume_kv_cache:
                steps.append(
                    (
                        "/resume_memory_occupation",
                        lambda: self.resume_memory_occupation(["kv_cache"]),
                    )
                )
            steps.append(("/flush_cache", self.flush_cache))
            steps.append(
                ("/continue_generation", lambda: self.continue_generation(torch_empty_cache))
            )
        try:
            message = await self._fused("end_weight_sync", steps, completed, budget_s)
        finally:
            label, self._label_with_end = self._label_with_end, None
            if label is not None:
                # The end refused before it reached the ranks: they take the label alone,
                # as after a separate update_weight_version; a failure to label them is
                # logged, and the step's own answer stands.
                try:
                    await self._run(SetWeightVersion(version=label), inline=True)
                except ControlError as exc:
                    logger.warning("labelling the ranks %s failed: %s", label, exc)
        return SessionEnd(message=message, changed_outside=ended[0].changed_outside), tuple(
            completed
        )

    def _holder(self, token: str | None, route: str) -> _Session:
        """The open session, if `token` may act on it."""
        session = self._lease
        if self._session != "open" or session is None:
            raise ControlError(
                f"{route}: no weight-update session is open (session {self._session})",
                status_code=400,
            )
        if session.token is not None and (
            token is None or not secrets.compare_digest(token.encode(), session.token.encode())
        ):
            raise ControlError(
                f"{route} refused: the open weight-update session is held by another client "
                "(its calls carry the session_token begin_weight_update returned); wait for "
                "it to end or for its lease to expire",
                status_code=400,
            )
        return session

    def _arm(self, session: _Session, lease_s: float) -> None:
        """(Re)start `session`'s lease timer."""
        if session.timer is not None:
            session.timer.cancel()
        loop = asyncio.get_running_loop()
        session.deadline = time.monotonic() + lease_s
        session.timer = loop.call_later(lease_s, lambda: loop.create_task(self._expire(session)))

    async def _expire(self, session: _Session) -> None:
        if self._lease is not session or self._session != "open":
            return
        logger.error(
            "the lease of the weight-update session expired (%g s without a renewal: its "
            "holder is gone or stuck); closing it",
            session.lease_s,
        )
        await self._close(session, (), reason=f"its lease expired after {session.lease_s:g} s")

    async def _close(
        self,
        session: _Session,
        expected: tuple[dict[str, int] | None, ...],
        *,
        reason: str,
        unverified: bool = False,
        after_events: Sequence[str] = (),
        landing_timeout_s: float = _LANDING_TIMEOUT_S,
    ) -> tuple[str | None, tuple[str, ...]]:
        """Close `session` on every rank and decide what the weights now are (see
        `end_weight_update`; `unverified` as there); returns the problem found (None when
        the update is complete or nothing changed) and, after a fenced begin, the parameters
        it found changed outside a session. With
        `after_events` (the IPC handles of the trainers' events), the ranks end it once the
        events are reached, waiting up to `landing_timeout_s`.

        Raises:
            ControlError: the ranks failed, or the events were not reached: the weights
                are then incomplete.
        """
        if session.timer is not None:
            session.timer.cancel()
        self._session = "closing"
        label, self._label_with_end = self._label_with_end, None
        try:
            if after_events:
                # While the copies land: a fenced begin's digest (done long ago) is read,
                # the trainers' digests are put in each rank's order and, at tp 1 (where
                # rank 0's reply, the gate, stays in this process), the end's digest is
                # queued behind a gate opened the moment they land.
                prepared = PrepareEnd(expected=expected, gated=self.info.num_ranks == 1)
                gates = [g for g in await self._run(prepared, inline=True) if g is not None]
                try:
                    await self._await_landing(after_events, landing_timeout_s)
                finally:
                    for gate in gates:
                        gate.open()
                end = EndUpdate(version=label, prepared=True)
            else:
                end = EndUpdate(expected=expected, version=label)
            checks = await self._run(end, inline=True)
        except _NotLandedError as exc:
            why = f"{exc}; nothing was verified, and bytes may still be on their way"
            self._mark_incomplete(why)
            # The ranks end their sessions unverified.
            await self._run(EndUpdate(version=label), inline=True)
            raise ControlError(
                f"{why}: the session is closed and the weights are incomplete until a "
                "complete update",
                status_code=exc.status_code,
            ) from None
        except BaseException:
            self._mark_incomplete(f"end of the weight-update session failed ({reason})")
            raise
        finally:
            self._session = "closed"
            self._lease = None
            await self._queue.notify()
        self._digest_s += max(c.seconds for c in checks)
        outside = _by_rank(checks, "changed_outside")
        # What a fenced begin would have said first: the verdict on this session follows.
        self._found_changed_outside(outside)
        changed = _by_rank(checks, "changed")
        problem: str | None = None
        if expected:
            mismatched = _by_rank(checks, "mismatched")
            if mismatched:
                problem = (
                    f"the weights that arrived differ from what the trainers wrote: "
                    f"{_names(mismatched)} (digest mismatch; bytes missing, misplaced or "
                    "written from outside the session)"
                )
            else:
                self._complete(verified=True)
        elif session.versioned and reason == "end_weight_update":
            if session.token is None or unverified:
                self._complete(verified=False)
            else:
                problem = (
                    "the labelled weight-update session ended without digests: nothing "
                    "verified what arrived; end it with the trainers' digests, or with "
                    "unverified=true where the trainers compute none"
                )
        elif changed:
            problem = (
                f"the weight-update session ended ({reason}) without a complete update after "
                f"writing {_names(changed)}"
            )
        if problem is not None:
            self._mark_incomplete(problem)
        return problem, _named(outside)

    def _found_changed_outside(self, changed: Mapping[int, Sequence[str]]) -> None:
        """Bytes changed outside any session (`changed`, by tp rank): incomplete weights,
        until a complete update lands."""
        if changed:
            self._mark_incomplete(
                f"parameters changed outside a weight-update session ({_names(changed)}): "
                "bytes were written into the replica without a session"
            )

    def _complete(self, *, verified: bool) -> None:
        if self._incomplete is not None:
            logger.info("a complete weight update landed; the weights are complete again")
        self._incomplete = None
        self._verified = verified

    def _mark_incomplete(self, reason: str) -> None:
        logger.error(
            "weights incomplete: %s; generation is refused until a complete update", reason
        )
        self._incomplete = reason
        self._verified = False

    async def weights_checker(
        self, request: WeightsCheckerRequest
    ) -> tuple[bool, str, dict[str, Any]]:
        """Run a checker action on every rank.

        Returns:
            ``(success, message, extra)``: for ``compare`` the message lists every differing
            parameter per rank; for ``checksum`` the message is JSON ``{"ranks": [{"tp_rank",
            "checksums": {name: {"sha256", "sum"}}}]}`` and `extra` holds SGLang's fields
            (``ranks``: per rank ``checksums`` ``{name: sha256}`` and ``parallelism_info``).

        Raises:
            ControlError: 400 for the ``draft`` selector or a bad skip list.
        """
        if request.selector == "draft":
            raise ControlError("this server has no draft model", status_code=400)
        if request.action == "reset_tensors":
            if self._session == "closed" and self._paused_mode is None:
                raise ControlError(
                    "reset_tensors refused: it randomises the weights a serving replica "
                    "answers with; pause_generation (or begin_weight_update) first",
                    status_code=400,
                )
            self._mark_incomplete("weights_checker reset_tensors randomised the weights")
        results = await self._run(
            CheckWeights(
                action=request.action,
                allow_quant_error=request.allow_quant_error,
                skip_tensor_list=tuple(request.skip_tensor_list),
            )
        )
        success = all(r.success for r in results)
        if request.action == "checksum":
            ranks = [
                {"tp_rank": rank, "checksums": r.details["checksums"]}
                for rank, r in enumerate(results)
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

    async def run_command(self, command: Any) -> list[Any]:
        """Run a server extension's `command` on every rank; each rank's value, by rank.

        Raises:
            ControlError: a rank refused (400 for bad input) or failed (500).
        """
        return await self._run(command)

    async def set_weight_version(self, version: str) -> None:
        """Label the weights every rank now holds (an extension's update set them)."""
        await self._run(SetWeightVersion(version=version))
        self._label(version)

    def _label(self, version: str) -> None:
        """Take `version` as the label of the weights held (and the highest numeric one)."""
        self._weight_version = version
        number = numeric_label(version)
        if number is not None and (self._highest_version is None or number > self._highest_version):
            self._highest_version = number

    def server_args(self) -> dict[str, Any]:
        """The ``/server_info`` fields that describe how the server runs."""
        return self.info.server_args()

    def server_info(self) -> dict[str, Any]:
        """The server's arguments, state and version (``GET /server_info``): SGLang's keys
        for what it has, and what it serves beyond SGLang under ``"weightsync"``."""
        return {
            **self.info.server_args(),
            "status": "ready",
            "weight_version": self._weight_version,
            "weightsync": {
                "version": __version__,
                "instance": self.instance,
                "highest_numeric_version": self._highest_version,
                "capabilities": list(self.capabilities),
                "weights": {
                    "complete": self._incomplete is None,
                    "incomplete_reason": self._incomplete,
                    "verified": self._verified,
                },
                "session": self._session_state(),
            },
            "state": {
                "paused": self._paused_mode is not None,
                "pause_mode": self._paused_mode,
                "weight_update_session": self._session,
                "memory_released": sorted(self._released),
                "num_running_requests": self._queue.num_running,
                "num_queued_requests": self._queue.num_queued,
                "engine_command": self._driver.current_command,
            },
        }

    def _session_state(self) -> dict[str, Any]:
        session = self._lease
        if session is None:
            return {"state": self._session, "leased": False, "last_digest_s": self._digest_s}
        remaining = (
            max(0.0, session.deadline - time.monotonic()) if session.deadline is not None else None
        )
        return {
            "state": self._session,
            "leased": session.token is not None,
            "lease_s": session.lease_s,
            "expires_in_s": remaining,
            "versioned": session.versioned,
            "last_digest_s": self._digest_s,
        }

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info``: the model and the weight version it serves."""
        hf_config = self.info.hf_config
        return {
            "model_path": self.info.server_args()["model_path"],
            "weight_version": self._weight_version,
            "is_generation": True,
            "model_type": hf_config.get("model_type"),
            "architectures": hf_config.get("architectures"),
        }

    def generation_refusal(self) -> str | None:
        """Why generation may not run now (paused, a session open, memory released, shutting
        down), or ``None``."""
        if self._stopping or self._driver.stopped:
            return "the server is shutting down"
        if self._incomplete is not None:
            return (
                f"the weights are incomplete ({self._incomplete}); the replica serves again "
                "once a complete weight update lands"
            )
        if self._session != "closed":
            return "a weight-update session is open; generation resumes after end_weight_update"
        if self._paused_mode is not None:
            return "generation is paused (pause_generation); call continue_generation"
        if self._released:
            return f"memory {sorted(self._released)} is released; call resume_memory_occupation"
        return None

    async def _generate_on_ranks(self, command: Generate) -> dict[str, Any]:
        (value, *_) = await self._run(command)
        return value

    async def _fused(
        self,
        name: str,
        steps: Sequence[tuple[str, Callable[[], Awaitable[Any]]]],
        completed: list[str],
        budget_s: float | None,
    ) -> Any:
        """`_run_steps` for the fused call `name`, logged as one line of its steps."""
        took: list[str] = []
        self._fused_call = True
        try:
            return await _run_steps(steps, completed, budget_s, took)
        finally:
            self._fused_call = False
            logger.info("%s: %s", name, ", ".join(took) or "no step ran")

    def _log_step(self, message: str, *args: Any) -> None:
        """Log what a lifecycle step did: at info, or at debug inside a fused call (which
        logs one info line of all its steps and their times)."""
        logger.log(logging.DEBUG if self._fused_call else logging.INFO, message, *args)

    async def _run(self, command: Command, *, inline: bool = False) -> list[Any]:
        """Run `command` on every rank; return each rank's value, or raise the failure.
        `inline`: a short command, which the driver may run in this thread (see
        `EngineDriver.submit`)."""
        try:
            future = self._driver.submit(command, inline=inline)
            replies = future.result() if future.done() else await asyncio.wrap_future(future)
        except EngineStoppedError as exc:
            logger.error("the engine is not running: %s", exc)
            raise ControlError(
                "the engine is not running (a rank stopped); see the server log", status_code=503
            ) from exc
        failed = [r for r in replies if not r.ok]
        if not failed:
            return [r.value for r in replies]
        if len({r.error for r in failed}) == 1 and len(failed) == len(replies):
            message = failed[0].error or ""
        else:
            message = "; ".join(f"tp rank {r.tp_rank}: {r.error}" for r in failed)
        kinds = [r.error_kind for r in failed]
        kind = OUT_OF_MEMORY if OUT_OF_MEMORY in kinds else kinds[0]
        raise ControlError(message, status_code=_STATUS_OF_KIND.get(kind, 500))


async def _run_steps(
    steps: Sequence[tuple[str, Callable[[], Awaitable[Any]]]],
    completed: list[str],
    budget_s: float | None,
    took: list[str],
) -> Any:
    """Run `steps` in order, appending each finished one's route to `completed` (and its
    route and time to `took`); the last step's value.

    Raises:
        StepRefusedError: a step refused, or (504) the call ran past `budget_s`: the pause,
            which waits on generation, is cut short; a step that cannot be interrupted
            safely is let finish, and the next one not started.
    """
    deadline = None if budget_s is None else time.monotonic() + budget_s
    value: Any = None
    for index, (route, step) in enumerate(steps):
        started = time.perf_counter()
        if deadline is not None and index and time.monotonic() > deadline:
            late = ControlError(
                f"the call ran past budget_s={budget_s:g} before {route}; it and the steps "
                "after it were not run",
                status_code=504,
            )
            raise StepRefusedError(late, route=route, completed=completed)
        try:
            if route == "/pause_generation" and deadline is not None:
                # A deadline on the running task, not a task of its own: no loop turn.
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    value = await step()
            else:
                value = await step()
        except TimeoutError:
            late = ControlError(
                f"{route} did not finish within budget_s={budget_s:g} (it has taken effect); "
                "the steps after it were not run",
                status_code=504,
            )
            raise StepRefusedError(late, route=route, completed=completed) from None
        except ControlError as exc:
            raise StepRefusedError(exc, route=route, completed=completed) from exc
        completed.append(route)
        took.append(f"{route} {(time.perf_counter() - started) * 1e3:.2f} ms")
    return value


def _check_lease(lease_s: float | None) -> None:
    if lease_s is not None and not (0 < lease_s <= MAX_LEASE_S):
        raise ControlError(
            f"lease_s must be in (0, {MAX_LEASE_S:g}] seconds, got {lease_s!r}", status_code=400
        )


def _by_rank(checks: Sequence[Any], field: str) -> dict[int, tuple[str, ...]]:
    """``{tp_rank: names}`` of the ranks whose `SessionCheck` lists names in `field`."""
    return {rank: getattr(c, field) for rank, c in enumerate(checks) if getattr(c, field)}


def _named(by_rank: Mapping[int, Sequence[str]]) -> tuple[str, ...]:
    """``"tp rank r: name"`` for every name of `by_rank`."""
    return tuple(f"tp rank {rank}: {name}" for rank, names in by_rank.items() for name in names)


def _names(by_rank: Mapping[int, Sequence[str]]) -> str:
    parts = []
    for rank, names in sorted(by_rank.items()):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        parts.append(f"tp rank {rank}: {len(names)} parameter(s) ({shown})")
    return "; ".join(parts)


def _tags(tags: Sequence[str] | None, *, default: frozenset[str]) -> set[str]:
    wanted = set(default if tags is None else tags)
    unknown = wanted - _KNOWN_TAGS
    if unknown:
        raise ControlError(
            f"unknown memory tags {sorted(unknown)}; known: {sorted(_KNOWN_TAGS)}",
            status_code=400,
        )
    return wanted
