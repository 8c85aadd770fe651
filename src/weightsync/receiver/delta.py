"""Delta syncs on a rank: the region trainers write encoded changes into, and applying them.

A trainer writes, per rollout rank, one payload (`weightsync.delta_codec`) per trainer
source rank into the rank's *delta region*, one-sidedly. The rank applies them in place,
then checks every changed parameter's checksum against what the trainers expect (the base
the rank proved plus the change they computed): equal checksums mean the bytes the trainers
meant. By default the checksums after are derived from that base and the elements written
(``check="changes"``, `weightsync.delta_codec.apply_and_check`); ``check="full"`` reads
every byte again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.delta_codec import Check, apply_and_check

if TYPE_CHECKING:
    from weightsync.transport import Transport

# Payloads start at 8-byte boundaries (`delta_codec` reads their tables as int64 words).
PAYLOAD_ALIGNMENT = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaResult:
    """What applying one sync's delta payloads on a rank found.

    Attributes:
        num_elements: elements the payloads wrote.
        mismatched: parameters whose checksum after applying differs from the expected
            one, then parameters a payload wrote that had no expected checksum.
        checksums: ``{param_name: checksum}`` of every parameter after applying (the next
            base).
        seconds: what applying and checking took.
        error: why a payload could not be applied (a `DeltaFormatError`), or None; the
            payloads before it were applied, it and those after it were not.
        check: how the checksums after were found: ``"changes"`` (derived from the base
            and the elements written) or ``"full"`` (every byte read).
        recomputed: under ``"changes"``, the parameters whose checksum was read over all
            their bytes instead (`weightsync.delta_codec.Checked.recomputed`).
    """

    num_elements: int
    mismatched: tuple[str, ...]
    checksums: dict[str, int]
    seconds: float
    error: str | None = None
    check: str = "full"
    recomputed: tuple[str, ...] = ()

    @property
    def verified(self) -> bool:
        """Every payload applied and every expected checksum matched."""
        return self.error is None and not self.mismatched

    def to_dict(self) -> dict[str, Any]:
        """One rank's reply to an apply-delta call (the fields of
        `weightsync.control.models.ApplyDeltaRank`)."""
        return {
            "num_elements": self.num_elements,
            "mismatched": list(self.mismatched),
            "checksums": self.checksums,
            "error": self.error,
            "verified": self.verified,
            "seconds": self.seconds,
            "check": self.check,
        }


class DeltaRegion:
    """A uint8 buffer beside a rank's parameters, registered with its transport, that
    trainers write delta payloads into.

    Args:
        transport: the rank's transport.
        num_bytes: the region's size (positive).
        device: where it lives: the parameters' device.

    Raises:
        ValueError: `num_bytes` is not a positive int.
    """

    def __init__(self, transport: Transport, num_bytes: int, device: torch.device) -> None:
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
            raise ValueError(f"a delta region needs a positive number of bytes, got {num_bytes!r}")
        self._transport = transport
        self._buffer = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        if self._buffer.device.type == "cuda":
            # Writers in other processes may write here once the region is published: the
            # zeroing kernel must not land after them.
            torch.cuda.synchronize(self._buffer.device)
        # Through the protocol alone: the receiver imports no transport module at run time
        # (an engine's worker brings its own transport).
        transport.register(self._buffer.data_ptr(), num_bytes)
        self._addr: int | None = self._buffer.data_ptr()

    @property
    def region(self) -> tuple[int, int]:
        """``(addr, num_bytes)`` as registered with the transport."""
        return self._buffer.data_ptr(), self._buffer.numel()

    def payloads(self, spans: Sequence[tuple[int, int]], *, where: str) -> list[torch.Tensor]:
        """Views of the region's ``(offset, num_bytes)`` `spans`, all checked first.

        Args:
            spans: where each payload lies in the region.
            where: the rank, as an error names it.

        Raises:
            ValueError: a span out of the region's bounds, empty, or not at an 8-byte offset.
        """
        size = self._buffer.numel()
        views = []
        for index, span in enumerate(spans):
            offset, num_bytes = (int(v) for v in span)
            if num_bytes <= 0 or offset < 0 or offset + num_bytes > size:
                raise ValueError(
                    f"{where}: delta payload {index} [{offset}, +{num_bytes}) is not inside "
                    f"the delta region of {size} bytes; nothing was applied. Payloads must "
                    "lie in the region the rank published (its delta_region)"
                )
            if offset % PAYLOAD_ALIGNMENT:
                raise ValueError(
                    f"{where}: delta payload {index} starts at offset {offset}, not a multiple "
                    f"of {PAYLOAD_ALIGNMENT}; nothing was applied"
                )
            views.append(self._buffer[offset : offset + num_bytes])
        return views

    def close(self) -> None:
        """Unregister the region (idempotent)."""
        addr, self._addr = self._addr, None
        if addr is not None:
            self._transport.unregister(addr)


def apply_deltas(
    payloads: Sequence[torch.Tensor],
    params: Mapping[str, torch.Tensor],
    expected: Mapping[str, int],
    *,
    where: str,
    base: Mapping[str, int] | None = None,
    check: Check = "changes",
) -> DeltaResult:
    """Apply `payloads` in order to `params`, then check every changed parameter's checksum.

    A payload that is not a valid delta (`DeltaFormatError`) stops there: it changed
    nothing, the ones before it stay applied, and the result carries the error.

    Args:
        payloads: the payloads' bytes (uint8), in the order the trainers wrote them.
        params: every parameter of the rank by name (`apply_payload` numbers them in the
            order of their sorted names).
        expected: ``{param_name: checksum}`` the trainers expect after applying, for the
            parameters they changed.
        where: the rank, as an error names it.
        base: ``{param_name: checksum}`` the rank read over every byte of `params` (and
            reported) before these payloads, nothing else written since; None: no such
            read, the check reads every byte after applying.
        check: ``"changes"`` (derive the checksums after from `base`) or ``"full"``.

    Raises:
        ValueError: `expected` names a parameter the rank does not have, or `check` is
            unknown (nothing applied).
    """
    unknown = sorted(set(expected) - set(params))
    if unknown:
        raise ValueError(
            f"{where}: expected checksums name {len(unknown)} parameter(s) it does not have "
            f"({', '.join(unknown[:5])}); nothing was applied"
        )
    start = time.perf_counter()
    checked = apply_and_check(payloads, params, expected, base=base, check=check)
    error = None
    if checked.refused is not None:
        index = checked.refused
        before = (
            "nothing was applied"
            if index == 0
            else f"the {index} payload(s) before it were applied"
        )
        error = f"delta payload {index} of {len(payloads)} was refused ({checked.error}); {before}"
    return DeltaResult(
        num_elements=checked.num_elements,
        mismatched=checked.mismatched + checked.unexpected,
        checksums=checked.checksums,
        seconds=time.perf_counter() - start,
        error=error,
        check=checked.check,
        recomputed=checked.recomputed,
    )
