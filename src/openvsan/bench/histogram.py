"""A log-bucketed latency histogram (the HdrHistogram idea, small): constant relative error, mergeable.

Values are nanoseconds. Below 2**SUB_BITS+1 every value has its own bucket; above, each power of two is cut
into 2**SUB_BITS equal buckets, so a bucket's width is at most 1/64 of its value (about 1.6 %). Workers in
other processes send `to_dict()`; the parent adds them with `merge()`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SUB_BITS = 6
SUB = 1 << SUB_BITS            # buckets per power of two
LINEAR = SUB * 2               # values below this have a bucket each
MAX_SHIFT = 40                 # up to about 2**47 ns (39 h): far beyond any I/O
NBUCKETS = LINEAR + MAX_SHIFT * SUB


def bucket_of(v: int) -> int:
    if v < LINEAR:
        return max(v, 0)
    shift = v.bit_length() - (SUB_BITS + 1)
    if shift > MAX_SHIFT:
        return NBUCKETS - 1
    return LINEAR + (shift - 1) * SUB + ((v >> shift) - SUB)


def buckets_of(v: np.ndarray) -> np.ndarray:
    """bucket_of of every value of an int64 array, at once."""
    out = np.maximum(v, 0)
    big = out >= LINEAR
    if big.any():
        b = out[big]
        shift = np.frexp(b.astype(np.float64))[1] - (SUB_BITS + 1)   # bit_length: exact below 2**53
        idx = LINEAR + (shift - 1) * SUB + ((b >> shift) - SUB)
        idx[shift > MAX_SHIFT] = NBUCKETS - 1
        out[big] = idx
    return out


def bucket_low(i: int) -> int:
    """The smallest value that lands in bucket i."""
    if i < LINEAR:
        return i
    shift, sub = divmod(i - LINEAR, SUB)
    return (SUB + sub) << (shift + 1)


def bucket_high(i: int) -> int:
    """One past the largest value of bucket i."""
    return bucket_low(i + 1) if i + 1 < NBUCKETS else bucket_low(i) * 2


class Histogram:
    __slots__ = ("count", "counts", "max", "min", "total")

    def __init__(self) -> None:
        self.counts = [0] * NBUCKETS
        self.count = 0
        self.total = 0          # sum of the values, for an exact mean
        self.min = 0
        self.max = 0

    def record(self, ns: int) -> None:
        self.counts[bucket_of(ns)] += 1
        if not self.count or ns < self.min:
            self.min = ns
        if ns > self.max:  # noqa: PLR1730 - not max(): a builtin call per request, twice (the run, the second)
            self.max = ns
        self.count += 1
        self.total += ns

    def record_many(self, ns: np.ndarray) -> None:
        """record() of every value of an int64 array, at once (vsan bench records its requests so)."""
        if not len(ns):
            return
        got = np.bincount(buckets_of(ns), minlength=NBUCKETS)
        counts = self.counts
        for i in np.flatnonzero(got).tolist():
            counts[i] += int(got[i])
        lo, hi = int(ns.min()), int(ns.max())
        if not self.count or lo < self.min:
            self.min = lo
        if hi > self.max:  # noqa: PLR1730 - as in record()
            self.max = hi
        self.count += len(ns)
        self.total += int(ns.sum())

    def merge(self, other: Histogram) -> Histogram:
        if not other.count:
            return self
        for i, c in enumerate(other.counts):
            if c:
                self.counts[i] += c
        self.min = other.min if not self.count else min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.count += other.count
        self.total += other.total
        return self

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def percentile(self, p: float) -> int:
        """The value at or below which p % of the recorded values lie (the bucket's midpoint, clamped to
        the exact min and max so p0/p100 are exact)."""
        if not self.count:
            return 0
        rank = max(1, -(-self.count * p // 100))  # ceil, as HdrHistogram does
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if c and seen >= rank:
                mid = (bucket_low(i) + bucket_high(i) - 1) // 2
                return min(max(mid, self.min), self.max)
        return self.max

    def buckets(self) -> list[tuple[int, int, int]]:
        """(low, high, count) for each non-empty bucket, in order."""
        return [(bucket_low(i), bucket_high(i), c) for i, c in enumerate(self.counts) if c]

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total, "min": self.min, "max": self.max,
                "buckets": {i: c for i, c in enumerate(self.counts) if c}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Histogram:
        h = cls()
        for i, c in d["buckets"].items():
            h.counts[int(i)] = int(c)
        h.count, h.total, h.min, h.max = int(d["count"]), int(d["total"]), int(d["min"]), int(d["max"])
        return h
