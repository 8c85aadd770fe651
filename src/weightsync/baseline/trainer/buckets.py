"""The broadcast baseline's buckets: every HF tensor once, full, grouped by size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.baseline.flat_bucket import FlatBucketLayout
from weightsync.errors import LayoutMismatchError
from weightsync.layout import DTYPE_SIZES, hf_tensor_shapes
from weightsync.plan.types import SourceHolding


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastBucket:
    """One broadcast: the tensors it carries and the trainer rank that supplies each.

    Attributes:
        layout: where each tensor lies in the flattened buffer.
        owners: per tensor (in `layout` order), the trainer rank that holds it; trainer rank
            0 takes its own copy whenever it holds one.
    """

    layout: FlatBucketLayout
    owners: tuple[int, ...]

    @property
    def names(self) -> list[str]:
        """The tensors' HF names, in buffer order."""
        return [span.name for span in self.layout.spans]

    @property
    def dtypes(self) -> list[str]:
        """The tensors' dtype names, in buffer order."""
        return [span.dtype for span in self.layout.spans]

    @property
    def shapes(self) -> list[list[int]]:
        """The tensors' shapes, in buffer order."""
        return [list(span.shape) for span in self.layout.spans]

    @property
    def num_bytes(self) -> int:
        """Bytes of the flattened buffer."""
        return self.layout.num_bytes


def plan_buckets(
    holdings: Sequence[SourceHolding], *, hf_config: Any, dtype: str, bucket_bytes: int
) -> tuple[BroadcastBucket, ...]:
    """Every tensor of the model's checkpoint, once, in buckets of about `bucket_bytes`.

    Tensors come in the order the trainer ranks hold them (rank 0's first, then those only
    later ranks hold: pipeline stages in order), each cast to `dtype`. A bucket closes when
    the next tensor would overflow it; a tensor larger than `bucket_bytes` travels alone.

    Args:
        holdings: what every trainer rank holds (PP-local), by rank.
        hf_config: the model's config (object or config.json dict).
        dtype: the rollout dtype name.
        bucket_bytes: the target size of one bucket.

    Raises:
        LayoutMismatchError: a tensor the trainer holds with a shape other than the
            checkpoint's (naming the tensor, the rank and both shapes).
        ValueError: a checkpoint tensor no rank holds, or a held tensor that is not one of
            the checkpoint's.
    """
    expected = hf_tensor_shapes(hf_config)
    owners: dict[str, int] = {}
    for holding in sorted(holdings, key=lambda h: h.rank):
        for name, meta in holding.tensors.items():
            if name not in expected:
                raise ValueError(
                    f"trainer rank {holding.rank} holds {name!r}, which is not a tensor of the "
                    "model's checkpoint"
                )
            if tuple(meta.shape) != expected[name]:
                raise LayoutMismatchError(
                    f"trainer rank {holding.rank} holds {name!r} with shape "
                    f"{tuple(meta.shape)}; the checkpoint's shape is {expected[name]}"
                )
            owners.setdefault(name, holding.rank)
    missing = [name for name in expected if name not in owners]
    if missing:
        raise ValueError(
            f"no trainer rank holds {len(missing)} checkpoint tensor(s): {missing[:5]}"
        )
    element_size = DTYPE_SIZES[dtype]
    buckets: list[BroadcastBucket] = []
    current: list[str] = []
    current_bytes = 0

    def close() -> None:
        layout = FlatBucketLayout.from_metadata(
            current, [dtype] * len(current), [expected[name] for name in current]
        )
        buckets.append(
            BroadcastBucket(layout=layout, owners=tuple(owners[name] for name in current))
        )

    for name in owners:
        num_bytes = element_size
        for dim in expected[name]:
            num_bytes *= dim
        if current and current_bytes + num_bytes > bucket_bytes:
            close()
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += num_bytes
    if current:
        close()
    return tuple(buckets)
