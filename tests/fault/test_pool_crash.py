"""The write hole, for real: a child process writes to a RAID 5 / RAID 6 pool on file-backed members and is
killed with SIGKILL at a random moment; the parent reassembles the pool, the resync of the dirty regions runs,
a scrub finds no inconsistent stripe, and every write the child had acknowledged reads back, also after
members are then lost (so parity, not only data, is right).

The child writes concurrently (never two writes on one block at a time), prints `start` before and `ack` after
each write (flushed), and each block it writes carries its LBA and a generation number. A block must read back
as its last acknowledged generation or the one in flight after it. Rounds chain: the members lost in one
round's check come back stale in the next round's child, which rebuilds them while it writes, so kills also
land mid-rebuild.

    VSAN_POOL_CRASH_ROUNDS=50 VSAN_POOL_CRASH_SEED=7 .venv/bin/python -m pytest tests/fault/test_pool_crash.py
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openvsan.block import FaultDevice, FileDevice
from openvsan.pool.raid import Pool

ROUNDS = int(os.environ.get("VSAN_POOL_CRASH_ROUNDS", "4"))
SEED = int(os.environ.get("VSAN_POOL_CRASH_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
BS = 512
CHUNK = 4096
HEADER = 64 * 1024
ROWS = 48
SIZE = HEADER + ROWS * CHUNK

CHILD = r"""
import asyncio, random, struct, sys
from openvsan.block import FileDevice
from openvsan.pool.raid import Pool

paths, level, seed, create = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "create"

def block(lba, gen):
    return struct.pack("<QQ", lba, gen) * 32

async def main():
    devs = [FileDevice(p, size=SIZE, name=f"m{i}") for i, p in enumerate(paths)]
    if create:
        pool = await Pool.create(devs, level, CHUNK, data_offset=HEADER, bitmap_region=1,
                                 bitmap_idle_s=0.02, init="none")
    else:
        pool = await Pool.assemble(devs, bitmap_idle_s=0.02)
    rng = random.Random(seed)
    busy = set()
    gen = seed * 1000000

    async def writer():
        nonlocal gen
        while True:
            lba = rng.randrange(pool.num_blocks)
            count = min(rng.choice((1, 1, 2, 8, 24)), pool.num_blocks - lba)
            span = set(range(lba, lba + count))
            if span & busy:
                await asyncio.sleep(0)
                continue
            busy.update(span)
            gen += 1
            g = gen
            print("start", lba, count, g, flush=True)
            await pool.write(lba, b"".join(block(b, g) for b in range(lba, lba + count)))
            print("ack", lba, count, g, flush=True)
            busy.difference_update(span)

    print("ready", pool.status().state, flush=True)
    await asyncio.gather(*(writer() for _ in range(6)))

asyncio.run(main())
""".replace("SIZE", str(SIZE)).replace("CHUNK", str(CHUNK)).replace("HEADER", str(HEADER))


def parse(lines: list[str]) -> tuple[dict[int, int], dict[int, int]]:
    """(last acknowledged generation, generation in flight after it) per block."""
    acked: dict[int, int] = {}
    inflight: dict[int, int] = {}
    for line in lines:
        parts = line.split()
        if len(parts) != 4 or parts[0] not in ("start", "ack"):
            continue  # the line the kill cut short
        lba, count, gen = map(int, parts[1:])
        for b in range(lba, lba + count):
            if parts[0] == "start":
                inflight[b] = gen
            else:
                acked[b] = gen
                if inflight.get(b) == gen:
                    del inflight[b]
    return acked, inflight


async def verify(paths: list[Path], level: int, baseline: dict[int, bytes], acked: dict[int, int],
                 inflight: dict[int, int], rng: random.Random) -> tuple[dict[int, bytes], str]:
    devs = [FaultDevice(FileDevice(p, name=f"m{i}"), name=f"m{i}") for i, p in enumerate(paths)]
    pool = await Pool.assemble(devs)
    await pool.wait_idle()
    assert pool.status().state == "optimal", pool.status()
    report = await pool.scrub(repair=False)
    assert report.clean, f"inconsistent stripes after the resync: {report}"

    def check(data: bytes, when: str) -> dict[int, bytes]:
        seen = {}
        for b in range(pool.num_blocks):
            got = data[b * BS:(b + 1) * BS]
            ok = {baseline.get(b, bytes(BS))} if b not in acked else {struct.pack("<QQ", b, acked[b]) * 32}
            if b in inflight:
                ok.add(struct.pack("<QQ", b, inflight[b]) * 32)
            assert got in ok, f"{when}: block {b} holds {got[:16].hex()}, expected acked gen {acked.get(b)} " \
                              f"or in-flight gen {inflight.get(b)}"
            seen[b] = got
        return seen

    seen = check(bytes(await pool.read(0, pool.num_blocks)), "after resync")
    lost = rng.sample(range(len(devs)), {5: 1, 6: 2}[level])
    for m in lost:
        devs[m].fail_device()
    check(bytes(await pool.read(0, pool.num_blocks)), f"with members {lost} lost")
    await pool.close()  # the lost members stay recorded as failed: the next child rebuilds them
    return seen, f"scrub {report.checked} stripes clean, lost {lost}"


@pytest.mark.parametrize(("level", "n"), [(5, 4), (6, 5)])
def test_sigkill_mid_writes(tmp_path: Path, level: int, n: int) -> None:
    print(f"to run again: VSAN_POOL_CRASH_SEED={SEED} VSAN_POOL_CRASH_ROUNDS={ROUNDS}")  # shown on failure
    rng = random.Random(SEED + level)
    paths = [tmp_path / f"m{i}.img" for i in range(n)]
    baseline: dict[int, bytes] = {}
    log = []
    for rnd in range(ROUNDS):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, ",".join(map(str, paths)), str(level), str(rng.randrange(1, 10**6)),
             "create" if rnd == 0 else "assemble"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert child.stdout is not None
        first = child.stdout.readline()
        if not first.startswith("ready"):
            child.kill()
            raise AssertionError(f"round {rnd}: child did not start: {first!r} {child.communicate()[1][-2000:]}")
        time.sleep(rng.uniform(0.05, 0.6))
        child.send_signal(signal.SIGKILL)
        out, err = child.communicate(timeout=30)
        lines = out.splitlines()
        acked, inflight = parse(lines)
        assert "Traceback" not in err, err[-3000:]
        assert len(acked) > 5, f"round {rnd}: the child acknowledged almost nothing: {lines[:5]} {err[-2000:]}"
        seen, what = asyncio.run(verify(paths, level, baseline, acked, inflight, rng))
        baseline = seen
        log.append(f"round {rnd} ({first.split()[1]}): {sum(1 for x in lines if x.startswith('ack'))} acks, "
                   f"{len(inflight)} blocks in flight; {what}")
    print(f"seed {SEED}:", *log, sep="\n  ")
