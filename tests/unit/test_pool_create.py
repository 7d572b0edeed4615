"""Pool.create: sizes per level, and a clear PoolError for every impossible request."""

from __future__ import annotations

import asyncio

import pytest

from openvsan.block import BlockDevice, RamDevice
from openvsan.pool.raid import Pool, PoolError
from openvsan.pool.superblock import read_superblock

MiB = 1 << 20


def ram(mib: float, name: str = "ram", block_size: int = 512) -> RamDevice:
    return RamDevice(int(mib * MiB) // block_size, block_size, name=name)


def run(coro):
    return asyncio.run(coro)


def test_sizes_per_level() -> None:
    async def go() -> None:
        expect = {0: 4 * 3, 1: 3, 10: 2 * 3, 5: 3 * 3, 6: 2 * 3}  # MiB of data from 4 members of 1+3 MiB
        for level, mib in expect.items():
            devs = [ram(4, f"d{i}") for i in range(4 if level != 1 else 3)]
            pool = await Pool.create(devs, level)
            if level == 1:
                mib = 3
            assert pool.num_blocks * pool.block_size == mib * MiB, level
            assert pool.status().state == "optimal"
            cfg = pool.to_config()
            assert cfg["type"] == "pool" and cfg["level"] == level and len(cfg["members"]) == len(devs)
            await pool.close()

    run(go())


@pytest.mark.parametrize(("level", "count", "message"), [
    ("raid5", 2, "RAID 5 needs at least 3 members, 2 given"),
    ("raid6", 3, "RAID 6 needs at least 4 members, 3 given"),
    ("raid1", 1, "RAID 1 needs at least 2 members, 1 given"),
    ("raid10", 2, "RAID 10 needs at least 4 members, 2 given"),
    ("raid10", 5, "RAID 10 needs an even number of members"),
])
def test_too_few_members(level: str, count: int, message: str) -> None:
    with pytest.raises(PoolError, match=message):
        run(Pool.create([ram(2, f"d{i}") for i in range(count)], level))


def test_impossible_requests() -> None:
    async def go() -> None:
        # a member smaller than the others by more than a chunk: named, with how much
        with pytest.raises(PoolError, match=r"small is 1 MiB smaller than d0; members must be within one chunk"):
            await Pool.create([ram(4, "d0"), ram(4, "d1"), ram(3, "small")], "raid5")
        # within one chunk is fine: the pool uses the smallest
        pool = await Pool.create([ram(4, "d0"), ram(4, "d1"), RamDevice(4 * MiB // 512 - 64, name="d2")], "raid5")
        assert pool.num_blocks == 2 * (3 * MiB // 512 - 128)
        await pool.close()
        with pytest.raises(PoolError, match="4096-byte blocks, d0 512: members must have one block size"):
            await Pool.create([ram(4, "d0"), ram(4, "d1"), ram(4, "d2", 4096)], "raid5")
        with pytest.raises(PoolError, match="chunk size 12288 must be a power of two"):
            await Pool.create([ram(4, "d0"), ram(4, "d1")], "raid1", 12288)
        with pytest.raises(PoolError, match="too small"):
            await Pool.create([ram(1, "d0"), ram(1, "d1")], "raid1")
        with pytest.raises(PoolError, match="the same device is given twice"):
            d = ram(4)
            await Pool.create([d, d], "raid1")
        with pytest.raises(ValueError, match="unknown RAID level"):
            await Pool.create([ram(4), ram(4)], "raid4")

    run(go())


def test_member_of_another_pool_needs_force() -> None:
    async def go() -> None:
        class Keep(RamDevice):
            async def close(self) -> None:
                pass

        devs: list[BlockDevice] = [Keep(4 * MiB // 512, name=f"d{i}") for i in range(3)]
        first = await Pool.create(devs, "raid5", name="first")
        await first.close()
        with pytest.raises(PoolError, match=r"d0 already belongs to pool 'first' \(.*\); destroy that pool first or"
                                            r" pass force=True"):
            await Pool.create(devs, "raid1", name="second")
        second = await Pool.create(devs, "raid1", name="second", force=True)
        sb = await read_superblock(devs[0])
        assert sb is not None and sb.name == "second" and sb.pool_uuid == second.uuid
        await second.close()

    run(go())


def test_destroy_frees_the_members() -> None:
    async def go() -> None:
        class Keep(RamDevice):
            async def close(self) -> None:
                pass

        devs: list[BlockDevice] = [Keep(4 * MiB // 512, name=f"d{i}") for i in range(4)]
        pool = await Pool.create(devs[:3], "raid5", name="old")
        await pool.add_spare(devs[3])
        await pool.destroy()
        assert [await read_superblock(d) for d in devs] == [None] * 4
        with pytest.raises(PoolError, match="carries no openvsan pool superblock"):
            await Pool.assemble(devs)
        pool = await Pool.create(devs, "raid6", name="new")  # no force needed
        await pool.close()

    run(go())
