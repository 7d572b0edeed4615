"""RAID geometry: MD's left-symmetric placement, RAID 10 near-2, segments, tolerance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openvsan.pool.layout import Geometry, Level


def test_level_parse() -> None:
    assert Level.parse("raid5") is Level.RAID5
    assert Level.parse("RAID10") is Level.RAID10
    assert Level.parse(6) is Level.RAID6
    assert Level.parse("1") is Level.RAID1
    with pytest.raises(ValueError, match="unknown RAID level"):
        Level.parse("raid4")


def test_raid5_left_symmetric_matches_md() -> None:
    # mdadm's layout picture for left-symmetric on 4 disks (P rotates right to left, data follows P):
    #   row 0: D0 D1 D2 P      row 1: D4 D5 P D3      row 2: D8 P D6 D7      row 3: P D9 D10 D11
    g = Geometry(Level.RAID5, 4, 8, 16)
    placement = []
    for row in range(4):
        cells = [""] * 4
        for i, m in enumerate(g.data_members(row)):
            cells[m] = f"D{row * 3 + i}"
        cells[g.parity_members(row)[0]] = "P"
        placement.append(cells)
    assert placement == [
        ["D0", "D1", "D2", "P"],
        ["D4", "D5", "P", "D3"],
        ["D8", "P", "D6", "D7"],
        ["P", "D9", "D10", "D11"],
    ]
    assert g.data_index(1, 3) == 0 and g.data_index(1, 2) is None


def test_raid6_left_symmetric_matches_md() -> None:
    # md raid6 ALGORITHM_LEFT_SYMMETRIC: pd = n-1 - row % n, qd = pd + 1, data from pd + 2
    g = Geometry(Level.RAID6, 5, 8, 16)
    assert g.parity_members(0) == (4, 0)
    assert g.data_members(0) == (1, 2, 3)
    assert g.parity_members(1) == (3, 4)
    assert g.data_members(1) == (0, 1, 2)
    for row in range(10):
        roles = sorted([*g.data_members(row), *g.parity_members(row)])
        assert roles == list(range(5))  # each member holds exactly one chunk of each row


def test_raid10_near2_and_raid1() -> None:
    g = Geometry(Level.RAID10, 6, 8, 16)
    assert g.data_chunks == 3
    segs = g.segments(0, 8 * 4)
    assert [(s.row, s.column) for s in segs] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert g.copies(0, 1) == (2, 3)
    assert g.available({0, 2, 5})  # one of each pair
    assert not g.available({2, 3})  # a whole pair
    r1 = Geometry(Level.RAID1, 3, 8, 16)
    assert r1.copies(5, 0) == (0, 1, 2) and r1.num_blocks == 16 * 8
    assert r1.tolerance == 2 and r1.available({0, 1}) and not r1.available({0, 1, 2})


def test_sizes_and_minimums() -> None:
    sizes = {lvl: Geometry(lvl, 4, 8, 10).num_blocks for lvl in Level}
    assert sizes == {Level.RAID0: 320, Level.RAID1: 80, Level.RAID5: 240, Level.RAID6: 160, Level.RAID10: 160}
    with pytest.raises(ValueError):
        Geometry(Level.RAID6, 3, 8, 10)
    with pytest.raises(ValueError):
        Geometry(Level.RAID10, 5, 8, 10)


@settings(max_examples=200, deadline=None)
@given(level=st.sampled_from(list(Level)), n=st.integers(4, 8), lba=st.integers(0, 2000),
       blocks=st.integers(1, 300))
def test_segments_cover_the_range_once(level: Level, n: int, lba: int, blocks: int) -> None:
    if level is Level.RAID10 and n % 2:
        n += 1
    g = Geometry(level, n, 8, 1000)
    segs = g.segments(lba, blocks)
    assert sum(s.blocks for s in segs) == blocks
    pos = 0
    for s in segs:
        assert s.start == pos and 0 <= s.offset and s.offset + s.blocks <= 8
        assert (s.row * g.data_chunks + s.column) * 8 + s.offset == lba + pos  # logical address round trip
        pos += s.blocks
        if level.parity:
            m = g.data_member(s.row, s.column)
            assert g.data_index(s.row, m) == s.column and m not in g.parity_members(s.row)
