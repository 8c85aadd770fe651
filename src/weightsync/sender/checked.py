"""`CheckedPush`: what `WeightSender.preflight` checked, the one thing `WeightSender.push` takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightsync.export.base import WeightExport
from weightsync.plan.items import SourcePlan
from weightsync.plan.program import PushProgram

if TYPE_CHECKING:
    from weightsync.sender.sender import WeightSender


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CheckedPush:
    """A push its sender checked and may run once: the export holds what the plan needs
    (each part's program was found or lowered) and, when due, its values are finite.

    Made by `WeightSender.preflight` only; `WeightSender.push` of the same sender takes it,
    and refuses it once pushed or once a later preflight replaced it.

    Attributes:
        plan: the rank's source plan.
        export: the export checked against it.
        programs: the program of each part of the plan (`SourcePlan.parts`; one for a plan
            of one dtype), as the push runs them.
        cached: every program was kept from an earlier push (none was lowered now).
        sender: the sender that checked it.
    """

    plan: SourcePlan
    export: WeightExport
    programs: tuple[PushProgram, ...]
    cached: bool
    sender: WeightSender = field(repr=False)
