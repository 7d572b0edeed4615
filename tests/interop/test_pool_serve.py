"""Pools in a real `vsan serve`, seen from the outside: iSCSI I/O with `vsan bench --verify` and our initiator,
and the pool run with `vsan pool` through the control socket.

For RAID 1, 10, 5 and 6 on file members: a member is failed during a verified random read/write run (no error
reaches the initiator), the pool reports degraded, a fresh file replaces the member and is rebuilt, then a
different member is failed and every byte is checked again, which can only pass if the rebuild was right.
Restarts: members listed in another order, a member file gone (degraded start, then rebuilt onto the blank
file), and a stale copy of a member put back (resynced, not trusted).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vsan_harness import VSAN, VsanServer, free_port, run

from openvsan.bench.verify import check_buffer

pytestmark = pytest.mark.interop

BS = 512
MiB = 1 << 20
BENCH_AREA = 4 * MiB  # `vsan bench --size`: the first 4 MiB
REF_A = 5 * MiB  # reference data written before a member is lost, and while the pool is degraded
REF_B = 7 * MiB
REF_LEN = MiB
MEMBERS = {"raid1": 2, "raid10": 4, "raid5": 4, "raid6": 4}


@dataclass
class PoolServer(VsanServer):
    """`vsan serve` with one pool of file members (d0..dN-1), volume vol0 on it as LUN 0, and `free` more file
    devices in the config that nothing uses (for `vsan pool replace`)."""

    level: str = "raid5"
    members: int = 4
    member_size: str = "16MiB"
    free: int = 1
    order: list[int] | None = None  # the members' order in the config (default d0, d1, ...)
    chunk: str = "16KiB"
    extra_pool: dict[str, Any] = field(default_factory=dict)
    member_dir: Path | None = None  # where the member files live (default the work dir; /dev/shm: in memory)

    def member_path(self, i: int) -> Path:
        return (self.member_dir or self.workdir) / f"d{i}.img"

    def write_config(self) -> None:
        lines = ["[node]", 'name = "pool-node"', ""]
        for i in range(self.members + self.free):
            lines += ["[[devices]]", f'name = "d{i}"', 'type = "file"', f"path = {json.dumps(str(self.member_path(i)))}",
                      f'size = "{self.member_size}"', ""]
        order = self.order or list(range(self.members))
        lines += ["[[pools]]", 'name = "pool0"', f'level = "{self.level}"',
                  f"members = {json.dumps([f'd{i}' for i in order])}", f'chunk = "{self.chunk}"']
        lines += [f"{k} = {json.dumps(v)}" for k, v in self.extra_pool.items()]
        lines += ["", "[[volumes]]", 'name = "vol0"', 'pool = "pool0"', "", "[iscsi]",
                  f'portals = ["127.0.0.1:{self.port}"]', "", "[[iscsi.targets]]", f"iqn = {json.dumps(self.iqn)}",
                  'luns = [{ lun = 0, volume = "vol0" }]']
        self.config.write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ vsan pool
    def pool(self, *args: object, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run([VSAN, "pool", *map(str, args), "--data-dir", self.data_dir], check=check, timeout=timeout)

    def status(self) -> dict[str, Any]:
        return json.loads(self.pool("status", "pool0", "--json").stdout)  # type: ignore[no-any-return]

    def wait_optimal(self, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st["state"] == "optimal" and st["resync_progress"] is None:
                return st
            if st["state"] == "failed" or time.monotonic() > deadline:
                pytest.fail(f"pool did not become optimal: {st}\n{self.log_tail()}", pytrace=False)
            time.sleep(0.2)

    # -------------------------------------------------------------- iSCSI I/O
    def write(self, offset: int, data: bytes, tmp: Path) -> None:
        f = tmp / f"w-{offset}.bin"
        f.write_bytes(data)
        run([VSAN, "initiator", "write", self.url(), offset // BS, "--in", f, "--fua"])

    def read(self, offset: int, length: int, tmp: Path) -> bytes:
        f = tmp / f"r-{offset}.bin"
        run([VSAN, "initiator", "read", self.url(), offset // BS, length // BS, "--out", f])
        return f.read_bytes()

    def bench(self, *args: object, seconds: float, seed: int) -> subprocess.Popen[str]:
        argv = [str(VSAN), "bench", self.url(), "--rw", "randrw", "--mix", "30", "--bs", "4k", "--qd", "8",
                "--duration", str(seconds), "--warmup", "0", "--verify", "--size", f"{BENCH_AREA // MiB}m",
                "--seed", str(seed), *map(str, args)]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(bench: subprocess.Popen[str], what: str) -> None:
    out, _ = bench.communicate(timeout=120)
    if bench.returncode != 0:
        pytest.fail(f"{what}: vsan bench --verify exit {bench.returncode}:\n{out}", pytrace=False)


def check_bench_area(server: PoolServer, tmp: Path) -> None:
    """Every block of the bench area holds zeroes or the verify pattern of its own LBA (vsan bench's format)."""
    data = server.read(0, BENCH_AREA, tmp)
    bad = check_buffer(data, 0, BS, None)
    assert not bad, [m.message for m in bad[:5]]


@pytest.fixture
def pools(tmp_path: Path) -> Any:
    servers: list[PoolServer] = []

    def make(**kw: Any) -> PoolServer:
        s = PoolServer(tmp_path / f"vsan{len(servers)}", free_port(), **kw)
        servers.append(s)
        return s

    yield make
    problems = []
    for s in servers:
        try:
            s.cleanup()
        except BaseException as e:  # noqa: BLE001  (pytest.fail raises an OutcomeException)
            problems.append(f"{s.workdir}: {e}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.parametrize("level", ["raid1", "raid10", "raid5", "raid6"])
def test_fail_replace_rebuild_fail_another(pools: Any, tmp_path: Path, level: str) -> None:
    rng = random.Random(level)
    s = pools(level=level, members=MEMBERS[level])
    s.start()
    assert s.status()["state"] == "optimal"
    ref_a = rng.randbytes(REF_LEN)
    s.write(REF_A, ref_a, tmp_path)

    # member 1 fails while a verified read/write run goes on: the initiator sees nothing
    bench = s.bench(seconds=3, seed=1)
    time.sleep(1.2)
    s.pool("fail", "pool0", "1")
    finish(bench, "member failed mid-run")
    st = s.status()
    assert st["state"] == "degraded", st
    assert [m["state"] for m in st["members"]][:2] == ["active", "failed"]
    assert "degraded" in s.pool("list").stdout
    ref_b = rng.randbytes(REF_LEN)
    s.write(REF_B, ref_b, tmp_path)  # written while degraded: lands on the rebuilt member only by the rebuild

    # a fresh file replaces it and is rebuilt while the run goes on
    new = tmp_path / "fresh.img"
    bench = s.bench(seconds=2, seed=2)
    out = s.pool("replace", "pool0", "1", f"file:{new}:16MiB").stdout
    assert "member 1" in out
    finish(bench, "during the rebuild")
    st = s.wait_optimal()
    assert st["members"][1]["device"] == f"file:{new}:16MiB" and new.stat().st_size == 16 * MiB

    # lose a different member (RAID 6: two): what it held now comes from the rebuilt one
    s.pool("fail", "pool0", "0")
    if level == "raid6":
        s.pool("fail", "pool0", "2")
    assert s.status()["state"] == "degraded"
    assert s.read(REF_A, REF_LEN, tmp_path) == ref_a
    assert s.read(REF_B, REF_LEN, tmp_path) == ref_b
    check_bench_area(s, tmp_path)
    finish(s.bench(seconds=1, seed=3), "after the second failure")
    s.stop()


@pytest.mark.parametrize("level", ["raid5", "raid6"])
def test_restarts_order_missing_stale(pools: Any, tmp_path: Path, level: str) -> None:
    rng = random.Random(f"restart-{level}")
    s = pools(level=level, members=4, free=0)
    s.start()
    ref_a = rng.randbytes(REF_LEN)
    s.write(REF_A, ref_a, tmp_path)
    finish(s.bench(seconds=1, seed=4), "first run")
    s.stop()
    # a clean stop leaves every member marked clean, at one event, for `vsan pool inspect` to see
    rows = json.loads(run([VSAN, "pool", "inspect", "--json", *(s.member_path(i) for i in range(4))]).stdout)
    assert [r["index"] for r in rows] == [0, 1, 2, 3] and all(r["clean"] for r in rows), rows
    assert len({r["event"] for r in rows}) == 1 and len({r["pool_uuid"] for r in rows}) == 1

    # the members listed in another order: the superblocks say who is who
    s.order = [2, 0, 3, 1]
    s.write_config()
    s.start()
    st = s.status()
    assert st["state"] == "optimal" and [m["device"] for m in st["members"]] == ["d0", "d1", "d2", "d3"]
    assert s.read(REF_A, REF_LEN, tmp_path) == ref_a
    s.stop()

    # a member's file is gone: the pool starts degraded (the blank file made in its place is not trusted)
    s.member_path(3).unlink()
    s.start()
    st = s.status()
    assert st["state"] == "degraded" and st["members"][3]["state"] == "missing", st
    assert "d3 (members[2]) carries no superblock" in s.log_text()
    assert s.read(REF_A, REF_LEN, tmp_path) == ref_a
    ref_b = rng.randbytes(REF_LEN)
    s.write(REF_B, ref_b, tmp_path)
    s.pool("replace", "pool0", "3", "d3")
    s.wait_optimal()
    s.stop()

    # a stale member: d1 copied aside, more writes, then the copy put back
    stale = tmp_path / "d1.stale"
    shutil.copyfile(s.member_path(1), stale)
    s.start()
    ref_c = rng.randbytes(REF_LEN)
    s.write(REF_A, ref_c, tmp_path)
    finish(s.bench(seconds=1, seed=5), "before the stale member is put back")
    s.stop()
    os.replace(stale, s.member_path(1))
    s.start()
    assert "d1 (slot 1) is stale" in s.log_text()
    assert s.status()["members"][1]["state"] in ("rebuilding", "active")
    s.wait_optimal()
    # d1 was rebuilt, not trusted: with two others gone (RAID 5: one) the data comes from it
    s.pool("fail", "pool0", "0")
    if level == "raid6":
        s.pool("fail", "pool0", "3")
    assert s.read(REF_A, REF_LEN, tmp_path) == ref_c
    assert s.read(REF_B, REF_LEN, tmp_path) == ref_b
    check_bench_area(s, tmp_path)
    s.stop()


def test_serve_refuses_beyond_tolerance(pools: Any, tmp_path: Path) -> None:
    s = pools(level="raid5", members=3, free=0)
    s.start()
    s.stop()
    s.member_path(0).unlink()
    s.member_path(2).unlink()
    p = run(s.command(), check=False, timeout=60)
    assert p.returncode == 1, p.stdout
    errors = [x for x in p.stdout.splitlines() if x.startswith("vsan: ")]
    assert len(errors) == 1 and "tolerates 1 lost (refusing to start)" in errors[0], p.stdout
    assert "Traceback" not in p.stdout
