"""Pool I/O against a reference model (a bytearray): every level, random writes, member losses up to the level's
tolerance (whole devices and media errors), concurrent writes, unmap and write_zeroes. Time is simulated
(FakeClock): the members' latency, the bitmap's idle time, the moments members are pulled."""

from __future__ import annotations

import asyncio
import random

import pytest
from fake_clock import FakeClock, SimulatedLatency, settle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openvsan.block import DeviceFailed, FaultDevice, OutOfRange, RamDevice
from openvsan.pool.raid import Pool

BS = 512
CHUNK = 4096
HEADER = 64 * 1024
ROWS = 24

# a task that finds its blocks busy waits this long (simulated): a sleep(0) poll would keep the loop busy, and a
# simulated clock only moves once every task waits
BACKOFF = 0.0002

# level -> member counts tried
LEVELS = {0: (2, 3), 1: (2, 3), 10: (4, 6), 5: (3, 4, 5), 6: (4, 5, 7)}  # RAID 5 of 5, RAID 6 of 7: read-modify-write pays


class Disk(SimulatedLatency, FaultDevice):
    """A member that outlives the pool object (close is a no-op), like a disk that stays in the machine; given
    a clock, each request takes `latency` seconds of simulated time."""

    def __init__(self, name: str, rows: int = ROWS, *, clock: FakeClock | None = None, latency: float = 0.0) -> None:
        super().__init__(RamDevice((HEADER + rows * CHUNK) // BS), name=name)
        self.clock, self.delay = clock, latency

    async def close(self) -> None:
        pass


def losable(level: int, n: int) -> list[list[int]]:
    """Member sets whose loss the level survives, largest first (RAID 10: one of each pair)."""
    match level:
        case 0:
            return [[]]
        case 1:
            return [list(range(n - 1))]
        case 10:
            return [[2 * p + (p % 2) for p in range(n // 2)]]
        case _:
            return [list(range({5: 1, 6: 2}[level]))]


async def make(level: int, n: int) -> tuple[Pool, list[Disk]]:
    """A pool on simulated time: pool.sleep lets it pass (the bitmap's lazy clearing runs)."""
    clock = FakeClock()
    disks = [Disk(f"d{i}") for i in range(n)]
    pool = await Pool.create(disks, level, CHUNK, data_offset=HEADER, bitmap_idle_s=0.05, clock=clock,
                             sleep=clock.sleep)
    return pool, disks


async def check_all(pool: Pool, model: bytearray) -> None:
    got = bytes(await pool.read(0, pool.num_blocks))
    if got != bytes(model):
        bad = next(i for i in range(len(got)) if got[i] != model[i])
        raise AssertionError(f"first difference at byte {bad} (lba {bad // BS})")


ops = st.lists(
    st.tuples(st.sampled_from(["write", "write", "write", "read", "lose", "medium", "zero", "idle"]),
              st.floats(0, 1), st.integers(1, 40), st.integers(0, 2**32)),
    min_size=4, max_size=30,
)


@pytest.mark.parametrize("level", list(LEVELS))
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), script=ops)
def test_random_io_with_member_losses(level: int, data: st.DataObject, script: list) -> None:
    n = data.draw(st.sampled_from(LEVELS[level]), label="members")
    to_lose = list(losable(level, n)[0])
    data.draw(st.randoms(use_true_random=False), label="rng").shuffle(to_lose)

    async def go() -> None:
        pool, disks = await make(level, n)
        model = bytearray(pool.num_blocks * BS)
        for op, where, length, seed in script:
            rng = random.Random(seed)
            lba = int(where * (pool.num_blocks - 1))
            blocks = min(length, pool.num_blocks - lba)
            if op == "write":
                buf = rng.randbytes(blocks * BS)
                await pool.write(lba, buf, fua=bool(seed & 1))
                model[lba * BS:(lba + blocks) * BS] = buf
            elif op == "zero":
                await (pool.unmap if seed & 1 else pool.write_zeroes)(lba, blocks)
                model[lba * BS:(lba + blocks) * BS] = bytes(blocks * BS)
            elif op == "read":
                assert bytes(await pool.read(lba, blocks)) == bytes(model[lba * BS:(lba + blocks) * BS])
            elif op == "idle":  # long enough for the bitmap's lazy clearing of what was written
                await pool.sleep(0.1)
            elif to_lose:
                victim = disks[to_lose.pop()]
                if op == "lose":
                    victim.fail_device()
                else:  # a media error somewhere: the member is failed when the pool trips over it
                    victim.fail(rng.randrange(victim.num_blocks))
        await check_all(pool, model)
        for m in to_lose:  # the rest of the tolerance, then everything must still read back
            disks[m].fail_device()
        await check_all(pool, model)
        await pool.close()
        # and it all comes back after a restart, degraded
        pool = await Pool.assemble([d for d in disks if not d.failed], clock=pool.clock, sleep=pool.sleep)
        await check_all(pool, model)
        await pool.close()

    asyncio.run(go())


@pytest.mark.parametrize("level", [0, 1, 10, 5, 6])
def test_beyond_tolerance_raises_device_failed(level: int) -> None:
    async def go() -> None:
        n = {0: 2, 1: 2, 10: 4, 5: 3, 6: 4}[level]
        pool, disks = await make(level, n)
        await pool.write(0, b"\1" * CHUNK * 4)
        lose = {0: [0], 1: [0, 1], 10: [0, 1], 5: [0, 1], 6: [0, 1, 2]}[level]
        for m in lose:
            disks[m].fail_device()
        with pytest.raises(DeviceFailed):
            await pool.read(0, pool.num_blocks)
        assert pool.status().state == "failed"
        with pytest.raises(DeviceFailed):
            await pool.write(0, b"\2" * BS)
        await pool.close()

    asyncio.run(go())


@pytest.mark.parametrize("level", [1, 10, 5, 6])
def test_concurrent_writes_sharing_stripes(level: int) -> None:
    """Many writes at once, on members of different speeds, never two on one block but many on one stripe:
    stripe locks keep parity and mirrors right (checked by a scrub) and every block reads back."""

    async def go() -> None:
        n = {1: 3, 10: 4, 5: 4, 6: 5}[level]
        clock = FakeClock()
        disks = [Disk(f"d{i}", clock=clock, latency=0.0005 * i) for i in range(n)]
        pool = await Pool.create(disks, level, CHUNK, data_offset=HEADER, clock=clock, sleep=clock.sleep)
        model = bytearray(pool.num_blocks * BS)
        rng = random.Random(level)
        for _ in range(3):
            blocks = list(range(pool.num_blocks))
            rng.shuffle(blocks)
            batch = []
            for b in blocks[:120]:
                buf = rng.randbytes(BS)
                model[b * BS:(b + 1) * BS] = buf
                batch.append(pool.write(b, buf))
            await asyncio.gather(*batch)
        await check_all(pool, model)
        report = await pool.scrub(repair=False)
        assert report.clean and report.checked == pool.geo.rows, report
        # a member lost afterwards: what parity and mirrors hold is right, not just the data chunks
        disks[1].fail_device()
        await check_all(pool, model)
        await pool.close()

    asyncio.run(go())


def test_bounds_and_alignment() -> None:
    async def go() -> None:
        pool, _ = await make(5, 3)
        with pytest.raises(OutOfRange):
            await pool.read(pool.num_blocks - 1, 2)
        with pytest.raises(OutOfRange):
            await pool.write(pool.num_blocks, b"\0" * BS)
        with pytest.raises(ValueError, match="multiple of the block size"):
            await pool.write(0, b"\0" * 100)
        assert await pool.read(0, 0) == b""
        await pool.write(0, b"", fua=True)
        await pool.close()
        with pytest.raises(DeviceFailed, match="closed"):
            await pool.read(0, 1)

    asyncio.run(go())


def test_write_paths_read_as_little_as_they_can() -> None:
    """A full-stripe write reads nothing; a one-block write to RAID 5 of 5 members reads two blocks
    (read-modify-write); a write of most of a stripe reads the rest (reconstruct-write)."""

    async def go() -> None:
        pool, disks = await make(5, 5)
        stripe = 4 * CHUNK

        def reads() -> int:
            return sum(d.reads for d in disks)

        before = reads()
        await pool.write(0, b"\7" * stripe)
        assert reads() == before
        before = reads()
        await pool.write(8, b"\1" * BS)
        assert reads() - before == 2  # old data and P
        before = reads()
        await pool.write(0, b"\2" * 3 * CHUNK)
        assert reads() - before == 1  # the one data chunk not written
        assert (await pool.scrub(repair=False)).clean
        await pool.close()

    asyncio.run(go())


def test_eager_gather_runs_what_it_can_at_once() -> None:
    from openvsan.pool.members import eager_gather

    async def go() -> None:
        order: list[str] = []

        async def now(x: int) -> int:
            order.append(f"now{x}")
            return x

        async def later(x: int) -> int:
            order.append(f"later{x}-start")
            await asyncio.sleep(0)
            order.append(f"later{x}-end")
            return x

        gate = asyncio.Event()

        async def parked() -> int:
            try:
                await gate.wait()
            except asyncio.CancelledError:
                order.append("parked-cancelled")
                raise
            return 0

        async def bad() -> int:
            raise ValueError("boom")

        before = len(asyncio.all_tasks())
        results = await eager_gather([now(1), later(2), bad(), now(3)])
        assert results[:2] == [1, 2] and isinstance(results[2], ValueError) and results[3] == 3
        assert order == ["now1", "later2-start", "now3", "later2-end"]  # started in order, in this turn
        assert len(asyncio.all_tasks()) == before
        gathering = asyncio.ensure_future(eager_gather([later(4), parked()]))
        await settle()
        gathering.cancel()
        with pytest.raises(asyncio.CancelledError):  # cancellation reaches a suspended one
            await gathering
        assert order[-2:] == ["later4-end", "parked-cancelled"]

    asyncio.run(go())


@pytest.mark.parametrize("level", [1, 10, 5, 6])
def test_member_fails_under_sustained_concurrent_writes(level: int) -> None:
    """Members pulled while 16 writers and 4 readers keep going: none sees an error or wrong data, and everything
    reads back, also after a restart (what the pool acknowledged was recorded with the failure)."""

    async def go() -> None:
        n = {1: 3, 10: 4, 5: 4, 6: 5}[level]
        clock = FakeClock()
        disks = [Disk(f"d{i}", clock=clock, latency=0.0002) for i in range(n)]
        pool = await Pool.create(disks, level, CHUNK, data_offset=HEADER, clock=clock, sleep=clock.sleep)
        model = bytearray(pool.num_blocks * BS)
        rng = random.Random(level)
        busy: set[int] = set()
        stop = asyncio.Event()

        async def writer() -> None:
            while not stop.is_set():
                lba = rng.randrange(pool.num_blocks - 16)
                span = set(range(lba, lba + 16))
                if span & busy:
                    await clock.sleep(BACKOFF)
                    continue
                busy.update(span)
                buf = rng.randbytes(rng.choice((1, 3, 16)) * BS)
                await pool.write(lba, buf)
                model[lba * BS:lba * BS + len(buf)] = buf
                busy.difference_update(span)

        async def reader() -> None:
            while not stop.is_set():
                lba = rng.randrange(pool.num_blocks - 40)
                span = set(range(lba, lba + 40))
                if span & busy:
                    await clock.sleep(BACKOFF)
                    continue
                busy.update(span)  # no writer there meanwhile: the model is the truth
                got = bytes(await pool.read(lba, 40))
                assert got == bytes(model[lba * BS:(lba + 40) * BS])
                busy.difference_update(span)

        writers = [asyncio.ensure_future(writer()) for _ in range(16)]
        writers += [asyncio.ensure_future(reader()) for _ in range(4)]
        lose = {1: [2, 0], 10: [1, 2], 5: [3], 6: [4, 1]}[level]
        for m in lose:  # 10 ms of requests (50 member latencies) between each
            await clock.sleep(0.01)
            disks[m].fail_device()
        await clock.sleep(0.01)
        stop.set()
        await asyncio.gather(*writers)
        assert [s.state for s in pool.status().members if s.index in lose] == ["failed"] * len(lose)
        await check_all(pool, model)
        await pool.close()
        pool = await Pool.assemble([d for d in disks if not d.failed], clock=clock, sleep=clock.sleep)
        await check_all(pool, model)
        await pool.close()

    asyncio.run(go())


@pytest.mark.parametrize("level", [1, 10, 5, 6])
def test_members_with_4k_blocks(level: int) -> None:
    async def go() -> None:
        n = {1: 2, 10: 4, 5: 3, 6: 4}[level]
        disks = [FaultDevice(RamDevice((HEADER + 32 * 16384) // 4096, 4096), name=f"d{i}") for i in range(n)]
        pool = await Pool.create(disks, level, 16384, data_offset=HEADER)
        assert pool.block_size == 4096
        rng = random.Random(level)
        model = bytearray(rng.randbytes(pool.num_blocks * 4096))
        await pool.write(0, model)
        for _ in range(30):
            lba = rng.randrange(pool.num_blocks - 5)
            buf = rng.randbytes(rng.randint(1, 5) * 4096)
            await pool.write(lba, buf)
            model[lba * 4096:lba * 4096 + len(buf)] = buf
        disks[1].fail_device()
        assert bytes(await pool.read(0, pool.num_blocks)) == bytes(model)
        assert (await pool.scrub(repair=False)).clean
        await pool.close()

    asyncio.run(go())


class RamMember(RamDevice):
    """A RAM member with its fast path (read_now), outliving the pool object like a Disk."""

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_read_now_returns_what_read_returns(level: int) -> None:
    """The pool's read fast path is a shortcut of read(): the same bytes for any range, from a healthy pool
    and from a degraded one (where it may decline, None, but never answers differently); members without a
    fast path make it decline."""
    for n in LEVELS[level]:
        rng = random.Random(level * 10 + n)

        async def go(n: int = n, rng: random.Random = rng) -> None:
            members = [RamMember((HEADER + ROWS * CHUNK) // BS, BS, name=f"r{i}") for i in range(n)]
            pool = await Pool.create(members, level, CHUNK, data_offset=HEADER, bitmap_idle_s=0.05)
            assert pool.capabilities.sync_read
            await pool.write(0, rng.randbytes(pool.num_blocks * BS))

            def ranges(k: int) -> list[tuple[int, int]]:
                out = []
                for _ in range(k):
                    blocks = rng.choice([1, 3, 8, CHUNK // BS, 3 * CHUNK // BS + 5, 40])
                    out.append((rng.randrange(pool.num_blocks - blocks + 1), blocks))
                return out

            for lba, blocks in ranges(150):
                now = pool.read_now(lba, blocks)
                assert now is not None, f"a healthy pool of RAM members declined {lba}+{blocks}"
                assert bytes(now) == bytes(await pool.read(lba, blocks))
            lost = losable(level, n)[0]
            for i in lost:
                await pool.fail_member(i)
            answered = declined = 0
            for lba, blocks in ranges(150):
                now = pool.read_now(lba, blocks)
                if now is None:
                    declined += 1
                    continue
                answered += 1
                assert bytes(now) == bytes(await pool.read(lba, blocks))
            assert answered, "a degraded pool declined every read, also those of in-sync members"
            if lost and level in (5, 6):
                assert declined, "reads of a lost member's chunks need the parity: read_now must decline them"
            await pool.close()

        asyncio.run(go())


def test_read_now_declines_without_member_fast_paths() -> None:
    async def go() -> None:
        disks = [Disk(f"d{i}") for i in range(3)]          # FaultDevice members: no read_now
        pool = await Pool.create(disks, 5, CHUNK, data_offset=HEADER, bitmap_idle_s=0.05)
        await pool.write(0, b"\x11" * CHUNK)
        assert pool.read_now(0, 1) is None
        assert bytes(await pool.read(0, 1)) == b"\x11" * BS
        await pool.close()
        assert pool.read_now(0, 1) is None                  # closed: read() says why

    asyncio.run(go())


class Declining(RamMember):
    """A RAM member whose fast path can be told to decline writes (a file in memory out of space), all of them
    or those from member block `decline_from` on."""

    decline = False
    decline_from: int | None = None

    def write_now(self, lba: int, data: bytes) -> bool:
        if self.decline or (self.decline_from is not None and lba >= self.decline_from):
            return False
        return super().write_now(lba, data)

    def write_window(self, lba: int, blocks: int) -> memoryview | None:
        if self.decline or (self.decline_from is not None and lba + blocks > self.decline_from):
            return None   # where it takes no fast write it lends no memory either (nor over a range reaching there)
        return super().write_window(lba, blocks)


class NoFastWrites(Declining):
    """A RAM member that declines every fast write: a pool of these takes the normal write path only."""

    decline = True


async def ram_pool(level: int, n: int, cls: type[RamMember] = RamMember) -> tuple[Pool, list[RamMember]]:
    members = [cls((HEADER + ROWS * CHUNK) // BS, BS, name=f"r{i}") for i in range(n)]
    return await Pool.create(members, level, CHUNK, data_offset=HEADER, bitmap_idle_s=3600), members


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_write_now_leaves_the_members_as_write_does(level: int) -> None:
    """The write fast path is a shortcut of write(): the same writes, one pool through write_now wherever it
    takes them and the other through write() alone, leave every member byte for byte the same (data,
    parity; the bitmaps alike); the fast path takes the small writes of a healthy pool once their region's bit is on
    disk, and the pools read back the model and scrub clean."""
    for n in LEVELS[level]:
        rng = random.Random(level * 100 + n)

        async def go(n: int = n, rng: random.Random = rng) -> None:
            fast, fast_members = await ram_pool(level, n)
            slow, slow_members = await ram_pool(level, n, NoFastWrites)  # write() takes no shortcut there
            model = bytearray(fast.num_blocks * BS)
            row = fast.geo.chunk_blocks * fast.geo.data_chunks
            taken = taken_rows = 0
            for _ in range(300):
                blocks = rng.choice([1, 2, 8, CHUNK // BS, CHUNK // BS + 3, 3 * CHUNK // BS, row, 2 * row + 5, 4 * row])
                lba = rng.randrange(fast.num_blocks - blocks + 1)
                data = rng.randbytes(blocks * BS)
                model[lba * BS:(lba + blocks) * BS] = data
                if fast.write_now(lba, data):
                    taken += 1
                    taken_rows += lba // row != (lba + blocks - 1) // row
                else:
                    await fast.write(lba, data)
                await slow.write(lba, data)
            assert taken > 50, f"the fast path took only {taken} of 300 writes"
            assert taken_rows > 10, f"the fast path took only {taken_rows} writes spanning rows"
            for a, b in zip(fast_members, slow_members, strict=True):      # the data area (headers hold ids)
                assert bytes(a._view[HEADER:]) == bytes(b._view[HEADER:]), f"member {a.name} differs"
            if fast.bitmap is not None and slow.bitmap is not None:
                assert fast.bitmap.bits == slow.bitmap.bits and fast.bitmap.durable == slow.bitmap.durable
            assert bytes(await fast.read(0, fast.num_blocks)) == bytes(model)
            if level != 0:
                assert (await fast.scrub(repair=False)).mismatches == 0
            for p in (fast, slow):
                await p.close()

        asyncio.run(go())


def test_write_now_keeps_the_write_intent_rule() -> None:
    """No member is written before its region's bit is on disk: a region whose bit is not durable (a new
    region, or one cleared as idle) goes through write(), which sets it first; then the fast path takes it."""
    async def go() -> None:
        pool, _ = await ram_pool(5, 4)
        bm = pool.bitmap
        assert bm is not None
        await pool.wait_idle()
        await bm.clear_idle(pool.flush_members, everything=True)
        assert not bm.dirty()
        assert not pool.write_now(0, b"\x01" * BS)           # bit not on disk: declined, nothing counted
        assert not bm.dirty() and not bm._inflight
        await pool.write(0, b"\x02" * BS)
        assert bm.is_set(0)
        assert pool.write_now(1, b"\x03" * BS)
        assert not bm._inflight
        async with pool.locks.hold(0):                      # a request in flight on the row: declined
            assert not pool.write_now(2, b"\x04" * BS)
        await pool.fail_member(3)                            # degraded: declined, write() rebuilds around it
        assert not pool.write_now(2, b"\x04" * BS)
        await pool.close()

    asyncio.run(go())


@pytest.mark.parametrize("level", [5, 6])
def test_a_fast_write_declined_half_way_is_written_again_whole(level: int) -> None:
    """A member that declines its part after others took theirs leaves the stripe torn: the row is marked,
    write() writes it again reconstructing the parity (a read-modify-write would trust the old parity), and
    the pool scrubs clean and reads back what was written."""
    async def go() -> None:
        pool, members = await ram_pool(level, 5, Declining)
        data = random.Random(level).randbytes(pool.num_blocks * BS)
        await pool.write(0, data)
        pq = pool.geo.parity_members(0)
        members[pq[0]].decline = True                         # a parity member declines: written after the data
        new = b"\x5a" * BS
        assert not pool.write_now(3, new)
        io = pool.io
        assert 0 in io.torn
        members[pq[0]].decline = False
        await pool.write(3, new)
        assert 0 not in io.torn
        assert bytes(await pool.read(3, 1)) == new
        assert (await pool.scrub(repair=False)).mismatches == 0
        await pool.close()

    asyncio.run(go())


class NoWindow(RamMember):
    """A RAM member that lends no memory: a full stripe's parity is made in a buffer and copied in."""

    def write_window(self, lba: int, blocks: int) -> memoryview | None:
        return None


class CountedWindows(RamMember):
    lent = 0

    def write_window(self, lba: int, blocks: int) -> memoryview | None:
        CountedWindows.lent += 1
        return super().write_window(lba, blocks)


@pytest.mark.parametrize("level", [5, 6])
def test_parity_computed_into_the_members_equals_parity_copied_in(level: int) -> None:
    """Full stripes written by write_now put their parity straight into RAM members' memory (MemberSet.window,
    Parity.encode_into): every member ends byte for byte as with members that lend none, partial rows,
    spanning writes and overwrites included, and scrub finds nothing."""
    async def go() -> None:
        rnd = random.Random(level)
        pools = [await ram_pool(level, 5, cls) for cls in (CountedWindows, NoWindow)]
        row = pools[0][0].geo.chunk_blocks * pools[0][0].geo.data_chunks
        total = pools[0][0].num_blocks
        CountedWindows.lent = 0
        for _ in range(60):
            blocks = rnd.choice((1, 7, row, 2 * row, 3 * row + 5))
            lba = rnd.choice((0, row, rnd.randrange(total - blocks + 1)))
            data = rnd.randbytes(blocks * BS)
            for pool, _ in pools:
                await pool.write(lba, data)
        assert CountedWindows.lent > 20
        (a, ma), (_, mb) = pools
        start = HEADER // BS     # the data area (the header holds each pool's own identity)
        for x, y in zip(ma, mb, strict=True):
            assert x.read_now(start, x.num_blocks - start) == y.read_now(start, y.num_blocks - start)
        assert (await a.scrub(repair=False)).mismatches == 0
        for pool, _ in pools:
            await pool.close()

    asyncio.run(go())


@pytest.mark.parametrize("level", [5, 6])
def test_a_span_plan_made_once_serves_every_row_of_its_rotation(level: int) -> None:
    """Sequential writes spanning rows, of a length that is not a whole number of rows (a 1 MiB write to 64 KiB
    chunks), start at a few places of rows of a few rotations: each place and rotation is planned once
    (ParityIO._span) and the plan is used again wherever the pattern recurs, with every member byte for byte
    as with members that lend no memory, and a clean scrub."""
    async def go() -> None:
        pools = []
        for cls in (CountedWindows, NoWindow):
            members = [cls((HEADER + 200 * CHUNK) // BS, BS, name=f"r{i}") for i in range(5)]
            pools.append((await Pool.create(members, level, CHUNK, data_offset=HEADER, bitmap_idle_s=3600), members))
        geo = pools[0][0].geo
        row = geo.chunk_blocks * geo.data_chunks
        blocks = 2 * row + geo.chunk_blocks        # 2 1/4 rows (RAID 6: 2 1/3), so 4 (3) places in a row
        total = pools[0][0].num_blocks
        rnd = random.Random(level)
        CountedWindows.lent = 0
        lba, writes = 0, 0
        for _ in range(3):   # three passes: the rows of each rotation are written at other places each time
            while lba + blocks <= total:
                data = rnd.randbytes(blocks * BS)
                for pool, _ in pools:
                    await pool.write(lba, data)
                lba += blocks
                writes += 1
            lba = lba % row + 1
        spans = pools[0][0].io._spans
        assert CountedWindows.lent >= (writes - 1) * geo.members   # the first waits for its bitmap bit: write()
        places = 3 * geo.data_chunks * geo.members       # per pass: where a write starts in a row, and its rotation
        assert len(spans) <= places < writes / 3, f"{len(spans)} plans made for {writes} writes"
        (a, ma), (_, mb) = pools
        start = HEADER // BS
        for x, y in zip(ma, mb, strict=True):
            assert x.read_now(start, x.num_blocks - start) == y.read_now(start, y.num_blocks - start)
        assert (await a.scrub(repair=False)).mismatches == 0
        for pool, _ in pools:
            await pool.close()

    asyncio.run(go())


@pytest.mark.parametrize("level", [5, 6])
def test_a_fast_write_spanning_rows_declined_in_a_later_row(level: int) -> None:
    """A write over rows 0 to 2 whose parity members of row 1 decline from row 1 on (after that row's data
    was written): row 0 is written by the fast path, row 1 is left torn, and write() (which a declined write_now hands the request to) writes the whole request
    again; the pool then reads back the new data and scrubs clean."""
    async def go() -> None:
        pool, members = await ram_pool(level, 5, Declining)
        data = random.Random(level).randbytes(pool.num_blocks * BS)
        await pool.write(0, data)
        geo = pool.geo
        row = geo.chunk_blocks * geo.data_chunks
        for m in geo.parity_members(1):
            members[m].decline_from = HEADER // BS + geo.chunk_blocks   # member blocks of row 1 and later
        new = random.Random(level + 1).randbytes((2 * row + 7) * BS)
        assert not pool.write_now(5, new)
        assert 1 in pool.io.torn
        got = bytes(await pool.read(5, row - 5))
        assert got == new[:(row - 5) * BS], "row 0 was written by the fast path before row 1 declined"
        for m in members:
            m.decline_from = None
        await pool.write(5, new)
        assert not pool.io.torn
        assert bytes(await pool.read(5, 2 * row + 7)) == new
        assert (await pool.scrub(repair=False)).mismatches == 0
        await pool.close()

    asyncio.run(go())


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_write_takes_the_fast_path_where_it_can(level: int) -> None:
    """write() of a healthy pool of RAM members is done by write_now, rows and all: the per-row path (a stripe
    lock and a plan per row) is not entered for a write spanning rows, and its data reads back; a pool whose
    members decline fast writes takes the per-row path for the same write."""
    async def go() -> None:
        for cls, fast in ((RamMember, True), (NoFastWrites, False)):
            pool, _ = await ram_pool(level, max(LEVELS[level]), cls)
            await pool.write(0, bytes(BS))                       # the first region's bit goes to disk once
            per_row: list[int] = []
            normal = pool.io.write

            async def spy(lba: int, data: bytes, fua: bool, normal: object = normal,
                          per_row: list[int] = per_row) -> None:
                per_row.append(lba)
                await normal(lba, data, fua)  # type: ignore[operator]

            pool.io.write = spy  # type: ignore[method-assign]
            geo = pool.geo
            span = min(2 * geo.chunk_blocks * geo.data_chunks + 3, pool.num_blocks - 1)
            data = random.Random(level).randbytes(span * BS)
            await pool.write(1, data)
            assert per_row == ([] if fast else [1])
            assert bytes(await pool.read(1, span)) == data
            await pool.close()

    asyncio.run(go())
