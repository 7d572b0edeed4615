"""Adaptive busy polling of the event loop: after a command arrives, the loop keeps looking at its sockets
for a short window instead of going to sleep, so the next command is seen without a wake-up.

Why: at queue depth 1 the target sleeps in epoll_wait between commands, and being woken costs more than the
command itself: on the 2-core test machine a 4 KiB read over iSCSI took 35 µs with sleeping and 24 µs with
polling (docs/benchmarks.md). SPDK polls all the time; Linux's hybrid polling and NAPI busy-poll do what
this does, only while I/O is flowing.

How: while a window is open, a callback re-schedules itself with call_soon, so the loop polls its sockets
with a zero timeout on every turn. A command arriving inside the window extends it. A window that ends with
no command having arrived is wasted CPU: the next 1, 2, 4 ... 64 arrivals then open no window, and one
useful window resets that. Sparse I/O so costs almost nothing; a steady stream at low depth costs one core
while it lasts.

How long: `window_us` at least; with `max_window_us` above it, the window learns the gap between commands. An
arrival the loop slept through (no window open) measures the time since the one before; when that gap is longer
than `window_us` and at most `max_window_us`, the following windows last a quarter longer than it (up to
`max_window_us`), so a stream whose commands come a little further apart than the shortest window (a
replicated write at queue depth 1: its primary waits for the peer's answer, its secondary for the next write,
both longer than a local round trip) is polled across its gaps instead of paying a wake-up at each. A window that catches nothing, or a gap longer
than `max_window_us`, brings it back to `window_us` (Linux's hybrid polling sizes its sleep from the mean
completion time in the same spirit).

Polling only pays on a core nobody else wants. A hyperconverged host runs VMs beside the target, and a
spinning loop would take their CPU. So every few dozen turns the window looks at this thread's context
switches (getrusage): a polling loop never sleeps, so any switch means another task wanted this core (it
was preempted, or sched_yield handed the core over). Such a window ends at once and counts as wasted, and
the backoff above keeps the target from polling again soon.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Callable
from typing import Any

MAX_BACKOFF = 64      # arrivals after a wasted window that open no new one, at most
CHECK_EVERY = 32      # turns of a window between looks at the thread's context switches


def context_switches() -> int:
    """This thread's context switches so far, voluntary and involuntary."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return ru.ru_nvcsw + ru.ru_nivcsw


class BusyPoll:
    """One per event loop (per `vsan serve`). Target connections call arrived() for every receive."""

    __slots__ = ("_backoff", "_clock", "_context_switches", "_deadline", "_last_ns", "_loop", "_seen", "_skip",
                 "_spinning", "_started_ns", "_switches", "_turns", "_useful", "contended", "floor_ns", "learned",
                 "max_ns", "polled_ns", "wasted", "window_ns", "windows")

    def __init__(self, window_us: int, switches: Callable[[], int] = context_switches,
                 clock: Callable[[], int] = time.monotonic_ns, max_window_us: int = 0) -> None:
        if window_us <= 0:
            raise ValueError(f"poll window must be positive, not {window_us} µs")
        self.floor_ns = self.window_ns = window_us * 1000     # the window now: floor_ns .. max_ns
        self.max_ns = max(self.floor_ns, max_window_us * 1000)  # == floor_ns: windows of one length, no learning
        self._last_ns = 0         # when the last arrival was seen (learning only)
        self.learned = 0          # windows sized from a gap above the shortest
        self._loop: asyncio.AbstractEventLoop | None = None
        self._spinning = False
        self._seen = False        # a command arrived since the window was last extended
        self._deadline = 0
        self._useful = False      # this window saw a command arrive
        self._skip = 0            # arrivals left that open no window
        self._backoff = 0
        self._started_ns = 0
        self._context_switches = switches
        self._clock = clock       # nanoseconds; injected by tests
        self._turns = 0
        self._switches = 0        # context switches when last looked at
        self.windows = 0          # windows opened
        self.wasted = 0           # windows that ended without a command arriving, or contended
        self.contended = 0        # windows ended because another task wanted the core
        self.polled_ns = 0        # time spent inside windows

    def arrived(self) -> None:
        if self._spinning:
            self._seen = True
            return
        now = self._clock()
        if self.max_ns > self.floor_ns:
            self._learn(now - self._last_ns)
            self._last_ns = now
        if self._skip:
            self._skip -= 1
            return
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._spinning, self._seen, self._useful = True, False, False
        self._started_ns, self._deadline = now, now + self.window_ns
        self._turns, self._switches = 0, self._context_switches()
        self.windows += 1
        loop.call_soon(self._spin)

    def _learn(self, gap: int) -> None:
        """An arrival the loop was not polling for came `gap` ns after the one before: size the next windows
        to cover such a gap, or back to the shortest when it is longer than the longest window."""
        if gap > self.max_ns:
            self.window_ns = self.floor_ns
        elif gap > self.floor_ns:       # (a shorter gap says nothing: the shortest window covers it)
            window = min(self.max_ns, max(self.floor_ns, gap + (gap >> 2)))
            self.learned += window > self.window_ns
            self.window_ns = window

    def _spin(self) -> None:
        now = self._clock()
        if self._seen:
            self._seen = False
            self._useful = True
            self._deadline = now + self.window_ns
            self._last_ns = now
        contended = False
        self._turns += 1
        if not self._turns % CHECK_EVERY:
            switches = self._context_switches()
            contended, self._switches = switches != self._switches, switches
        if now < self._deadline and not contended:
            # hand the core to anything else runnable on it (the switch is then seen above)
            os.sched_yield()
            self._loop.call_soon(self._spin)  # type: ignore[union-attr]  # set by arrived()
            return
        self._spinning = False
        self.polled_ns += now - self._started_ns
        if self._useful and not contended:
            self._backoff = 0
        else:
            self.wasted += 1
            self.contended += contended
            self._backoff = min(self._backoff * 2 or 1, MAX_BACKOFF)
            if not contended:
                self.window_ns = self.floor_ns   # nothing came: the stream it was sized for has ended
        self._skip = self._backoff

    def stats(self) -> dict[str, Any]:
        return {"window_us": self.floor_ns // 1000, "max_window_us": self.max_ns // 1000,
                "current_window_us": self.window_ns // 1000, "learned": self.learned, "windows": self.windows,
                "wasted": self.wasted, "contended": self.contended, "polled_s": round(self.polled_ns / 1e9, 3)}
