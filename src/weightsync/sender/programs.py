"""The push programs a sender keeps: those of the plan it pushes, per stream geometry.

A plan is lowered into a program once per geometry its export's stream takes
(`weightsync.plan.program.lower_push`); a later push whose stream lies in memory the same way
runs the kept program with no planning left. Beside each program the sender keeps what its
pushes build once: digest sums, the arrival table and the captured push it replays.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.plan.geometry import StreamGeometry
from weightsync.plan.items import SourcePlan
from weightsync.plan.program import PushProgram, StagingSpec, lower_push
from weightsync.sender.digest import DigestSums
from weightsync.sender.executor import ArrivalTable
from weightsync.sender.replay import CapturedPush

MAX_PROGRAMS = 4
"""Programs kept per plan (per part of a plan of several dtypes): one per stream geometry a
rank alternates between (say, a model whose memory moves between two layouts); more would
only hold memory."""


@dataclass(eq=False)
class KeptProgram:
    """A lowered program and what its pushes keep: its digest sums and arrival table (built
    on its first push) and its captured push (while it replays)."""

    program: PushProgram
    sums: DigestSums | None = None
    table: ArrivalTable | None = None
    captured: CapturedPush | None = None


class ProgramCache:
    """The programs of one plan (the one pushed last), the newest first.

    Call protocol: `use` with the plan a push runs (a new one drops everything kept for the
    old), then `program` for each part of it; `kept` for what a program's pushes keep.
    """

    def __init__(self) -> None:
        self._plan: SourcePlan | None = None
        self._kept: list[KeptProgram] = []

    def use(self, plan: SourcePlan) -> bool:
        """Keep the programs of `plan` (the whole plan, not a part of it); True when it is
        not the plan kept so far, whose programs are then dropped."""
        if plan is self._plan:
            return False
        self._plan, self._kept = plan, []
        return True

    def program(
        self, plan: SourcePlan, geometry: StreamGeometry, staging: StagingSpec
    ) -> tuple[PushProgram, bool]:
        """The program of `plan` (the plan `use` got, or one of its parts) for a stream laid
        out as `geometry` staged as `staging`, and whether it was kept (else it is lowered
        now, and kept).

        Raises:
            ValueError: as `weightsync.plan.lower_push` says.
        """
        for kept in self._kept:
            if kept.program.matches(plan, geometry, staging):
                return kept.program, True
        program = lower_push(plan, geometry, staging)
        num_parts = len(self._plan.parts) if self._plan is not None else 0
        keep = MAX_PROGRAMS * max(1, num_parts)
        self._kept = [KeptProgram(program), *self._kept[: keep - 1]]
        return program, False

    def kept(self, program: PushProgram) -> KeptProgram:
        """What is kept for `program` (a record of its own if it is no longer kept)."""
        for kept in self._kept:
            if kept.program is program:
                return kept
        return KeptProgram(program)

    def drop_captures(self) -> None:
        """Forget every captured push (they hold the tensors they read)."""
        for kept in self._kept:
            kept.captured = None
