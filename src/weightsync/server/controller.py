"""`ReplicaController`: the serving state of a reference replica and what each route does.

It lives on rank 0's event loop, turns route calls into engine commands, and composes one
object per noun, each in its own module:

- `Generation` (`weightsync.server.generation`): requests and pause;
- `ReplicaSession` (`weightsync.server.session`): the weight-update session, from begin to
  end (lease, fencing token, verdict); generation is refused while one is not closed;
- `WeightIntegrity` (`weightsync.server.integrity`): whether the weights are a complete,
  verified update; generation is refused (503) and ``continue_generation`` too (400) until
  one lands;
- `ReleasedMemory` (`weightsync.server.memory_tags`): released memory-saver tags;
- delta syncs (`weightsync.server.delta`): checksums any time, deltas applied inside the
  session, which remembers whether they verified;
- the fused calls (`weightsync.server.fused`) and what the replica says about itself
  (`weightsync.server.info`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.control.models import GenerateRequest, GenerateResponse, WeightsCheckerRequest
from weightsync.control.protocol import WEIGHT_SYNC_DELTA, WEIGHT_SYNC_FENCE
from weightsync.cuda_events import IpcEvents
from weightsync.receiver.delta import DeltaResult
from weightsync.server import fused
from weightsync.server import info as about
from weightsync.server.delta import RankDelta, delta_command
from weightsync.server.engine_calls import EngineCalls
from weightsync.server.fused import StepLog, StepRefusedError
from weightsync.server.generation import Generation
from weightsync.server.http import ControlError
from weightsync.server.integrity import (
    WeightIntegrity,
    by_rank,
    expected_digests,
    named,
    run_weights_checker,
)
from weightsync.server.landing import LANDING_TIMEOUT_S
from weightsync.server.limits import GenerationBounds
from weightsync.server.memory_tags import ReleasedMemory
from weightsync.server.ranks.commands import (
    DeltaChecksums,
    FlushCache,
    Generate,
    SetWeightVersion,
)
from weightsync.server.ranks.driver import EngineDriver
from weightsync.server.replica_info import ReplicaInfo
from weightsync.server.session import (
    ReplicaSession,
    ReplicaSessionState,
    SessionEnd,
    SessionGrant,
    check_lease,
)

__all__ = ["ReplicaController", "SessionEnd", "SessionGrant", "StepRefusedError"]

logger = logging.getLogger(__name__)


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
        self._engine = EngineCalls(driver)
        self.capabilities = about.capabilities(
            fused_lifecycle=fused_lifecycle,
            events=events is not None,
            fence=fence,
            delta=info.serves_deltas,
        )
        self._events = events
        self.info = info
        self._label = about.WeightLabel(weight_version)
        self.instance = uuid.uuid4().hex
        """This process's identity: a new one every start, so that a client can tell a
        restarted replica behind the same URL (metadata, plans and digests of the old one
        are void) from the one it wrote to."""
        self._session: ReplicaSession | None = None  # the session not yet closed
        self._integrity = WeightIntegrity()
        self.step_log = StepLog(logger)
        """Where the lifecycle steps log (one line per fused call)."""
        self._memory = ReleasedMemory(self.step_log)
        self._stopping = False
        self._generation = Generation(
            run=self._generate_on_ranks,
            bounds=bounds or GenerationBounds.of_model(info.hf_config),
            blocked=self.generation_refusal,
            weight_version=lambda: self._label.version,
            step_log=self.step_log,
        )

    def start(self) -> None:
        """Start handing queued generation requests to the engine."""
        self._generation.queue.start()

    async def stop(self) -> None:
        """Refuse new work and abort the queued requests."""
        self._stopping = True
        await self._generation.queue.stop("the server is shutting down")

    @property
    def healthy(self) -> bool:
        """Whether the replica serves (not shutting down, engine alive)."""
        return not self._stopping and not self._engine.stopped

    @property
    def weight_version(self) -> str:
        """The label of the weights the replica holds."""
        return self._label.version

    @property
    def session(self) -> ReplicaSession | None:
        """The weight-update session not yet closed, or None."""
        return self._session

    @property
    def _session_state(self) -> ReplicaSessionState:
        return ReplicaSessionState.CLOSED if self._session is None else self._session.state

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
        return await self._generation.submit(request)

    async def pause_generation(self, mode: str) -> str:
        """Stop starting requests; ``abort`` also aborts the queued ones (``retract`` and
        ``in_place`` hold them until `continue_generation`). Returns once none runs."""
        return await self._generation.pause(mode)

    async def continue_generation(self, torch_empty_cache: bool) -> str:
        """Serve requests again (``torch_empty_cache``: return cached device memory first).

        Raises:
            ControlError: 400 while a weight-update session is open (its holder ends it
                first) or the weights are incomplete (a complete update must land first).
        """
        state = self._session_state
        if state is not ReplicaSessionState.CLOSED:
            raise ControlError(
                f"continue_generation refused: a weight-update session is {state.value}; "
                "serving now would use half-written weights. The session's holder ends it "
                "with end_weight_update (a leased session also ends when its lease expires)",
                status_code=400,
            )
        incomplete = self._integrity.incomplete
        if incomplete is not None:
            raise ControlError(
                f"continue_generation refused: the weights are incomplete ({incomplete});"
                " the replica serves again once a complete weight update lands",
                status_code=400,
            )
        if torch_empty_cache:
            await self._engine.run(FlushCache(empty_device_cache=True))
        await self._generation.resume()
        return "Generation continued"

    async def abort_request(self, rid: str, abort_all: bool) -> str:
        """Abort queued request `rid`, or every queued request."""
        return await self._generation.abort(rid, abort_all)

    async def release_memory_occupation(self, tags: Sequence[str] | None) -> str:
        """Release KV-cache memory while idle; generation is refused until it is resumed.

        Raises:
            ControlError: 400 when requests are in flight and generation is not paused, for
                the ``weights`` tag (parameters never move) and for unknown tags.
        """
        paused = self._generation.paused_mode is not None
        return self._memory.release(tags, num_busy=self._generation.num_busy, paused=paused)

    async def resume_memory_occupation(self, tags: Sequence[str] | None) -> str:
        """Take back what `release_memory_occupation` released.

        Raises:
            ControlError: 400 for unknown tags.
        """
        message = self._memory.resume(tags)
        await self._generation.queue.notify()
        return message

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
        if self._session is not None:
            raise ControlError(
                f"a weight-update session is already {self._session.state.value}; call "
                "end_weight_update before beginning another",
                status_code=400,
            )
        check_lease(lease_s)
        if fence and WEIGHT_SYNC_FENCE not in self.capabilities:
            raise ControlError(
                "fence: this replica cannot fence a session (it takes writes from other hosts, "
                "or its weights are not on a GPU; it does not advertise weight_sync_fence)",
                status_code=400,
            )
        session = self._session = ReplicaSession(
            selector=selector,
            lease_s=lease_s,
            run=self._engine.run,
            integrity=self._integrity,
            events=self._events,
            num_ranks=self.info.num_ranks,
            on_closed=self._closed,
        )
        checks = await session.begin(fence=fence)
        self.step_log.step(
            "weight-update session opened (selector=%s%s)",
            selector,
            f", lease {lease_s:g} s" if lease_s is not None else "",
        )
        return SessionGrant(
            message=f"Weight update session begun (selector={selector})",
            token=session.token,
            lease_s=lease_s,
            changed_outside=named(by_rank(checks, "changed")),
            fences=tuple(c.fence for c in checks) if fence else (),
            weight_version=self._label.version,
            instance=self.instance,
            highest_version=self._label.highest,
        )

    async def renew_weight_update(self, token: str | None, lease_s: float) -> float:
        """Extend the open session's lease by `lease_s` from now; returns the lease.

        Raises:
            ControlError: 400 when no leased session is open, for another holder's token or
                a lease out of range.
        """
        check_lease(lease_s)
        self._holder(token, "renew_weight_update").renew(lease_s)
        return lease_s

    async def end_weight_update(
        self,
        *,
        token: str | None = None,
        digests: Mapping[int, Mapping[str, int]] | None = None,
        unverified: bool = False,
        abandoned: str | None = None,
        after_events: Sequence[str] = (),
        landing_timeout_s: float = LANDING_TIMEOUT_S,
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
            abandoned: why the holder gives the session up after its writes began: the
                weights are incomplete whatever arrived, since its writes may still land
                after the end (the reply says so; it is no error).
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
        state = self._session_state
        if state is not ReplicaSessionState.OPEN:
            raise ControlError(
                f"no weight-update session is open (session {state.value}); call "
                "begin_weight_update first",
                status_code=400,
            )
        session = self._holder(token, "end_weight_update")
        problem, outside = await session.close(
            expected_digests(digests, self.info.num_ranks),
            reason="end_weight_update",
            unverified=unverified,
            abandoned=abandoned,
            after_events=after_events,
            landing_timeout_s=landing_timeout_s,
        )
        if abandoned is not None:
            self.step_log.step("weight-update session abandoned: %s", abandoned)
            return SessionEnd(
                message=f"Weight update session ended; the weights are incomplete: {problem}",
                changed_outside=outside,
            )
        if problem is not None:
            raise ControlError(problem, status_code=400)
        self.step_log.step("weight-update session ended (weight version %s)", self._label.version)
        return SessionEnd(message="Weight update session ended", changed_outside=outside)

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
        session's end, in the same round trip (`weightsync.server.fused.end_weight_sync`).

        Raises:
            ControlError: 400 for another holder's token or incomplete weights.
        """
        session = self._session
        if session is not None:
            self._holder(token, "update_weight_version").versioned = True
        elif self._integrity.incomplete is not None:
            raise ControlError(
                f"update_weight_version refused: the weights are incomplete "
                f"({self._integrity.incomplete}); label them in the session of a complete "
                "update",
                status_code=400,
            )
        if abort_all_requests:
            await self.abort_request("", abort_all=True)
        if with_end and session is not None and session.state is ReplicaSessionState.OPEN:
            session.label = new_version
        else:
            await self._engine.run(SetWeightVersion(version=new_version), inline=True)
        self._label.take(new_version)
        self.step_log.step("weight version is now %s", new_version)
        return f"Weight version updated to {new_version}"

    # The fused calls: the plain calls above in order, each with its own semantics, in one
    # round trip; a step that refuses answers as the refusing call would.
    begin_weight_sync = fused.begin_weight_sync
    end_weight_sync = fused.end_weight_sync

    async def delta_checksums(self, token: str | None) -> list[dict[str, int]]:
        """Every rank's checksums of its parameters (`weightsync.delta_codec`), by tp rank;
        any time (read-only).

        Raises:
            ControlError: 400 for `token` while a session is open that another client
                holds (or that is not open: beginning or ending).
        """
        session = self._session
        if token is not None and session is not None:
            session.check_holder(token, "delta_checksums")
        return await self._engine.run(DeltaChecksums())

    async def apply_delta(
        self, token: str | None, ranks: Mapping[int, RankDelta], *, check: str = "changes"
    ) -> tuple[str | None, list[DeltaResult]]:
        """Apply the delta payloads trainers wrote into every rank's delta region, inside
        the open session, and check them (`ReplicaSession.apply_delta`). A delta that does
        not verify leaves the weights incomplete, and the session open for its holder to
        end: that end is not verified.

        Args:
            token: the session token (required for a leased session).
            ranks: per tp rank (every one), its payloads and expected checksums.
            check: how the ranks check them (``"changes"`` or ``"full"``,
                `weightsync.delta_codec.apply_and_check`).

        Returns:
            The problem (None when every rank verified) and each rank's result, by tp rank.

        Raises:
            ControlError: 400 where this replica has no delta region, no session is open,
                for another holder's token, or a request that fails `delta_command` (then
                nothing was applied); a rank's failure (its status).
        """
        if WEIGHT_SYNC_DELTA not in self.capabilities:
            raise ControlError(
                "apply_delta: this replica has no delta region (it does not advertise "
                "weight_sync_delta); start it with weightsync serve --delta-region-mb N, or "
                "write full bytes",
                status_code=400,
            )
        session = self._holder(token, "apply_delta")
        return await session.apply_delta(delta_command(self.info, ranks, check=check))

    def _holder(self, token: str | None, route: str) -> ReplicaSession:
        """The open session, if `token` may act on it (`ReplicaSession.check_holder`)."""
        session = self._session
        if session is None:
            raise ControlError(
                f"{route}: no weight-update session is open (session closed)", status_code=400
            )
        session.check_holder(token, route)
        return session

    async def _closed(self, session: ReplicaSession) -> None:
        """`session` closed (or failed to open): generation may resume."""
        if self._session is session:
            self._session = None
        await self._generation.queue.notify()

    async def weights_checker(
        self, request: WeightsCheckerRequest
    ) -> tuple[bool, str, dict[str, Any]]:
        """Run a checker action on every rank.

        Returns:
            ``(success, message, extra)``, as `run_weights_checker` gives them.

        Raises:
            ControlError: 400 for the ``draft`` selector, a bad skip list, or
                ``reset_tensors`` while the replica serves.
        """
        if request.selector == "draft":
            raise ControlError("this server has no draft model", status_code=400)
        if request.action == "reset_tensors":
            if self._session is None and self._generation.paused_mode is None:
                raise ControlError(
                    "reset_tensors refused: it randomises the weights a serving replica "
                    "answers with; pause_generation (or begin_weight_update) first",
                    status_code=400,
                )
            self._integrity.mark_incomplete("weights_checker reset_tensors randomised the weights")
        return await run_weights_checker(self._engine.run, request)

    async def run_command(self, command: Any) -> list[Any]:
        """Run a server extension's `command` on every rank; each rank's value, by rank.

        Raises:
            ControlError: a rank refused (400 for bad input) or failed (500).
        """
        return await self._engine.run(command)

    async def set_weight_version(self, version: str) -> None:
        """Label the weights every rank now holds (an extension's update set them)."""
        await self._engine.run(SetWeightVersion(version=version))
        self._label.take(version)

    def server_args(self) -> dict[str, Any]:
        """The ``/server_info`` fields that describe how the server runs."""
        return self.info.server_args()

    def server_info(self) -> dict[str, Any]:
        """The server's arguments, state and version (``GET /server_info``): SGLang's keys
        for what it has, and what it serves beyond SGLang under ``"weightsync"``."""
        return about.server_info(
            self.info,
            weight_version=self._label.version,
            instance=self.instance,
            highest_version=self._label.highest,
            capabilities=self.capabilities,
            integrity=self._integrity,
            session=self._session,
            state={
                "paused": self._generation.paused_mode is not None,
                "pause_mode": self._generation.paused_mode,
                "weight_update_session": self._session_state.value,
                "memory_released": self._memory.tags,
                "num_running_requests": self._generation.queue.num_running,
                "num_queued_requests": self._generation.queue.num_queued,
                "engine_command": self._engine.current_command,
            },
        )

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info``: the model and the weight version it serves."""
        return about.model_info(self.info, weight_version=self._label.version)

    def generation_refusal(self) -> str | None:
        """Why generation may not run now (paused, a session open, memory released, shutting
        down), or ``None``."""
        if self._stopping or self._engine.stopped:
            return "the server is shutting down"
        if self._integrity.incomplete is not None:
            return self._integrity.refusal()
        if self._session is not None:
            return "a weight-update session is open; generation resumes after end_weight_update"
        return self._generation.refusal() or self._memory.refusal()

    async def _generate_on_ranks(self, command: Generate) -> dict[str, Any]:
        (value, *_) = await self._engine.run(command)
        return value
