"""The history checker (tests/support/history.py) on synthetic histories and on Writers against in-memory
devices: what it must catch (a lost ack, a torn, foreign, garbage or never-attempted block, a resurrected
failed write, a device that drops acked writes), what it must let pass (newer than acked, indeterminate
writes, never-written zeros), the replica image and epoch checks, and the JSON-lines history file."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
from fake_clock import FakeClock
from history import (
    HEADER,
    Recorder,
    Writer,
    check,
    check_device,
    check_epochs,
    check_identical,
    decode_block,
    load,
    make_block,
    make_payload,
    stripe,
)

from openvsan.block import FaultDevice, MediumError, RamDevice

BS = 512


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def disk(blocks: dict[int, bytes]):  # type: ignore[no-untyped-def]
    """read_block over a dict: LBAs not in it read zeros."""
    return lambda lba: blocks.get(lba, bytes(BS))


def recorder() -> Recorder:
    return Recorder(BS, clock=FakeClock())


# -- the payload --


def test_block_names_its_write_and_detects_damage() -> None:
    b = make_block(3, 77, 12, BS)
    assert len(b) == BS and b[:8] == b"OVHIST01"
    d = decode_block(b, BS)
    assert (d.kind, d.writer, d.lba, d.gen) == ("data", 3, 77, 12)
    assert decode_block(bytes(BS), BS).kind == "zero"
    assert decode_block(random.Random(1).randbytes(BS), BS).kind == "garbage"
    flipped = bytearray(b)
    flipped[300] ^= 0x10
    assert decode_block(flipped, BS).kind == "torn"
    # the first sector of one write and the rest of another (a 4K block torn at 512 bytes)
    a, c = make_block(0, 5, 1, 4096), make_block(0, 5, 2, 4096)
    assert decode_block(a[:512] + c[512:], 4096).kind == "torn"
    assert decode_block(c[:512] + a[512:], 4096).kind == "torn"
    assert make_payload(1, 10, 3, 4, BS) == b"".join(make_block(1, 10 + i, 4, BS) for i in range(3))
    assert HEADER.size == 32


# -- the checker on synthetic histories --


def test_lost_ack_is_caught() -> None:
    rec = recorder()
    for gen in (1, 2, 3):
        rec.ack(rec.begin(8, 1, gen))
    report = check(rec, disk({8: make_block(0, 8, 2, BS)}))
    assert not report.ok and (report.lost, report.corrupt) == (1, 0)
    assert report.findings[0].gap == 1
    assert "1 LOST ACK" in str(report) and "lba 8" in str(report) and "gen 3 was acked" in str(report)
    # and zeros where an ack was: lost, and listed first among the worst
    rec.ack(rec.begin(9, 1, 1))
    report = check(rec, disk({8: make_block(0, 8, 2, BS)}))
    assert report.lost == 2 and report.worst()[0].lba == 9 and "reads zeros" in report.worst()[0].message


def test_newer_than_acked_and_indeterminate_values_pass() -> None:
    rec = recorder()
    rec.ack(rec.begin(0, 2, 1))
    rec.fail(rec.begin(0, 2, 2), "MediumError: injected")  # may have landed...
    rec.begin(0, 2, 3)  # ...and so may one still in flight
    rec.ack(rec.begin(4, 1, 1))
    rec.fail(rec.begin(4, 1, 2), "timeout")
    blocks = {0: make_block(0, 0, 2, BS), 1: make_block(0, 1, 3, BS), 4: make_block(0, 4, 1, BS)}
    report = check(rec, disk(blocks))
    assert report.ok, str(report)
    assert (report.lbas, report.acked, report.failed, report.pending) == (3, 2, 2, 1)
    assert "0 LOST ACK, 0 CORRUPT" in str(report)


def test_never_written_lba_reads_zeros_and_passes() -> None:
    rec = recorder()
    rec.claim(0, [(0, 4)])
    rec.ack(rec.begin(1, 1, 1))
    rec.fail(rec.begin(2, 1, 1), "DeviceFailed")  # failed and never landed: zeros are right
    report = check(rec, disk({1: make_block(0, 1, 1, BS)}))
    assert report.ok, str(report)
    assert report.lbas == 4  # claimed LBAs are checked although never written


def test_torn_foreign_garbage_and_unknown_blocks_are_corrupt() -> None:
    rec = recorder()
    rec.claim(0, [(0, 4)])
    rec.claim(1, [(4, 4)])
    for lba in range(8):
        rec.ack(rec.begin(lba, 1, 1, writer=lba // 4))
    good = {lba: make_block(lba // 4, lba, 1, BS) for lba in range(8)}
    assert check(rec, disk(good)).ok

    def kinds(blocks: dict[int, bytes]) -> list[str]:
        report = check(rec, disk({**good, **blocks}))
        assert report.lost == 0 and report.corrupt == len(report.findings), str(report)
        return [f.kind for f in report.findings]

    torn = make_block(0, 1, 1, BS)[:256] + make_block(0, 1, 2, BS)[256:]
    assert kinds({1: torn}) == ["torn"]
    assert kinds({2: make_block(0, 3, 1, BS)}) == ["foreign"]  # another LBA's block: misdirected
    assert kinds({2: make_block(1, 2, 1, BS)}) == ["foreign"]  # another writer's block on writer 0's LBA
    assert kinds({5: random.Random(2).randbytes(BS)}) == ["garbage"]
    assert kinds({6: make_block(1, 6, 9, BS)}) == ["unknown"]  # a generation never attempted
    assert "CORRUPT" in str(check(rec, disk({**good, 1: torn})))


def test_a_failed_write_landing_after_a_later_ack_is_a_lost_ack() -> None:
    # a stale primary's write (reported failed) that gets through after failover and the next acked write
    rec = recorder()
    rec.fail(rec.begin(0, 1, 1), "ConnectionResetError")
    rec.ack(rec.begin(0, 1, 2))
    report = check(rec, disk({0: make_block(0, 0, 1, BS)}))
    assert report.lost == 1 and "op 1, failed" in str(report)


def test_unreadable_lba_is_reported() -> None:
    rec = recorder()
    rec.ack(rec.begin(0, 2, 1))

    def read(lba: int) -> bytes:
        if lba == 1:
            raise MediumError("unrecovered read", lba=1)
        return make_block(0, lba, 1, BS)

    report = check(rec, read)
    assert [f.kind for f in report.findings] == ["unreadable"] and not report.ok


def test_report_lists_worst_examples_and_how_many_more() -> None:
    rec = recorder()
    for lba in range(30):
        for gen in (1, 2):
            rec.ack(rec.begin(lba, 1, gen))
    blocks = {lba: make_block(0, lba, 1, BS) for lba in range(30)}
    blocks[7] = bytes(BS)
    report = check(rec, disk(blocks))
    assert report.lost == 30
    assert report.worst()[0].lba == 7 and len(report.worst()) == 10
    assert "and 20 more" in str(report)


# -- the history file and the recorder --


def test_history_round_trips_as_json_lines_and_survives_a_cut_last_line(tmp_path: Path) -> None:
    clock = FakeClock(50.0)
    log = tmp_path / "history.jsonl"
    rec = Recorder(BS, clock=clock, log=log, meta={"seed": 42})
    rec.claim(0, [(0, 2)])
    op = rec.begin(0, 2, 1)
    clock.advance(0.25)
    rec.ack(op)
    rec.fail(rec.begin(0, 2, 2), "MediumError: x")
    rec.begin(0, 2, 3)
    rec.close()
    rec.save(tmp_path / "saved.jsonl")
    assert log.read_text() == (tmp_path / "saved.jsonl").read_text()
    hist = load(log)
    assert hist.meta == {"seed": 42} and hist.block_size == BS and hist.claims == {0: [(0, 2)]}
    assert [(o.gen, o.status) for o in hist.ops.values()] == [(1, "acked"), (2, "failed"), (3, "pending")]
    assert (hist.ops[1].t_begin, hist.ops[1].t_end) == (50.0, 50.25)
    assert hist.ops[2].why == "MediumError: x"
    with log.open("a") as f:
        f.write('{"ev":"ack","op":')  # the run was killed while writing this line
    assert len(load(log).ops) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text(log.read_text().replace('"ev":"begin"', "nonsense", 1))
    with pytest.raises(ValueError, match="not a JSON line"):
        load(bad)


def test_recorder_refuses_double_ack_and_unknown_op() -> None:
    rec = recorder()
    op = rec.begin(0, 1, 1)
    rec.ack(op)
    with pytest.raises(ValueError, match="already acked"):
        rec.fail(op, "late")
    with pytest.raises(ValueError, match="never begun"):
        rec.ack(999)


def test_recorder_is_thread_safe() -> None:
    rec = recorder()

    def hammer(w: int) -> None:
        for gen in range(1, 201):
            rec.ack(rec.begin(w, 1, gen, writer=w))

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hist = rec.history()
    assert sorted(hist.ops) == list(range(1, 1601)) and hist.count("acked") == 1600


# -- writers against in-memory devices --


class Tracked:
    """A RamDevice whose writes take a random simulated time and assert one write in flight per LBA."""

    def __init__(self, inner: RamDevice, clock: FakeClock) -> None:
        self.inner, self.clock = inner, clock
        self.block_size, self.num_blocks = inner.block_size, inner.num_blocks
        self.in_flight: set[int] = set()
        self.most = 0
        self.rng = random.Random(5)

    async def write(self, lba: int, data: bytes, *, fua: bool = False) -> None:
        span = set(range(lba, lba + len(data) // self.block_size))
        assert not span & self.in_flight, f"two writes in flight on lba {lba}"
        self.in_flight |= span
        self.most = max(self.most, len(self.in_flight))
        await self.clock.sleep(self.rng.uniform(0.001, 0.01))
        await self.inner.write(lba, data, fua=fua)
        self.in_flight -= span

    async def read(self, lba: int, blocks: int) -> bytes:
        return bytes(await self.inner.read(lba, blocks))


def test_stripe_deals_disjoint_extents() -> None:
    parts = stripe(10, 20, writers=3, blocks=2)
    starts = [a for p in parts for a, _ in p]
    assert sorted(starts) == list(range(10, 30, 2)) and all(n == 2 for p in parts for _, n in p)
    assert parts[0][:2] == [(10, 2), (16, 2)]


def test_writers_on_ram_device_check_clean() -> None:
    async def go() -> None:
        clock = FakeClock()
        dev = Tracked(RamDevice(256), clock)
        rec = Recorder(BS, clock=clock)
        writers = [
            Writer(dev, rec, w, ext, concurrency=4, sleep=clock.sleep, seed=w, max_writes=150)
            for w, ext in enumerate(stripe(0, 240, writers=3, blocks=4))
        ]
        await asyncio.gather(*(w.run() for w in writers))
        assert dev.most > 4  # several LBAs at once (4 blocks an extent: more than one write in flight)
        hist = rec.history()
        assert hist.count("acked") == 450 and hist.count("failed") == 0
        assert max(o.gen for o in hist.ops.values()) > 1  # extents were rewritten
        report = await check_device(hist, dev)
        assert report.ok and report.lbas == 240, str(report)
        # and the LBAs outside every writer's extents are not judged
        await dev.inner.write(250, make_block(9, 250, 1, BS))
        assert (await check_device(hist, dev)).ok

    run(go())


class FailEveryThird(FaultDevice):
    """Every third write fails (FaultDevice's own injected MediumError); with `land`, it lands first."""

    def __init__(self, inner: RamDevice, *, land: bool) -> None:
        super().__init__(inner, name="every3")
        self.calls, self.land = 0, land

    async def write(self, lba: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        self.calls += 1
        if self.calls % 3 == 0:
            if self.land:
                await super().write(lba, data, fua=fua)
            self.fail_writes(lba, times=1)
        await super().write(lba, data, fua=fua)


@pytest.mark.parametrize("land", [False, True], ids=["failed-not-landed", "failed-but-landed"])
def test_writer_against_failing_device_records_failures_and_checks_clean(land: bool) -> None:
    async def go() -> None:
        clock = FakeClock()
        dev = FailEveryThird(RamDevice(64), land=land)
        rec = Recorder(BS, clock=clock)
        w = Writer(
            dev,
            rec,
            0,
            stripe(0, 64, writers=1, blocks=2)[0],
            concurrency=3,
            sleep=clock.sleep,
            backoff=0.01,
            max_writes=300,
        )
        await w.run()
        hist = rec.history()
        assert (w.failed, w.acked) == (100, 200)
        assert hist.count("failed") == 100 and "injected write error" in next(
            o.why for o in hist.ops.values() if o.status == "failed"
        )
        assert clock.jumps > 0  # it backed off on the (fake) clock after failures
        report = await check_device(hist, dev)
        assert report.ok, str(report)
        assert report.failed == 100

    run(go())


def test_writer_stops_and_cancelled_writes_stay_indeterminate() -> None:
    async def go() -> None:
        clock = FakeClock()
        dev = Tracked(RamDevice(64), clock)
        rec = Recorder(BS, clock=clock)
        w = Writer(dev, rec, 0, [(i, 1) for i in range(16)], concurrency=4, sleep=clock.sleep)
        task = asyncio.create_task(w.run())
        await clock.sleep(0.2)
        w.stop()
        await asyncio.wait_for(task, 5)
        assert rec.history().count("pending") == 0 and w.acked > 20
        w2 = Writer(dev, rec, 1, [(i, 1) for i in range(16, 32)], concurrency=4, sleep=clock.sleep)
        task = asyncio.create_task(w2.run())
        await clock.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rec.history().count("pending") > 0  # cut mid-write: indeterminate, and still checks clean
        report = await check_device(rec, dev)
        assert report.ok and report.pending > 0, str(report)

    run(go())


def test_dropped_acked_writes_make_the_check_fail() -> None:
    """The proof that the check can fail: a lying disk acknowledges writes after its 'crash' and loses them."""

    async def go() -> None:
        clock = FakeClock()
        dev = FaultDevice(RamDevice(64), crash_after_writes=40, after_crash="drop")
        rec = Recorder(BS, clock=clock)
        w = Writer(dev, rec, 0, [(i, 1) for i in range(32)], concurrency=4, sleep=clock.sleep, max_writes=120)
        await w.run()
        assert w.failed == 0  # every write was acknowledged
        report = await check_device(rec, dev)
        assert not report.ok and report.lost > 0 and report.corrupt == 0
        assert "LOST ACK" in str(report)

    run(go())


def test_writer_refuses_overlapping_extents_and_wrong_block_size() -> None:
    dev = RamDevice(16)
    with pytest.raises(ValueError, match="overlaps"):
        Writer(dev, recorder(), 0, [(0, 4), (2, 4)])
    with pytest.raises(ValueError, match="leaves the device"):
        Writer(dev, recorder(), 0, [(14, 4)])
    with pytest.raises(ValueError, match="block size"):
        Writer(dev, Recorder(4096, clock=FakeClock()), 0, [(0, 1)])


# -- replicas and epochs --


def test_check_identical_finds_a_one_byte_difference(tmp_path: Path) -> None:
    size = 3 * (1 << 20) + 4096
    a = bytearray(random.Random(3).randbytes(size))
    b = bytearray(a)
    assert check_identical([a, b]).ok
    b[2_500_017] ^= 1
    (tmp_path / "c.img").write_bytes(bytes(a))
    report = check_identical({"n1": a, "n2": bytes(b), "n3": tmp_path / "c.img"}, chunk=1 << 20)
    assert not report.ok
    assert report.diffs == [(2_500_017, ["n2"])] and report.differing_chunks == 1
    assert "offset 2500017 (n2)" in str(report)
    c = bytearray(a)
    for off in (0, 5000, 9000, 2_000_000):
        c[off] ^= 0xFF
    report = check_identical([a, c], max_diffs=3)
    assert [off for off, _ in report.diffs] == [0, 5000, 9000] and report.differing_chunks == 4


def test_check_identical_reports_size_difference() -> None:
    report = check_identical([bytes(8192), bytes(4096)])
    assert not report.ok and "sizes image0=8192, image1=4096" in str(report)


def test_check_epochs_catches_two_nodes_in_one_epoch() -> None:
    clean = [("n1", 1, 0.1), ("n1", 1, 0.2), ("n2", 2, 1.5), ("n2", 2, 1.6), ("n1", 3, 3.0)]
    assert check_epochs(clean, order_slack=0.0).ok
    report = check_epochs([*clean, ("n2", 3, 3.1)])
    assert not report.ok and report.conflicts == [3]
    assert "epoch 3 acked by n1 (1 acks" in str(report) and "n2 (1 acks" in str(report)
    # a stale primary still acknowledging in epoch 1 after n2 took over in epoch 2
    stale = [*clean, ("n1", 1, 2.0)]
    assert check_epochs(stale).ok  # the order check only with a slack
    report = check_epochs(stale, order_slack=0.1)
    assert not report.ok and report.conflicts == [] and "n1 acked in epoch 1 at t=2.000" in str(report)


def test_a_compact_history_judges_every_block_as_the_whole_one(tmp_path: Path) -> None:
    """load(compact=True) keeps per extent only the last ack and what came after it (a soak's history has
    millions of ops), yet finds the same lost acks, unknown writes and foreign blocks as the whole history."""
    log = tmp_path / "h.jsonl"
    rec = Recorder(BS, clock=FakeClock(), log=log, keep=False)
    rng = random.Random(7)
    last_acked: dict[int, int] = {}
    gens: dict[int, int] = {}
    for w in range(2):
        rec.claim(w, [(w * 64 + e * 4, 4) for e in range(16)])
    for _ in range(2000):
        w, e = rng.randrange(2), rng.randrange(16)
        lba = w * 64 + e * 4
        gens[lba] = gen = gens.get(lba, 0) + 1
        op = rec.begin(lba, 4, gen, writer=w)
        fate = rng.random()
        if fate < 0.8:
            rec.ack(op)
            last_acked[lba] = gen
        elif fate < 0.95:
            rec.fail(op, "cut")
        # else: still in flight at the end
    rec.close()
    with pytest.raises(RuntimeError):
        rec.history()
    blocks: dict[int, bytes] = {}
    for lba, gen in gens.items():
        w = lba // 64
        for i in range(4):
            pick = rng.random()
            if pick < 0.6:
                g = gen                                  # the newest attempted
            elif pick < 0.8:
                g = max(1, last_acked.get(lba, 1) - 1)   # older than the last ack: a lost ack
            elif pick < 0.9:
                g = gen + 5                              # never attempted
            else:
                blocks[lba + i] = make_block(1 - w, lba + i, 1, BS)   # another writer's: foreign
                continue
            blocks[lba + i] = make_block(w, lba + i, g, BS)
    whole, compact = load(log), load(log, compact=True)
    assert len(compact.ops) < len(whole.ops) / 4
    for status in ("acked", "failed", "pending"):
        assert compact.count(status) == whole.count(status)   # type: ignore[arg-type]
    a = check(whole, lambda lba: blocks.get(lba, bytes(BS)))
    b = check(compact, lambda lba: blocks.get(lba, bytes(BS)))
    assert a.lbas == b.lbas and a.lost > 0 and a.corrupt > 0
    assert [(f.lba, f.kind, f.gap) for f in a.findings] == [(f.lba, f.kind, f.gap) for f in b.findings]
