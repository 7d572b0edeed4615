"""The QoS layer (volume/qos.py) on simulated time: sustained rates, bursts, live changes, FIFO order, the
wait cap, the fast path, the config round trip and byte equivalence. No real sleeps, no sockets: the layer
gets a fake clock and timer, and the clients' "device time" is simulated the same way."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
from collections.abc import Callable

import pytest

from openvsan.block.ram import RamDevice
from openvsan.volume import Volume
from openvsan.volume.qos import MAX_WAIT, MIN_DELAY, TICK, WARN_AFTER, QosError, QosLayer, QosLimits
from openvsan.volume.registry import build_stack, stack_config

BS = 512


class _Handle:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimTime:
    """A clock and a timer heap; run_until() fires the timers in order and lets the tasks run between them."""

    def __init__(self, start: float = 1000.0) -> None:
        self.start = self.now = start
        self._heap: list[tuple[float, int, Callable[[], None], _Handle]] = []
        self._seq = 0

    def clock(self) -> float:
        return self.now

    def call_later(self, delay: float, fn: Callable[[], None]) -> _Handle:
        h = _Handle()
        self._seq += 1
        heapq.heappush(self._heap, (self.now + max(0.0, delay), self._seq, fn, h))
        return h

    @property
    def t(self) -> float:
        """Seconds since the start."""
        return self.now - self.start

    async def sleep(self, delay: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.call_later(delay, lambda: fut.done() or fut.set_result(None))
        await fut

    @staticmethod
    async def settle() -> None:
        """Run the tasks until none is ready (no simulated time passes)."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0)
        while loop._ready:  # type: ignore[attr-defined]  # CPython's queue of runnable callbacks
            await asyncio.sleep(0)

    async def run_until(self, t: float) -> None:
        end = self.start + t
        while True:
            await self.settle()
            while self._heap and self._heap[0][3].cancelled:
                heapq.heappop(self._heap)
            if not self._heap or self._heap[0][0] > end:
                break
            when, _, fn, _ = heapq.heappop(self._heap)
            self.now = max(self.now, when)
            fn()
        self.now = max(self.now, end)
        await self.settle()


def qos_over_ram(sim: SimTime, limits: QosLimits, blocks: int = 1 << 16) -> tuple[QosLayer, Volume]:
    layer = QosLayer(RamDevice(blocks, BS), limits, clock=sim.clock, call_later=sim.call_later)
    return layer, Volume(layer, name="v")


class Workload:
    """Closed-loop clients, each with one command outstanding (queue depth = clients), each command going the
    way a frontend sends it: read_now / write_now first, the normal path when that declines."""

    def __init__(self, sim: SimTime, vol: Volume, *, device_time: float = 0.0) -> None:
        self.sim = sim
        self.vol = vol
        self.device_time = device_time
        self.done: list[tuple[float, str, int]] = []   # (sim t, "r"/"w", bytes) per completed command
        self.tasks: list[asyncio.Task[None]] = []
        self.stopped = False

    def start(self, op: str, clients: int, blocks: int, device_time: float | None = None) -> None:
        for i in range(clients):
            self.tasks.append(asyncio.ensure_future(self._client(op, blocks, i, device_time)))

    async def _client(self, op: str, blocks: int, i: int, device_time: float | None) -> None:
        vol, data = self.vol, bytes([i % 251]) * (blocks * BS)
        lba = (i * blocks) % (vol.num_blocks - blocks)
        dt = self.device_time if device_time is None else device_time
        while not self.stopped:
            if dt:
                await self.sim.sleep(dt)
            if op == "r":
                if vol.read_now(lba, blocks) is None:
                    await vol.read(lba, blocks)
                else:
                    await asyncio.sleep(0)
            elif not vol.write_now(lba, data):
                await vol.write(lba, data)
            else:
                await asyncio.sleep(0)
            self.done.append((self.sim.t, op, blocks * BS))

    def count(self, t0: float, t1: float, op: str | None = None, *, nbytes: bool = False) -> int:
        return sum(n if nbytes else 1 for t, o, n in self.done if t0 < t <= t1 and (op is None or o == op))

    async def stop(self) -> None:
        self.stopped = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


# ---- limits: validation, one line naming the key

@pytest.mark.parametrize("cfg, words", [
    ({"read_iops_limit": -5}, ["read_iops_limit", "negative"]),
    ({"iops_limit": 100, "iops_burst": 50}, ["iops_burst", "below", "iops_limit"]),
    ({"write_bps_burst": 1000}, ["write_bps_burst", "write_bps_limit"]),
    ({"bps_limit": 10, "bps_burst": 20, "bps_burst_seconds": 0}, ["bps_burst_seconds", "more than 0"]),
    ({"read_ops_limit": 1}, ["read_ops_limit is not a QoS knob", "did you mean read_iops_limit?"]),
    ({"iops_limit": "100"}, ["iops_limit", "number"]),
    ({"iops_limit": True}, ["iops_limit", "number"]),
    ({"bps_limit": float("inf")}, ["bps_limit", "number"]),
])
def test_bad_limits_are_one_line_naming_the_key(cfg, words):
    with pytest.raises(QosError) as e:
        QosLimits.from_dict(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_limits_round_trip_and_defaults():
    lim = QosLimits.from_dict({"read_iops_limit": 100, "read_iops_burst": 200, "read_iops_burst_seconds": 3,
                               "bps_limit": 10_000_000})
    assert lim.to_dict() == {"read_iops_limit": 100, "read_iops_burst": 200, "read_iops_burst_seconds": 3,
                             "bps_limit": 10_000_000}
    assert QosLimits.from_dict(lim.to_dict()) == lim
    assert QosLimits().unlimited and not lim.unlimited
    assert QosLimits(iops_limit=100, iops_burst=100).iops_burst == 100   # burst equal to the limit is fine


# ---- sustained rates: each knob within 1 % over 10 simulated seconds

KNOB_CASES = [
    # (knob, value, what is measured, the other direction: must go at its own pace)
    ("iops_limit", 100, None, None),
    ("iops_limit", 1000, None, None),
    ("iops_limit", 5000, None, None),
    ("read_iops_limit", 1000, "r", "w"),
    ("write_iops_limit", 1000, "w", "r"),
    ("bps_limit", 10_000_000, None, None),
    ("bps_limit", 100_000_000, None, None),
    ("read_bps_limit", 10_000_000, "r", "w"),
    ("write_bps_limit", 10_000_000, "w", "r"),
]


@pytest.mark.parametrize("knob, value, op, other", KNOB_CASES)
def test_sustained_rate_within_one_percent(knob, value, op, other):
    async def go():
        sim = SimTime()
        _, vol = qos_over_ram(sim, QosLimits.from_dict({knob: value}))
        w = Workload(sim, vol)
        blocks = 128 if "bps" in knob else 8      # 64 KiB for byte limits, 4 KiB for operation limits
        for o in ("r", "w"):
            # the direction under the limit: 16 clients with no device time (always a queue); the other
            # direction, if it is not limited: 4 clients at 10 ms each, 400 commands a second
            w.start(o, 16 if o == op or op is None else 4, blocks, 0.0 if o == op or op is None else 0.01)
        await sim.run_until(11.0)
        await w.stop()
        measured = w.count(1.0, 11.0, op, nbytes="bps" in knob) / 10.0
        assert measured == pytest.approx(value, rel=0.01)
        if other is not None:
            assert w.count(1.0, 11.0, other) / 10.0 == pytest.approx(400, rel=0.02)   # not held back
    asyncio.run(go())


# ---- bursts

def test_burst_allows_exactly_the_excess_then_settles_and_refills_when_idle():
    limit, burst, seconds = 100, 300, 2
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(iops_limit=limit, iops_burst=burst, iops_burst_seconds=seconds))
        w = Workload(sim, vol)
        w.start("r", 32, 8)
        await sim.run_until(10.0)
        # while the budget lasts: at the burst rate (and no faster), for burst_seconds less one tick
        assert w.count(0.1, 1.1) == pytest.approx(burst, abs=2)
        # then the sustained rate
        assert w.count(4.0, 10.0) / 6.0 == pytest.approx(limit, rel=0.01)
        # and over the whole run: the sustained amount, one tick's depth, and exactly the configured excess
        excess = (burst - limit) * seconds
        assert w.count(-1, 10.0) == pytest.approx(limit * (10.0 + TICK) + excess, abs=2)
        await w.stop()
        # idle for 1 s: the excess refills at the sustained rate (100 tokens), not at once
        await sim.run_until(11.0)
        n0 = len(w.done)
        w.stopped = False
        w.tasks.clear()
        w.start("r", 32, 8)
        await sim.run_until(14.0)
        assert len(w.done) - n0 == pytest.approx(limit * 3 + limit * 1.0, abs=2)
        await w.stop()
        assert layer.stats()["throttled"] > 0
    asyncio.run(go())


def test_without_burst_an_idle_volume_gets_one_tick_of_work_at_once():
    async def go():
        sim = SimTime()
        _, vol = qos_over_ram(sim, QosLimits(iops_limit=1000))
        w = Workload(sim, vol)
        w.start("r", 200, 8)
        await sim.run_until(0.0)
        assert len(w.done) == 1000 * TICK      # 50 at once, no more
        await w.stop()
    asyncio.run(go())


# ---- live change

@pytest.mark.parametrize("before, after", [(100, 1000), (1000, 100), (5000, 100)])
def test_limit_changed_mid_run_takes_effect_at_the_next_tick(before, after):
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(iops_limit=before))
        w = Workload(sim, vol)
        w.start("r", 64, 8)
        await sim.run_until(5.0)
        assert w.count(1.0, 5.0) / 4.0 == pytest.approx(before, rel=0.01)
        layer.set_limits(QosLimits(iops_limit=after))
        await sim.run_until(7.0 + TICK)
        assert w.count(5.0 + TICK, 6.0 + TICK) == pytest.approx(after, rel=0.01, abs=1)
        assert w.count(6.0 + TICK, 7.0 + TICK) == pytest.approx(after, rel=0.01, abs=1)
        await w.stop()
    asyncio.run(go())


def test_raising_a_limit_lets_waiting_commands_go_at_once():
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(iops_limit=1))
        w = Workload(sim, vol)
        w.start("r", 32, 8)
        await sim.run_until(0.52)
        assert len(w.done) == 1 and layer.stats()["waiting"] == 32   # 31, and the first one again
        layer.set_limits(QosLimits(iops_limit=10_000))
        # the bucket owes 0.48 token (at the old rate, the next command would go at 1.0 s, the queue's timer
        # at the next tick, 0.55 s): at the new rate that is 48 us, so the timer is set anew, for as soon as a
        # timer goes (MIN_DELAY), not for 0.55 s
        await sim.run_until(0.52 + MIN_DELAY + 0.001)
        assert len(w.done) >= 1 + 5
        await sim.run_until(0.52 + TICK)
        assert len(w.done) >= 1 + 32
        await w.stop()
        # all limits off while commands wait: a pass-through, and they go with no time passing
        layer.set_limits(QosLimits(iops_limit=1))
        await sim.run_until(1.0)
        reads = [asyncio.ensure_future(vol.read(0, 8)) for _ in range(32)]
        await sim.settle()
        assert layer.stats()["waiting"] == 31               # the bucket was full again: one went
        layer.set_limits(QosLimits())
        await sim.settle()
        assert all(r.done() for r in reads) and layer.stats()["waiting"] == 0
        assert all(vol.read_now(0, 8) is not None for _ in range(1000))
    asyncio.run(go())


def test_commands_due_close_together_go_on_one_wake_up():
    """A throttled queue wakes the loop at most once per MIN_DELAY (a wake-up costs about 100 µs of CPU on
    these VMs), and the rate still holds: the bucket refills while the commands wait."""
    async def go():
        sim = SimTime()
        fired: list[float] = []
        layer, vol = qos_over_ram(sim, QosLimits(iops_limit=1000))
        arm = layer._call_later

        def counted(delay: float, fn: Callable[[], None]) -> object:
            return arm(delay, lambda: (fired.append(sim.t), fn()))
        layer._call_later = counted
        w = Workload(sim, vol)
        w.start("r", 32, 8)
        await sim.run_until(10.0)
        await w.stop()
        done = [t for t, _, _ in w.done if t >= 1.0]    # past the first bucket's burst
        assert len(done) == pytest.approx(9 * 1000, rel=0.01)
        assert len(w.done) / len(fired) >= 4, len(fired)      # at 1,000 IOPS: 4 or more per wake-up
        assert all(b - a >= MIN_DELAY - 1e-9 for a, b in itertools.pairwise(fired))
    asyncio.run(go())


# ---- order, big I/O, the wait cap

def test_fifo_small_io_does_not_starve_a_large_one():
    async def go():
        sim = SimTime()
        _, vol = qos_over_ram(sim, QosLimits(bps_limit=1_000_000))
        order: list[str] = []

        async def write(tag: str, blocks: int, delay: float) -> None:
            await sim.sleep(delay)
            await vol.write(0, bytes(blocks * BS))
            order.append(tag)

        # a stream of small writes, a 256 KiB one among them, and small ones after it
        tasks = [asyncio.ensure_future(write(f"s{i}", 8, i * 0.001)) for i in range(100)]
        tasks.append(asyncio.ensure_future(write("big", 512, 0.0305)))
        await sim.run_until(5.0)
        assert all(t.done() for t in tasks)
        big = order.index("big")
        assert order[:big] == [f"s{i}" for i in range(big)]
        assert order[big + 1:] == [f"s{i}" for i in range(big, 100)]   # those after it waited their turn
        assert 25 <= big <= 31
    asyncio.run(go())


def test_an_io_larger_than_the_bucket_goes_when_it_is_full_and_runs_it_negative():
    async def go():
        sim = SimTime()
        _, vol = qos_over_ram(sim, QosLimits(bps_limit=1_000_000))   # 50 KB deep
        times: list[float] = []

        async def write(blocks: int) -> None:
            await vol.write(0, bytes(blocks * BS))
            times.append(sim.t)

        t = asyncio.ensure_future(write(2048))          # 1 MiB: twenty times the bucket
        await sim.run_until(0.0)
        assert times == [0.0]                           # the bucket was full: it went
        t2 = asyncio.ensure_future(write(8))            # 4 KiB: waits for the 1 MiB to be paid back
        await sim.run_until(5.0)
        assert t.done() and t2.done()
        due = (2048 * BS - 50_000 + 8 * BS) / 1_000_000
        assert due - 1e-9 <= times[1] <= due + MIN_DELAY + 1e-9   # when paid back, or with the commands due by then
    asyncio.run(go())


def test_no_command_waits_longer_than_the_cap_and_long_waits_are_logged_once(caplog):
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(iops_limit=1))
        waits: list[float] = []

        async def read() -> None:
            t0 = sim.t
            await vol.read(0, 1)
            waits.append(sim.t - t0)

        tasks = [asyncio.ensure_future(read()) for _ in range(64)]
        with caplog.at_level(logging.WARNING, logger="openvsan.volume.qos"):
            await sim.run_until(MAX_WAIT + 1.0)
        assert all(t.done() for t in tasks)
        assert len(waits) == 64
        assert max(waits) <= MAX_WAIT + TICK
        assert layer.stats()["capped"] >= 50
        lines = [r for r in caplog.records if "waited over" in r.getMessage()]
        assert len(lines) == 1 and f"{WARN_AFTER:g} s" in lines[0].getMessage()
    asyncio.run(go())


def test_a_cancelled_waiter_takes_nothing_and_frees_its_place():
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(iops_limit=10))      # one every 100 ms, half a token deep
        assert await vol.read(0, 1) is not None                       # the full bucket: it goes, owing 0.5
        first = asyncio.ensure_future(vol.read(0, 1))                 # would go at 0.1 s
        second = asyncio.ensure_future(vol.read(0, 1))                # would go at 0.2 s
        await sim.run_until(0.01)
        first.cancel()
        await sim.run_until(0.099)
        assert first.cancelled() and not second.done()
        await sim.run_until(0.1)
        assert second.done()                                          # in the first one's place
        assert layer.stats()["waiting"] == 0 and layer.stats()["read_ops"] == 2
    asyncio.run(go())


def test_unmap_and_write_zeroes_are_one_write_operation_and_no_bytes():
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(bps_limit=1000, write_iops_limit=10))
        await vol.unmap(0, 60_000)              # 30 MB at 1 kB/s would wait the cap: it moves no data
        assert sim.t == 0.0
        t = asyncio.ensure_future(vol.write_zeroes(0, 60_000))   # the write IOPS bucket is empty now
        await sim.run_until(0.05)
        assert not t.done()
        await sim.run_until(0.1)
        assert t.done()
        assert layer.stats()["write_bytes"] == 0 and layer.stats()["write_ops"] == 2
    asyncio.run(go())


# ---- the fast path

def test_fast_path_is_used_under_the_limits_and_declined_when_a_bucket_is_empty():
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(read_iops_limit=100, write_bps_limit=1_000_000))
        assert vol.read_now is not None
        got = [vol.read_now(0, 8) for _ in range(6)]
        assert all(g is not None for g in got[:5]) and got[5] is None    # 5 tokens deep (100 x 50 ms)
        sim.now += 0.01                                                  # one token
        assert vol.read_now(0, 8) is not None and vol.read_now(0, 8) is None
        # a waiting command holds the fast path back even when its tokens come: first come, first served
        waiting = asyncio.ensure_future(vol.read(0, 8))
        await sim.settle()
        assert layer.stats()["waiting"] == 1
        sim.now += 0.02
        assert vol.read_now(0, 8) is None
        await sim.run_until(sim.t + 0.001)
        assert waiting.done()
        # writes only use the write bps bucket: 50 KB deep, so 12 x 4 KiB at once, not 13
        assert sum(vol.write_now(0, bytes(4096)) for _ in range(13)) == 12
        assert layer.stats()["read_ops"] == 7 and layer.stats()["write_ops"] == 12
    asyncio.run(go())


def test_tokens_prepaid_to_the_fast_path_go_back_when_a_command_waits():
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(iops_limit=100_000))   # 5,000 deep; grants of 100 (1 ms)
        assert vol.read_now(0, 8) is not None                           # 99 prepaid for the next reads
        assert layer.stats()["buckets"]["total_iops"] == pytest.approx(4900)
        writes = 0
        while vol.write_now(0, bytes(4096)):
            writes += 1
        assert writes == 4900                                           # the bucket is empty
        waiting = asyncio.ensure_future(vol.write(0, bytes(4096)))
        await sim.settle()
        assert layer.stats()["waiting"] == 0 and waiting.done()          # the reads' 99 came back: it went
        assert layer.stats()["buckets"]["total_iops"] == pytest.approx(0)   # the write's grant: itself and 98
        blocked = [asyncio.ensure_future(vol.write(0, bytes(4096))) for _ in range(200)]
        await sim.settle()
        assert layer.stats()["waiting"] == 102
        assert vol.read_now(0, 8) is None                               # nobody passes them on the fast path
        await sim.run_until(0.01)
        assert all(b.done() for b in blocked)
    asyncio.run(go())


def test_a_device_that_declines_gets_the_tokens_back():
    class Declining(RamDevice):
        def read_now(self, lba, blocks):
            return None

    async def go():
        sim = SimTime()
        layer = QosLayer(Declining(64), QosLimits(iops_limit=100), clock=sim.clock, call_later=sim.call_later)
        for _ in range(20):
            assert layer.read_now(0, 1) is None
        reads = [asyncio.ensure_future(layer.read(0, 1)) for _ in range(6)]
        await sim.settle()
        assert sum(r.done() for r in reads) == 5     # the bucket's 5 tokens (100 x 50 ms) are all still there
        await sim.run_until(0.01)
        assert all(r.done() for r in reads)
    asyncio.run(go())


def test_capabilities_stay_the_devices():
    sim = SimTime()
    ram = RamDevice(64)
    layer = QosLayer(ram, QosLimits(iops_limit=100), clock=sim.clock, call_later=sim.call_later)
    # all but the write window: data received straight into the device would go around the limits
    assert layer.capabilities == ram.capabilities.but(write_window=False)
    assert layer.write_window(0, 1) is None
    assert layer.flush == ram.flush          # what QoS does not change is the device's own method


# ---- config, stats, bytes

def test_config_round_trips_through_the_registry():
    cfg = [{"type": "qos", "read_iops_limit": 500, "read_iops_burst": 1000, "read_iops_burst_seconds": 5,
            "bps_limit": 100_000_000}]
    ram = RamDevice(1024)
    top = build_stack(ram, cfg)
    assert isinstance(top, QosLayer) and top.below is ram
    assert top.limits == QosLimits(read_iops_limit=500, read_iops_burst=1000, read_iops_burst_seconds=5,
                                   bps_limit=100_000_000)
    assert stack_config(top) == cfg
    assert stack_config(build_stack(RamDevice(1024), stack_config(top))) == cfg
    assert Volume(top, name="v").to_config()["layers"] == cfg
    with pytest.raises(QosError, match="iops_burst 5 is below iops_limit 10"):
        build_stack(ram, [{"type": "qos", "iops_limit": 10, "iops_burst": 5}])


def test_stats_count_waits_and_measure_rates():
    async def go():
        sim = SimTime()
        layer, vol = qos_over_ram(sim, QosLimits(read_iops_limit=200, write_bps_limit=2_000_000))
        w = Workload(sim, vol)
        w.start("r", 8, 8)
        w.start("w", 8, 64)
        await sim.run_until(3.0)
        layer.stats()
        await sim.run_until(5.0)
        s = layer.stats()
        await w.stop()
        assert s["read_iops"] == pytest.approx(200, rel=0.01)
        assert s["write_bps"] == pytest.approx(2_000_000, rel=0.01)
        assert s["throttled"] > 1000 and s["wait_seconds"] > 10
        assert s["limits"] == {"read_iops_limit": 200, "write_bps_limit": 2_000_000}
    asyncio.run(go())


def test_a_volume_over_qos_gives_the_same_bytes_as_the_device():
    async def go():
        sim = SimTime()
        plain = Volume(RamDevice(4096, BS), name="plain")
        layer, vol = qos_over_ram(sim, QosLimits(iops_limit=2000, bps_limit=20_000_000), blocks=4096)
        rng = random.Random(11)

        async def both(fn: str, *args: object) -> None:
            a = getattr(plain, fn)(*args)
            b = asyncio.ensure_future(getattr(vol, fn)(*args))
            await a
            await sim.run_until(sim.t + 0.5)
            await b

        for i in range(300):
            lba, blocks = rng.randrange(4000), rng.randrange(1, 96)
            data = rng.randbytes(blocks * BS)
            if i % 3 == 0:
                assert plain.write_now(lba, data)
                if not vol.write_now(lba, data):
                    await both("write", lba, data)
            elif i % 3 == 1:
                await both("write", lba, data)
            else:
                await both("write_zeroes", lba, blocks // 2 + 1)
        for lba in range(0, 4096, 64):
            want = await plain.read(lba, 64)
            got = vol.read_now(lba, 64)
            if got is None:
                fut = asyncio.ensure_future(vol.read(lba, 64))
                await sim.run_until(sim.t + 0.5)
                got = await fut
            assert bytes(got) == bytes(want)
        assert layer.stats()["throttled"] > 0          # both paths were taken
    asyncio.run(go())
