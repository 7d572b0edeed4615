"""The worker: sequential streams stay in their slice, latency and the run's length, --rate, workers merge. Time
is simulated (FakeClock; each request of a Slow device takes a set time), but for the worker processes' merge
(--rate on the real clock: tests/integration/test_bench_engine_timing.py)."""

from __future__ import annotations

from fake_clock import FakeClock, Slow

from openvsan.bench.engine import Plan
from openvsan.bench.profiles import custom_job
from openvsan.bench.runner import RunResult, run_in_process
from openvsan.block import FaultDevice, RamDevice


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


def test_rate_paces_requests() -> None:
    """--rate 400 for half a simulated second: 200 requests, however fast the device and deep the queue."""
    plan = Plan("ram", custom_job("randread", "4k", qd=8), duration=0.5, rate=400)
    r = simulated(RamDevice(2048), plan, 0.0001).result
    assert 200 <= r.read.count <= 201, r.read.count
