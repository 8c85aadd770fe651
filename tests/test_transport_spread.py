"""`spread`: how the CUDA IPC transport deals one write's regions over its streams (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from weightsync.transport.cuda_ipc.transport import spread

MIB = 1 << 20


def _pieces_cover_every_region(regions, parts, min_piece) -> None:
    dst = [r[0] for r in regions]
    src = [r[1] for r in regions]
    lengths = [r[2] for r in regions]
    lists = spread(dst, src, lengths, parts, min_piece)
    assert 1 <= len(lists) <= parts
    assert all(lists)
    pieces = [piece for part in lists for piece in part]
    # In order, each region's pieces tile it exactly, with src and dst moving together.
    by_region: dict[int, list[tuple[int, int, int, int]]] = {}
    for piece in pieces:
        by_region.setdefault(piece[0], []).append(piece)
    assert [p[0] for p in pieces] == sorted(p[0] for p in pieces)
    assert sorted(by_region) == list(range(len(regions)))
    for index, region_pieces in by_region.items():
        to, frm, left = dst[index], src[index], lengths[index]
        for _, piece_dst, piece_src, num_bytes in region_pieces:
            assert (piece_dst, piece_src) == (to, frm)
            assert num_bytes >= min(min_piece, lengths[index])
            to, frm, left = to + num_bytes, frm + num_bytes, left - num_bytes
        assert left == 0


@given(
    st.lists(st.integers(1, 600 * MIB), min_size=1, max_size=12),
    st.integers(1, 8),
    st.sampled_from([1, 4096, 8 * MIB]),
)
def test_every_byte_once_in_order(lengths, parts, min_piece) -> None:
    regions, addr = [], 0
    for length in lengths:
        regions.append((addr, addr + (1 << 40), length))
        addr += length + 4096
    _pieces_cover_every_region(regions, parts, min_piece)


def test_one_big_region_is_cut_evenly() -> None:
    lists = spread([0], [1 << 40], [256 * MIB], 4, 8 * MIB)
    assert [sum(p[3] for p in part) for part in lists] == [64 * MIB] * 4


def test_small_writes_stay_on_one_stream() -> None:
    assert len(spread([0, 1 << 30], [0, 1 << 31], [3 * MIB, 4 * MIB], 4, 8 * MIB)) == 1
    assert len(spread([0], [0], [20 * MIB], 4, 8 * MIB)) == 2
    assert spread([5], [7], [9], 1, 8 * MIB) == [[(0, 5, 7, 9)]]
