"""The worker: sequential streams stay in their slice, latency and the run's length, --rate, workers merge. Time
is simulated (FakeClock; each request of a Slow device takes a set time), but for the worker processes' merge
(--rate on the real clock: tests/integration/test_bench_engine_timing.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_clock import FakeClock, Slow

from openvsan.bench.engine import LOG_AT, Plan, Worker
from openvsan.bench.histogram import Histogram
from openvsan.bench.profiles import custom_job
from openvsan.bench.runner import RunResult, run_in_process
from openvsan.block import FaultDevice, RamDevice
from openvsan.block.errors import BlockError, MediumError


def simulated(dev: object, plan: Plan, latency: float) -> RunResult:
    clock = FakeClock()
    return run_in_process(Slow(dev, clock, latency), plan, clock=clock.ns, sleep=clock.sleep)  # type: ignore[arg-type]


def test_sequential_worker_slices_do_not_overlap() -> None:
    dev = FaultDevice(RamDevice(4096))
    seen: list[tuple[int, int]] = []
    real = dev.read

    async def spy(lba: int, blocks: int) -> object:
        seen.append((lba, blocks))
        return await real(lba, blocks)

    dev.read = spy  # type: ignore[method-assign,assignment]
    plan = Plan("ram", custom_job("read", "64k", qd=2), duration=0.2, index=1, workers=2)
    simulated(dev, plan, 0.001)
    assert seen and all(2048 <= lba and lba + n <= 4096 for lba, n in seen)  # worker 1 of 2: the upper half
    assert seen[:3] == [(2048, 128), (2176, 128), (2304, 128)]


def test_latency_and_length_of_the_run() -> None:
    """QD 4 on a device that takes 2 ms a request, for 3 simulated seconds: 6,000 requests, each timed at 2 ms,
    and one time-series point a second."""
    plan = Plan("ram", custom_job("randread", "4k", qd=4), duration=3.0)
    r = simulated(RamDevice(2048), plan, 0.002).result
    assert abs(r.elapsed - 3.0) < 0.003, r.elapsed
    assert 6000 <= r.read.count <= 6004 and r.write.count == 0, r.read.count
    assert r.read.min >= 1_999_000 and r.read.max <= 2_001_000, (r.read.min, r.read.max)
    points = [i.reads for i in r.intervals]  # (a completion on a second's edge may fall either side)
    assert len(points) in (3, 4) and all(abs(n - 2000) <= 4 for n in points[:3]) and sum(points) == r.read.count


def test_completions_kept_and_recorded_at_once_give_what_recording_each_one_gives() -> None:
    """Worker._record keeps each completion and puts them into the result in bulk (past LOG_AT, at each progress
    report and at the end): the histograms, bytes and time-series points are those of recording each one as it
    came, across interval edges, for both directions."""
    w = Worker(RamDevice(2048), Plan("ram", custom_job("randrw", "4k", qd=4)))
    w.t0, w.measuring = 5.0, True
    reads, writes = Histogram(), Histogram()
    points: dict[int, list[int]] = {}
    for i in range(3 * LOG_AT):
        write = i % 3 == 0
        done = 5_000_000_000 + i * 977_000 + (i * 7919) % 1000   # about 3 s of completions
        t = done - 20_000 - (i * 104_729) % 900_000
        w._record(write, t, done)
        (writes if write else reads).record(done - t)
        points.setdefault(int((done / 1e9 - w.t0) / 1.0), []).append(done - t)
    w._logs_out()
    r = w.result
    assert r.read.to_dict() == reads.to_dict() and r.write.to_dict() == writes.to_dict()
    assert r.read_bytes == 4096 * reads.count and r.write_bytes == 4096 * writes.count
    assert len(r.intervals) == len(points) >= 3
    for k, iv in enumerate(r.intervals):
        h = Histogram()
        for v in points[k]:
            h.record(v)
        assert iv.lat.to_dict() == h.to_dict() and iv.reads + iv.writes == len(points[k])
        assert iv.bytes == 4096 * len(points[k])


def test_rate_paces_requests() -> None:
    """--rate 400 for half a simulated second: 200 requests, however fast the device and deep the queue."""
    plan = Plan("ram", custom_job("randread", "4k", qd=8), duration=0.5, rate=400)
    r = simulated(RamDevice(2048), plan, 0.0001).result
    assert 200 <= r.read.count <= 201, r.read.count


class SoonDevice:
    """A RAM device with read_soon / write_soon (as our NVMe/TCP initiator offers them), each request answered by
    callback `latency` simulated seconds later; `decline_after` requests taken, it declines the rest, and
    `fail_every` n-th one fails (the caller must send those again the normal way)."""

    def __init__(self, clock: FakeClock, latency: float, *, decline_after: int | None = None,
                 fail_every: int = 0, bad: int | None = None) -> None:
        self.ram, self.clock, self.latency = RamDevice(2048), clock, latency
        self.decline_after, self.fail_every, self.bad = decline_after, fail_every, bad
        self.soon = self.normal = 0
        self.block_size, self.num_blocks = self.ram.block_size, self.ram.num_blocks
        self.reads: list[tuple[str, int]] = []     # (path, lba) of each read, in order

    def _take(self) -> bool:
        if self.decline_after is not None and self.soon >= self.decline_after:
            return False
        self.soon += 1
        return True

    def _later(self, answer: Any) -> None:
        async def go() -> None:
            await self.clock.sleep(self.latency)
            failed = self.fail_every and self.soon % self.fail_every == 0
            answer(BlockError("lost") if failed else None)
        asyncio.ensure_future(go())

    def read_soon(self, lba: int, blocks: int, done: Any) -> bool:
        if not self._take():
            return False
        self.reads.append(("soon", lba))
        if lba == self.bad:
            self._later(lambda e: done(None, MediumError("bad block", lba)))
            return True
        self._later(lambda e: done(None, e) if e else done(self.ram.read_now(lba, blocks), None))
        return True

    def write_soon(self, lba: int, data: bytes, fua: bool, done: Any) -> bool:
        if not self._take():
            return False
        self._later(lambda e: done(e) if e else done(None) if self.ram.write_now(lba, data) else None)
        return True

    async def read(self, lba: int, blocks: int) -> Any:
        self.normal += 1
        self.reads.append(("normal", lba))
        await self.clock.sleep(self.latency)
        if lba == self.bad:
            raise MediumError("bad block", lba)
        return self.ram.read_now(lba, blocks)

    async def write(self, lba: int, data: Any, *, fua: bool = False) -> None:
        self.normal += 1
        await self.clock.sleep(self.latency)
        self.ram.write_now(lba, data)

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        return None


@pytest.mark.parametrize("kind", ["randread", "randwrite", "randrw"])
def test_soon_lanes_time_and_count_as_the_coroutine_lanes(kind: str) -> None:
    """A device with read_soon / write_soon runs on callback lanes: QD 4 at 2 ms a request for 3 simulated
    seconds gives the coroutine lanes' figures (6,000 requests, each timed at 2 ms, one point a second), every
    request through the fast path."""
    clock = FakeClock()
    dev = SoonDevice(clock, 0.002)
    plan = Plan("ram", custom_job(kind, "4k", qd=4), duration=3.0)
    r = run_in_process(dev, plan, clock=clock.ns, sleep=clock.sleep).result  # type: ignore[arg-type]
    n = r.read.count + r.write.count
    assert abs(r.elapsed - 3.0) < 0.003 and 6000 <= n <= 6004, (r.elapsed, n)
    assert (r.read.count == 0) == (kind == "randwrite") and (r.write.count == 0) == (kind == "randread")
    for h in (r.read, r.write):
        assert not h.count or (h.min >= 1_999_000 and h.max <= 2_001_000), (h.min, h.max)
    assert sum(i.reads + i.writes for i in r.intervals) == n and r.io_errors == 0
    assert dev.normal == 0 and dev.soon >= n


def test_soon_lanes_go_on_as_coroutine_lanes_where_declined_or_failed() -> None:
    """A lane whose fast request is declined (the initiator has no slot free, or no connection) or fails
    (dropped connection) goes on through read()/write(), which retry and reconnect: the run keeps its queue
    depth and its length, and the failed requests are sent again, not counted as errors."""
    for dev_kw in ({"decline_after": 100}, {"fail_every": 7}):
        clock = FakeClock()
        dev = SoonDevice(clock, 0.002, **dev_kw)  # type: ignore[arg-type]
        plan = Plan("ram", custom_job("randrw", "4k", qd=4), duration=3.0)
        r = run_in_process(dev, plan, clock=clock.ns, sleep=clock.sleep).result  # type: ignore[arg-type]
        n = r.read.count + r.write.count
        assert 5990 <= n <= 6004 and r.io_errors == 0, (dev_kw, n, r.io_errors)
        assert dev.normal > 0 and dev.soon > 0, (dev.normal, dev.soon)


def test_verify_and_rate_keep_the_coroutine_lanes() -> None:
    """--verify (its generations and checks live in _one) and --rate (pacing) do not take the fast path."""
    for kw in ({"verify": True}, {"rate": 400.0}):
        clock = FakeClock()
        dev = SoonDevice(clock, 0.001)
        plan = Plan("ram", custom_job("randrw", "4k", qd=4), duration=0.5, **kw)  # type: ignore[arg-type]
        r = run_in_process(dev, plan, clock=clock.ns, sleep=clock.sleep).result  # type: ignore[arg-type]
        assert r.read.count + r.write.count > 0 and dev.soon == 0 and r.mismatches == 0, kw


def test_a_fast_request_that_fails_is_sent_again_to_the_same_blocks() -> None:
    """A read that fails on the fast path is read again, at the same LBA, by read() (which retries and
    reconnects where it can): an error that stays is counted, as the coroutine lanes count it."""
    clock = FakeClock()
    dev = SoonDevice(clock, 0.001, bad=64)
    plan = Plan("ram", custom_job("read", "4k", qd=1), duration=0.5)   # sequential: LBA 64 once a pass
    r = run_in_process(dev, plan, clock=clock.ns, sleep=clock.sleep).result  # type: ignore[arg-type]
    first = dev.reads.index(("soon", 64))
    assert dev.reads[first + 1] == ("normal", 64)
    assert r.io_errors == dev.reads.count(("normal", 64)) >= 1

