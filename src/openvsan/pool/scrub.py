"""Scrub: read every stripe, check its redundancy, repair what can be repaired, and say what was found.

The per-row checks live with each level's I/O (`io_mirror.MirrorIO.check`, `io_parity.ParityIO.check`); this
module walks the rows under their stripe locks (so writes keep going, and never race a check) and adds up
what the rows report. What "repair" means per level:

- RAID 1/10: the copies are compared with the first in-sync copy, and differing copies are rewritten from it
  (a mirror cannot tell which copy is right).
- RAID 5: P is compared with the XOR of the data, and on a mismatch P is rewritten from the data (a single
  parity cannot tell a bad data chunk from a bad P).
- RAID 6: P and Q are compared with the data. Only P (or only Q) wrong: it is rewritten. Both wrong: the one
  data chunk that, rebuilt from the others and P, makes Q agree again is the corrupt one; it is rewritten and
  its member named. No such chunk: the stripe is reported unrepairable (more than one chunk is bad).
- RAID 0: the stripes are only read, so an unreadable block shows up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

MAX_DETAILS = 100


@dataclass(frozen=True)
class Mismatch:
    row: int
    members: tuple[int, ...]  # the member(s) found wrong, or whose chunk was rewritten
    what: str


@dataclass
class RowCheck:
    """What a check of some rows found; added into a ScrubReport."""

    checked: int = 0
    mismatches: int = 0
    repaired: int = 0
    unrepairable: int = 0
    skipped: int = 0  # rows not checked: not enough members in sync to compare
    details: list[Mismatch] = field(default_factory=list)

    def mismatch(self, row: int, members: list[int] | tuple[int, ...], what: str) -> None:
        self.mismatches += 1
        if len(self.details) < MAX_DETAILS:
            self.details.append(Mismatch(row, tuple(members), what))


@dataclass
class ScrubReport:
    repair: bool
    stripes: int = 0  # rows of the pool
    checked: int = 0
    mismatches: int = 0
    repaired: int = 0
    unrepairable: int = 0
    skipped: int = 0
    seconds: float = 0.0
    details: list[Mismatch] = field(default_factory=list)

    def add(self, rc: RowCheck) -> None:
        self.checked += rc.checked
        self.mismatches += rc.mismatches
        self.repaired += rc.repaired
        self.unrepairable += rc.unrepairable
        self.skipped += rc.skipped
        self.details += rc.details[:MAX_DETAILS - len(self.details)]

    @property
    def clean(self) -> bool:
        return not self.mismatches and not self.unrepairable

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Checker(Protocol):
    async def check_rows(self, start: int, end: int, *, repair: bool, locate: bool) -> RowCheck: ...


async def scrub_rows(checker: Checker, rows: int, batch: int, *, repair: bool,
                     clock: Callable[[], float] = time.monotonic) -> ScrubReport:
    """Check rows [0, rows) `batch` rows at a time; `clock` (seconds) times the report."""
    report = ScrubReport(repair=repair, stripes=rows)
    started = clock()
    for start in range(0, rows, batch):
        report.add(await checker.check_rows(start, min(rows, start + batch), repair=repair, locate=True))
    report.seconds = round(clock() - started, 3)
    return report
