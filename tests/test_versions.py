"""Labels: which are numbers (one rule everywhere), and how an update's label is chosen from
what the replicas hold as it begins."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.control.labels import check_label, highest_numeric, numeric_label
from weightsync.manager.versions import HeldLabel, next_label


@pytest.mark.parametrize(
    ("label", "number"),
    [
        ("0", 0),
        ("7", 7),
        ("007", 7),
        ("9" * 18, 10**18 - 1),
        ("9" * 19, None),  # past an int64: a label, not a number
        ("²", None),  # str.isdigit() says yes; int() raises
        ("٣", None),  # Arabic-Indic three: int() reads 3, the rule does not
        ("-1", None),
        ("1.0", None),
        (" 1", None),
        ("", None),
        ("step-3", None),
        (None, None),
    ],
)
def test_only_ascii_digits_are_numbers(label, number) -> None:
    assert numeric_label(label) == number


@given(st.text(max_size=40))
def test_numeric_label_never_raises_and_agrees_with_int(label) -> None:
    number = numeric_label(label)
    if number is not None:
        assert label.isascii() and label.isdigit() and int(label) == number


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("", "must not be empty"),
        ("x" * 257, "at most 256 characters"),
        ("a\nb", "must be printable"),
        ("9" * 19, "at most 18 digits"),
    ],
)
def test_labels_that_cannot_name_weights_are_refused(label, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_label(label)
    assert check_label("²") == "²" and check_label("run-7") == "run-7"


def test_highest_numeric_skips_labels_that_are_not_numbers() -> None:
    assert highest_numeric(["3", "²", None, "12", "x"]) == 12
    assert highest_numeric(["x", None]) is None


def held(*labels: str | None, highest: int | None = None) -> dict[str, HeldLabel]:
    return {f"http://r{i}": HeldLabel(label=x, highest=highest) for i, x in enumerate(labels)}


@pytest.mark.parametrize(
    ("replicas", "given_labels", "given_highest", "expected"),
    [
        (held(None), (), 0, "1"),
        (held("3", "5"), (), 0, "6"),
        (held("3"), (), 9, "10"),  # this manager gave 9 (on a replica since removed)
        (held("x", highest=7), (), 0, "8"),  # holds a word now; has held 7
        (held("²", "9" * 30), (), 0, "1"),  # neither is a number
        (held("4"), ("5", "6"), 4, "7"),  # never a label this manager gave
    ],
)
def test_the_next_label_goes_above_everything_held_and_given(
    replicas, given_labels, given_highest, expected
) -> None:
    got = next_label(None, replicas, given=given_labels, given_highest=given_highest)
    assert got == expected


@pytest.mark.parametrize(
    ("requested", "replicas", "given_labels", "rollback", "message"),
    [
        ("5", held("5"), (), False, "already names the weights replica http://r0 holds"),
        ("run", held("run"), (), True, "already names"),
        ("4", held("3"), ("4",), False, "never reused"),
        ("3", held("1", "5"), (), False, "not above '5', which replica http://r1 holds"),
        ("5", held("5"), (), True, "already names"),  # a rollback still names new weights
        ("", held("1"), (), False, "must not be empty"),
    ],
)
def test_a_requested_label_is_refused_naming_why(
    requested, replicas, given_labels, rollback, message
) -> None:
    with pytest.raises(ValueError, match=message):
        next_label(requested, replicas, given=given_labels, rollback=rollback)


def test_a_rollback_or_a_word_may_be_below_what_is_held() -> None:
    assert next_label("3", held("5"), rollback=True) == "3"
    assert next_label("before-rl", held("5")) == "before-rl"
    assert next_label("6", held("5")) == "6"
