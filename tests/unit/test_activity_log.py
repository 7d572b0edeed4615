"""A primary's activity log (replication/activity.py): what enters and leaves it, its group commit and hot
path, and that a crash at any point leaves a log that covers every region with a write in flight."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from openvsan.replication.activity import ActivityLog, ActivityLogError, LogFile, decode, encode, record_size

REGIONS = 64
REGION = 1 << 20
REC = record_size(1024)


class Torn(OSError):
    pass


class Writer:
    """The real writer, with a record of its calls (offsets; None: the whole file), and writes to tear: such a
    call writes half of its data (a whole-file one only to a temporary file) and raises, as a crash would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.real = LogFile(path)
        self.calls: list[int | None] = []
        self.tear: set[int] = set()          # indices of calls to tear

    def __call__(self, offset: int | None, data: bytes) -> None:
        self.calls.append(offset)
        if len(self.calls) - 1 in self.tear:
            tear(self.path, offset, data)
            raise Torn("torn write")
        self.real(offset, data)


def tear(path: Path, offset: int | None, data: bytes) -> None:
    if offset is None:
        path.with_name(f".{path.name}.torn.tmp").write_bytes(data[:len(data) // 2])
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data[:len(data) // 2], offset)
    finally:
        os.close(fd)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def reload(path: Path, regions: int = REGIONS, region_size: int = REGION, slots: int = 1024) -> set[int] | None:
    """What a restarted primary reads."""
    return ActivityLog(path, regions, region_size, slots=slots).load()


def test_enter_leave_and_eviction_of_the_least_recently_entered_idle_region(tmp_path: Path) -> None:
    async def go() -> None:
        al = ActivityLog(tmp_path / "v.al", REGIONS, REGION, slots=3)
        assert al.load() == set()
        for r in (0, 1, 2):
            await al.enter(range(r, r + 1))
            al.leave(range(r, r + 1))
        await al.enter(range(1))                        # in the log: only recency changes
        al.leave(range(1))
        await al.enter(range(3, 4))                        # full: 1 is the least recently entered
        assert al.hot() == {0, 2, 3}
        al.leave(range(3, 4))
        await al.enter(range(2, 3))                        # 2 in flight: not evictable
        await al.enter(range(4, 5))
        assert al.hot() == {2, 3, 4}                       # 0 went, not 2
        await al.enter(range(5, 6))
        assert al.hot() == {2, 4, 5}
        assert reload(al.path, slots=3) == {2, 4, 5}
        assert al.stats() == {"slots": 3, "used": 3, "updates": 6, "waits": 0, "waiting": 0, "in_flight": 3,
                              "pinned": 0}
        al.leave(range(2, 3))
        with pytest.raises(ValueError, match="region 2 has no write in flight"):
            al.leave(range(2, 3))
        await al.close()
    run(go())


def test_enter_waits_for_a_leave_when_every_slot_has_a_write_in_flight(tmp_path: Path) -> None:
    async def go() -> None:
        al = ActivityLog(tmp_path / "v.al", REGIONS, REGION, slots=2)
        al.load()
        await al.enter(range(2))
        waiting = asyncio.create_task(al.enter(range(7, 8)))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done() and al.stats()["waits"] == 1 and al.stats()["waiting"] == 1
        assert al.hot() == {0, 1}
        al.leave(range(1, 2))
        await waiting
        assert al.hot() == {0, 7} and reload(al.path, slots=2) == {0, 7}
        with pytest.raises(ValueError, match="3 regions entered at once; the log has 2 slots"):
            await al.enter(range(10, 13))
        await al.close()
    run(go())


def test_concurrent_enters_of_new_regions_share_one_update(tmp_path: Path) -> None:
    async def go() -> None:
        w = Writer(tmp_path / "v.al")
        al = ActivityLog(w.path, REGIONS, REGION, write=w)
        al.load()
        await asyncio.gather(*(al.enter(range(r, r + 2)) for r in range(0, 16, 2)))
        assert al.stats()["updates"] == 1 and w.calls == [None]        # the first update makes the file
        await asyncio.gather(*(al.enter(range(r, r + 1)) for r in range(20, 28)))
        await al.idle()
        # one commit (over the copy without the last record), then the other copy, as nothing waits
        assert al.stats()["updates"] == 2 and w.calls == [None, REC, 0]
        assert reload(w.path) == set(range(16)) | set(range(20, 28))
    run(go())


def test_an_enter_of_regions_already_in_the_log_does_no_io_and_does_not_yield(tmp_path: Path) -> None:
    async def go() -> None:
        w = Writer(tmp_path / "v.al")
        al = ActivityLog(w.path, REGIONS, REGION, write=w)
        al.load()
        await al.enter(range(3, 6))
        await al.idle()
        calls = list(w.calls)
        step = al.enter(range(4, 6))
        with pytest.raises(StopIteration):                 # done at the first step: no suspension at all
            step.send(None)
        assert w.calls == calls and al.stats()["in_flight"] == 3
        al.leave(range(4, 6))
        al.leave(range(3, 6))
        assert al.stats()["in_flight"] == 0
    run(go())


def test_an_enter_joins_an_update_in_progress_that_holds_its_regions(tmp_path: Path) -> None:
    async def go() -> None:
        gate = threading.Event()
        real = LogFile(tmp_path / "v.al")

        def slow(offset: int | None, data: bytes) -> None:
            gate.wait()
            real(offset, data)

        al = ActivityLog(real.path, REGIONS, REGION, write=slow)
        al.load()
        first = asyncio.create_task(al.enter(range(1)))
        await asyncio.sleep(0)
        second = asyncio.create_task(al.enter(range(1)))      # region 0 is in the log, but not on disk
        try:
            for _ in range(5):
                await asyncio.sleep(0)
            assert not second.done()
        finally:
            gate.set()
        await asyncio.gather(first, second)
        assert al.stats()["updates"] == 1 and al.stats()["in_flight"] == 1
    run(go())


def test_a_previous_runs_hot_set_round_trips_and_stays_until_resynced(tmp_path: Path) -> None:
    async def go() -> None:
        path = tmp_path / "v.al"
        al = ActivityLog(path, REGIONS, REGION, slots=4)
        al.load()
        for r in (5, 9, 2):
            await al.enter(range(r, r + 1))
        al.leave(range(9, 10))
        await al.close()
        raw = path.read_bytes()
        assert decode(raw[:record_size(4)])[0] == [5, 9, 2]          # least recently entered first
        # a crash; the next run
        again = ActivityLog(path, REGIONS, REGION, slots=4)
        assert again.load() == {2, 5, 9} and again.stats()["pinned"] == 3
        with pytest.raises(RuntimeError, match="once, before enter"):
            again.load()
        await again.enter(range(30, 31))                  # the fourth slot
        blocked = asyncio.create_task(again.enter(range(31, 32)))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not blocked.done()                         # the hot set is pinned: not evicted before its resync
        assert reload(path, slots=4) == {2, 5, 9, 30}
        again.release([5])                                # resynced
        await blocked
        assert reload(path, slots=4) == {2, 9, 30, 31}
        await again.clear()                               # the rest resynced; 30 and 31 are in flight
        assert again.hot() == {30, 31} and reload(path, slots=4) == {30, 31}
        await again.close()
    run(go())


def test_what_is_not_trusted(tmp_path: Path) -> None:
    async def go() -> None:
        path = tmp_path / "v.al"
        assert reload(path) == set()                      # no file: nothing was in flight
        al = ActivityLog(path, REGIONS, REGION)
        al.load()
        await al.enter(range(7, 9))
        await al.close()
    run(go())
    path = tmp_path / "v.al"
    good = path.read_bytes()
    assert len(good) == 2 * REC and reload(path) == {7, 8}

    def flip(raw: bytes, at: int) -> bytes:
        return raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1:]

    path.write_bytes(flip(good, 50))                      # one copy rotten: the other one
    assert reload(path) == {7, 8}
    path.write_bytes(flip(flip(good, 50), REC + 50))      # both: a full copy
    assert reload(path) is None
    path.write_bytes(flip(flip(good, 0), REC))            # bad magic in both
    assert reload(path) is None
    path.write_bytes(good[:-1])                           # truncated: not a size this log ever has
    assert reload(path) is None
    path.write_bytes(good)
    assert reload(path, regions=REGIONS + 1) is None      # another volume's geometry
    assert reload(path, region_size=REGION * 2) is None
    assert reload(path, slots=1000) is None               # same file size, other slots
    path.unlink()
    path.mkdir()
    assert reload(path) is None                           # unreadable

    rec = encode([1, 2], 4, 512, 8, generation=3)
    assert decode(rec) == ([1, 2], (4, 512, 8), 3)
    for bad, why in ((rec[:10], "shorter than the header"), (b"X" + rec[1:], "bad magic"),
                     (flip(rec, len(rec) - 6), "checksum"), (rec[:-1], "regions in 8 slots"),
                     (encode([1, 1], 4, 512, 8, 3), "listed twice"), (encode([4], 4, 512, 8, 3), "outside")):
        with pytest.raises(ActivityLogError, match=why):
            decode(bad)


def test_a_torn_update_leaves_the_previous_log_and_the_next_one_rewrites_the_torn_copy(tmp_path: Path) -> None:
    async def go() -> None:
        w = Writer(tmp_path / "v.al")
        al = ActivityLog(w.path, REGIONS, REGION, write=w)
        al.load()
        w.tear = {0}
        with pytest.raises(OSError, match="update failed: torn write"):
            await al.enter(range(1, 2))                   # the first update (whole file) dies
        assert reload(w.path) == set() and al.stats()["in_flight"] == 0
        await al.enter(range(1, 2))                       # calls 1 (the file)
        await al.idle()
        assert w.calls == [None, None]
        w.tear = {2}                                      # the commit over copy 1
        with pytest.raises(OSError, match="torn"):
            await al.enter(range(2, 3))
        await al.idle()
        assert w.calls[2] == REC and reload(w.path) == {1}
        w.tear = {3}                                      # the next commit goes to the torn copy again
        with pytest.raises(OSError, match="torn"):
            await al.enter(range(3, 4))
        await al.idle()
        assert w.calls[3] == REC and reload(w.path) == {1}
        w.tear = {5}                                      # its commit lands; the second copy tears
        await al.enter(range(4, 5))
        await al.idle()
        assert w.calls[4:] == [REC, 0] and reload(w.path) == {1, 2, 3, 4}
        w.tear = set()                                    # then copy 0 is the suspect one: written first
        await al.enter(range(5, 6))
        await al.idle()
        assert w.calls[6:] == [0, REC] and reload(w.path) == {1, 2, 3, 4, 5}
        assert al.stats()["in_flight"] == 3               # 1, 4, 5: the failed enters entered nothing
    run(go())


def test_bad_calls(tmp_path: Path) -> None:
    async def go() -> None:
        al = ActivityLog(tmp_path / "v.al", REGIONS, REGION)
        with pytest.raises(RuntimeError, match="load\\(\\) before enter"):
            await al.enter(range(1))
        al.load()
        with pytest.raises(ValueError, match="region 64 is outside 0..63"):
            await al.enter(range(63, 65))
        assert al.hot() == set() and al.stats()["in_flight"] == 0
    run(go())
    with pytest.raises(ValueError, match="positive"):
        ActivityLog(tmp_path / "v.al", 0, REGION)


# -- a crash at any point

P_REGIONS, P_SLOTS = 8, 3
OPS = st.lists(st.one_of(
    st.tuples(st.just("enter"), st.integers(0, P_REGIONS - 1), st.integers(1, 2)),
    st.tuples(st.just("enter"), st.integers(0, P_REGIONS - 1), st.just(1)),
    st.tuples(st.just("leave"), st.integers(0, 20), st.just(0)),
    st.tuples(st.just("leave"), st.integers(0, 20), st.just(0)),
    st.tuples(st.just("yield"), st.integers(1, 5), st.just(0)),
    st.tuples(st.just("tear"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("clear"), st.just(0), st.just(0)),
    st.tuples(st.just("settle"), st.just(0), st.just(0)),
    st.tuples(st.just("settle"), st.just(0), st.just(0)),
), max_size=50)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
@example([("enter", 0, 1), ("settle", 0, 0), ("enter", 1, 1), ("settle", 0, 0), ("enter", 2, 1),   # the log full,
          ("settle", 0, 0), ("leave", 1, 0), ("enter", 3, 1), ("settle", 0, 0)])           # its oldest in flight
def test_a_crash_at_any_point_leaves_a_log_that_covers_every_write_in_flight(ops: list[tuple[str, int, int]]) -> None:
    """At every update (before it, after it, and torn in the middle), and between all steps, what a restarted
    primary would load holds every region whose enter returned and whose leave was not yet called."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "v.al"
        lock = threading.Lock()
        in_flight: list[range] = []
        failures: list[str] = []
        tear_in = [-1]                                    # writer calls to go before a torn one

        def check(where: str) -> None:
            with lock:
                expect = {r for rg in in_flight for r in rg}
            got = ActivityLog(path, P_REGIONS, 4096, slots=P_SLOTS).load()
            if got is None or not expect <= got:
                failures.append(f"{where}: {sorted(expect)} in flight, the log holds {got}")

        real = LogFile(path)

        def writer(offset: int | None, data: bytes) -> None:
            check("before an update")
            tear_in[0] -= 1
            if tear_in[0] == 0:
                tear(path, offset, data)
                check("in a torn update")
                raise Torn("torn write")
            real(offset, data)
            check("after an update")

        async def go() -> None:
            al = ActivityLog(path, P_REGIONS, 4096, slots=P_SLOTS, write=writer)
            assert al.load() == set()
            tasks = []

            async def enter(rg: range) -> None:
                try:
                    await al.enter(rg)
                except OSError as e:
                    assert "torn write" in str(e)
                    return
                with lock:
                    in_flight.append(rg)

            def leave(i: int) -> None:
                with lock:
                    rg = in_flight.pop(i % len(in_flight))
                al.leave(rg)

            for op, a, b in ops:
                if op == "enter":
                    tasks.append(asyncio.create_task(enter(range(a, min(a + b, P_REGIONS)))))
                elif op == "leave" and in_flight:
                    leave(a)
                elif op == "yield":
                    for _ in range(a):
                        await asyncio.sleep(0)
                elif op == "tear":
                    tear_in[0] = a + 1
                elif op == "clear":
                    tasks.append(asyncio.create_task(clear(al)))
                elif op == "settle":                       # until every enter is done or waits for a slot
                    # looked at again every few ms, not only when a task ends: an enter woken for a slot that
                    # it then finds taken waits again without ending, and only a leave of ours can free it
                    while (busy := [t for t in tasks if not t.done()]) and al.stats()["waiting"] < len(busy):
                        await asyncio.wait(busy, timeout=0.005, return_when=asyncio.FIRST_COMPLETED)
                check(f"after {op}")
            while not all(t.done() for t in tasks):        # drain: leave everything, let the waiters in
                while in_flight:
                    leave(0)
                await asyncio.wait([t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                t.result()
            check("at the end")

        async def clear(al: ActivityLog) -> None:
            try:
                await al.clear()
            except OSError:
                pass

        asyncio.run(go())
        real.close()
        assert not failures, failures[0]


def test_an_update_that_drops_regions_awaits_before_evict_first(tmp_path: Path) -> None:
    """A region leaves the log on disk only after the replicas were flushed (its writes durable everywhere);
    an update that only adds regions does not flush; a failed flush fails the enter and drops nothing."""
    async def go() -> None:
        path = tmp_path / "v.al"
        al = ActivityLog(path, REGIONS, REGION, slots=2)
        assert al.load() == set()
        seen: list[set[int] | None] = []
        fail = False

        async def flushed() -> None:
            seen.append(reload(path, slots=2))          # what is on disk while the flush runs
            if fail:
                raise OSError("peer flush failed")

        al.before_evict = flushed
        for r in (0, 1):
            await al.enter(range(r, r + 1))
            al.leave(range(r, r + 1))
        assert seen == []                               # nothing dropped yet
        await al.enter(range(2, 3))                     # 0 goes: flushed before the record without it
        al.leave(range(2, 3))
        assert seen == [{0, 1}] and reload(path, slots=2) == {1, 2}
        fail = True
        with pytest.raises(OSError, match="peer flush failed"):
            await al.enter(range(3, 4))                 # 1 would go: the flush fails, the enter too
        assert reload(path, slots=2) == {1, 2}          # the log on disk still holds 1
        fail = False
        await al.enter(range(4, 5))                     # flushed, then written
        al.leave(range(4, 5))
        assert len(seen) == 3 and 4 in (reload(path, slots=2) or set())
        await al.close()
    run(go())
