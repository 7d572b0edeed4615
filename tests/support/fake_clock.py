"""Simulated time for the unit tier (DESIGN.md, "Layout": tests/unit reads no real clock): shared by
tests/unit/test_pool_*.py and test_bench_*.py (tests/conftest.py puts this folder on sys.path).

`FakeClock` is what the code under test takes as `clock=` (seconds, like time.monotonic; `.ns` for a clock in
nanoseconds, like time.perf_counter_ns) and its `sleep` as `sleep=`. Time moves only when a test sets or
advances it, or, once anything sleeps on it, when every task in the loop is waiting (trio's autojump clock):
then it jumps to the earliest sleeper's wake-up. A rebuild throttled to X B/s thus takes exactly its simulated
seconds and no real ones, and two sleepers wake in the order of their simulated deadlines.

`Slow` gives a device a simulated service time per request, so that a loop that never sleeps by itself (a
bench worker without --rate) still moves the clock.
"""

from __future__ import annotations

import asyncio
import heapq
from typing import Any

FALLBACK_TURNS = 32   # loop turns taken as "everyone waits" on a loop whose ready queue cannot be seen (uvloop)
MAX_TURNS = 10_000    # turns after which time moves on even though some task is still runnable
REAL_HORIZON = 0.01   # seconds: a real timer due within this is waited for before simulated time jumps


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.jumps = 0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._jumper: asyncio.Task[None] | None = None

    def __call__(self) -> float:
        return self.now

    def ns(self) -> int:
        return round(self.now * 1e9)

    def advance(self, seconds: float) -> None:
        """Time passes; sleepers due by then wake at the caller's next await."""
        self.now += seconds
        self._wake()

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._timers, (self.now + seconds, self._seq, fut))
        self._seq += 1
        if self._jumper is None or self._jumper.done() or self._jumper.get_loop() is not loop:
            self._jumper = loop.create_task(self._autojump(), name="fake-clock-autojump")
        await fut  # a cancelled sleeper leaves a cancelled future: _live skips it

    def _live(self) -> bool:
        while self._timers and self._timers[0][2].done():
            heapq.heappop(self._timers)
        return bool(self._timers)

    def _wake(self) -> None:
        while self._live() and self._timers[0][0] <= self.now:
            heapq.heappop(self._timers)[2].set_result(None)

    async def _autojump(self) -> None:
        while True:
            await settle()
            if not self._live():
                return  # the next sleep starts another
            self.now = max(self.now, self._timers[0][0])
            self.jumps += 1
            self._wake()


async def settle() -> None:
    """Until no task can run: on asyncio's loop, no ready callback and no real timer due soon (a FaultDevice's
    latency is waited out, not jumped over; a far one, a timeout, is not waited for)."""
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)
    scheduled = getattr(loop, "_scheduled", None)
    for turn in range(1, MAX_TURNS + 1):
        await asyncio.sleep(0)
        if ready is None or scheduled is None:
            if turn >= FALLBACK_TURNS:
                return
        elif not ready:
            soon = loop.time() + REAL_HORIZON
            if all(h.cancelled() or h.when() > soon for h in scheduled):
                return
    # a task that polls with sleep(0) keeps the loop busy for ever: time moves on after MAX_TURNS turns


class Slow:
    """`inner` with every read, write and flush taking `seconds` of simulated time first."""

    def __init__(self, inner: Any, clock: FakeClock, seconds: float) -> None:
        self.inner, self.clock, self.seconds = inner, clock, seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def read(self, lba: int, blocks: int) -> Any:
        await self.clock.sleep(self.seconds)
        return await self.inner.read(lba, blocks)

    async def write(self, lba: int, data: Any, *, fua: bool = False) -> None:
        await self.clock.sleep(self.seconds)
        await self.inner.write(lba, data, fua=fua)

    async def flush(self) -> None:
        await self.clock.sleep(self.seconds)
        await self.inner.flush()


class SimulatedLatency:
    """A mixin, before a device class in the bases (`class Disk(SimulatedLatency, FaultDevice)`): each read,
    write and flush first takes `self.delay` seconds on `self.clock` (no clock or no delay: none)."""

    clock: FakeClock | None = None
    delay: float = 0.0

    async def _simulated_wait(self) -> None:
        if self.clock is not None and self.delay:
            await self.clock.sleep(self.delay)

    async def read(self, lba: int, blocks: int) -> Any:
        await self._simulated_wait()
        return await super().read(lba, blocks)  # type: ignore[misc]

    async def write(self, lba: int, data: Any, *, fua: bool = False) -> None:
        await self._simulated_wait()
        await super().write(lba, data, fua=fua)  # type: ignore[misc]

    async def flush(self) -> None:
        await self._simulated_wait()
        await super().flush()  # type: ignore[misc]
