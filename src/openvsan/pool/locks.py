"""Per-stripe locks: two updates of one stripe (row) never interleave, since a parity update is a
read-compute-write of the whole row and two mirrors written in different orders would disagree.

Ordinary I/O holds one row at a time (a request spanning rows runs one task per row); rebuild, resync and
scrub hold a run of consecutive rows, always taken in ascending order, so no two holders wait on each other in
a cycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


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

    @asynccontextmanager
    async def hold(self, row: int) -> AsyncIterator[None]:
        lock = self._get(row)
        try:
            async with lock:
                yield
        finally:
            self._put(row)

    @asynccontextmanager
    async def hold_rows(self, start: int, end: int) -> AsyncIterator[None]:
        """Rows [start, end), taken in ascending order."""
        held: list[int] = []
        try:
            for row in range(start, end):
                lock = self._get(row)
                try:
                    await lock.acquire()
                except BaseException:
                    self._put(row)
                    raise
                held.append(row)
            yield
        finally:
            for row in reversed(held):
                self._locks[row].release()
                self._put(row)

    def __len__(self) -> int:
        return len(self._locks)
