"""Errors survive pickling (they travel between trainer ranks) with their keyword attributes."""

from __future__ import annotations

import pickle

import pytest

from weightsync.errors import (
    CollectiveError,
    LayoutMismatchError,
    LifecycleStepError,
    PartialPushError,
    PartialSyncError,
    RemoteReplicaError,
    TensorChangedError,
    TransferError,
)

ERRORS = [
    TransferError(
        "write failed", target_session="s:1", byte_ranges=[(8, 16)], return_code=-1, param_name="w"
    ),
    PartialPushError("one target failed", failed={"s:1": "timeout"}, result=3, target_session="s"),
    PartialSyncError("one replica failed", report={"version": "2"}, failed={"u": "why"}),
    RemoteReplicaError("refused", replica="http://r", route="/pause_generation", status_code=400),
    LifecycleStepError(
        "refused", replica="http://r", route="/end_weight_update", completed=("/a", "/b")
    ),
    LayoutMismatchError("mismatch"),
    CollectiveError("timed out"),
    TensorChangedError("changed", hf_name="model.norm.weight", rank=1),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_round_trip_through_pickle(error: Exception) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)
