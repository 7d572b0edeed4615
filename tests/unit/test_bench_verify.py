"""--verify: the block pattern, and the engine catching a corrupted block through a FaultDevice (runs on simulated
time: FakeClock, 1 ms a request)."""

from __future__ import annotations

import asyncio

from fake_clock import FakeClock, Slow

from openvsan.bench.engine import Plan
from openvsan.bench.profiles import custom_job
from openvsan.bench.runner import RunResult, run_in_process
from openvsan.bench.verify import Generations, check_buffer, make_block, make_buffer
from openvsan.block import FaultDevice, RamDevice


def simulated(dev: object, plan: Plan) -> RunResult:
    clock = FakeClock()
    return run_in_process(Slow(dev, clock, 0.001), plan, clock=clock.ns, sleep=clock.sleep)  # type: ignore[arg-type]


def test_pattern_is_self_describing() -> None:
    buf = make_buffer(10, 4, 3, 512)
    assert len(buf) == 2048 and buf[:8] == b"OVSBENCH"
    assert check_buffer(buf, 10, 512, None) == []
    gens = Generations(0, 64)
    gens.set(10, 4, 3)
    assert check_buffer(buf, 10, 512, gens) == []
    assert gens.written_runs() == [(10, 4)]


def test_mismatch_kinds_name_the_lba() -> None:
    gens = Generations(0, 64)
    gens.set(20, 2, 5)
    # misdirected: LBA 21 holds the block written for LBA 40
    (m,) = check_buffer(make_block(20, 5, 512) + make_block(40, 5, 512), 20, 512, gens)
    assert (m.lba, m.kind) == (21, "lba") and "LBA 40" in m.message
    # lost write: an older generation, intact
    (m,) = check_buffer(make_block(20, 4, 512) + make_block(21, 5, 512), 20, 512, gens)
    assert (m.lba, m.kind) == (20, "generation")
    # one flipped bit anywhere, even in the header's LBA field
    for byte in (9, 100, 511):
        bad = bytearray(make_buffer(20, 2, 5, 512))
        bad[512 + byte] ^= 4
        (m,) = check_buffer(bad, 20, 512, gens)
        assert (m.lba, m.kind) == (21, "corrupt") and f"byte {byte}" in m.message
    # zeroes: fine where this run never wrote, a lost write where it did
    assert check_buffer(bytes(512), 30, 512, gens) == []
    (m,) = check_buffer(bytes(1024), 20, 512, gens)[:1]
    assert m.kind == "no-pattern"


def test_verify_catches_a_corrupted_block_through_a_fault_device() -> None:
    dev = FaultDevice(RamDevice(2048))  # 1 MiB
    write = Plan("ram", custom_job("randrw", "4k", qd=8, mix=50), duration=0.3, verify=True, precondition=True)
    res = simulated(dev, write).result
    assert res.mismatches == 0 and res.io_errors == 0 and res.write.count > 0

    asyncio.run(dev.corrupt(777, bit=1234))
    read = Plan("ram", custom_job("randread", "4k", qd=4), duration=0.3, verify=True)
    res = simulated(dev, read).result
    assert res.mismatches >= 1
    assert [p["lba"] for p in res.problems] == [777]  # listed once however often it is read
    assert res.problems[0]["kind"] == "corrupt" and "byte 154" in res.problems[0]["message"]


def test_final_pass_reads_back_everything_written() -> None:
    # a write-only run never reads during the run; the read-back pass still finds the bad block
    dev = FaultDevice(RamDevice(1024))
    plan = Plan("ram", custom_job("write", "64k", qd=2), duration=0.2, verify=True)
    real_write = dev.write
    hit = []

    async def corrupting_write(lba: int, data: object, *, fua: bool = False) -> None:
        await real_write(lba, data, fua=fua)  # type: ignore[arg-type]
        if lba <= 300 < lba + 128:  # every time: the sequential stream wraps and rewrites it
            hit.append(lba)
            await dev.corrupt(300)

    dev.write = corrupting_write  # type: ignore[method-assign]
    res = simulated(dev, plan).result
    assert hit and res.read.count == 0
    assert 300 in [p["lba"] for p in res.problems]


def test_generations_of_a_worker_slice() -> None:
    g = Generations(100, 10)
    g.set(100, 2, 1)
    g.set(105, 5, 2)
    assert g.get(101) == 1 and g.get(102) == 0 and g.get(109) == 2
    assert g.written_runs() == [(100, 2), (105, 5)]
