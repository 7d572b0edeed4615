"""Adaptive busy polling (frontend/busypoll.py): windows open on arrival, stretch while commands keep coming,
close when they stop, back off after windows that caught nothing, and end at once when another task wants
the core. Context switches are counted by a stand-in, so a loaded test machine does not end windows early;
the tests with sockets and a real competitor on the same core are in tests/integration/test_busypoll_loopback.py."""

from __future__ import annotations

import asyncio

import pytest

from openvsan.frontend.busypoll import CHECK_EVERY, MAX_BACKOFF, BusyPoll

WINDOW_US = 50_000
TURN_NS = 1_000_000  # fake time that passes per look at the clock: a 50 ms window lasts about 50 loop turns


class Clock:
    """Monotonic nanoseconds that move TURN_NS on every read, so time passes only as the poller's loop turns."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        self.now += TURN_NS
        return self.now


def quiet(window_us: int, clock: Clock | None = None) -> BusyPoll:
    """A poller on a core nobody else wants (the context switch count never moves), on a fake clock."""
    return BusyPoll(window_us, switches=lambda: 0, clock=clock or Clock())


async def until_closed(p: BusyPoll) -> int:
    """Let the window run out; returns how many loop turns that took."""
    turns = 0
    while p._spinning:
        await asyncio.sleep(0)
        turns += 1
    return turns


def test_window_polls_then_closes() -> None:
    async def go() -> None:
        clock = Clock()
        p = quiet(WINDOW_US, clock)
        p.arrived()
        assert p.windows == 1
        t0 = clock.now
        turns = await until_closed(p)
        # the loop kept turning (zero-timeout polls) for the whole window instead of sleeping
        assert clock.now - t0 == WINDOW_US * 1000
        assert turns >= WINDOW_US * 1000 // TURN_NS
        assert p.wasted == 1 and p.stats()["windows"] == 1 and p.polled_ns == WINDOW_US * 1000

    asyncio.run(go())


async def for_a_while(clock: Clock, ns: int) -> None:
    """Turn the loop until `ns` of fake time has passed (a spinning poller reads the clock on every turn)."""
    end = clock.now + ns
    while clock.now < end:
        await asyncio.sleep(0)


def test_arrivals_stretch_the_window_and_reset_the_backoff() -> None:
    async def go() -> None:
        clock = Clock()
        p = quiet(WINDOW_US, clock)
        p.arrived()
        await until_closed(p)
        assert p.wasted == 1 and p._skip == 1
        p.arrived()                  # skipped: the last window caught nothing
        assert p.windows == 1 and not p._spinning
        p.arrived()
        assert p.windows == 2 and p._spinning
        t0 = clock.now
        for _ in range(10):          # a command every fifth of a window keeps it open
            await for_a_while(clock, WINDOW_US * 1000 // 5)
            p.arrived()
        assert p._spinning and p.windows == 2
        await until_closed(p)
        assert clock.now - t0 >= 3 * WINDOW_US * 1000
        assert p.wasted == 1 and p._skip == 0    # a useful window: the next arrival polls again
        p.arrived()
        assert p.windows == 3
        await until_closed(p)

    asyncio.run(go())


def test_backoff_doubles_up_to_the_cap() -> None:
    async def go() -> None:
        p = quiet(1)
        skips = []
        for _ in range(10):
            while not p._spinning:
                p.arrived()
            await until_closed(p)
            skips.append(p._skip)
        assert skips == [1, 2, 4, 8, 16, 32, 64, 64, 64, 64]
        assert MAX_BACKOFF == 64 and p.wasted == 10
        assert p.windows == 10    # sparse traffic: ten windows for 1+2+...+64+64+64 arrivals

    asyncio.run(go())


def test_a_context_switch_ends_the_window_as_wasted() -> None:
    async def go() -> None:
        switches = [0]
        clock = Clock()
        p = BusyPoll(1_000_000, switches=lambda: switches[0], clock=clock)     # a 1 s window
        p.arrived()
        for _ in range(100):
            await asyncio.sleep(0)
        assert p._spinning
        p.arrived()                   # useful so far
        switches[0] += 1              # another task took the core for a moment
        t0 = clock.now
        turns = await until_closed(p)
        assert turns <= CHECK_EVERY + 1 and clock.now - t0 < 1_000_000_000 // 2
        assert (p.wasted, p.contended, p._skip) == (1, 1, 1)

    asyncio.run(go())


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="poll window must be positive"):
        BusyPoll(0)


