"""Merging copy items that one box read and one destination run can serve, to keep items few."""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.plan.items import CopyItem


def merged_box(
    first: tuple[tuple[int, int], ...], second: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, int], ...] | None:
    """The box whose row-major read is `first`'s read followed by `second`'s, if there is one.

    That holds when the boxes differ in exactly one dim ``k``, `second` starts where `first`
    stops in it, and every dim before ``k`` has extent 1 (for ``k = 0``: consecutive rows).

    Returns:
        The merged box, or ``None`` when the two reads are not one box read.
    """
    if len(first) != len(second):
        return None
    differing = [k for k, (a, b) in enumerate(zip(first, second, strict=True)) if a != b]
    if len(differing) != 1:
        return None
    k = differing[0]
    if first[k][1] != second[k][0]:
        return None
    if any(stop - start != 1 for start, stop in first[:k]):
        return None
    return (*first[:k], (first[k][0], second[k][1]), *first[k + 1 :])


def merge_items(items: Sequence[CopyItem]) -> tuple[CopyItem, ...]:
    """Merge neighbours in `items` that are one destination run and one box read.

    Two neighbours merge when they write the same parameter back to back and either both are
    padding or both read the same HF tensor through boxes `merged_box` can join.

    Args:
        items: copy items sorted by (parameter order, destination offset).

    Returns:
        The items with mergeable neighbours replaced by one item each, in the same order.
    """
    merged: list[CopyItem] = []
    for item in items:
        if merged:
            last = merged[-1]
            adjacent = (
                last.param_name == item.param_name
                and last.hf_name == item.hf_name
                and last.dst_offset_bytes + last.num_bytes == item.dst_offset_bytes
            )
            box = None
            if adjacent and item.hf_name is not None:
                box = merged_box(last.src_box, item.src_box)
            if adjacent and (item.hf_name is None or box is not None):
                merged[-1] = CopyItem(
                    hf_name=item.hf_name,
                    src_box=box or (),
                    param_name=item.param_name,
                    dst_offset_bytes=last.dst_offset_bytes,
                    num_bytes=last.num_bytes + item.num_bytes,
                )
                continue
        merged.append(item)
    return tuple(merged)
