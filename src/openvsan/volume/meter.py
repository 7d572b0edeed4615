"""Per-volume I/O counters and latency histograms (the REST API's /metrics, `vsan volume show`).

A Volume counts what its frontends ask of it, on both paths: the synchronous fast path (read_now /
write_now, wrapped here, so a command the stack answers at once is counted and timed like any other) and
the coroutine path. Latency is the time the stack took, from the call to its answer, not the network's (a write whose payload is
received straight into the device's memory, Volume.open_window, is counted when the stack hands out that
memory: the rest is the network's). Each direction keeps bytes,
nanoseconds in all, and a histogram of power-of-two buckets: bucket i counts commands that took fewer than
2**i ns (i = the nanoseconds' bit length), so filing a command is one int method and one list index, no
search. Operations are the histogram's total. Flush, unmap and write-zeroes are counted apart ("other").

What it costs is measured beside tgt (docs/benchmarks.md): two clock reads and four additions per command.
Counters live as long as the Volume: a volume moved to another worker starts from zero there (Prometheus'
rate() takes counter resets in its stride).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from openvsan.block.device import Buffer

BUCKETS = 35       # bucket 34 holds everything from 2**33 ns (8.6 s) up
FIRST_BOUND = 10   # the first bucket reported: < 2**10 ns (about 1 µs); those below are folded into it
REPORT_STEP = 2    # buckets reported: every 4x (1 µs, 4 µs, 16 µs ... 4.3 s), so a scrape of many volumes stays small


class Direction:
    """Bytes, total nanoseconds and a latency histogram for one kind of command."""

    __slots__ = ("bytes", "hist", "ns")

    def __init__(self) -> None:
        self.bytes = 0
        self.ns = 0
        self.hist = [0] * (BUCKETS + 64)   # room for any int's bit length: no bounds check on the hot path

    def add(self, nbytes: int, ns: int) -> None:
        self.hist[ns.bit_length()] += 1
        self.ns += ns
        self.bytes += nbytes

    def report(self) -> dict[str, Any]:
        """ops, bytes, seconds, and the histogram as (upper bound in seconds, cumulative count) pairs, the
        last bound None (+Inf)."""
        counts = self.hist[:BUCKETS - 1] + [sum(self.hist[BUCKETS - 1:])]
        ops = sum(counts)
        cumulative: list[tuple[float | None, int]] = []
        running = sum(counts[:FIRST_BOUND + 1])
        cumulative.append(((1 << FIRST_BOUND) / 1e9, running))
        for i in range(FIRST_BOUND + 1, BUCKETS - 1):
            running += counts[i]
            if (i - FIRST_BOUND) % REPORT_STEP == 0:
                cumulative.append(((1 << i) / 1e9, running))
        cumulative.append((None, ops))
        return {"ops": ops, "bytes": self.bytes, "seconds": self.ns / 1e9, "buckets": cumulative}


class IoMeter:
    __slots__ = ("other", "read", "write")

    def __init__(self) -> None:
        self.read = Direction()
        self.write = Direction()
        self.other = Direction()

    def report(self) -> dict[str, Any]:
        return {"read": self.read.report(), "write": self.write.report(), "other": self.other.report()}


def metered_read_now(fn: Callable[[int, int], Buffer | None], d: Direction,
                     block_size: int) -> Callable[[int, int], Buffer | None]:
    clock = time.perf_counter_ns
    hist = d.hist

    def read_now(lba: int, blocks: int) -> Buffer | None:
        t = clock()
        out = fn(lba, blocks)
        if out is not None:
            ns = clock() - t
            hist[ns.bit_length()] += 1
            d.ns += ns
            d.bytes += blocks * block_size
        return out
    read_now.__wrapped__ = fn  # type: ignore[attr-defined]  # the stack's own (functools' convention)
    return read_now


def metered_write_now(fn: Callable[[int, Buffer], bool], d: Direction) -> Callable[[int, Buffer], bool]:
    clock = time.perf_counter_ns
    hist = d.hist

    def write_now(lba: int, data: Buffer) -> bool:
        t = clock()
        if fn(lba, data):
            ns = clock() - t
            hist[ns.bit_length()] += 1
            d.ns += ns
            d.bytes += len(data)
            return True
        return False
    write_now.__wrapped__ = fn  # type: ignore[attr-defined]
    return write_now
