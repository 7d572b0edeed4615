"""The worker: sequential streams stay in their slice, workers merge (--rate on the real clock:
tests/integration/test_bench_engine_timing.py)."""

from __future__ import annotations

from pathlib import Path

from openvsan.bench.engine import Plan, WorkerResult
from openvsan.bench.profiles import custom_job
from openvsan.bench.runner import run_in_process, run_processes
from openvsan.block import FaultDevice, RamDevice


def test_sequential_worker_slices_do_not_overlap() -> None:
    dev = FaultDevice(RamDevice(4096))
    seen: list[tuple[int, int]] = []
    real = dev.read

    async def spy(lba: int, blocks: int) -> object:
        seen.append((lba, blocks))
        return await real(lba, blocks)

    dev.read = spy  # type: ignore[method-assign,assignment]
    plan = Plan("ram", custom_job("read", "64k", qd=2), duration=0.2, index=1, workers=2)
    run_in_process(dev, plan)
    assert seen and all(2048 <= lba and lba + n <= 4096 for lba, n in seen)  # worker 1 of 2: the upper half
    assert seen[:3] == [(2048, 128), (2176, 128), (2304, 128)]


def test_processes_merge_their_results(tmp_path: Path) -> None:
    img = tmp_path / "d.img"
    img.write_bytes(bytes(8 << 20))
    plan = Plan(str(img), custom_job("randrw", "4k", threads=3, qd=2, mix=50), duration=0.5, verify=True)
    r = run_processes(plan)
    assert r.result.read.count > 0 and r.result.write.count > 0 and r.result.mismatches == 0
    assert r.bench_cpu_pct > 0
    w = WorkerResult.from_dict(r.result.to_dict())
    assert w.read.count == r.result.read.count and len(w.intervals) == len(r.result.intervals)
