"""The latency histogram: bucket layout, percentiles within the bucket error, merging across workers."""

from __future__ import annotations

import random

import numpy as np

from openvsan.bench.histogram import LINEAR, NBUCKETS, SUB, Histogram, bucket_high, bucket_low, bucket_of, buckets_of


def test_buckets_tile_the_number_line() -> None:
    for i in range(NBUCKETS - 1):
        assert bucket_high(i) == bucket_low(i + 1) > bucket_low(i)
        assert bucket_of(bucket_low(i)) == i
        assert bucket_of(bucket_high(i) - 1) == i
    # relative width: at most 1/SUB of the bucket's low edge once past the linear range
    for i in range(2 * SUB, NBUCKETS - 1):
        assert (bucket_high(i) - bucket_low(i)) / bucket_low(i) <= 1 / SUB


def test_percentiles_match_the_sorted_values() -> None:
    rng = random.Random(7)
    values = [int(rng.lognormvariate(11, 1.2)) for _ in range(20000)]  # ~60 µs median, long tail
    h = Histogram()
    for v in values:
        h.record(v)
    s = sorted(values)
    assert h.count == len(values) and h.min == s[0] and h.max == s[-1]
    assert h.mean == sum(values) / len(values)
    for p in (50, 90, 99, 99.9):
        exact = s[max(0, int(-(-len(s) * p // 100)) - 1)]
        assert abs(h.percentile(p) - exact) <= exact / SUB + 1, p
    assert h.percentile(100) == s[-1]
    assert h.percentile(0) == s[0]


def test_merge_equals_recording_everything_in_one() -> None:
    rng = random.Random(1)
    parts = [[rng.randrange(1, 10**7) for _ in range(1000)] for _ in range(4)]
    one = Histogram()
    merged = Histogram()
    for part in parts:
        h = Histogram()
        for v in part:
            h.record(v)
            one.record(v)
        merged.merge(Histogram.from_dict(h.to_dict()))  # as it crosses from a worker process
    assert merged.counts == one.counts
    assert (merged.count, merged.total, merged.min, merged.max) == (one.count, one.total, one.min, one.max)
    assert Histogram().merge(Histogram()).count == 0
    assert Histogram().percentile(99) == 0


def test_huge_values_land_in_the_last_bucket() -> None:
    h = Histogram()
    h.record(1 << 60)
    assert h.buckets()[-1][2] == 1 and h.max == 1 << 60


def test_recording_an_array_at_once_equals_recording_each_value() -> None:
    """buckets_of and record_many (vsan bench's way) against bucket_of and record: every bucket edge, values
    below zero and past the last bucket, and a long-tailed sample, recorded in two arrays."""
    edges = [v for i in range(NBUCKETS) for v in (bucket_low(i), bucket_high(i) - 1)]
    odd = [-5, 0, 1, LINEAR - 1, LINEAR, (1 << 47) + 3, (1 << 53) - 1, (1 << 60) + 12345]
    rng = random.Random(3)
    sample = [int(rng.lognormvariate(11, 1.5)) for _ in range(5000)]
    values = edges + odd + sample
    arr = np.array(values, dtype=np.int64)
    assert buckets_of(arr).tolist() == [bucket_of(v) for v in values]
    one, many = Histogram(), Histogram()
    for v in values:
        one.record(v)
    many.record_many(arr[:1000])
    many.record_many(arr[1000:])
    many.record_many(arr[:0])
    assert many.to_dict() == one.to_dict()
