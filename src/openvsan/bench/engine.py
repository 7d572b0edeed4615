"""One worker: one device (its own connection(s)), `qd` requests in flight, for warmup + duration seconds.

The worker is asyncio only; the runner (runner.py) starts one per thread, in its own process when there is
more than one, and merges what they report. Latency is measured from submission to completion of each
request and recorded in nanoseconds; with --rate a request that had to wait for its slot is timed from when
it was sent, not from when it was due (no coordinated-omission correction). Time is the worker's `clock`
(nanoseconds, time.perf_counter_ns) and `sleep` (asyncio.sleep): the unit tests pass simulated ones.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from openvsan.bench.histogram import Histogram
from openvsan.bench.profiles import Job
from openvsan.bench.verify import Generations, Mismatch, check_buffer, make_buffer
from openvsan.block.device import BlockDevice
from openvsan.block.errors import BlockError

INTERVAL = 1.0           # seconds per time-series point
PROGRESS_EVERY = 0.5     # seconds between progress messages
MAX_REPORTED = 20        # mismatches / errors listed by LBA; the rest only counted
PRECONDITION_BS = 1 << 20
LOG_AT = 1 << 13         # completions kept per direction before they are put into the histograms at once
SLOTS_AT = 1 << 12       # random slots drawn at once


@dataclass(frozen=True)
class Plan:
    """What one worker runs (picklable: it crosses to worker processes)."""

    target: str
    job: Job
    index: int = 0
    workers: int = 1
    warmup: float = 0.0
    duration: float = 5.0
    rate: float | None = None        # this worker's share of --rate, requests/s
    verify: bool = False
    precondition: bool = False
    size: int | None = None          # bytes of the device to use (default: all of it)
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # for open_url: queues=, queue_depth=


@dataclass
class Interval:
    reads: int = 0
    writes: int = 0
    bytes: int = 0
    lat: Histogram = field(default_factory=Histogram)

    def to_dict(self) -> dict[str, Any]:
        return {"reads": self.reads, "writes": self.writes, "bytes": self.bytes, "lat": self.lat.to_dict()}


@dataclass
class WorkerResult:
    read: Histogram = field(default_factory=Histogram)
    write: Histogram = field(default_factory=Histogram)
    read_bytes: int = 0
    write_bytes: int = 0
    elapsed: float = 0.0             # seconds of the measured phase
    cpu: float = 0.0                 # CPU seconds of this process during the measured phase
    intervals: list[Interval] = field(default_factory=list)
    io_errors: int = 0
    mismatches: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_REPORTED, with LBAs
    block_size: int = 0
    num_blocks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read.to_dict(), "write": self.write.to_dict(), "read_bytes": self.read_bytes,
                "write_bytes": self.write_bytes, "elapsed": self.elapsed, "cpu": self.cpu,
                "intervals": [i.to_dict() for i in self.intervals], "io_errors": self.io_errors,
                "mismatches": self.mismatches, "problems": self.problems, "block_size": self.block_size,
                "num_blocks": self.num_blocks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerResult:
        r = cls(Histogram.from_dict(d["read"]), Histogram.from_dict(d["write"]), d["read_bytes"],
                d["write_bytes"], d["elapsed"], d["cpu"], [], d["io_errors"], d["mismatches"], d["problems"],
                d["block_size"], d["num_blocks"])
        r.intervals = [Interval(i["reads"], i["writes"], i["bytes"], Histogram.from_dict(i["lat"]))
                       for i in d["intervals"]]
        return r

    def merge(self, o: WorkerResult) -> WorkerResult:
        self.read.merge(o.read)
        self.write.merge(o.write)
        self.read_bytes += o.read_bytes
        self.write_bytes += o.write_bytes
        self.elapsed = max(self.elapsed, o.elapsed)
        self.cpu += o.cpu
        while len(self.intervals) < len(o.intervals):
            self.intervals.append(Interval())
        for mine, theirs in zip(self.intervals, o.intervals, strict=False):
            mine.reads += theirs.reads
            mine.writes += theirs.writes
            mine.bytes += theirs.bytes
            mine.lat.merge(theirs.lat)
        self.io_errors += o.io_errors
        self.mismatches += o.mismatches
        self.problems = (self.problems + o.problems)[:MAX_REPORTED]
        self.block_size = self.block_size or o.block_size
        self.num_blocks = self.num_blocks or o.num_blocks
        return self


Emit = Callable[[str, dict[str, Any]], None]
Sleep = Callable[[float], Awaitable[None]]


class Worker:
    def __init__(self, dev: BlockDevice, plan: Plan, emit: Emit | None = None, *,
                 clock: Callable[[], int] = time.perf_counter_ns, sleep: Sleep = asyncio.sleep) -> None:
        self.dev, self.plan, self.job = dev, plan, plan.job
        self.emit = emit
        self.clock = clock  # nanoseconds: latencies; seconds from it (_now) for phases, intervals and --rate
        self.sleep = sleep
        bs = dev.block_size
        if self.job.bs % bs:
            raise ValueError(f"block size {self.job.bs} is not a multiple of the device's {bs}-byte blocks")
        self.blocks_per_io = self.job.bs // bs
        total = dev.num_blocks if plan.size is None else min(dev.num_blocks, plan.size // bs)
        # each worker owns a slice: sequential streams do not overlap, and --verify knows every block's
        # last generation because no other worker writes it
        share = total // plan.workers
        slots = share // self.blocks_per_io
        if slots < 1:
            raise ValueError(f"{total * bs} bytes split over {plan.workers} workers leaves less than one "
                             f"{self.job.bs}-byte request each")
        self.first = plan.index * share
        self.slots = slots
        self.rng = random.Random(plan.seed * 1000003 + plan.index)
        self._slot_rng = np.random.default_rng(plan.seed * 1000003 + plan.index)
        self._slots: list[int] = []   # random slots drawn ahead, taken from the end
        self.random = self.job.pattern != "seq"
        # each direction's (sent, completed) clock pairs not yet in the histograms (_record, _log_out)
        self._logs: tuple[list[int], list[int]] = ([], [])
        self.gens = Generations(self.first, slots * self.blocks_per_io) if plan.verify else None
        self.generation = 0
        self.busy: set[int] = set()   # slots with a request in flight (--verify: no overlapping requests)
        self.next_seq = 0
        self.reported: set[int] = set()
        self.payload = os.urandom(self.job.bs)
        self.result = WorkerResult(block_size=bs, num_blocks=dev.num_blocks)
        self.t0 = 0.0                 # start of the measured phase (_now, seconds)
        self.measuring = False
        self._next_due = 0.0

    def _now(self) -> float:
        return self.clock() / 1e9

    # ------------------------------------------------------------------ picking requests
    def _slot(self) -> int:
        if not self.busy and self.random:   # no --verify: any slot will do
            return self._drawn()
        for _ in range(64):
            if not self.random:
                s = self.next_seq
                self.next_seq = (s + 1) % self.slots
            else:
                s = self._drawn()
            if s not in self.busy:
                return s
        raise RuntimeError("no free slot: the region is smaller than the queue depth")

    def _drawn(self) -> int:
        """The next random slot, drawn SLOTS_AT at a time."""
        drawn = self._slots
        if not drawn:
            drawn = self._slots = self._slot_rng.integers(0, self.slots, SLOTS_AT).tolist()
        return drawn.pop()

    def _note(self, problem: Mismatch | dict[str, Any]) -> None:
        if len(self.result.problems) < MAX_REPORTED:
            self.result.problems.append(problem.to_dict() if isinstance(problem, Mismatch) else problem)

    async def _one(self, write: bool, slot: int | None = None) -> None:
        """One request, to `slot` (default: the next one the job's pattern picks), timed and recorded."""
        if slot is None:
            slot = self._slot()
        lba = self.first + slot * self.blocks_per_io
        n = self.blocks_per_io
        bs = self.dev.block_size
        gens = self.gens
        gen = 0
        if gens is not None:
            self.busy.add(slot)
            if write:
                self.generation += 1
                gen = self.generation
                data: bytes = make_buffer(lba, n, gen, bs)
        elif write:
            data = self.payload
        t = self.clock()
        try:
            if write:
                await self.dev.write(lba, data)
                got = None
            else:
                got = await self.dev.read(lba, n)
        except BlockError as e:
            self.result.io_errors += 1
            self._note({"lba": lba, "kind": "io-error", "message": f"{'write' if write else 'read'} "
                                                                   f"LBA {lba}: {e}"})
            self.busy.discard(slot)
            return
        done = self.clock()
        if gens is not None:
            if write:
                gens.set(lba, n, gen)
            elif got is not None:
                self._check(got, lba)
            self.busy.discard(slot)
        self._record(write, t, done)

    def _record(self, write: bool, t: int, done: int) -> None:
        """A request sent at `t` and completed at `done` (clock nanoseconds), counted if it completed while
        measuring (both kinds of lane): kept, and put into the result with the others at once (_log_out)."""
        if self.measuring:
            log = self._logs[write]
            log.append(t)
            log.append(done)
            if len(log) >= LOG_AT:
                self._log_out(write)

    def _log_out(self, write: bool) -> None:
        """The kept completions of one direction into the result: latencies, bytes and time-series points."""
        log = self._logs[write]
        if not log:
            return
        pairs = np.array(log, dtype=np.int64).reshape(-1, 2)
        log.clear()
        done = pairs[:, 1]
        ns = done - pairs[:, 0]
        r, bs = self.result, self.job.bs
        (r.write if write else r.read).record_many(ns)
        if write:
            r.write_bytes += bs * len(ns)
        else:
            r.read_bytes += bs * len(ns)
        at = ((done / 1e9 - self.t0) / INTERVAL).astype(np.int64)   # _now() at completion, in whole intervals
        for k in np.unique(at).tolist():
            while len(r.intervals) <= k:
                r.intervals.append(Interval())
            iv = r.intervals[k]
            mine = ns[at == k]
            if write:
                iv.writes += len(mine)
            else:
                iv.reads += len(mine)
            iv.bytes += bs * len(mine)
            iv.lat.record_many(mine)

    def _logs_out(self) -> None:
        self._log_out(False)
        self._log_out(True)

    def _check(self, data: Any, lba: int) -> None:
        bad = check_buffer(data, lba, self.dev.block_size, self.gens)
        for m in bad:
            self.result.mismatches += 1
            if m.lba not in self.reported:  # a bad block read again is counted, listed once
                self.reported.add(m.lba)
                self._note(m)

    async def _loop(self, end: float) -> None:
        wp = self.job.write_pct
        rate = self.plan.rate
        while self._now() < end:
            if rate:
                now = self._now()
                # one slot every 1/rate s, shared by the qd loops; after a stall, no catching-up burst
                due = self._next_due = max(self._next_due, now - 1 / rate)
                self._next_due += 1 / rate
                if due > now:
                    await self.sleep(due - now)
                if self._now() >= end:
                    return
            await self._one(wp == 100 or (wp > 0 and self.rng.random() * 100 < wp))

    def _soon_ops(self) -> tuple[Callable[..., bool] | None, Callable[..., bool] | None] | None:
        """The device's read_soon and write_soon (block/device.py ReadSoon, WriteSoon: our NVMe/TCP initiator)
        when the job can run on them: no --verify (its bookkeeping stays with _one) and no --rate; None: the
        coroutine lanes."""
        if self.plan.verify or self.plan.rate:
            return None
        wp = self.job.write_pct
        rs = getattr(self.dev, "read_soon", None) if wp < 100 else None
        ws = getattr(self.dev, "write_soon", None) if wp > 0 else None
        if (wp < 100 and rs is None) or (wp > 0 and ws is None):
            return None
        return rs, ws

    async def _soon_lanes(self, end: float, read_soon: Callable[..., bool] | None,
                          write_soon: Callable[..., bool] | None) -> None:
        """qd lanes whose requests are sent by the device's read_soon / write_soon, each next one from its
        predecessor's completion callback: no coroutine, Task or future per request (vsan bench's own cost per
        request is what limits it against a fast target). Requests are picked, timed and recorded as in _one.
        A lane whose request is declined or fails goes on as a coroutine lane (_loop), that request sent again
        to the same blocks the normal way (which retries and reconnects, and counts an error that stays)."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        left = [self.job.qd]
        tasks: list[asyncio.Task[None]] = []
        stopped = [False]
        wp, n, payload, clock = self.job.write_pct, self.blocks_per_io, self.payload, self.clock

        def lane_ended() -> None:
            left[0] -= 1
            if not left[0] and not finished.done():
                finished.set_result(None)

        def as_coroutine(write: bool, slot: int) -> None:
            async def go() -> None:
                try:
                    await self._one(write, slot)
                    await self._loop(end)
                finally:
                    lane_ended()
            tasks.append(loop.create_task(go()))

        end_ns = end * 1e9

        def issue() -> None:
            t = clock()
            if stopped[0] or t >= end_ns:
                lane_ended()
                return
            write = wp == 100 or (wp > 0 and self.rng.random() * 100 < wp)
            slot = self._slot()
            lba = self.first + slot * n
            if write:
                ok = write_soon(lba, payload, False, functools.partial(wrote, slot, t))  # type: ignore[misc]
            else:
                ok = read_soon(lba, n, functools.partial(read, slot, t))  # type: ignore[misc]
            if not ok:
                as_coroutine(write, slot)

        def wrote(slot: int, t: int, e: BaseException | None) -> None:
            if e is not None:
                as_coroutine(True, slot)
                return
            self._record(True, t, clock())
            issue()

        def read(slot: int, t: int, _data: object, e: BaseException | None) -> None:
            if e is not None:
                as_coroutine(False, slot)
                return
            self._record(False, t, clock())
            issue()

        for _ in range(self.job.qd):
            issue()
        try:
            await finished
            await asyncio.gather(*tasks)
        finally:
            stopped[0] = True
            for task in tasks:
                task.cancel()

    # ------------------------------------------------------------------ phases
    async def precondition(self) -> None:
        """Fill this worker's slice once, sequentially in 1 MiB writes, QD 8 (fio's usual steady-state prep)."""
        bs = self.dev.block_size
        step = max(PRECONDITION_BS // bs, self.blocks_per_io)
        end = self.first + self.slots * self.blocks_per_io
        starts = list(range(self.first, end, step))
        sem = asyncio.Semaphore(8)
        self.generation += 1
        gen = self.generation

        async def fill(lba: int) -> None:
            n = min(step, end - lba)
            async with sem:
                if self.gens is not None:
                    await self.dev.write(lba, make_buffer(lba, n, gen, bs))
                    self.gens.set(lba, n, gen)
                else:
                    await self.dev.write(lba, (self.payload * (n * bs // len(self.payload) + 1))[:n * bs])

        await asyncio.gather(*(fill(s) for s in starts))
        await self.dev.flush()

    async def verify_pass(self) -> None:
        """--verify: read back every block this worker wrote and check it."""
        assert self.gens is not None
        bs = self.dev.block_size
        step = max(PRECONDITION_BS // bs, 1)
        sem = asyncio.Semaphore(8)

        async def check(lba: int, n: int) -> None:
            async with sem:
                self._check(await self.dev.read(lba, n), lba)

        work = [(lba + i, min(step, n - i)) for lba, n in self.gens.written_runs() for i in range(0, n, step)]
        await asyncio.gather(*(check(a, n) for a, n in work))

    async def run(self, start: Callable[[], Awaitable[None]] | None = None) -> WorkerResult:
        plan = self.plan
        if plan.precondition:
            await self.precondition()
        if self.emit:
            self.emit("ready", {"block_size": self.dev.block_size, "num_blocks": self.dev.num_blocks})
        if start is not None:
            await start()
        now = self._now()
        warm_end = now + plan.warmup
        end = warm_end + plan.duration
        soon = self._soon_ops()
        loops = ([asyncio.create_task(self._soon_lanes(end, *soon))] if soon is not None
                 else [asyncio.create_task(self._loop(end)) for _ in range(self.job.qd)])
        if plan.warmup > 0:
            await self.sleep(max(0.0, warm_end - self._now()))
        self.t0 = self._now()
        cpu0 = time.process_time()
        self.measuring = True
        if self.emit:
            self.emit("measuring", {})
        reporter = asyncio.create_task(self._report()) if self.emit else None
        try:
            await asyncio.gather(*loops)
        finally:
            for t in loops:
                t.cancel()
            if reporter:
                reporter.cancel()
        self.result.elapsed = self._now() - self.t0
        self.result.cpu = time.process_time() - cpu0
        self.measuring = False
        self._logs_out()
        if self.emit:
            self.emit("measured", {})
        if plan.verify:
            await self.verify_pass()
        return self.result

    async def _report(self) -> None:
        assert self.emit is not None
        while True:
            await self.sleep(PROGRESS_EVERY)
            self._logs_out()
            r = self.result
            self.emit("progress", {"ops": r.read.count + r.write.count, "bytes": r.read_bytes + r.write_bytes,
                                   "lat_total": r.read.total + r.write.total,
                                   "elapsed": self._now() - self.t0,
                                   "errors": r.io_errors + r.mismatches})
