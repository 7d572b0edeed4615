"""The write-intent bitmap and the resync: the write hole closed, under power loss modelled by FaultDevice's
volatile cache (unflushed writes lost or torn at random), for RAID 1, 5 and 6. Time is simulated (FakeClock):
the idle time before a bit is cleared, the members' latency, the moment of the crash."""

from __future__ import annotations

import asyncio
import random

import pytest
from fake_clock import FakeClock, SimulatedLatency, settle

from openvsan.block import FaultDevice, RamDevice
from openvsan.pool.bitmap import WriteIntentBitmap
from openvsan.pool.parity import backend
from openvsan.pool.raid import Pool
from openvsan.pool.superblock import BITMAP_OFFSET

BS = 512
CHUNK = 4096
CB = CHUNK // BS
HEADER = 64 * 1024
ROWS = 32


class Disk(SimulatedLatency, FaultDevice):
    """A member that outlives the pool object (close is a no-op), with a volatile write cache and, given a
    clock, `latency` seconds of simulated time per request."""

    def __init__(self, name: str, clock: FakeClock | None = None, latency: float = 0.0) -> None:
        super().__init__(RamDevice((HEADER + ROWS * CHUNK) // BS), name=name, volatile_cache=True)
        self.clock, self.delay = clock, latency

    async def close(self) -> None:
        pass


def timed(clock: FakeClock) -> dict[str, object]:
    """A pool's clock and sleep: simulated."""
    return {"clock": clock, "sleep": clock.sleep}


# --- WriteIntentBitmap alone -------------------------------------------------------------------------------------


def test_bit_is_durable_before_the_write_and_cleared_when_idle() -> None:
    async def go() -> None:
        stored: list[tuple[int, bytes, bool]] = []
        flushed = []

        async def store(block: int, content: bytes, fua: bool) -> None:
            await asyncio.sleep(0)  # the other writers run meanwhile
            stored.append((block, content, fua))

        async def flush() -> None:
            flushed.append(1)

        clock = FakeClock()
        bm = WriteIntentBitmap(regions=5000, region_rows=4, block_size=512, store=store, idle_s=0.5, clock=clock)
        assert bm.byte_size == 1024 and bm.regions_of(0, 9) == range(3)
        # two writers to one clean region, and one to a region in another bitmap block: every bit is durable
        # (written with FUA) by the time begin() returns; the second writer of region 1 adds no write
        await asyncio.gather(bm.begin([1]), bm.begin([1]), bm.begin([4100]))
        assert sorted(stored) == [(0, stored[0][1], True), (1, stored[1][1], True)]  # 4096 bits a block
        assert bm.dirty() == [1, 4100] and bm.durable == bm.bits
        stored.clear()
        await bm.begin([1])  # already durable: nothing written
        assert stored == []
        bm.end([1])
        bm.end([1])
        assert await bm.clear_idle(flush) == 0  # region 1 still has a writer in flight; 4100 not idle yet
        bm.end([1])
        bm.end([4100])
        clock.advance(0.25)
        assert await bm.clear_idle(flush) == 0 and flushed == []  # idle, but not for idle_s yet
        clock.advance(0.25)  # (sums a float clock holds exactly: idle for idle_s, to the bit)
        bm.pending_resync.add(4100)  # a region waiting for resync keeps its bit
        assert await bm.clear_idle(flush) == 1
        assert flushed == [1] and bm.dirty() == [4100]
        assert stored == [(0, bytes(512), False)]  # the cleared block; no FUA needed to clear
        assert not bm.durable[0] & 2  # and a later writer of region 1 writes its bit again

    asyncio.run(go())


def test_a_write_after_the_idle_check_keeps_its_bit() -> None:
    async def go() -> None:
        async def store(block: int, content: bytes, fua: bool) -> None:
            pass

        bm = WriteIntentBitmap(regions=8, region_rows=1, block_size=512, store=store, idle_s=0.0, clock=FakeClock())
        await bm.begin([3])
        bm.end([3])

        async def flush() -> None:
            # a write to region 3 starts and finishes while the members are being flushed
            await bm.begin([3])
            bm.end([3])

        assert await bm.clear_idle(flush) == 0 and bm.dirty() == [3]

    asyncio.run(go())


# --- the pool ------------------------------------------------------------------------------------------------------


def test_bitmap_on_the_members_follows_writes() -> None:
    async def go() -> None:
        clock = FakeClock()
        ds = [Disk(f"d{i}") for i in range(3)]
        pool = await Pool.create(ds, 5, CHUNK, data_offset=HEADER, bitmap_region=4, bitmap_idle_s=0.05, **timed(clock))
        assert pool.bitmap is not None
        await pool.write(2 * 9 * CB, b"\1" * BS)  # row 9: region 2

        async def on_disk(d: Disk) -> int:
            raw = await d.inner.read(BITMAP_OFFSET // BS, 1)  # the medium, not the cache: durable?
            return raw[0]

        assert [await on_disk(d) for d in ds] == [4, 4, 4]
        await clock.sleep(0.04)  # the cleaner has looked (every idle_s / 2): not idle long enough
        assert pool.status().dirty_regions == 1
        await clock.sleep(0.04)  # idle for idle_s at the next look: flushed, then cleared
        assert pool.status().dirty_regions == 0
        await pool.flush()
        assert [await on_disk(d) for d in ds] == [0, 0, 0]
        await pool.write(0, b"\2" * BS)
        await pool.close()  # a clean close leaves no bit set
        assert [await on_disk(d) for d in ds] == [0, 0, 0]

    asyncio.run(go())


def test_torn_stripe_is_resynced_before_a_member_loss_can_expose_it() -> None:
    """The classic write hole: a partial-stripe write reaches the data member but not the parity member, then
    the power goes. Without the resync, losing another member of that stripe rebuilds garbage."""
    model = bytearray(random.Random(1).randbytes(3 * ROWS * CHUNK))
    row = 5
    state: dict[str, object] = {}

    clock = FakeClock()

    async def before_crash() -> list[Disk]:
        ds = [Disk(f"d{i}") for i in range(4)]
        pool = await Pool.create(ds, 5, CHUNK, data_offset=HEADER, **timed(clock))
        await pool.write(0, model)
        await pool.flush()
        dm, (p,) = pool.geo.data_members(row), pool.geo.parity_members(row)
        state.update(dm=dm, p=p)
        new = b"\xee" * BS
        lba = row * 3 * CB  # data chunk 0 of the row
        await pool.write(lba, new)  # read-modify-write: data chunk 0 and P, both in the caches
        model[lba * BS:(lba + 1) * BS] = new  # (or the old value: it was never flushed)
        for d in ds:
            d.crash(survive=1.0 if d is ds[dm[0]] else 0.0)  # data reached the disk, parity did not
        return ds  # the process "dies": asyncio.run cancels whatever the pool still had running

    ds = asyncio.run(before_crash())

    async def after() -> None:
        for d in ds:
            await d.restart()
        dm, p = state["dm"], state["p"]
        assert isinstance(dm, tuple) and isinstance(p, int)
        raw = [bytes(await ds[m].read(HEADER // BS + row * CB, CB)) for m in (*dm, p)]
        assert backend().xor(raw[:3]) != raw[3]  # the hole is there
        pool = await Pool.assemble(ds, **timed(clock))
        assert pool.status().resync_progress is not None  # dirty region found
        await pool.wait_idle()
        assert pool.maintenance.resync_fixed == 1
        assert (await pool.scrub(repair=False)).clean
        ds[dm[1]].fail_device()
        assert bytes(await pool.read(0, pool.num_blocks)) == bytes(model)
        await pool.close()

    asyncio.run(after())


@pytest.mark.parametrize(("level", "n"), [(1, 2), (5, 4), (6, 5)])
@pytest.mark.parametrize("seed", range(4))
def test_power_loss_mid_writes_then_member_loss(level: int, n: int, seed: int) -> None:
    """Concurrent writes, a random power loss with the caches half written back, restart: the resync leaves
    no inconsistent stripe, and after losing members every block holds its durable value or one written
    since the last flush (a block nobody wrote is never damaged by its stripe's neighbours)."""
    rng = random.Random(seed * 100 + level)
    clock = FakeClock()
    ds = [Disk(f"d{i}", clock, latency=0.0003) for i in range(n)]
    blocks = 0
    durable = bytearray()
    allowed: dict[int, set[bytes]] = {}

    async def before_crash() -> None:
        nonlocal blocks, durable
        pool = await Pool.create(ds, level, CHUNK, data_offset=HEADER, bitmap_region=2, bitmap_idle_s=0.01,
                                 **timed(clock))
        blocks = pool.num_blocks
        durable = bytearray(rng.randbytes(blocks * BS))
        await pool.write(0, durable, fua=True)
        model = bytearray(durable)

        async def one(lba: int, buf: bytes) -> None:
            allowed.setdefault(lba, set()).add(buf)
            await pool.write(lba, buf, fua=rng.random() < 0.2)

        crash_at = rng.randrange(3, 12)
        for batch in range(crash_at + 1):
            lbas = rng.sample(range(blocks), 12)
            bufs = [rng.randbytes(BS) for _ in lbas]
            tasks = [asyncio.ensure_future(one(a, b)) for a, b in zip(lbas, bufs, strict=True)]
            if batch == crash_at:
                await clock.sleep(rng.random() * 0.004)  # mid-batch
                for d in ds:
                    d.crash(survive=rng.random(), rng=rng)
                return
            await asyncio.gather(*tasks)
            for a, b in zip(lbas, bufs, strict=True):
                model[a * BS:(a + 1) * BS] = b
            if rng.random() < 0.3:
                await pool.flush()
                durable[:] = model
                allowed.clear()

    asyncio.run(before_crash())

    async def after() -> None:
        for d in ds:
            await d.restart()
        pool = await Pool.assemble(ds, **timed(clock))
        await pool.wait_idle()
        report = await pool.scrub(repair=False)
        assert report.clean, report
        for m in rng.sample(range(n), {1: 1, 5: 1, 6: 2}[level]):
            ds[m].fail_device()
        got = bytes(await pool.read(0, blocks))
        for b in range(blocks):
            block = got[b * BS:(b + 1) * BS]
            if block != durable[b * BS:(b + 1) * BS] and block not in allowed.get(b, ()):
                raise AssertionError(f"block {b} holds neither its durable value nor one written since")
        await pool.close()

    asyncio.run(after())


@pytest.mark.parametrize(("level", "n"), [(1, 3), (5, 4), (6, 5)])
def test_create_with_init_resync_over_garbage(level: int, n: int) -> None:
    """init="resync": the members keep whatever they held; every region is dirty and the background resync
    makes parity (or the copies) agree with the data before the scrub looks."""

    async def go() -> None:
        rng = random.Random(level)
        ds = [Disk(f"d{i}") for i in range(n)]
        for d in ds:
            await d.inner.write(0, rng.randbytes(d.num_blocks * BS))
        pool = await Pool.create(ds, level, CHUNK, data_offset=HEADER, init="resync", bitmap_region=4,
                                 **timed(FakeClock()))
        st = pool.status()
        assert st.resync_progress == 0.0 and st.dirty_regions == ROWS // 4
        await pool.wait_idle()
        assert pool.status().resync_progress is None
        assert (await pool.scrub(repair=False)).clean
        data = bytes(await pool.read(0, pool.num_blocks))
        ds[0].fail_device()
        assert bytes(await pool.read(0, pool.num_blocks)) == data
        await pool.close()

    asyncio.run(go())


def test_a_writer_during_a_lazy_clear_sets_its_bit_again_after_it() -> None:
    """The race CI's SIGKILL test found: a lazy clear has taken the bitmap block's content (bit clear) and is
    writing it; a writer that comes now must not trust the bit as durable, or the clear lands on disk while
    its stripe update is in flight, and a crash then leaves a torn stripe that no resync knows of."""

    async def go() -> None:
        on_disk: list[tuple[int, bool]] = []
        gate = asyncio.Event()

        async def store(block: int, content: bytes, fua: bool) -> None:
            if not fua:
                await gate.wait()   # the lazy clear's write is slow
            on_disk.append((content[0], fua))

        async def flush() -> None:
            pass

        bm = WriteIntentBitmap(8, 1, 512, store, idle_s=0, clock=FakeClock())
        await bm.begin([0])
        bm.end([0])
        assert on_disk == [(1, True)]
        clearing = asyncio.create_task(bm.clear_idle(flush))
        await settle()                     # the clear now waits inside its store
        writer = asyncio.create_task(bm.begin([0]))
        await settle()
        assert not writer.done()           # the writer's bit must reach the disk after the clear, FUA
        gate.set()
        await clearing
        await writer
        assert on_disk[-1] == (1, True), on_disk
        bm.end([0])

    asyncio.run(go())


def test_a_bitmap_write_that_ends_during_a_lazy_clear_does_not_make_the_cleared_bit_durable_again() -> None:
    """The race `tests/fault/test_pool_crash.py` hit about once in 700 rounds: a writer of another region of
    the same bitmap block is writing the block (its content still has region 0's bit) when the lazy clear
    clears region 0; that write ends first and, counting its whole content as on disk, made bit 0 durable
    again while the clear's write (bit 0 clear) was queued behind it. A writer of region 0 then trusted the
    bit, wrote its stripe, and the clear landed on disk meanwhile: a crash left a torn stripe that no resync
    knows of (all members active, the row not among the dirty regions)."""

    async def go() -> None:
        on_disk: list[tuple[int, bool]] = []
        gates: list[asyncio.Event] = []

        async def store(block: int, content: bytes, fua: bool) -> None:
            gate = asyncio.Event()
            gates.append(gate)
            await gate.wait()
            on_disk.append((content[0], fua))

        async def flush() -> None:
            pass

        def release() -> None:
            for g in gates:
                g.set()

        bm = WriteIntentBitmap(8, 1, 512, store, idle_s=0, clock=FakeClock())
        first = asyncio.create_task(bm.begin([0]))
        await settle()
        release()
        await first
        bm.end([0])                               # region 0: dirty, durable, idle
        other = asyncio.create_task(bm.begin([1]))   # region 1, same block: a FUA write of bits 0 and 1
        await settle()
        clearing = asyncio.create_task(bm.clear_idle(flush))
        await settle()                            # region 0 cleared in memory; its write waits for the block
        gates[-1].set()                           # region 1's write ends (its content: bit 0 still set)
        await other
        await settle()                            # the clear's write has the block now, and is slow
        writer = asyncio.create_task(bm.begin([0]))
        await settle()
        assert not writer.done(), "trusted a bit that the lazy clear is taking off the disk"
        while not (clearing.done() and writer.done()):
            release()
            await settle()
        assert on_disk[-1] == (0b11, True), on_disk   # the last word on disk: bits 0 and 1 set, FUA
        bm.end([0])
        bm.end([1])

    asyncio.run(go())
