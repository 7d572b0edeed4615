"""Per-stripe locks: two updates of one stripe (row) never interleave, since a parity update is a
read-compute-write of the whole row and two mirrors written in different orders would disagree.

Ordinary I/O holds one row at a time (a request spanning rows runs one task per row); rebuild, resync and
scrub hold a run of consecutive rows, always taken in ascending order, so no two holders wait on each other in
a cycle.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class StripeLocks:
    def __init__(self) -> None:
        self._locks: dict[int, asyncio.Lock] = {}
        self._users: dict[int, int] = {}

    def _get(self, row: int) -> asyncio.Lock:
        lock = self._locks.get(row)
        if lock is None:
            lock = self._locks[row] = asyncio.Lock()
            self._users[row] = 0
        self._users[row] += 1
        return lock

    def _put(self, row: int) -> None:
        self._users[row] -= 1
        if not self._users[row]:
            # nobody holds or waits: forget it, so the map stays as small as the I/O in flight
            del self._users[row], self._locks[row]

    def hold(self, row: int) -> _Held:
        """`async with locks.hold(row):` the one row."""
        return _Held(self, row, row + 1)

    def hold_rows(self, start: int, end: int) -> _Held:
        """`async with locks.hold_rows(start, end):` rows [start, end), taken in ascending order."""
        return _Held(self, start, end)

    async def _acquire(self, start: int, end: int) -> None:
        for row in range(start, end):
            lock = self._get(row)
            try:
                await lock.acquire()
            except BaseException:
                self._put(row)
                self._release(start, row)
                raise

    def _release(self, start: int, end: int) -> None:
        for row in range(end - 1, start - 1, -1):
            self._locks[row].release()
            self._put(row)

    def busy(self, row: int) -> bool:
        """Someone holds `row` or waits for it (a request on the fast path, done within one turn of the loop,
        goes ahead only where nobody does)."""
        return row in self._locks

    def __len__(self) -> int:
        return len(self._locks)


class _Held:
    """The context manager of a hold: a plain class, since an async generator (asynccontextmanager) costs a
    registration with the loop's async-generator hooks on every request."""

    __slots__ = ("end", "locks", "start")

    def __init__(self, locks: StripeLocks, start: int, end: int) -> None:
        self.locks, self.start, self.end = locks, start, end

    async def __aenter__(self) -> None:
        await self.locks._acquire(self.start, self.end)

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.locks._release(self.start, self.end)
