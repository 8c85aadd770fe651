"""Choosing the label of an update from what the replicas hold as it begins.

Labels are facts of the replicas: every begin says what the replica holds (its label, and
the largest numeric label its process has held), and the label of the update is chosen from
that, never from what a manager remembers of an earlier contact. Two managers interleaved,
a ``weightsync push`` between two trainer syncs, a replica restarted from a checkpoint: each
begin reads what is there now. The rules (`next_label`):

- a label that a replica holds now is refused: one label names one set of weights;
- a label this manager gave before is refused, numeric or not;
- a numeric label at or below one a replica holds is refused unless the caller says it
  means to roll back (a trainer that labels by its step, resuming an earlier step);
- by default, one more than every numeric label any replica holds or has held, and than
  every one this manager gave.

What counts as numeric is `weightsync.control.labels.numeric_label`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from weightsync.control.labels import check_label, numeric_label


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldLabel:
    """What one replica holds as an update begins.

    Attributes:
        label: the label of its weights (None when it has none).
        highest: the largest numeric label its process has held, where it says (the
            reference server does; SGLang does not).
    """

    label: str | None
    highest: int | None = None


def next_label(
    requested: str | None,
    held: Mapping[str, HeldLabel],
    *,
    given: Collection[str] = (),
    given_highest: int = 0,
    rollback: bool = False,
) -> str:
    """The label of an update of the replicas in `held` (see the module).

    Args:
        requested: the caller's label, or None for the next number.
        held: by replica URL, what it holds as the update begins.
        given: the labels this manager gave before.
        given_highest: the largest numeric label this manager gave (0: none).
        rollback: the caller means to label weights older than a replica holds.

    Raises:
        ValueError: `requested` is not a label (`check_label`), a replica holds it, this
            manager gave it before, or it is numeric and not above what a replica holds
            (without `rollback`); the message names the replica and its label.
    """
    if requested is None:
        highest = [given_highest]
        for state in held.values():
            highest += [n for n in (numeric_label(state.label), state.highest) if n is not None]
        number = max(highest) + 1
        while str(number) in given:
            number += 1
        return str(number)
    check_label(requested)
    if requested in given:
        raise ValueError(
            f"weight version {requested!r} was given to other weights by this trainer before: "
            "labels are never reused; pass a new version, or version=None for the next number"
        )
    for url, state in held.items():
        if state.label == requested:
            raise ValueError(
                f"weight version {requested!r} already names the weights replica {url} holds: "
                "one label must never name two weight sets; pass a new version, or "
                "version=None for the next number"
            )
    number = numeric_label(requested)
    if number is not None and not rollback:
        for url, state in held.items():
            held_number = numeric_label(state.label)
            if held_number is not None and held_number >= number:
                raise ValueError(
                    f"weight version {requested!r} is not above {state.label!r}, which replica "
                    f"{url} holds: numeric labels go forward; pass the next number (or "
                    "version=None), or rollback=True to label weights older than it holds"
                )
    return requested


class LabelBook:
    """What each replica holds, as last seen, and the labels one manager gave: the facts
    `next_label` chooses from."""

    def __init__(self) -> None:
        self._held: dict[str, HeldLabel] = {}
        self._given: set[str] = set()
        self._highest = 0  # the largest numeric label given

    def next(self, requested: str | None, replicas: Collection[str], *, rollback: bool) -> str:
        """The label of an update of `replicas` (`next_label`).

        Raises:
            ValueError: as `next_label`.
        """
        held = {url: self._held.get(url, HeldLabel(label=None)) for url in replicas}
        return next_label(
            requested, held, given=self._given, given_highest=self._highest, rollback=rollback
        )

    def give(self, label: str) -> None:
        """Record that this manager gave `label` to an update."""
        self._given.add(label)

    def seen(self, url: str, label: str | None, *, keep_highest: bool = False) -> None:
        """Replica `url` holds `label` (with `keep_highest`, as well as the highest it was
        known to hold)."""
        known = self._held.get(url)
        highest = known.highest if keep_highest and known is not None else None
        self._held[url] = HeldLabel(label=label, highest=highest)

    def began(self, url: str, held: HeldLabel) -> None:
        """What replica `url` said it holds as its session began."""
        self._held[url] = held

    def hold(self, label: str, replicas: Collection[str]) -> None:
        """`replicas` hold `label` now: an update gave it to them."""
        number = numeric_label(label)
        for url in replicas:
            known = self._held.get(url)
            highest = known.highest if known is not None else None
            if number is not None:
                highest = max(number, highest or 0)
            self._held[url] = HeldLabel(label=label, highest=highest)
        if number is not None:
            self._highest = max(self._highest, number)

    def forget(self, replicas: Collection[str]) -> None:
        """Nothing is known of what `replicas` hold (written part-way, or gone)."""
        for url in replicas:
            self._held.pop(url, None)
