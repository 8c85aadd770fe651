"""`WeightSender`: one trainer rank's side of a sync, from its export to the targets."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from weightsync.cuda_events import wait_reached
from weightsync.errors import PartialPushError, TransferError, WeightsRefusedError
from weightsync.export.base import WeightExport
from weightsync.plan.direct import DirectSpec
from weightsync.plan.geometry import StreamGeometry
from weightsync.plan.items import SourcePlan
from weightsync.plan.program import PushProgram, StagingSpec, lower_push
from weightsync.plan.types import SourceHolding
from weightsync.sender.config import SenderConfig
from weightsync.sender.digest import DigestSums
from weightsync.sender.direct import (
    MappedDirect,
    SourceMemory,
    TransportDirect,
    wait_stream,
)
from weightsync.sender.executor import ArrivalTable, ProgramRun, arrival_table
from weightsync.sender.fences import PushFences
from weightsync.sender.fill import SlotFiller
from weightsync.sender.pins import PushPins
from weightsync.sender.replay import CapturedPush, GraphPush, WritePush
from weightsync.sender.staging import StagingRing, direct_spec, transport_reads
from weightsync.sender.stats import PushStats
from weightsync.sender.writes import WriteQueue
from weightsync.torch_dtypes import torch_dtype

if TYPE_CHECKING:
    from weightsync.transport import Transport

# Programs kept per plan: one per stream geometry a rank alternates between (say, a model
# whose memory moves between two layouts); more would only hold memory.
_MAX_PROGRAMS = 4


class WeightSender:
    """Executes one trainer rank's share of a sync plan.

    Call protocol, on every rank of the trainer group:

    1. ``holdings = sender.gather_holdings(export)`` (collective) and hand them, with the
       rollout's targets, to `weightsync.plan.build_plan`;
    2. ``sender.push(plan.for_source(sender.rank), export)`` after every optimizer step (the
       plan is reused until the targets change);
    3. ``release()`` before a trainer checkpoint save and ``restore()`` after it, if memory
       is tight;
    4. ``close()`` at the end.

    A push runs a program (`weightsync.plan.program`) lowered from the plan and the export's
    geometry: each tensor the plan needs is copied (and cast) into a staging ring registered
    with the transport once, in chunks whose writes go out as soon as they are filled, so a
    push overlaps its fills with its writes. Staging memory is ``num_slots * bucket_bytes``,
    on the host (pinned when CUDA is available) or, for CUDA tensors and a transport that
    reads GPU memory, on the GPU. Programs are cached per plan and geometry: a later push
    whose stream lies in memory the same way runs the same program with no planning left
    (``PushStats.cached_program``); one whose geometry changed gets a new program before it
    writes anything. The sender does not own the transport: closing it is the caller's job.
    """

    def __init__(self, config: SenderConfig, *, transport: Transport, group: Any = None) -> None:
        """Create the sender; staging memory is allocated at the first push.

        Args:
            config: bucket size, workers, timeouts, staging placement.
            transport: writes the bytes (a `weightsync.transport.Transport`).
            group: the trainer's torch.distributed process group, or None for a single
                process.
        """
        self.config = config
        self.group = group
        self._transport = transport
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            import torch.distributed as dist

            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        self._ring: StagingRing | None = None
        self._filler = SlotFiller(num_workers=config.num_workers)
        self._queue = WriteQueue(
            transport,
            timeout_s=config.timeout_s,
            max_outstanding_per_peer=config.max_outstanding_per_peer,
        )
        self._plan: SourcePlan | None = None
        self._programs: list[_Kept] = []  # the newest first
        self._pushed = False  # a push has completed (check_finite="first" checks until then)
        # (id(plan), id(export)) a preflight checked, and whether its program was cached then.
        self._preflighted: tuple[int, int, bool] | None = None
        self._sources = SourceMemory.of(transport)
        self._holding: SourceHolding | None = None
        # Receiver parameters mapped into this process, by (session, name, address).
        self._mapped_params: dict[tuple[str, str, int], torch.Tensor] = {}
        # One interprocess event per device that in-flight copies complete at, and the
        # push whose copies are in flight (``push(wait=False)``) with the event's handle.
        self._landing: dict[torch.device, tuple[torch.cuda.Event, str]] = {}
        self._recorded: tuple[torch.cuda.Event, str] | None = None
        self._in_flight: tuple[torch.cuda.Event, PushStats] | None = None
        # The pins of pushed parts whose copies are still in flight, checked once they land.
        self._landing_pins: list[PushPins] = []
        self._fences: PushFences | None = None
        self._closed = False

    @property
    def transport(self) -> Transport:
        """The transport the sender writes with."""
        return self._transport

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory currently allocated (0 before the first push)."""
        return self._ring.num_bytes if self._ring is not None and self._ring.allocated else 0

    @property
    def staging_device(self) -> torch.device | None:
        """Where the staging ring lives, once the first push chose it."""
        return self._ring.device if self._ring is not None else None

    def holding(self, export: WeightExport) -> SourceHolding:
        """What this rank can produce, for the plan.

        Raises:
            ValueError: `export` is not a `WeightExport`, or its stream is malformed.
        """
        if not isinstance(export, WeightExport):
            raise ValueError(
                "holding() takes a WeightExport (e.g. weightsync.ModelExport(model)), got "
                f"{type(export).__name__}"
            )
        tensors = export.holding()
        cached = self._holding
        if cached is None or cached.tensors is not tensors:
            # The same object while the export's holding is: comparing a sync's holdings
            # with the cached plan's is then an identity check.
            cached = self._holding = SourceHolding(rank=self.rank, tensors=tensors)
        return cached

    def gather_holdings(self, export: WeightExport) -> list[SourceHolding]:
        """Every rank's `holding`, by rank; collective over the group (every rank calls it)."""
        mine = self.holding(export)
        if self.world_size == 1:
            return [mine]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        return sorted(gathered, key=lambda h: h.rank)

    def program_for(
        self, plan: SourcePlan, export: WeightExport, *, whole: SourcePlan | None = None
    ) -> tuple[PushProgram, bool]:
        """The program that pushes `export` for `plan`, and whether it was cached.

        Args:
            plan: a source plan of one dtype.
            export: the rank's export.
            whole: the plan `plan` is a part of (`SourcePlan.parts`), if any: the cache
                keeps the programs of all its parts.

        Raises:
            ValueError: as `weightsync.plan.lower_push` says (a missing tensor, a shape that
                differs from the plan's, a box out of range); nothing is written.
        """
        owner = whole if whole is not None else plan
        if owner is not self._plan:
            # A new plan (new targets, or a replica that came back): nothing of the old one's
            # programs, captures or mappings of receiver memory is kept.
            self._plan, self._programs, self._mapped_params = owner, [], {}
        geometry = export.geometry()
        staging = self._staging(plan, geometry)
        for kept in self._programs:
            if kept.program.matches(plan, geometry, staging):
                return kept.program, True
        program = lower_push(plan, geometry, staging)
        keep = _MAX_PROGRAMS * max(1, len(owner.parts))
        self._programs = [_Kept(program), *self._programs[: keep - 1]]
        return program, False

    def _kept(self, program: PushProgram) -> _Kept:
        """What is kept for `program` (a record of its own if it is no longer kept)."""
        for kept in self._programs:
            if kept.program is program:
                return kept
        return _Kept(program)

    def preflight(self, plan: SourcePlan, export: WeightExport) -> None:
        """Everything `push` checks before it writes: the program (the export holds what the
        plan needs) and, when due (``config.check_finite``), finite values. A `push` of the
        same plan and export that follows does not check again.

        A group of trainer ranks runs it on every rank and pushes only if no rank refused,
        so that one rank's bad weights leave every replica untouched.

        Raises:
            ValueError: the export does not hold what the plan needs.
            WeightsRefusedError: a value that is not finite in the rollout's dtype.
        """
        if self._closed:
            raise ValueError("preflight() on a closed WeightSender")
        _begin_push(export)
        check = self.config.check_finite
        all_cached = True
        for part in plan.parts or (plan,):
            program, cached = self.program_for(part, export, whole=plan)
            all_cached = all_cached and cached
            if check == "always" or (check == "first" and not self._pushed):
                refuse_non_finite(program, export)
        self._preflighted = (id(plan), id(export), all_cached)

    def push(
        self,
        plan: SourcePlan,
        export: WeightExport,
        *,
        wait: bool = True,
        fences: Mapping[str, str] | None = None,
    ) -> PushStats:
        """Write this rank's share of a sync into the plan's targets.

        The export's tensors are pinned for the push (`weightsync.sender.pins`): they must
        not change from when the push takes each one (as the stream yields it; a replayed
        push takes them all as it starts) until its last write that reads them landed. The
        push reads each one's version counter then and again before it returns, and fails
        naming the first that moved: a change in that window, such as an optimizer step on
        another thread, would leave the replicas with part old, part new values. A plan of
        several dtypes (``plan.parts``) is pushed part by part, each part checked over its
        own window. A streamed push pays 0.15-0.3 us per HF tensor (an 18,867-tensor MoE:
        3-5 ms, 2-3 % of the push's Python in ``bench/sender_overhead.py``); a replay pays
        per version counter, which views share with the tensor they view: ~50 us for a
        dense 8B model's 398 tensors, ~60 us for a MoE whose 18,867 tensors are views of
        531 (one core of an H200 host; 60 and 80 us on a shared 2-core VM).

        With ``wait=False`` and a replay left in flight, the push checks up to its copies
        being queued and `wait_landed` checks again once they landed: until it returns the
        tensors must not change (a change ordered after the copies on their CUDA stream
        cannot mix with them, but the check cannot tell it apart). A push whose landing is
        never waited for is checked only up to its return.

        Args:
            plan: ``sync_plan.for_source(self.rank)``.
            export: this rank's PP-local export; its tensors may have any dtype (cast to
                ``plan.dtype``). Tensors the plan does not need from this rank are skipped
                without a copy.
            wait: wait for every write to land. With False, a push replayed as a CUDA graph
                returns once its copies are queued and its digests read
                (``PushStats.in_flight``, with the IPC handle of the event the copies
                complete at in ``PushStats.events``); `wait_landed` then waits for them.
                Other pushes wait either way.
            fences: by target session id, the IPC handle (hex) of a CUDA event on this host
                that writes into that target must follow (a replica's fenced begin digest):
                waited for, up to ``config.timeout_s``, before the first write.

        Returns:
            What was staged and written, and how long it took.

        Raises:
            ValueError: the export does not hold what the plan needs in the shapes the plan
                was built for (raised before anything is written), or its stream differs
                from its geometry (raised before that tensor is staged).
            WeightsRefusedError: a value that is not finite in the rollout's dtype (with
                ``check_finite``); raised before anything is written.
            PartialPushError: writes to some targets failed or timed out (a `TransferError`
                naming the first target and its parameters; ``failed`` lists every failed
                target); every write to the other targets landed, and ``result`` holds this
                push's `PushStats` (their digests included).
            TransferError: a fence was not reached in time (nothing was written).
            TensorChangedError: a tensor changed while the push read it (naming the first
                whose version counter moved); raised after the writes landed (or were
                drained), so the targets may hold a mix of old and new values. It takes
                precedence over a `PartialPushError` of the same push.
        """
        if self._closed:
            raise ValueError("push() on a closed WeightSender")
        preflight, self._preflighted = self._preflighted, None
        checked = preflight is not None and preflight[:2] == (id(plan), id(export))
        if not checked:
            _begin_push(export)
        self._settle()
        if fences:
            self._fences_here().wait(plan, fences, self.config.timeout_s)
        if not plan.parts:
            stats = self._push_one(plan, export, whole=plan, checked=checked, wait=wait)
        else:
            # Every part's program and values are checked before the first part writes.
            if not checked:
                self.preflight(plan, export)
                preflight, self._preflighted = self._preflighted, None
                checked = True
            done: list[PushStats] = []
            for part in plan.parts:
                try:
                    done.append(self._push_one(part, export, whole=plan, checked=True, wait=wait))
                except PartialPushError as exc:
                    raise _partial_of_parts(exc, [*done, exc.result]) from exc
            stats = _merge_stats(done)
        if checked and preflight is not None:
            stats = dataclasses.replace(stats, cached_program=preflight[2])
        if stats.in_flight:
            if self._recorded is None:
                # A later part waited for its writes, and so for the copies before them.
                stats = dataclasses.replace(stats, in_flight=False)
            else:
                # The last part recorded the event on the stream every part's copies use.
                event, handle = self._recorded
                stats = dataclasses.replace(stats, events=(handle,))
                self._in_flight = (event, stats)
        self._recorded = None
        self._pushed = True
        return stats

    def wait_landed(self) -> float:
        """Wait for the copies a ``push(..., wait=False)`` left in flight.

        Returns:
            The `time.perf_counter` at which they were seen done (now, when none were in
            flight).

        Raises:
            PartialPushError: they did not finish within ``config.timeout_s`` (every target
                they wrote to is named failed; they may still finish later).
            TensorChangedError: a tensor the copies read changed between the push taking it
                and this call seeing the copies done (see `push`).
        """
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return time.perf_counter()
        event, stats = pending
        t0 = time.perf_counter()
        if wait_reached((event,), self.config.timeout_s):
            landed = time.perf_counter()
            self._check_landed()
            return landed
        waited = time.perf_counter() - t0
        failed = {
            session: TransferError(
                f"the copies into {session}'s mapped memory did not finish within "
                f"{self.config.timeout_s:g} s (waited {waited:.1f} s)",
                target_session=session,
            )
            for session in stats.bytes_per_target
        }
        raise _partial(failed, stats, num_targets=len(failed))

    def _fences_here(self) -> PushFences:
        """What waits for fences on this rank's GPU (the transport's, else the current)."""
        if self._fences is None:
            device = getattr(self._transport, "device", None)
            index = device if isinstance(device, int) else torch.cuda.current_device()
            self._fences = PushFences(torch.device("cuda", index))
        return self._fences

    def _settle(self) -> None:
        """Wait (up to ``config.timeout_s``) for copies left in flight that nobody waited
        for, and forget them (their pins unchecked, as `push` says): later work on the stream
        is ordered after them anyway."""
        pending, self._in_flight = self._in_flight, None
        self._landing_pins = []
        if pending is not None:
            wait_reached((pending[0],), self.config.timeout_s)

    def _check_landed(self) -> None:
        """Check the pins of parts whose copies were in flight, now that they landed."""
        pins, self._landing_pins = self._landing_pins, []
        for part in pins:
            part.check(until="its copies being seen landed")

    def _push_one(
        self,
        plan: SourcePlan,
        export: WeightExport,
        *,
        whole: SourcePlan,
        checked: bool,
        wait: bool = True,
    ) -> PushStats:
        """`push` of a plan of one dtype (`plan` is `whole` or one of its parts)."""
        start = time.perf_counter()
        program, cached = self.program_for(plan, export, whole=whole)
        lowered = time.perf_counter()
        check = self.config.check_finite
        if not checked and (check == "always" or (check == "first" and not self._pushed)):
            refuse_non_finite(program, export)
        device = torch.device(program.staging.device)
        kept = self._kept(program)
        if self.config.digest and kept.sums is None:
            kept.sums = DigestSums(program, device=device)
        sums = kept.sums if self.config.digest else None
        key = getattr(export, "geometry_key", None) if self._replays(program) else None
        captured = kept.captured
        self._queue.start()
        self._sources.start()
        if cached and key is not None and captured is not None and captured.key == key:
            return self._replay(captured, sums, start=start, lowered=lowered, wait=wait)
        if self._recorded is not None:
            # An earlier part left its copies in flight; this one returns with every write
            # landed, so the push does too.
            wait_reached((self._recorded[0],), self.config.timeout_s)
            self._recorded = None
            self._check_landed()
        ring = self._ring_for(program.staging) if program.steps else None
        writer = self._direct_writer(program, device) if program.direct else None
        if kept.table is None:
            kept.table = arrival_table(program)
        pins = PushPins(self.rank)
        run = ProgramRun(
            program,
            ring=ring,
            filler=self._filler,
            queue=self._queue,
            digests=sums,
            direct=writer,
            table=kept.table,
            pins=pins,
        )
        try:
            run.execute(iter(export))
            self._wait_mapped(program, writer)
            pins.check()
        except BaseException:
            self._queue.drain()
            raise
        t0 = time.perf_counter()
        digests = _per_target(program, sums.values()) if sums is not None else {}
        digest_seconds = run.times.digest_s + time.perf_counter() - t0
        failed = self._queue.failed
        if key is not None and not failed and writer is not None:
            kept.captured = self._capture(program, key, writer, sums, device)
        stats = _stats(
            self.rank,
            program,
            seconds=time.perf_counter() - start,
            lower_seconds=lowered - start,
            fill_seconds=run.times.fill_s,
            write_seconds=run.times.write_s,
            cached=cached,
            digests=digests,
            digest_seconds=digest_seconds,
        )
        return self._finished(program, stats)

    def _finished(self, program: PushProgram, stats: PushStats) -> PushStats:
        """`stats` of a push that ended; raises, after draining, when a target failed (and
        drops the program's captured push, so the next push writes from the stream)."""
        failed = self._queue.failed
        if not failed:
            return stats
        self._queue.drain()
        self._kept(program).captured = None
        raise _partial(failed, stats, num_targets=len(program.counters.bytes_per_target))

    def _replays(self, program: PushProgram) -> bool:
        """Whether pushes of `program` are captured and replayed."""
        return self.config.replay and program.all_direct

    def _direct_writer(
        self, program: PushProgram, device: torch.device
    ) -> TransportDirect | MappedDirect:
        """What runs `program`'s direct steps: copies into mapped memory where the transport
        maps receivers on the program's GPU, transport writes otherwise."""
        if device.type == "cuda" and callable(getattr(self._transport, "local_address", None)):
            return MappedDirect(
                self._transport, failed=self._queue.failed, params=self._mapped_params
            )
        return TransportDirect(self._queue, self._sources)

    def _wait_mapped(
        self, program: PushProgram, writer: TransportDirect | MappedDirect | GraphPush | None
    ) -> None:
        """Wait for copies into mapped memory (queued on the current stream) to finish; a
        timeout fails every target they wrote to."""
        if not isinstance(writer, MappedDirect | GraphPush):
            return
        device = torch.device(program.staging.device)
        t0 = time.perf_counter()
        if wait_stream(device, self.config.timeout_s):
            return
        for session in program.counters.bytes_per_target:
            self._queue.failed.setdefault(
                session,
                TransferError(
                    f"the copies into {session}'s mapped memory did not finish within "
                    f"{self.config.timeout_s:g} s (waited {time.perf_counter() - t0:.1f} s)",
                    target_session=session,
                ),
            )

    def _capture(
        self,
        program: PushProgram,
        key: Any,
        writer: TransportDirect | MappedDirect,
        sums: DigestSums | None,
        device: torch.device,
    ) -> CapturedPush:
        """What `writer` did in an all-direct push, kept for replay."""
        if isinstance(writer, MappedDirect):
            return GraphPush(
                program,
                key,
                writer.bound,
                writer.copies,
                sums,
                device=device,
                timeout_s=self.config.timeout_s,
            )
        return WritePush(program, key, writer.bound)

    def _replay(
        self,
        captured: CapturedPush,
        sums: DigestSums | None,
        *,
        start: float,
        lowered: float,
        wait: bool = True,
    ) -> PushStats:
        """Run a captured push again (see `weightsync.sender.replay`); without `wait`, a
        graph's copies are left in flight."""
        program = captured.program
        in_flight = not wait and isinstance(captured, GraphPush)
        t0 = time.perf_counter()
        pins = PushPins(self.rank)
        pins.take(*captured.pinned)
        try:
            captured.replay(self._queue, self._sources, sums)
            if in_flight:
                self._recorded = self._record_landing(torch.device(program.staging.device))
            else:
                self._wait_mapped(program, captured)
                self._queue.wait_all()
            t1 = time.perf_counter()
            digests = _per_target(program, captured.digests(sums)) if sums is not None else {}
            if in_flight:
                # Up to the copies being queued; the rest when they are seen landed.
                pins.check(until="its copies being queued")
                self._landing_pins.append(pins)
            else:
                pins.check()
                if isinstance(captured, GraphPush):
                    # Earlier parts' copies ran ahead of this part's on the stream it waited
                    # for.
                    self._check_landed()
        except BaseException:
            self._queue.drain()
            raise
        stats = _stats(
            self.rank,
            program,
            seconds=time.perf_counter() - start,
            lower_seconds=lowered - start,
            fill_seconds=0.0,
            write_seconds=t1 - t0,
            cached=True,
            digests=digests,
            digest_seconds=time.perf_counter() - t1,
            replayed=True,
            in_flight=in_flight,
        )
        return self._finished(program, stats)

    def _record_landing(self, device: torch.device) -> tuple[torch.cuda.Event, str]:
        """Record `device`'s interprocess landing event on its current stream; the event
        and its IPC handle (hex; one event per device, so the handle stays the same)."""
        landing = self._landing.get(device)
        if landing is None:
            with torch.cuda.device(device):
                event = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream(device))
                landing = self._landing[device] = (event, event.ipc_handle().hex())
            return landing
        landing[0].record(torch.cuda.current_stream(device))
        return landing

    def release(self) -> None:
        """Unregister and free the staging memory (e.g. before a trainer checkpoint save),
        unregister the trainer memory direct writes read, and drop the captured pushes (they
        hold the tensors they read)."""
        self._settle()
        self._queue.drain()
        if self._ring is not None:
            self._ring.free()
        for kept in self._programs:
            kept.captured = None
        self._mapped_params = {}
        self._sources.release()

    def restore(self) -> None:
        """Allocate and register the staging memory again after `release` (no-op if unused)."""
        if self._closed:
            raise ValueError("restore() on a closed WeightSender")
        if self._ring is not None:
            self._ring.allocate()

    def close(self) -> None:
        """Free the staging memory and stop the worker threads; the sender is done."""
        if self._closed:
            return
        self.release()
        self._filler.close()
        self._closed = True

    def _staging(self, plan: SourcePlan, geometry: StreamGeometry) -> StagingSpec:
        """Where this push stages: decided by the first tensor the plan reads."""
        device = torch.device("cpu")
        for key, tensor in zip(geometry.keys, geometry.tensors, strict=True):
            if key in plan.work:
                device = torch.device(tensor.device)
                break
        staging_device = self._staging_device(device)
        direct = DirectSpec()
        if transport_reads(self._transport, staging_device):
            direct = direct_spec(self.config.direct, self._transport.write_cost, staging_device)
        return StagingSpec(
            device=str(staging_device),
            num_slots=self.config.num_slots,
            slot_bytes=self.config.slot_bytes,
            chunk_bytes=self.config.slot_chunk_bytes(staging_device),
            stream_ordered=bool(getattr(self._transport, "stream_ordered", False)),
            direct=direct,
        )

    def _ring_for(self, staging: StagingSpec) -> StagingRing:
        """The staging ring of `staging`, allocated (and registered) on first use."""
        ring = self._ring
        device = torch.device(staging.device)
        if ring is None or ring.device != device or ring.num_bytes != staging.ring_bytes:
            if ring is not None:
                self._queue.drain()
                ring.free()
            ring = self._ring = StagingRing(
                transport=self._transport,
                num_slots=staging.num_slots,
                slot_bytes=staging.slot_bytes,
                device=device,
                pin_memory=self.config.pin_memory,
            )
        ring.allocate()
        return ring

    def _staging_device(self, device: torch.device) -> torch.device:
        staging = self.config.staging
        if staging == "host":
            return torch.device("cpu")
        on_gpu = device.type == "cuda"
        readable = on_gpu and transport_reads(self._transport, device)
        if staging == "cuda" and not readable:
            raise ValueError(
                f"SenderConfig.staging='cuda' needs CUDA tensors and a transport that reads GPU "
                f"memory; the tensors are on {device} and the transport "
                f"{'does not' if on_gpu else 'was not asked'}; use staging='auto' or 'host'"
            )
        return device if readable else torch.device("cpu")


def _partial(
    failed: dict[str, TransferError], stats: PushStats, *, num_targets: int
) -> PartialPushError:
    first = next(iter(failed.values()))
    others = f" ({len(failed)} of {num_targets} targets failed)" if num_targets > 1 else ""
    return PartialPushError(
        f"{first}{others}",
        failed={session: str(exc) for session, exc in failed.items()},
        result=stats,
        target_session=first.target_session,
        byte_ranges=first.byte_ranges,
        return_code=first.return_code,
        param_name=first.param_name,
    )


def _stats(
    rank: int,
    program: PushProgram,
    *,
    seconds: float,
    lower_seconds: float,
    fill_seconds: float,
    write_seconds: float,
    cached: bool,
    digests: dict[str, dict[str, int]],
    digest_seconds: float,
    replayed: bool = False,
    in_flight: bool = False,
) -> PushStats:
    """The `PushStats` of one execution of `program`."""
    counters = program.counters
    return PushStats(
        rank=rank,
        bytes_staged=counters.bytes_staged,
        bytes_written=counters.bytes_written,
        num_writes=counters.num_writes,
        num_regions=counters.num_regions,
        num_buckets=counters.num_buckets,
        num_chunks=counters.num_chunks,
        num_copies=counters.num_copies,
        seconds=seconds,
        lower_seconds=lower_seconds,
        fill_seconds=fill_seconds,
        write_seconds=write_seconds,
        bytes_per_target=dict(counters.bytes_per_target),
        cached_program=cached,
        digests=digests,
        digest_seconds=digest_seconds,
        bytes_direct=counters.bytes_direct,
        replayed=replayed,
        in_flight=in_flight,
        writes_per_target=dict(counters.writes_per_target),
    )


def _begin_push(export: WeightExport) -> None:
    """Tell an export that caches per push (`weightsync.export.Fp8Export`) a push starts."""
    begin = getattr(export, "begin_push", None)
    if callable(begin):
        begin()


def _merge_stats(parts: list[PushStats]) -> PushStats:
    """The stats of a push of several parts (one per dtype) as one push's."""
    per_target: dict[str, int] = {}
    writes: dict[str, int] = {}
    digests: dict[str, dict[str, int]] = {}
    for stats in parts:
        for session, num_bytes in stats.bytes_per_target.items():
            per_target[session] = per_target.get(session, 0) + num_bytes
        for session, num_writes in stats.writes_per_target.items():
            writes[session] = writes.get(session, 0) + num_writes
        for session, values in stats.digests.items():
            digests.setdefault(session, {}).update(values)
    return PushStats(
        rank=parts[0].rank,
        bytes_staged=sum(s.bytes_staged for s in parts),
        bytes_written=sum(s.bytes_written for s in parts),
        num_writes=sum(s.num_writes for s in parts),
        num_regions=sum(s.num_regions for s in parts),
        num_buckets=sum(s.num_buckets for s in parts),
        num_chunks=sum(s.num_chunks for s in parts),
        num_copies=sum(s.num_copies for s in parts),
        seconds=sum(s.seconds for s in parts),
        lower_seconds=sum(s.lower_seconds for s in parts),
        fill_seconds=sum(s.fill_seconds for s in parts),
        write_seconds=sum(s.write_seconds for s in parts),
        bytes_per_target=per_target,
        cached_program=all(s.cached_program for s in parts),
        digests=digests,
        digest_seconds=sum(s.digest_seconds for s in parts),
        bytes_direct=sum(s.bytes_direct for s in parts),
        replayed=all(s.replayed for s in parts),
        in_flight=any(s.in_flight for s in parts),
        writes_per_target=writes,
    )


def _partial_of_parts(exc: PartialPushError, done: list[PushStats]) -> PartialPushError:
    """`exc` of one part, its result what every part so far wrote."""
    return PartialPushError(
        str(exc),
        failed=exc.failed,
        result=_merge_stats(done),
        target_session=exc.target_session,
        byte_ranges=exc.byte_ranges,
        return_code=exc.return_code,
        param_name=exc.param_name,
    )


@dataclasses.dataclass(eq=False)
class _Kept:
    """A lowered program and what its pushes keep: its digest sums and arrival table (built
    on its first push) and its captured push (while it replays)."""

    program: PushProgram
    sums: DigestSums | None = None
    table: ArrivalTable | None = None
    captured: CapturedPush | None = None


def _per_target(
    program: PushProgram, sums: dict[tuple[int, str], int]
) -> dict[str, dict[str, int]]:
    """The digests of a push by target session id; the targets of one layout share one dict
    (it pickles once)."""
    per_layout: dict[int, dict[str, int]] = {}
    for (layout_id, param_name), value in sums.items():
        per_layout.setdefault(layout_id, {})[param_name] = value
    return {
        target.session_id: per_layout.get(layout_id, {})
        for layout_id, targets in program.plan.targets.items()
        for target in targets
    }


def refuse_non_finite(program: PushProgram, export: WeightExport) -> None:
    """Raise, before anything is written, if a tensor the program reads holds a value that is
    NaN or infinite once cast to the rollout's dtype (a float32 weight of 3.4e38 is finite,
    and infinite in bfloat16).

    Reads every such tensor once: the largest magnitude of each (a multi-tensor reduction
    over batches of the stream, so a MoE's thousands of experts cost a few launches, and at
    most a batch is held at a time) decides, as a NaN propagates and rounding is monotonic.

    Raises:
        WeightsRefusedError: naming the tensor, the trainer rank and what to do.
    """
    dtype = torch_dtype(program.dtype)
    if not dtype.is_floating_point:
        return
    needed = set(program.keys)
    batch: list[tuple[str, torch.Tensor]] = []
    batch_bytes = 0
    with torch.no_grad():
        for name, tensor in export:
            if name not in needed or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if tensor.element_size() == 1:
                # FP8 codes: a quantiser's output, finite by construction; a NaN or infinity
                # in its input makes the block's float32 scale non-finite, checked here too.
                continue
            batch.append((name, tensor))
            batch_bytes += tensor.numel() * tensor.element_size()
            if len(batch) == _FINITE_BATCH or batch_bytes >= _FINITE_BATCH_BYTES:
                _check_finite(batch, dtype, program)
                batch, batch_bytes = [], 0
        if batch:
            _check_finite(batch, dtype, program)


# Tensors per multi-tensor reduction of the finite check, and the bytes after which a batch
# is checked sooner: an export that reads its tensors into memory of their own (a checkpoint
# on disk, `weightsync.export.CheckpointExport`) holds a batch in host memory.
_FINITE_BATCH = 1024
_FINITE_BATCH_BYTES = 1 << 30


def _check_finite(
    batch: list[tuple[str, torch.Tensor]], dtype: torch.dtype, program: PushProgram
) -> None:
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in batch:
        groups.setdefault((tensor.device, tensor.dtype), []).append((name, tensor))
    for members in groups.values():
        peaks = torch.stack(torch._foreach_norm([t for _, t in members], float("inf")))
        finite = torch.isfinite(peaks.to(dtype))
        if bool(finite.all()):
            continue
        name = members[int((~finite).nonzero()[0])][0]
        raise WeightsRefusedError(
            f"trainer rank {program.plan.rank}: HF tensor {name!r} holds values that "
            f"are not finite in the rollout's {program.dtype} (NaN, or beyond its range "
            "once cast); nothing was written. Fix the trainer's weights, or set "
            "SenderConfig(check_finite='never') to write them anyway"
        )
