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




def learning(clock: Clock, switches: list[int] | None = None) -> BusyPoll:
    """A poller whose windows may grow from WINDOW_US to ten times that, learned from the gaps."""
    count = switches if switches is not None else [0]
    return BusyPoll(WINDOW_US, switches=lambda: count[0], clock=clock, max_window_us=10 * WINDOW_US)


def test_windows_learn_to_cover_the_gaps_of_a_steady_stream() -> None:
    async def go() -> None:
        clock = Clock()
        p = learning(clock)
        gap = 3 * WINDOW_US * 1000           # commands three shortest windows apart (a replicated write at QD 1)
        p.arrived()
        first = p._last_ns
        await until_closed(p)                # the shortest window: nothing came in it
        assert p.window_ns == WINDOW_US * 1000 and p._skip == 1
        clock.now += gap
        p.arrived()                          # slept through: the gap is measured (this arrival opens no window)
        assert not p._spinning
        measured = p._last_ns - first        # from the arrival before, the window it opened included
        assert measured > gap and p.window_ns == measured + measured // 4 and p.learned == 1
        clock.now += gap
        p.arrived()                          # the next one opens a window as long
        assert p._spinning
        t0 = clock.now
        for _ in range(5):                   # and the stream is polled across its gaps: no window ends
            await for_a_while(clock, gap)
            assert p._spinning
            p.arrived()
        assert clock.now - t0 >= 5 * gap and p.windows == 2
        learned = p.window_ns
        await until_closed(p)                # the stream stops: the window that caught its last one ends
        assert p.wasted == 1 and p.window_ns == learned
        p.arrived()
        await until_closed(p)                # a window with nothing in it: back to the shortest
        assert p.wasted == 2 and p.window_ns == WINDOW_US * 1000

    asyncio.run(go())


def test_a_gap_longer_than_the_longest_window_keeps_windows_short() -> None:
    async def go() -> None:
        clock = Clock()
        p = learning(clock)
        p.arrived()
        clock.now += 2 * WINDOW_US * 1000
        p.arrived()                          # inside the window: no gap measured
        await until_closed(p)
        clock.now += 3 * WINDOW_US * 1000
        p.arrived()
        assert p.window_ns > WINDOW_US * 1000
        await until_closed(p)
        clock.now += 11 * WINDOW_US * 1000   # sparse I/O: longer than any window may grow
        p.arrived()
        assert p.window_ns == WINDOW_US * 1000
        clock.now += 40 * WINDOW_US * 1000
        p.arrived()
        assert p.window_ns == WINDOW_US * 1000

    asyncio.run(go())


def test_a_window_another_task_ended_keeps_its_learned_length() -> None:
    async def go() -> None:
        clock = Clock()
        switches = [0]
        p = learning(clock, switches)
        p.arrived()
        await until_closed(p)
        clock.now += 4 * WINDOW_US * 1000
        p.arrived()                          # learned (and skipped: the first window caught nothing)
        learned = p.window_ns
        assert learned > 4 * WINDOW_US * 1000
        p.arrived()
        assert p._spinning
        switches[0] += 1                     # a competitor on the core ends it: not a sign the stream ended
        await until_closed(p)
        assert p.contended == 1 and p.window_ns == learned

    asyncio.run(go())


def test_without_a_longer_maximum_windows_keep_one_length() -> None:
    async def go() -> None:
        clock = Clock()
        p = BusyPoll(WINDOW_US, switches=lambda: 0, clock=clock, max_window_us=WINDOW_US // 2)
        p.arrived()
        await until_closed(p)
        clock.now += 3 * WINDOW_US * 1000
        p.arrived()
        p.arrived()
        assert p.window_ns == WINDOW_US * 1000 and p.learned == 0 and p.stats()["max_window_us"] == WINDOW_US

    asyncio.run(go())
