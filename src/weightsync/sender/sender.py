"""`WeightSender`: one trainer rank's side of a sync, from its export to the targets."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from weightsync.errors import PartialPushError, TransferError
from weightsync.export.base import WeightExport
from weightsync.plan.items import SourcePlan
from weightsync.plan.program import PushProgram, StagingSpec
from weightsync.plan.types import SourceHolding, TargetRank
from weightsync.sender.checked import CheckedPush
from weightsync.sender.config import SenderConfig
from weightsync.sender.delta import DeltaPush, DeltaStats
from weightsync.sender.delta_reference import DeltaReference
from weightsync.sender.digest import DigestSums
from weightsync.sender.direct import (
    MappedDirect,
    SourceMemory,
    TransportDirect,
    wait_stream,
)
from weightsync.sender.executor import ProgramRun, arrival_table
from weightsync.sender.fences import Fence, PushFences
from weightsync.sender.fill import SlotFiller
from weightsync.sender.finite import refuse_non_finite
from weightsync.sender.in_flight import InFlight
from weightsync.sender.pins import PushPins
from weightsync.sender.programs import ProgramCache
from weightsync.sender.replay import CapturedPush, GraphPush, WritePush
from weightsync.sender.staging import StagingRing, staging_spec
from weightsync.sender.stats import (
    PushStats,
    merge_stats,
    partial_error,
    partial_of_parts,
    per_target,
    program_stats,
)
from weightsync.sender.writes import WriteQueue
from weightsync.transport.base import MemoryMapper

if TYPE_CHECKING:
    from weightsync.transport import Transport


class WeightSender:
    """Executes one trainer rank's share of a sync plan.

    Call protocol, on every rank of the trainer group:

    1. ``holdings = sender.gather_holdings(export)`` (collective) and hand them, with the
       rollout's targets, to `weightsync.plan.build_plan`;
    2. after every optimizer step, ``checked = sender.preflight(plan.for_source(sender.rank),
       export)`` and ``sender.push(checked)`` (the plan is reused until the targets change;
       a group of ranks agrees between the two that no rank refused);
    3. ``release()`` before a trainer checkpoint save and ``restore()`` after it, if memory
       is tight;
    4. ``close()`` at the end.

    A push runs the program (`weightsync.plan.program`) its preflight lowered from the plan
    and the export's geometry: each tensor the plan needs is copied (and cast) into a staging
    ring registered with the transport once, in chunks whose writes go out as soon as they
    are filled, so a push overlaps its fills with its writes. Staging memory is
    ``num_slots * bucket_bytes``, on the host (pinned when CUDA is available) or, for CUDA
    tensors and a transport that reads GPU memory, on the GPU. Programs are cached per plan
    and geometry (`weightsync.sender.programs`): a later preflight whose stream lies in
    memory the same way finds the same program with no planning left
    (``PushStats.cached_program``); one whose geometry changed gets a new program before
    anything is written. The sender does not own the transport: closing it is the caller's
    job.
    """

    def __init__(self, config: SenderConfig, *, transport: Transport, group: Any = None) -> None:
        """Create the sender; staging memory is allocated at the first push.

        Args:
            config: bucket size, workers, timeouts, staging placement.
            transport: writes the bytes (a `weightsync.transport.Transport`); its
                capabilities are read once, here.
            group: the trainer's torch.distributed process group, or None for a single
                process.

        Raises:
            ValueError: the transport declares that it maps receivers' memory and is no
                `weightsync.transport.MemoryMapper`.
        """
        self.config = config
        self.group = group
        self._transport = transport
        self._capabilities = transport.capabilities
        self._mapper: MemoryMapper | None = None
        if self._capabilities.maps_device_memory:
            if not isinstance(transport, MemoryMapper):
                raise ValueError(
                    f"{type(transport).__name__}'s capabilities say maps_device_memory, but it "
                    "has no local_address(target_session, addr, num_bytes)"
                )
            self._mapper = transport
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
        self._programs = ProgramCache()
        self._pushed = False  # a push has completed (check_finite="first" checks until then)
        self._checked: CheckedPush | None = None  # the preflight a push may still take
        self._sources = SourceMemory.of(transport)
        self._holding: SourceHolding | None = None
        # Receiver parameters mapped into this process, by (session, name, address).
        self._mapped_params: dict[tuple[str, str, int], torch.Tensor] = {}
        self._in_flight = InFlight(config.timeout_s)
        self._fences: PushFences | None = None
        self._delta: DeltaPush | None = None
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
        if self._programs.use(whole if whole is not None else plan):
            # A new plan (new targets, or a replica that came back): nothing of the old one's
            # programs, captures or mappings of receiver memory is kept.
            self._mapped_params = {}
        geometry = export.geometry()
        staging = staging_spec(
            self.config,
            plan,
            geometry,
            capabilities=self._capabilities,
            write_cost=self._transport.write_cost,
        )
        return self._programs.program(plan, geometry, staging)

    def preflight(self, plan: SourcePlan, export: WeightExport) -> CheckedPush:
        """Everything a push checks before it writes: the program of each part of `plan`
        (the export holds what the plan needs) and, when due (``config.check_finite``),
        finite values. Tells the export a push starts (`WeightExport.begin_push`).

        A group of trainer ranks runs it on every rank and pushes only if no rank refused,
        so that one rank's bad weights leave every replica untouched. The export's tensors
        must not move between it and the `push` that takes its result.

        Args:
            plan: ``sync_plan.for_source(self.rank)``.
            export: this rank's PP-local export; its tensors may have any dtype (cast to
                ``plan.dtype``). Tensors the plan does not need from this rank are skipped
                without a copy.

        Returns:
            The checked push, for `push` (it replaces any earlier one not pushed yet).

        Raises:
            ValueError: the sender is closed, or the export does not hold what the plan
                needs in the shapes the plan was built for.
            WeightsRefusedError: a value that is not finite in the rollout's dtype.
        """
        if self._closed:
            raise ValueError("preflight() on a closed WeightSender")
        self._checked = None
        export.begin_push()
        check = self.config.check_finite
        due = check == "always" or (check == "first" and not self._pushed)
        programs = []
        all_cached = True
        for part in plan.parts or (plan,):
            program, cached = self.program_for(part, export, whole=plan)
            all_cached = all_cached and cached
            if due:
                refuse_non_finite(program, export)
            programs.append(program)
        self._checked = CheckedPush(
            plan=plan, export=export, programs=tuple(programs), cached=all_cached, sender=self
        )
        return self._checked

    def push(
        self, checked: CheckedPush, *, wait: bool = True, fences: Sequence[Fence] = ()
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
            checked: what `preflight` of this sender checked, not pushed yet: its plan and
                export are pushed, running its programs.
            wait: wait for every write to land. With False, a push replayed as a CUDA graph
                returns once its copies are queued and its digests read
                (``PushStats.in_flight``, with the IPC handle of the event the copies
                complete at in ``PushStats.events``); `wait_landed` then waits for them.
                Other pushes wait either way.
            fences: CUDA events on this host that writes into their targets must follow (a
                replica's fenced begin digest): those of the plan's targets are waited for,
                up to ``config.timeout_s``, before the first write.

        Returns:
            What was staged and written, and how long it took.

        Raises:
            ValueError: `checked` is not this sender's latest preflight, or was pushed
                already (raised before anything is written); the export's stream differs
                from its geometry (raised before that tensor is staged).
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
        self._take(checked)
        plan, export = checked.plan, checked.export
        self._in_flight.settle()
        if fences:
            self._fences_here().wait(plan, fences, self.config.timeout_s)
        if not plan.parts:
            stats = self._push_one(checked.programs[0], export, checked.cached, wait)
        else:
            done: list[PushStats] = []
            for program in checked.programs:
                try:
                    done.append(self._push_one(program, export, checked.cached, wait))
                except PartialPushError as exc:
                    raise partial_of_parts(exc, [*done, exc.result]) from exc
            stats = merge_stats(done)
        stats = self._in_flight.finish(stats)
        self._pushed = True
        return stats

    def push_delta(
        self,
        plan: SourcePlan,
        export: WeightExport,
        targets: Sequence[TargetRank],
        *,
        token: int,
        pulls: Collection[str] = (),
    ) -> DeltaStats:
        """Write the changes since the last push into `targets`' delta regions (or keep
        them where the targets in `pulls` read them), and keep this push as the reference
        of the next (`weightsync.sender.delta`).

        Call it after `push` of the same export (which writes the targets that take full
        bytes; it may have none), on every rank, for every push of a sync that keeps a
        delta reference: a push with no delta target only records the reference.

        Args:
            plan: the rank's whole source plan (the delta targets among its targets).
            export: the export `push` read.
            targets: the targets that take a delta; their bases must be the bytes of the
                push the reference holds (the driver checks, `weightsync.manager`).
            token: labels the reference once this push recorded every tensor.
            pulls: session ids of the `targets` that read their payloads from this rank's
                staging memory (they need no delta region); the payloads stay there until
                the next delta push.

        Returns:
            What was written where (or lies where), per target, with each parameter's
            checksum change.

        Raises:
            ValueError: the sender is closed, a delta is asked for without a complete
                reference, or a target that does not read its payloads offers no delta
                region (nothing is written).
            TensorChangedError: a tensor changed while the push read it.
        """
        if self._closed:
            raise ValueError("push_delta() on a closed WeightSender")
        if self._delta is None:
            self._delta = DeltaPush(
                self._transport,
                rank=self.rank,
                world_size=self.world_size,
                timeout_s=self.config.timeout_s,
                reference=DeltaReference(self.config.delta_reference),
            )
        return self._delta.push(plan, export, targets, token=token, pulls=pulls)

    @property
    def delta_reference_bytes(self) -> int:
        """Bytes the delta reference keeps (0 before a push kept one)."""
        return self._delta.reference.num_bytes if self._delta is not None else 0

    def _take(self, checked: CheckedPush) -> None:
        """Accept `checked` for a push, once.

        Raises:
            ValueError: the sender is closed, or `checked` is not its latest preflight.
        """
        if self._closed:
            raise ValueError("push() on a closed WeightSender")
        if not isinstance(checked, CheckedPush):
            raise ValueError(
                "push() takes the CheckedPush preflight(plan, export) returned, got "
                f"{type(checked).__name__}"
            )
        if checked.sender is not self:
            raise ValueError(
                "this CheckedPush came from another WeightSender's preflight(); push it with "
                "that sender, or preflight the plan with this one"
            )
        if checked is not self._checked:
            raise ValueError(
                "this CheckedPush was pushed already, or a later preflight() replaced it; "
                "call preflight(plan, export) again before each push"
            )
        self._checked = None

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
        return self._in_flight.wait()

    def _fences_here(self) -> PushFences:
        """What waits for fences on this rank's GPU (the transport's, else the current)."""
        if self._fences is None:
            index = self._capabilities.device
            if index is None:
                index = torch.cuda.current_device()
            self._fences = PushFences(torch.device("cuda", index))
        return self._fences

    def _push_one(
        self, program: PushProgram, export: WeightExport, cached: bool, wait: bool
    ) -> PushStats:
        """Run `program` (of the checked plan, or of one of its parts) from `export`."""
        start = time.perf_counter()
        device = torch.device(program.staging.device)
        kept = self._programs.kept(program)
        found = time.perf_counter()
        if self.config.digest and kept.sums is None:
            kept.sums = DigestSums(program, device=device)
        sums = kept.sums if self.config.digest else None
        key = export.geometry_key if self._replays(program) else None
        captured = kept.captured
        self._queue.start()
        self._sources.start()
        if key is not None and captured is not None and captured.key == key:
            return self._replay(captured, sums, cached, start=start, found=found, wait=wait)
        # An earlier part left its copies in flight; this one returns with every write
        # landed, so the push does too.
        self._in_flight.wait_recorded()
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
        digests = per_target(program, sums.values()) if sums is not None else {}
        digest_seconds = run.times.digest_s + time.perf_counter() - t0
        failed = self._queue.failed
        if key is not None and not failed and writer is not None:
            kept.captured = self._capture(program, key, writer, sums, device)
        stats = program_stats(
            self.rank,
            program,
            seconds=time.perf_counter() - start,
            lower_seconds=found - start,
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
        self._programs.kept(program).captured = None
        raise partial_error(failed, stats, num_targets=len(program.counters.bytes_per_target))

    def _replays(self, program: PushProgram) -> bool:
        """Whether pushes of `program` are captured and replayed."""
        return self.config.replay and program.all_direct

    def _direct_writer(
        self, program: PushProgram, device: torch.device
    ) -> TransportDirect | MappedDirect:
        """What runs `program`'s direct steps: copies into mapped memory where the transport
        maps receivers on the program's GPU, transport writes otherwise."""
        if device.type == "cuda" and self._mapper is not None:
            return MappedDirect(self._mapper, failed=self._queue.failed, params=self._mapped_params)
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
        cached: bool,
        *,
        start: float,
        found: float,
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
                self._in_flight.record(torch.device(program.staging.device))
            else:
                self._wait_mapped(program, captured)
                self._queue.wait_all()
            t1 = time.perf_counter()
            digests = per_target(program, captured.digests(sums)) if sums is not None else {}
            if in_flight:
                # Up to the copies being queued; the rest when they are seen landed.
                pins.check(until="its copies being queued")
                self._in_flight.keep_pins(pins)
            else:
                pins.check()
                if isinstance(captured, GraphPush):
                    # Earlier parts' copies ran ahead of this part's on the stream it waited
                    # for.
                    self._in_flight.check_pins()
        except BaseException:
            self._queue.drain()
            raise
        stats = program_stats(
            self.rank,
            program,
            seconds=time.perf_counter() - start,
            lower_seconds=found - start,
            fill_seconds=0.0,
            write_seconds=t1 - t0,
            cached=cached,
            digests=digests,
            digest_seconds=time.perf_counter() - t1,
            replayed=True,
            in_flight=in_flight,
        )
        return self._finished(program, stats)

    def release(self) -> None:
        """Unregister and free the staging memory (e.g. before a trainer checkpoint save),
        unregister the trainer memory direct writes read, and drop the captured pushes (they
        hold the tensors they read)."""
        self._in_flight.settle()
        self._queue.drain()
        if self._ring is not None:
            self._ring.free()
        self._programs.drop_captures()
        self._mapped_params = {}
        self._sources.release()
        if self._delta is not None:
            self._delta.release()

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
        if self._delta is not None:
            self._delta.reference.free()
        self._filler.close()
        self._closed = True

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
