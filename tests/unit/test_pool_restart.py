"""Pool.assemble: restarts with members in any order, missing, stale, torn superblock updates, and refusals."""

from __future__ import annotations

import asyncio
import random

import pytest
from fake_clock import FakeClock

from openvsan.block import FaultDevice, RamDevice
from openvsan.pool.raid import Pool, PoolError
from openvsan.pool.superblock import MemberState, read_superblock, write_superblock

BS = 512
CHUNK = 4096
HEADER = 64 * 1024
ROWS = 32


class Disk(FaultDevice):
    """A member that outlives the pool object (close is a no-op), like a disk that stays in the machine."""

    def __init__(self, name: str, rows: int = ROWS) -> None:
        super().__init__(RamDevice((HEADER + rows * CHUNK) // BS), name=name)

    async def close(self) -> None:
        pass


def disks(n: int, prefix: str = "d") -> list[Disk]:
    return [Disk(f"{prefix}{i}") for i in range(n)]


async def fill(pool: Pool, model: bytearray, rng: random.Random, writes: int = 40) -> None:
    for _ in range(writes):
        lba = rng.randrange(pool.num_blocks)
        blocks = min(rng.randint(1, 24), pool.num_blocks - lba)
        buf = rng.randbytes(blocks * BS)
        await pool.write(lba, buf)
        model[lba * BS:(lba + blocks) * BS] = buf


async def same(pool: Pool, model: bytearray) -> bool:
    return bytes(await pool.read(0, pool.num_blocks)) == bytes(model)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("level", [0, 1, 10, 5, 6])
def test_close_and_reassemble_in_any_order(level: int) -> None:
    async def go() -> None:
        ds = disks({0: 3, 1: 2, 10: 4, 5: 4, 6: 5}[level])
        pool = await Pool.create(ds, level, CHUNK, data_offset=HEADER, name="tank")
        model = bytearray(pool.num_blocks * BS)
        await fill(pool, model, random.Random(level))
        uuid = pool.uuid
        await pool.close()
        sb = await read_superblock(ds[0])
        assert sb is not None and sb.clean and sb.name == "tank"
        shuffled = ds[::-1]
        pool = await Pool.assemble(shuffled)
        assert pool.uuid == uuid and pool.name == "tank" and [m.dev for m in pool.members] == ds
        assert pool.status().state == "optimal" and not pool.status().dirty_regions
        assert await same(pool, model)
        await pool.close()

    run(go())


def test_member_missing_then_stale_member_is_resynced_not_trusted() -> None:
    async def go() -> None:
        ds = disks(4)
        pool = await Pool.create(ds, 5, CHUNK, data_offset=HEADER)
        model = bytearray(pool.num_blocks * BS)
        rng = random.Random(5)
        await fill(pool, model, rng)
        await pool.close()
        # restart without d2: degraded, and d2 is recorded missing
        pool = await Pool.assemble([ds[3], ds[0], ds[1]])
        st = pool.status()
        assert st.state == "degraded" and st.members[2].state == "missing"
        assert await same(pool, model)
        await fill(pool, model, rng, 60)  # d2 misses these writes
        await pool.close()
        sb2, sb0 = await read_superblock(ds[2]), await read_superblock(ds[0])
        assert sb2 is not None and sb0 is not None and sb2.event < sb0.event
        assert sb0.roles[2].state is MemberState.MISSING
        # d2 comes back with its old event: rebuilt (at 64 rows a simulated second), never read while it is behind
        clock = FakeClock()
        pool = await Pool.assemble(ds, rebuild_rate=CHUNK * 64, clock=clock, sleep=clock.sleep)
        st = pool.status()
        assert st.state == "rebuilding" and st.members[2].state == "rebuilding"
        assert await same(pool, model)  # served from the other three while d2 is behind
        await pool.wait_idle()
        assert pool.status().state == "optimal"
        ds[0].fail_device()  # now d2's rebuilt chunks carry the data
        assert await same(pool, model)
        await pool.close()

    run(go())


def test_refusals() -> None:
    async def go() -> None:
        a = disks(3, "a")
        b = disks(3, "b")
        pa = await Pool.create(a, 5, CHUNK, data_offset=HEADER, name="pa")
        pb = await Pool.create(b, 5, CHUNK, data_offset=HEADER, name="pb")
        await pa.close()
        await pb.close()
        with pytest.raises(PoolError, match=r"the devices belong to 2 different pools \(a0: pool 'pa'"):
            await Pool.assemble([a[0], a[1], b[2]])
        with pytest.raises(PoolError, match=r"members 1 \(missing\), 2 \(missing\) cannot be used; RAID 5 of 3 "
                                            r"members tolerates 1 lost \(refusing to start\)"):
            await Pool.assemble([a[0]])
        with pytest.raises(PoolError, match="blank carries no openvsan pool superblock"):
            await Pool.assemble([a[0], a[1], Disk("blank")])
        with pytest.raises(PoolError, match="no devices"):
            await Pool.assemble([])
        # all members there but one unreadable: left out, and the pool starts degraded
        a[1].fail_device()
        pool = await Pool.assemble(a)
        assert pool.status().state == "degraded"
        await pool.close()

    run(go())


def test_torn_superblock_update_one_event_behind_is_trusted() -> None:
    """A crash while superblocks were being written leaves some members one event behind: they are in sync
    (nothing was written that skipped them) and must not be rebuilt."""

    async def go() -> None:
        ds = disks(3)
        pool = await Pool.create(ds, 5, CHUNK, data_offset=HEADER)
        model = bytearray(pool.num_blocks * BS)
        await fill(pool, model, random.Random(1))
        await pool.close()
        sb = await read_superblock(ds[0])
        assert sb is not None
        await write_superblock(ds[0], sb.evolve(event=sb.event + 1, clean=False))  # only d0 got the update
        pool = await Pool.assemble(ds)
        assert pool.status().state == "optimal"
        assert await same(pool, model)
        await pool.close()
        # two events behind is stale
        for d in ds[:2]:
            sb = await read_superblock(d)
            assert sb is not None
            await write_superblock(d, sb.evolve(event=sb.event + 2))
        pool = await Pool.assemble(ds)
        assert [m.state for m in pool.status().members] == ["active", "active", "rebuilding"]
        await pool.wait_idle()
        assert await same(pool, model)
        await pool.close()

    run(go())


def test_replaced_member_and_spares_after_restart() -> None:
    async def go() -> None:
        ds = disks(4)
        pool = await Pool.create(ds, 6, CHUNK, data_offset=HEADER)
        model = bytearray(pool.num_blocks * BS)
        await fill(pool, model, random.Random(2))
        spare, new = Disk("spare"), Disk("new")
        await pool.add_spare(spare)
        await pool.fail_member(1)  # the spare takes over slot 1 at once
        assert pool.status().members[1].name == "spare"
        await pool.wait_idle()
        await pool.close()
        # the old d1 still carries slot 1's superblock, with an older member UUID: ignored, not trusted
        pool = await Pool.assemble([ds[1], *ds[2:], ds[0], spare])
        assert [m.name for m in pool.status().members] == ["d0", "spare", "d2", "d3"]
        assert pool.status().state == "optimal"
        assert await same(pool, model)
        await pool.add_spare(new)
        await pool.close()
        pool = await Pool.assemble([*ds, spare, new])
        assert pool.status().spares == ["new"]
        await pool.close()

    run(go())


def test_create_with_spares_and_a_spare_takes_over() -> None:
    async def go() -> None:
        ds = disks(3)
        spare = Disk("s0")
        pool = await Pool.create(ds, 5, CHUNK, data_offset=HEADER, spares=[spare])
        assert pool.status().spares == ["s0"]
        model = bytearray(pool.num_blocks * BS)
        await fill(pool, model, random.Random(3))
        await pool.fail_member(2)
        assert pool.status().members[2].name == "s0"
        await pool.wait_idle()
        ds[0].fail_device()   # the rebuilt spare must now carry its share
        assert await same(pool, model)
        await pool.close()

    run(go())


@pytest.mark.parametrize("level, bad", [(10, [3]), (5, [1]), (5, [1, 2])])
def test_bad_sector_in_a_members_bitmap_fails_that_member_at_assembly(level: int, bad: list[int]) -> None:
    """A member whose write-intent bitmap cannot be read at start-up is failed, like any member I/O error; the
    pool comes up degraded when it tolerates that, and refuses with one line when it does not."""
    from openvsan.pool.superblock import BITMAP_OFFSET

    async def go() -> None:
        ds = disks(4)
        pool = await Pool.create(ds, level, CHUNK, data_offset=HEADER, name="tank")
        model = bytearray(pool.num_blocks * BS)
        await fill(pool, model, random.Random(3))
        await pool.close()
        for i in bad:
            ds[i].fail(BITMAP_OFFSET // BS)
        if len(bad) > 1:
            with pytest.raises(PoolError, match="while reading the write-intent bitmaps"):
                await Pool.assemble(ds)
            return
        pool = await Pool.assemble(ds)
        assert [m.state for m in pool.status().members] == ["failed" if i in bad else "active" for i in range(4)]
        assert await same(pool, model)
        await pool.close()

    run(go())
