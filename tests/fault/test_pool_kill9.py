"""kill -9 of a `vsan serve` whose volume is a RAID 5 or RAID 6 pool on file members, while a writer keeps
stripe updates in flight through iSCSI; after each restart the pool's resync runs, `vsan pool scrub
--no-repair` reports no inconsistent stripe, and every acknowledged write reads back.

The writer (a child process, openvsan's iSCSI initiator) runs several workers, each in its own region of the
volume so no two writes in flight overlap; each write (1 to 128 blocks, so partial stripes, whole stripes and
writes across stripes) carries its LBA and a generation in every block (`vsan bench --verify`'s pattern), is
sent with FUA, and is printed `start` before and `ack` after. A block must then hold its last acknowledged
generation, or the one in flight over it when the target died. Rounds chain on the same members, and the last
round also fails a member and reads everything again (so parity, not only data, is right).

    VSAN_POOL_KILL9_ROUNDS=20 VSAN_POOL_KILL9_SEED=7 .venv/bin/python -m pytest tests/fault/test_pool_kill9.py
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_pool_serve import PoolServer
from vsan_harness import free_port

from openvsan.bench.verify import make_block
from openvsan.block.file import MEMORY_FS, fs_type
from openvsan.initiator import open_url

pytestmark = pytest.mark.interop

ROUNDS = int(os.environ.get("VSAN_POOL_KILL9_ROUNDS", "3"))
SEED = int(os.environ.get("VSAN_POOL_KILL9_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
BS = 512
WORKERS = 32  # writes in flight when the target dies: enough that most kills tear a stripe
REGION = 512  # blocks per worker (256 KiB)
AREA = WORKERS * REGION

WRITER = r"""
import asyncio, random, sys
from openvsan.bench.verify import make_buffer
from openvsan.initiator import open_url

url, seed, gen0, workers, region = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

async def main():
    dev = await open_url(url)
    rng = random.Random(seed)
    gen = gen0
    print("ready", flush=True)

    async def worker(w):
        nonlocal gen
        while True:
            n = rng.choice((1, 3, 8, 16, 32, 33, 96, 128))
            lba = w * region + rng.randrange(region - n + 1)
            gen += 1
            g = gen
            print(f"start {lba} {n} {g}", flush=True)
            await dev.write(lba, make_buffer(lba, n, g, 512), fua=True)
            print(f"ack {lba} {n} {g}", flush=True)

    await asyncio.gather(*(worker(w) for w in range(workers)))

asyncio.run(main())
"""


class Writer:
    def __init__(self, url: str, seed: int, gen0: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, url, str(seed), str(gen0), str(WORKERS),
                                      str(REGION)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.acks = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("ack "):
                self.acks += 1

    def wait_acks(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.acks < n:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail("the writer stopped before writing:\n" + "\n".join(self.lines[-30:]), pytrace=False)
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(10)


class Model:
    """Per block: the generation last acknowledged (0: never written, reads zeroes), and the generations of
    writes in flight over it when the target died (either may be what it holds)."""

    def __init__(self) -> None:
        self.acked = [0] * AREA
        self.maybe: list[set[int]] = [set() for _ in range(AREA)]

    def replay(self, lines: list[str]) -> tuple[int, int]:
        started: dict[int, tuple[int, int]] = {}
        acks = 0
        for line in lines:
            kind, *rest = line.split()
            if kind not in ("start", "ack"):
                continue
            lba, n, g = map(int, rest)
            if kind == "start":
                started[g] = (lba, n)
            else:
                started.pop(g)
                acks += 1
                for b in range(lba, lba + n):
                    self.acked[b] = g
                    self.maybe[b].clear()  # one writer per region: nothing older can still land
        for g, (lba, n) in started.items():
            for b in range(lba, lba + n):
                self.maybe[b].add(g)
        return acks, len(started)

    def check(self, data: bytes) -> None:
        zero = bytes(BS)
        bad: list[str] = []
        for b in range(AREA):
            blk = data[b * BS:(b + 1) * BS]
            allowed = {self.acked[b], *self.maybe[b]}
            got = next((g for g in allowed if blk == (make_block(b, g, BS) if g else zero)), None)
            if got is None:
                bad.append(f"LBA {b}: holds neither generation {sorted(allowed)} (first bytes {blk[:32].hex()})")
            else:
                # what it holds is now its durable value
                self.acked[b] = got
                self.maybe[b].clear()
        assert not bad, f"{len(bad)} blocks lost an acknowledged write: {bad[:8]}"


async def read_area(url: str) -> bytes:
    dev = await open_url(url)
    try:
        return bytes(await dev.read(0, AREA))
    finally:
        await dev.close()


@pytest.fixture
def server(tmp_path: Path) -> Any:
    made: list[PoolServer] = []

    def make(**kw: Any) -> PoolServer:
        s = PoolServer(tmp_path / f"vsan{len(made)}", free_port(), **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.cleanup()


@pytest.fixture
def shm_dir() -> Any:
    """A directory in memory (tmpfs) that outlives the killed process, as a disk would."""
    d = Path(tempfile.mkdtemp(prefix="ovsan-kill9-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
@pytest.mark.parametrize("level", ["raid5", "raid6"])
def test_kill9_mid_stripe_writes(server: Any, tmp_path: Path, shm_dir: Path, level: str, where: str) -> None:
    """On members on the disk, writes take the pool's normal path; on members in memory (tmpfs) the small
    ones take its fast path (write_now, a whole stripe update within one turn of the loop)."""
    rng = random.Random(f"{SEED}-{level}-{where}")
    s: PoolServer = server(level=level, members=5 if level == "raid6" else 4, free=0, chunk="8KiB",
                           member_dir=shm_dir if where == "tmpfs" else None)
    if where == "tmpfs":
        s.member_path(0).touch()
        assert fs_type(os.stat(s.member_path(0)).st_dev) in MEMORY_FS, "/dev/shm is not a memory file system"
    model = Model()
    log: list[dict[str, Any]] = []
    record = tmp_path / "kill9-rounds.json"
    s.start()
    for rnd in range(ROUNDS):
        info: dict[str, Any] = {"round": rnd, "seed": SEED, "level": level}
        log.append(info)
        writer = Writer(s.url(), rng.randrange(2**31), gen0=(rnd + 1) * 10_000_000)
        writer.wait_acks(rng.randrange(5, 60))
        delay = rng.uniform(0.0, 0.8)
        time.sleep(delay)
        s.kill9()
        time.sleep(0.2)  # answers already on the wire reach the writer
        writer.kill()
        info["kill_after_s"] = round(delay, 3)
        info["acked"], info["in_flight"] = model.replay(writer.lines)
        record.write_text(json.dumps(log, indent=1))
        assert info["in_flight"] <= WORKERS, writer.lines[-20:]

        s.start()
        st = s.wait_optimal(timeout=60)  # the dirty regions are resynced first
        scrub = json.loads(s.pool("scrub", "pool0", "--no-repair", "--json", check=False).stdout)
        info["scrub"] = {k: scrub[k] for k in ("checked", "mismatches", "unrepairable", "skipped")}
        record.write_text(json.dumps(log, indent=1))
        assert scrub["mismatches"] == 0 and scrub["unrepairable"] == 0 and scrub["skipped"] == 0, (
            f"round {rnd} (seed {SEED}, {record}): scrub after the crash: {scrub}")
        assert scrub["checked"] == scrub["stripes"] > 0
        model.check(asyncio.run(read_area(s.url())))
        assert st["state"] == "optimal"

    # the parity is right as well as the data: lose members and read it all again
    s.pool("fail", "pool0", str(rng.randrange(2)))
    if level == "raid6":
        s.pool("fail", "pool0", "3")
    model.check(asyncio.run(read_area(s.url())))
    s.stop()
