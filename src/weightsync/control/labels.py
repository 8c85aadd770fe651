"""Weight-version labels: what a label may be, and which labels count as numbers.

A label names one set of weights: the manager derives the next one from what every replica
serves at the begin of an update, refuses one that a replica serves now, and refuses a
numeric one at or below what a replica serves unless the caller means to roll back. One rule
decides which labels are numbers, shared by the trainer (`weightsync.TrainerSync`), the
reference server and ``weightsync push``: ASCII decimal digits only, at most
`MAX_NUMERIC_DIGITS` of them (``"²"`` or ``"٣"`` are labels, not numbers; Python's
``str.isdigit`` says otherwise, and ``int()`` of a 5,000-digit string raises).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_LABEL_CHARS = 256
"""The longest label (characters)."""
MAX_NUMERIC_DIGITS = 18
"""The most digits a numeric label has: every numeric label fits an int64."""
_NUMERIC = re.compile(rf"[0-9]{{1,{MAX_NUMERIC_DIGITS}}}")


def numeric_label(label: str | None) -> int | None:
    """The number `label` stands for, or None when it is not a numeric label (see the
    module): only ASCII digits, at most `MAX_NUMERIC_DIGITS` of them."""
    if label is None or _NUMERIC.fullmatch(label) is None:
        return None
    return int(label)


def check_label(label: str) -> str:
    """`label`, when it can name weights: a non-empty string of at most `MAX_LABEL_CHARS`
    printable characters.

    Raises:
        ValueError: naming what is wrong with it.
    """
    if not isinstance(label, str):
        raise ValueError(f"a weight version must be a string, got {type(label).__name__}")
    if not label:
        raise ValueError("a weight version must not be empty")
    if len(label) > MAX_LABEL_CHARS:
        raise ValueError(
            f"a weight version has at most {MAX_LABEL_CHARS} characters, got {len(label)}"
        )
    if not label.isprintable():
        raise ValueError(f"a weight version must be printable, got {label!r}")
    if label.isascii() and label.isdigit() and len(label) > MAX_NUMERIC_DIGITS:
        raise ValueError(
            f"a numeric weight version has at most {MAX_NUMERIC_DIGITS} digits, got "
            f"{len(label)}; count from a smaller number or use a label that is not a number"
        )
    return label


def highest_numeric(labels: Iterable[str | None]) -> int | None:
    """The largest numeric label (`numeric_label`) among `labels`, or None when none is."""
    numbers = [n for n in (numeric_label(label) for label in labels) if n is not None]
    return max(numbers) if numbers else None
