"""Shared/exclusive locks on LBA ranges: COMPARE AND WRITE and ORWRITE are atomic against every other
write to their blocks (SBC-4 5.3: VMware ATS relies on it) without ordinary writes waiting on each other."""

from __future__ import annotations

import asyncio
import itertools


class RangeLock:
    def __init__(self) -> None:
        self._held: dict[int, tuple[int, int, bool]] = {}   # token -> (start, end, exclusive)
        self._exclusive_waiting: dict[int, tuple[int, int]] = {}
        self._exclusive_held = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._tokens = itertools.count(1)

    def _blocked(self, start: int, end: int, exclusive: bool, me: int) -> bool:
        if not exclusive and not self._exclusive_held and not self._exclusive_waiting:
            return False  # the common case: only plain writes in flight
        for s, e, x in self._held.values():
            if (exclusive or x) and s < end and start < e:
                return True
        if not exclusive:
            # a waiting exclusive locker goes first, so a stream of writes cannot starve it
            for t, (s, e) in self._exclusive_waiting.items():
                if t != me and s < end and start < e:
                    return True
        return False

    async def acquire(self, start: int, end: int, exclusive: bool = False) -> int:
        token = next(self._tokens)
        if exclusive:
            self._exclusive_waiting[token] = (start, end)
        try:
            while self._blocked(start, end, exclusive, token):
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._waiters.append(fut)
                await fut
        except BaseException:
            if exclusive:
                del self._exclusive_waiting[token]
                self._wake()
            raise
        if exclusive:
            del self._exclusive_waiting[token]
        self._held[token] = (start, end, exclusive)
        if exclusive:
            self._exclusive_held += 1
        return token

    @property
    def exclusive_idle(self) -> bool:
        """No exclusive holder or waiter: a plain write may go straight to the device."""
        return not self._exclusive_held and not self._exclusive_waiting

    def release(self, token: int) -> None:
        _, _, exclusive = self._held.pop(token)
        if exclusive:
            self._exclusive_held -= 1
        self._wake()

    def _wake(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
