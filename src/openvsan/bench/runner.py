"""Run a job against a target: one worker per thread, in this process (one thread) or one process each.

Workers report over a queue: "ready" (connected, preconditioned), "measuring"/"measured" (the timed
phase's edges, where the target's CPU is sampled), "progress" (for the live line) and "done" (their
mergeable result). All workers start together when every one is ready, so connection setup and
preconditioning are never timed. run_in_process passes its worker's `clock` and `sleep` through (engine.py):
the unit tests simulate time.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from openvsan.bench.engine import Plan, Sleep, Worker, WorkerResult
from openvsan.bench.profiles import Job
from openvsan.bench.target import open_target, redact
from openvsan.block.device import BlockDevice
from openvsan.block.errors import BlockError
from openvsan.malloc import keep_large_buffers
from openvsan.procstat import tree_cpu_seconds


class BenchError(RuntimeError):
    pass


@dataclass
class RunResult:
    target: str
    job: Job
    result: WorkerResult
    bench_cpu_pct: float
    target_cpu_pct: float | None
    round: int = 0


@dataclass
class Progress:
    elapsed: float
    ops: int
    bytes: int
    lat_mean_ns: float
    errors: int


ProgressFn = Callable[[Progress], None]


class Collector:
    def __init__(self, workers: int, target_pid: int | None, on_progress: ProgressFn | None) -> None:
        self.workers = workers
        self.target_pid = target_pid
        self.on_progress = on_progress
        self.ready = 0
        self.done: list[WorkerResult] = []
        self.progress: dict[int, dict[str, Any]] = {}
        self.errors: list[str] = []
        self.t_cpu: list[tuple[float, float]] = []  # (wall, target cpu seconds) at measuring/measured
        self.measuring = self.measured = 0

    def _sample_target(self) -> None:
        if self.target_pid is not None:
            c = tree_cpu_seconds(self.target_pid)   # with the worker processes of a vsan serve
            if c is not None:
                self.t_cpu.append((time.perf_counter(), c))

    def handle(self, index: int, kind: str, payload: dict[str, Any]) -> None:
        if kind == "ready":
            self.ready += 1
        elif kind == "measuring":
            self.measuring += 1
            if self.measuring == 1:
                self._sample_target()
        elif kind == "measured":
            self.measured += 1
            if self.measured == self.workers:
                self._sample_target()
        elif kind == "progress":
            self.progress[index] = payload
            if self.on_progress:
                ps = self.progress.values()
                ops = sum(p["ops"] for p in ps)
                self.on_progress(Progress(max(p["elapsed"] for p in ps), ops, sum(p["bytes"] for p in ps),
                                          sum(p["lat_total"] for p in ps) / ops if ops else 0.0,
                                          sum(p["errors"] for p in ps)))
        elif kind == "done":
            self.done.append(WorkerResult.from_dict(payload["result"]))
        elif kind == "error":
            self.errors.append(payload["message"])

    def target_cpu_pct(self) -> float | None:
        if len(self.t_cpu) < 2:
            return None
        (w0, c0), (w1, c1) = self.t_cpu[0], self.t_cpu[-1]
        return 100.0 * (c1 - c0) / (w1 - w0) if w1 > w0 else None


async def _serve_worker(plan: Plan, emit: Callable[[str, dict[str, Any]], None],
                        start: Callable[[], Any] | None, dev: BlockDevice | None = None, *,
                        clock: Callable[[], int] = time.perf_counter_ns, sleep: Sleep = asyncio.sleep) -> WorkerResult:
    own = dev is None
    if dev is None:
        dev = await open_target(plan.target, qd=plan.job.qd, size=plan.size, **plan.options)
    try:
        return await Worker(dev, plan, emit, clock=clock, sleep=sleep).run(start)
    finally:
        if own:
            await dev.close()


def _loop_runner() -> Any:
    """uvloop.run where installed (the client must not be the slower side of a benchmark), else asyncio.run;
    glibc's malloc keeps large buffers (malloc.py): a 1 MiB read's buffer is not faulted in anew each time."""
    keep_large_buffers()
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def _process_main(plan: Plan, q: Any, go: Any) -> None:
    """A worker process: its own event loop (uvloop where installed) and its own connection(s)."""
    def emit(kind: str, payload: dict[str, Any]) -> None:
        q.put((plan.index, kind, payload))

    async def start() -> None:
        await asyncio.get_running_loop().run_in_executor(None, go.wait)

    try:
        res = _loop_runner()(_serve_worker(plan, emit, start))
        emit("done", {"result": res.to_dict()})
    except (OSError, BlockError, ValueError) as e:  # a target that cannot be reached or used: one line
        emit("error", {"message": f"worker {plan.index}: {e}"})
    except BaseException as e:  # noqa: BLE001  (a bug: reported to the parent, with where, to fail the run)
        emit("error", {"message": f"worker {plan.index}: {type(e).__name__}: {e}\n{traceback.format_exc()}"})


def run_in_process(dev: BlockDevice | None, plan: Plan, *, target_pid: int | None = None,
                   on_progress: ProgressFn | None = None, clock: Callable[[], int] = time.perf_counter_ns,
                   sleep: Sleep = asyncio.sleep) -> RunResult:
    """One worker in this process (threads = 1), on `dev` if given (tests pass a FaultDevice) else the target."""
    col = Collector(1, target_pid, on_progress)
    res = _loop_runner()(_serve_worker(plan, lambda k, p: col.handle(0, k, p), None, dev, clock=clock, sleep=sleep))
    return _finish(plan, col, [res])


def run_processes(plan: Plan, *, target_pid: int | None = None, on_progress: ProgressFn | None = None,
                  ready_timeout: float = 120.0) -> RunResult:
    n = plan.job.threads
    ctx = mp.get_context("fork")  # the parent holds no loop or connection here, so fork is safe and quick
    q = ctx.Queue()
    go = ctx.Event()
    col = Collector(n, target_pid, on_progress)
    procs = [ctx.Process(target=_process_main, args=(replace(plan, index=i, workers=n), q, go), daemon=True)
             for i in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + ready_timeout
    try:
        while len(col.done) + len(col.errors) < n:
            if col.ready == n and not go.is_set():
                go.set()
                deadline = time.monotonic() + plan.warmup + plan.duration + ready_timeout
            if col.errors and not go.is_set():
                break
            try:
                index, kind, payload = q.get(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise BenchError(f"workers did not finish ({len(col.done)} of {n} done)") from None
                if not any(p.is_alive() for p in procs) and q.empty():
                    break
                continue
            col.handle(index, kind, payload)
    finally:
        go.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if col.errors:
        raise BenchError(col.errors[0])
    if len(col.done) < n:
        raise BenchError(f"{n - len(col.done)} worker(s) died without a result")
    return _finish(plan, col, col.done)


def _finish(plan: Plan, col: Collector, results: list[WorkerResult]) -> RunResult:
    total = WorkerResult()
    for r in results:
        total.merge(r)
    elapsed = total.elapsed or plan.duration
    return RunResult(redact(plan.target), plan.job, total, 100.0 * total.cpu / elapsed, col.target_cpu_pct())


def run(plan: Plan, *, target_pid: int | None = None, on_progress: ProgressFn | None = None) -> RunResult:
    if plan.job.threads > 1:
        return run_processes(plan, target_pid=target_pid, on_progress=on_progress)
    return run_in_process(None, plan, target_pid=target_pid, on_progress=on_progress)
