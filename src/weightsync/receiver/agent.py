"""`RolloutAgent`: weightsync's receiving side inside one rank of any PyTorch engine."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import numpy as np
import torch

from weightsync.control.bootstrap_client import BootstrapClient
from weightsync.control.models import Selector
from weightsync.cuda_events import StreamGate
from weightsync.delta_codec import CHECKS, Check, checksums
from weightsync.errors import WeightSyncError
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.receiver.checker import CheckResult, WeightsChecker
from weightsync.receiver.delta import DeltaRegion, DeltaResult, apply_deltas
from weightsync.receiver.digest import ParameterDigests

if TYPE_CHECKING:
    from weightsync.transport import Transport


class UpdateSessionError(WeightSyncError):
    """A weight-update session was begun while one is open, or ended while none is."""


class SessionState(enum.Enum):
    """Where a rank's weight-update session stands (`RolloutAgent.session_state`).

    A session goes ``CLOSED`` → ``FENCED`` (a fenced begin, its digest still on the GPU) or
    ``OPEN`` → ``ENDING`` (`RolloutAgent.prepare_end` ran while the bytes land) →
    ``CLOSED``; `RolloutAgent.read_fenced_begin` takes ``FENCED`` to ``OPEN``.
    """

    CLOSED = "closed"
    FENCED = "fenced"
    OPEN = "open"
    ENDING = "ending"


@dataclass(slots=True)
class _Session:
    """One open weight-update session of a rank: everything it knows from begin to end.

    Attributes:
        selector: the weights it updates (``target`` or ``all``).
        state: `SessionState.FENCED`, ``OPEN`` or ``ENDING``.
        at_begin: the digests at begin, in the order of `ParameterDigests.names` (None
            while a fenced begin's are still on the GPU).
        changed_outside: what a fenced begin found changed outside a session, for the end.
        expected: the trainers' digests `prepare_end` put in that order (None: none sent).
        delta: whether every `RolloutAgent.apply_delta` of the session verified (None: it
            applied none); False decides the end: not verified, whatever digests come.
        delta_base: ``{param_name: checksum}`` this rank holds as far as the session knows:
            what `RolloutAgent.delta_checksums` computed over every byte in it, then moved by
            each delta it applied (the base a delta's ``"changes"`` check derives from);
            None before that read, and after anything else the rank wrote itself.
    """

    selector: str
    state: SessionState
    at_begin: np.ndarray | None = None
    changed_outside: tuple[str, ...] = ()
    expected: np.ndarray | None = None
    delta: bool | None = None
    delta_base: dict[str, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCheck:
    """What one rank found when a session began or ended (`weightsync.layout.digest`).

    Attributes:
        changed: parameters whose bytes differ from what they held at the last reference
            point: at begin, the end of the last session (bytes written from outside any
            session); at an end without expected digests, the begin of this one (what the
            session wrote).
        mismatched: at end, with expected digests, the parameters whose digest differs from
            the expected one or that had none expected.
        verified: at end, the session's bytes were checked and hold what the trainers
            wrote: expected digests were given and every parameter matched, or (without
            them) every delta the session applied verified; never after a delta that did
            not verify.
        seconds: what computing the digests took (the cost of the checks).
        fence: at a fenced begin, the IPC handle (hex) of the CUDA event the begin's digest
            completes at: writes into the rank must follow it.
        changed_outside: at the end of a session begun with a fence, what its begin would
            have said in `changed` (known once the digest was read).
        delta: at end, whether every delta the session applied verified (None: it applied
            none).
    """

    changed: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()
    verified: bool = False
    seconds: float = 0.0
    fence: str | None = None
    changed_outside: tuple[str, ...] = ()
    delta: bool | None = None


class RolloutAgent:
    """Registers one rank's parameters with a transport and serves its side of a sync.

    The call protocol, on each rank of a rollout replica:

    1. ``RolloutAgent(params=..., parallelism=..., transport=...)`` once the parameters are
       allocated and loaded: their memory is registered with the transport, once. From then
       on nothing may move, free or replace a parameter's storage (no weight offload, no
       memory saver): trainers write into those addresses.
    2. `publish` to the replica's bootstrap server (or serve `transfer_engine_info` yourself).
    3. Per update: `begin_update`, (trainers write the bytes), `set_weight_version`,
       `end_update` (with the digests the trainers computed, to verify what arrived; handed
       over with `prepare_end` while the bytes still land, where the caller can). The
       engine must not run forward passes between begin and end (`session_state` says
       where the session stands). Both calls say which parameters changed since the last
       reference point (`SessionCheck`), so the engine knows without trusting anyone
       whether a session wrote anything and whether bytes arrived from outside a session.
       A delta sync (an agent with a delta region) applies the trainers' payloads inside
       the session, once they landed: `apply_delta` with the checksums the trainers
       expect (`delta_checksums` read before the writes proves the base). An end without
       digests of a session whose deltas verified counts as verified; one whose delta
       did not verify never does.
    4. Any time: `weights_checker` (snapshot / reset_tensors / compare / checksum) and
       `delta_checksums`.
    5. `close` when the engine shuts down: unregisters the memory (the transport stays the
       caller's to close).

    An agent is used from one thread (the rank's engine loop); it is not thread-safe.

    Args:
        params: every parameter of the rank by the engine's name, each contiguous; buffers
            are not synced and must not be included.
        parallelism: where this rank sits in its replica.
        transport: the rank's transport (e.g. a `MooncakeTransport`).
        on_update_end: the engine's post-load processing (re-quantisation, splits), run by
            `end_update` after the bytes arrived.
        post_load_writes_params: whether `on_update_end` may rewrite the parameters
            themselves (then their digests are taken again after it); False when it only
            derives other tensors from them.
        weight_version: the label of the weights the rank starts with.
        delta_region_bytes: the size of the delta region to allocate on the parameters'
            device and register beside them (trainers write delta payloads there); 0 for
            none (the rank then takes full syncs only).

    Raises:
        ValueError: no parameters, a value that is not a tensor, a non-contiguous
            parameter (its bytes would not be where `weights_info` says), or a negative
            `delta_region_bytes`.
    """

    def __init__(
        self,
        *,
        params: Mapping[str, torch.Tensor],
        parallelism: ParallelismConfig,
        transport: Transport,
        on_update_end: Callable[[], None] | None = None,
        post_load_writes_params: bool = True,
        weight_version: str = "default",
        delta_region_bytes: int = 0,
    ) -> None:
        if not params:
            raise ValueError("RolloutAgent needs at least one parameter")
        if (
            isinstance(delta_region_bytes, bool)
            or not isinstance(delta_region_bytes, int)
            or delta_region_bytes < 0
        ):
            raise ValueError(
                f"delta_region_bytes must be a non-negative int (0: no delta region), got "
                f"{delta_region_bytes!r}"
            )
        for name, tensor in params.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"parameter {name!r} is a {type(tensor).__name__}, not a tensor")
            if not tensor.is_contiguous():
                raise ValueError(
                    f"parameter {name!r} (shape {tuple(tensor.shape)}, stride {tensor.stride()}) "
                    "is not contiguous; the engine must allocate parameters contiguously so "
                    "that their bytes are one registered region"
                )
        self._params = {name: t.detach() for name, t in params.items()}
        self._parallelism = parallelism
        self._transport = transport
        self._on_update_end = on_update_end
        self._post_load_writes = post_load_writes_params and on_update_end is not None
        self._weight_version = weight_version
        self._session: _Session | None = None
        self._checker = WeightsChecker(self._params)
        self._digests = ParameterDigests(self._params)
        # Digests as int64 arrays in the order of self._digests.names: what the last end
        # found, the reference a begin compares against.
        self._reference = self._digests.compute_values()
        device = next(iter(self._params.values())).device
        self._gate = StreamGate(device) if StreamGate.supported(device) else None
        self._registered: list[int] = []
        self._regions = memory_regions(self._params.values())
        self._delta_region: DeltaRegion | None = None
        try:
            for addr, num_bytes in self._regions:
                transport.register(addr, num_bytes)
                self._registered.append(addr)
            if delta_region_bytes:
                self._delta_region = DeltaRegion(transport, delta_region_bytes, device)
        except BaseException:
            self.close()
            raise

    @property
    def parallelism(self) -> ParallelismConfig:
        """Where this rank sits in its replica."""
        return self._parallelism

    @property
    def session_id(self) -> str:
        """The transport's session id (``host:port``) that trainers write to."""
        return self._transport.session_id

    @property
    def registered_regions(self) -> int:
        """How many memory regions are registered (adjacent parameters share one)."""
        return len(self._registered)

    @property
    def regions(self) -> tuple[tuple[int, int], ...]:
        """The ``(addr, num_bytes)`` memory regions registered with the transport."""
        return tuple(self._regions)

    @property
    def delta_region(self) -> tuple[int, int] | None:
        """The ``(addr, num_bytes)`` delta region registered with the transport, or None."""
        return self._delta_region.region if self._delta_region is not None else None

    @property
    def session_open(self) -> bool:
        """Whether a weight-update session is open."""
        return self._session is not None

    @property
    def session_state(self) -> SessionState:
        """Where the weight-update session stands (`SessionState.CLOSED` when none is open)."""
        return SessionState.CLOSED if self._session is None else self._session.state

    @property
    def weight_version(self) -> str:
        """The label of the weights this rank holds."""
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """Label the weights this rank now holds."""
        self._weight_version = version

    def weights_info(self) -> dict[str, list[int]]:
        """``{param_name: [data_ptr, numel, element_size]}`` of every parameter."""
        return {
            name: [t.data_ptr(), t.numel(), t.element_size()] for name, t in self._params.items()
        }

    def transfer_engine_info(self) -> dict[str, object]:
        """``{"session_id": ..., "weights_info_dict": weights_info()}`` as docs/protocol.md
        publishes it; with a delta region, also ``"delta_region": [addr, num_bytes]``."""
        info: dict[str, object] = {
            "session_id": self.session_id,
            "weights_info_dict": self.weights_info(),
        }
        if self._delta_region is not None:
            info["delta_region"] = list(self._delta_region.region)
        return info

    def publish(
        self, bootstrap_url: str, *, api_key: str | None = None, timeout_s: float = 30.0
    ) -> None:
        """Register this rank's transfer-engine info and parallelism config with the
        replica's bootstrap server (``PUT /register_transfer_engine_info`` and
        ``PUT /register_parallelism_config``).

        Blocking (it runs its own event loop); call it from the rank's own thread, never
        from inside an event loop.

        Raises:
            RemoteReplicaError: the bootstrap server refused or could not be reached.
        """
        asyncio.run(self._publish(bootstrap_url, api_key=api_key, timeout_s=timeout_s))

    async def _publish(self, bootstrap_url: str, *, api_key: str | None, timeout_s: float) -> None:
        tp_rank = self._parallelism.tp_rank
        async with BootstrapClient(bootstrap_url, api_key=api_key, timeout_s=timeout_s) as client:
            results = await asyncio.gather(
                client.register_transfer_engine_info(tp_rank, self.session_id, self.weights_info()),
                client.register_parallelism_config(tp_rank, self._parallelism),
                return_exceptions=True,
            )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    @property
    def can_fence(self) -> bool:
        """Whether `begin_update` can fence (the parameters are on a GPU)."""
        return self._digests.on_gpu

    def begin_update(self, selector: Selector = "target", *, fence: bool = False) -> SessionCheck:
        """Open a weight-update session; the engine must not generate until `end_update`.

        The session begins with a digest of what every parameter holds. With `fence` it is
        queued on the GPU and not waited for: the returned check carries the IPC handle of
        the event it completes at, which every writer must wait for before it writes into
        this rank (a writer on this host: CUDA IPC), and `end_update` reports what changed
        outside a session (``changed_outside``).

        Returns:
            The parameters whose bytes changed since the last session ended (written from
            outside a session; empty when nothing was, and with `fence`); with `fence`, the
            event's handle.

        Raises:
            UpdateSessionError: a session is already open.
            ValueError: ``selector="draft"``: this agent holds no draft model; `fence` where
                the parameters are not on a GPU.
        """
        if selector == "draft":
            raise ValueError("this rank has no draft model; use selector 'target' or 'all'")
        if self._session is not None:
            raise UpdateSessionError(
                f"a weight-update session (selector={self._session.selector}) is already open "
                f"on tp rank {self._parallelism.tp_rank}; end it before beginning another"
            )
        if fence and not self.can_fence:
            raise ValueError(
                f"tp rank {self._parallelism.tp_rank} cannot fence a session: its parameters "
                "are not on a GPU; begin without fence"
            )
        start = time.perf_counter()
        if fence:
            # Read by `read_fenced_begin`.
            handle = self._digests.launch()
            self._session = _Session(selector=selector, state=SessionState.FENCED)
            return SessionCheck(fence=handle, seconds=time.perf_counter() - start)
        at_begin = self._digests.compute_values()
        self._session = _Session(selector=selector, state=SessionState.OPEN, at_begin=at_begin)
        return SessionCheck(
            changed=self._differing(at_begin, self._reference),
            seconds=time.perf_counter() - start,
        )

    def read_fenced_begin(self) -> None:
        """Read the digest a fenced begin queued (done once writes began: every writer
        waited for it) and keep what it found changed outside a session, for `end_update`.
        Called while the session's writes are still landing, it spares the end that work;
        `end_update` does it otherwise. Nothing without a fenced begin pending."""
        if self._session is not None:
            self._digests_at_begin(self._session)

    def _digests_at_begin(self, session: _Session) -> np.ndarray:
        """`session`'s digests at begin, read first where a fenced begin left them on the
        GPU (with what they say changed outside a session)."""
        if session.at_begin is None:
            session.at_begin = self._digests.collect_values()
            session.changed_outside = self._differing(session.at_begin, self._reference)
            session.state = SessionState.OPEN
        return session.at_begin

    def prepare_end(
        self, expected: Mapping[str, int] | None, *, gated: bool = False
    ) -> StreamGate | None:
        """Do what `end_update` can do before the session's bytes are all in, while they
        land: `read_fenced_begin`, and put `expected` (as `end_update` takes it) in the
        order this rank's digests come in, for ``end_update(prepared=True)``. With `gated`,
        where the parameters are on a GPU whose driver can hold a stream on host memory
        (`StreamGate`), the end's digest is queued now, behind a gate that the caller opens
        the moment the bytes are in (or it gave up on them): it then runs without a
        launch's delay. Opened or not, `end_update` reads it (opening it first).

        Returns:
            The gate to open, or None (not `gated`, or the rank cannot gate).

        Raises:
            UpdateSessionError: no session is open.
        """
        session = self._open_session()
        self.read_fenced_begin()
        session.expected = None if expected is None else self._digests.order(expected)
        session.state = SessionState.ENDING
        gate = self._gate if gated else None
        if gate is not None:
            self._digests.launch(gate)
        return gate

    def end_update(
        self, expected: Mapping[str, int] | None = None, *, prepared: bool = False
    ) -> SessionCheck:
        """Verify what arrived, run the engine's post-load processing and close the session.

        Args:
            expected: ``{param_name: digest}`` of what the trainers wrote (summed over the
                trainer ranks), or None when they sent none.
            prepared: take `prepare_end`'s expected digests instead of `expected`.

        Returns:
            Without `expected`, which parameters the session changed; with it, which do not
            hold what the trainers wrote (every parameter must have a digest: a sync writes
            all), the verdict that decides (`changed` is then left empty: it is judged
            while generation waits, and nothing reads it); after a fenced begin, which had
            changed outside a session before it. Verified with matching `expected`, or
            without it when every `apply_delta` of the session verified; never when one
            did not.

        Raises:
            UpdateSessionError: no session is open.
            RuntimeError: `prepared` without a `prepare_end` in this session.
        """
        session = self._open_session()
        if prepared and session.state is not SessionState.ENDING:
            raise RuntimeError("end_update(prepared=True) without prepare_end")
        try:
            start = time.perf_counter()
            if prepared:
                wanted = session.expected
            else:
                wanted = None if expected is None else self._digests.order(expected)
            at_begin = self._digests_at_begin(session)
            # Before post-load processing, which may rewrite parameters in place.
            if self._digests.pending:  # once the begin's is read, only prepare_end's
                now = self._digests.collect_values()
            else:
                now = self._digests.compute_values()
            seconds = time.perf_counter() - start
            mismatched: tuple[str, ...] = ()
            changed: tuple[str, ...] = ()
            if wanted is None:
                changed = self._differing(now, at_begin)
            else:
                mismatched = self._differing(now, wanted)
            if self._on_update_end is not None:
                self._on_update_end()
            if self._post_load_writes:
                start = time.perf_counter()
                now = self._digests.compute_values()
                seconds += time.perf_counter() - start
            self._reference = now
        finally:
            self._session = None
        if session.delta is False:
            verified = False
        elif wanted is not None:
            verified = not mismatched
        else:
            verified = session.delta is True
        return SessionCheck(
            changed=changed,
            mismatched=mismatched,
            verified=verified,
            seconds=seconds,
            changed_outside=session.changed_outside,
            delta=session.delta,
        )

    def _open_session(self) -> _Session:
        """The open session.

        Raises:
            UpdateSessionError: none is open.
        """
        if self._session is None:
            raise UpdateSessionError(
                f"no weight-update session is open on tp rank {self._parallelism.tp_rank}; "
                "call begin_weight_update first"
            )
        return self._session

    def _differing(self, now: np.ndarray, before: np.ndarray) -> tuple[str, ...]:
        """The parameters whose digests differ between two value arrays."""
        if now.tobytes() == before.tobytes():  # the common case, in a microsecond
            return ()
        names = self._digests.names
        return tuple(names[i] for i in np.flatnonzero(now != before).tolist())

    def digests(self) -> dict[str, int]:
        """``{param_name: digest}`` of what every parameter holds now."""
        # A fenced begin's digest shares the host buffer: read it before another runs.
        self.read_fenced_begin()
        return self._digests.compute()

    def delta_checksums(self) -> dict[str, int]:
        """``{param_name: checksum}`` (`weightsync.delta_codec.checksums`) of what every
        parameter holds now, read over every byte; read-only, any time. Inside an open
        session (not yet ending) the rank keeps them: they are the base its deltas'
        ``"changes"`` check derives from (`apply_delta`)."""
        sums = checksums(self._params)
        session = self._session
        if session is not None and session.state is not SessionState.ENDING:
            session.delta_base = dict(sums)
        return sums

    def apply_delta(
        self,
        payloads: Sequence[tuple[int, int]],
        expected: Mapping[str, int],
        *,
        check: Check = "changes",
    ) -> DeltaResult:
        """Apply the delta payloads the trainers wrote into the delta region, in order, and
        check every changed parameter against the checksums they expect; the session
        remembers the verdict for `end_update`.

        A payload that is not a valid delta stops the apply: it changed nothing, but the
        payloads before it stay applied, so the result (with its ``error``) is not verified.

        The ``"changes"`` check derives each parameter's checksum after from the base this
        session read (`delta_checksums`) and the elements the payloads wrote, as read before
        and after each write (`weightsync.delta_codec.apply_and_check` says what it proves
        and what only a full pass does); without that read in this session it reads every
        byte, as ``"full"`` always does.

        Args:
            payloads: ``(offset, num_bytes)`` of each payload inside the delta region.
            expected: ``{param_name: checksum}`` each changed parameter must hold after
                applying (the base's checksum plus the trainers' change).
            check: ``"changes"`` or ``"full"``.

        Returns:
            What was written and the checksums of every parameter after it; ``mismatched``
            names the parameters whose checksum is not the expected one and those a
            payload wrote without one expected.

        Raises:
            UpdateSessionError: no session is open, or its end is being prepared.
            ValueError: this rank has no delta region, a payload lies outside it,
                `expected` names a parameter the rank does not have, or `check` is unknown;
                nothing was applied.
        """
        session = self._open_session()
        rank = f"tp rank {self._parallelism.tp_rank}"
        if session.state is SessionState.ENDING:
            raise UpdateSessionError(
                f"{rank}: the weight-update session's end is being prepared; apply deltas "
                "before ending the session"
            )
        if self._delta_region is None:
            raise ValueError(
                f"{rank} has no delta region (its agent was built with delta_region_bytes=0); "
                "it takes full syncs only"
            )
        if check not in CHECKS:
            raise ValueError(f"{rank}: check must be one of {CHECKS}, got {check!r}")
        views = self._delta_region.payloads(payloads, where=rank)
        # A fenced begin's digest reads the parameters on the GPU: read it before they change.
        self._digests_at_begin(session)
        base, session.delta_base = session.delta_base, None  # unknown if it fails midway
        try:
            result = apply_deltas(views, self._params, expected, where=rank, base=base, check=check)
        except ValueError:
            session.delta_base = base  # refused before anything was written
            raise
        session.delta = result.verified and session.delta is not False
        session.delta_base = dict(result.checksums)
        return result

    def weights_checker(
        self,
        action: str,
        *,
        allow_quant_error: bool = False,
        skip_tensor_list: Collection[str] = (),
        seed: int | None = None,
    ) -> CheckResult:
        """Run a weights-checker action on this rank's parameters (see `WeightsChecker.run`).

        Raises:
            ValueError: unknown action or a skip entry that matches no parameter.
            MemoryError: a snapshot found no host memory for its copy.
        """
        result = self._checker.run(
            action,
            allow_quant_error=allow_quant_error,
            skip_tensor_list=skip_tensor_list,
            seed=seed,
        )
        if action == "reset_tensors" and self._session is None:
            # A change the engine made itself, not one from outside a session.
            self._reference = self._digests.compute_values()
        elif action == "reset_tensors":
            # Written after the session's base was read: a delta's check reads every byte.
            self._session.delta_base = None
        return result

    def close(self) -> None:
        """Unregister every region this agent registered, the delta region too
        (idempotent); a digest still held behind the gate is let run."""
        if self._gate is not None:
            self._gate.open()
        if self._delta_region is not None:
            self._delta_region.close()
        while self._registered:
            self._transport.unregister(self._registered.pop())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def memory_regions(tensors: Collection[torch.Tensor]) -> list[tuple[int, int]]:
    """The ``(addr, num_bytes)`` regions that cover `tensors`, sorted by address.

    Tensors that share one storage (an engine that carves parameters out of one flat buffer)
    and touch or overlap are merged into one region; tensors of different storages are never
    merged, even when their addresses happen to be adjacent, because one registration must
    not span two allocations. Empty tensors are left out.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.nbytes, t.untyped_storage().data_ptr())
        for t in tensors
        if t.numel()
    )
    regions: list[list[int]] = []
    for start, end, storage in spans:
        last = regions[-1] if regions else None
        if last is not None and last[0] == storage and start <= last[2]:
            last[2] = max(last[2], end)
        else:
            regions.append([storage, start, end])
    return [(start, end - start) for _, start, end in regions]
