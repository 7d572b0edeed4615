"""RAID geometry: where a logical block of the pool lives on the members. Pure arithmetic, no I/O.

Every member's data area is cut into chunk rows: row r is member blocks [r * chunk, (r + 1) * chunk). A row
across all members is a stripe. The levels differ in what each member holds in a row:

- RAID 0: n data chunks; logical chunk c is member c % n, row c // n.
- RAID 1: one data chunk, copied on every member (n-way mirror); logical chunk c is row c on all members.
- RAID 10: MD's "near 2" layout with an even member count: n/2 mirrored pairs striped, logical chunk c is row
  c // (n/2) on members 2p and 2p+1, p = c % (n/2).
- RAID 5: n-1 data chunks and P, left-symmetric like MD's default (algorithm 2): P sits on member
  n-1 - (r mod n), and data chunk i on member (P + 1 + i) mod n, so consecutive chunks go round the members.
- RAID 6: n-2 data chunks, P and Q, MD's left-symmetric RAID 6: P as RAID 5, Q on (P + 1) mod n, data chunk i
  on (P + 2 + i) mod n. Q = sum 2^i * D_i over GF(2^8) with i the data index in the row (openvsan.pool.parity).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple


class Level(enum.IntEnum):
    RAID0 = 0
    RAID1 = 1
    RAID5 = 5
    RAID6 = 6
    RAID10 = 10

    @classmethod
    def parse(cls, value: int | str | Level) -> Level:
        """0, 1, 5, 6, 10, "5", "raid5", "RAID10"."""
        text = str(int(value)) if isinstance(value, int) else value.strip().lower().removeprefix("raid")
        try:
            return cls(int(text))
        except ValueError:
            raise ValueError(f"unknown RAID level {value!r}; use one of 0, 1, 5, 6, 10") from None

    @property
    def parity(self) -> int:
        """Parity chunks per stripe: 1 for RAID 5, 2 for RAID 6, else 0."""
        return _PARITY[self]

    @property
    def mirrored(self) -> bool:
        return self is Level.RAID1 or self is Level.RAID10

    @property
    def redundant(self) -> bool:
        return self is not Level.RAID0

    def min_members(self) -> int:
        return {Level.RAID0: 1, Level.RAID1: 2, Level.RAID5: 3, Level.RAID6: 4, Level.RAID10: 4}[self]


_PARITY = {Level.RAID0: 0, Level.RAID1: 0, Level.RAID5: 1, Level.RAID6: 2, Level.RAID10: 0}


class Segment(NamedTuple):  # a tuple: made for every chunk of every request
    """A run of logical blocks that lies inside one data chunk: row, column (the chunk's data index in the row),
    block offset inside the chunk, length in blocks, and where it starts in the request (in blocks)."""

    row: int
    column: int
    offset: int
    blocks: int
    start: int


@dataclass(frozen=True)
class Geometry:
    level: Level
    members: int
    chunk_blocks: int
    rows: int  # chunk rows per member

    def __post_init__(self) -> None:
        if self.members < self.level.min_members():
            raise ValueError(f"RAID {int(self.level)} needs at least {self.level.min_members()} members")
        if self.level is Level.RAID10 and self.members % 2:
            raise ValueError("RAID 10 needs an even number of members (mirrored pairs)")

    @cached_property
    def data_chunks(self) -> int:
        """Data chunks per stripe (row)."""
        n = self.members
        return {Level.RAID0: n, Level.RAID1: 1, Level.RAID10: n // 2}.get(self.level, n - self.level.parity)

    @cached_property
    def tolerance(self) -> int:
        """How many members can be lost, whichever they are, with no data lost (RAID 10: one per pair, but
        only one is guaranteed)."""
        return {Level.RAID0: 0, Level.RAID1: self.members - 1, Level.RAID10: 1}.get(self.level, self.level.parity)

    @property
    def num_blocks(self) -> int:
        return self.rows * self.data_chunks * self.chunk_blocks

    @property
    def member_blocks(self) -> int:
        """Blocks of data area each member needs."""
        return self.rows * self.chunk_blocks

    # --- placement --------------------------------------------------------------------------------------------

    @cached_property
    def _nparity(self) -> int:
        return self.level.parity

    def _p_member(self, row: int) -> int:
        return self.members - 1 - row % self.members

    def parity_members(self, row: int) -> tuple[int, ...]:
        """(P,) for RAID 5, (P, Q) for RAID 6, () otherwise."""
        npar = self._nparity
        if not npar:
            return ()
        p = self._p_member(row)
        return (p,) if npar == 1 else (p, (p + 1) % self.members)

    def copies(self, row: int, index: int) -> tuple[int, ...]:
        """The members holding data chunk `index` of `row`: one for RAID 0/5/6, the mirrors for RAID 1/10."""
        n = self.members
        match self.level:
            case Level.RAID0:
                return (index,)
            case Level.RAID1:
                return tuple(range(n))
            case Level.RAID10:
                return (2 * index, 2 * index + 1)
            case _:
                return (self.data_member(row, index),)

    def data_member(self, row: int, index: int) -> int:
        """The member holding data chunk `index` of `row` (the first copy of a mirrored level)."""
        npar = self._nparity
        if npar:
            return (self._p_member(row) + npar + index) % self.members
        return self.copies(row, index)[0]

    def data_members(self, row: int) -> tuple[int, ...]:
        """Member of each data index of a parity row (RAID 5/6), in data index order."""
        return self.data_member_rows[row % self.members]

    @cached_property
    def data_member_rows(self) -> tuple[tuple[int, ...], ...]:
        """data_members(row) of rows 0 .. members - 1: the placement repeats every `members` rows (a small
        request looks it up rather than computing it)."""
        n = self.members
        return tuple(tuple((n - 1 - r + self._nparity + i) % n for i in range(self.data_chunks)) for r in range(n))

    def data_index(self, row: int, member: int) -> int | None:
        """Which data chunk `member` holds in `row` (the pair's index for RAID 10), None for a parity chunk."""
        match self.level:
            case Level.RAID0:
                return member
            case Level.RAID1:
                return 0
            case Level.RAID10:
                return member // 2
            case _:
                i = (member - self._p_member(row) - self.level.parity) % self.members
                return i if i < self.data_chunks else None

    def locate(self, lba: int) -> tuple[int, int, int]:
        """(row, data index, block offset in the chunk) of a logical block: the first segment of a request that
        starts there, without the list (a small read's or write's shortcut)."""
        chunk, off = divmod(lba, self.chunk_blocks)
        row, index = divmod(chunk, self.data_chunks)
        return row, index, off

    def segments(self, lba: int, blocks: int) -> list[Segment]:
        """Split a logical range into per-chunk segments, in logical order."""
        cb, k = self.chunk_blocks, self.data_chunks
        out: list[Segment] = []
        done = 0
        while done < blocks:
            chunk, off = divmod(lba + done, cb)
            n = min(cb - off, blocks - done)
            row, index = divmod(chunk, k)
            out.append(Segment(row, index, off, n, done))
            done += n
        return out

    # --- failure tolerance ------------------------------------------------------------------------------------

    def available(self, lost: Iterable[int]) -> bool:
        """Whether every row can still be read with the members in `lost` unusable."""
        gone = set(lost)
        if self.level is Level.RAID10:
            return all(not {2 * p, 2 * p + 1} <= gone for p in range(self.members // 2))
        return len(gone) <= self.tolerance
