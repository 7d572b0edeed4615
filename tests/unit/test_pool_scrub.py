"""Scrub: a chunk corrupted behind the pool's back is found, reported, and repaired where the level allows."""

from __future__ import annotations

import asyncio
import random

import pytest

from openvsan.block import FaultDevice, RamDevice
from openvsan.pool.layout import Level
from openvsan.pool.raid import Pool

BS = 512
CHUNK = 4096
CB = CHUNK // BS
HEADER = 64 * 1024
ROWS = 32


def disks(n: int) -> list[FaultDevice]:
    return [FaultDevice(RamDevice((HEADER + ROWS * CHUNK) // BS), name=f"d{i}") for i in range(n)]


async def filled(level: int, n: int) -> tuple[Pool, list[FaultDevice], bytearray]:
    ds = disks(n)
    pool = await Pool.create(ds, level, CHUNK, data_offset=HEADER)
    rng = random.Random(level)
    model = bytearray(rng.randbytes(pool.num_blocks * BS))
    await pool.write(0, model)
    return pool, ds, model


async def corrupt(dev: FaultDevice, row: int, block: int = 3, bit: int = 77) -> None:
    await dev.corrupt(HEADER // BS + row * CB + block, bit=bit)


async def same(pool: Pool, model: bytearray) -> bool:
    return bytes(await pool.read(0, pool.num_blocks)) == bytes(model)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(("level", "n", "victim"), [(1, 3, 2), (10, 4, 3)])
def test_mirror_copy_mismatch_is_rewritten_from_the_first_copy(level: int, n: int, victim: int) -> None:
    async def go() -> None:
        pool, ds, model = await filled(level, n)
        await corrupt(ds[victim], 5)
        report = await pool.scrub(repair=False)
        assert (report.checked, report.mismatches, report.repaired) == (ROWS, 1, 0), report
        assert report.details[0].row == 5 and report.details[0].members == (victim,)
        report = await pool.scrub(repair=True)
        assert (report.mismatches, report.repaired, report.unrepairable) == (1, 1, 0)
        assert (await pool.scrub(repair=False)).clean
        # only the repaired copy of its data is left
        for i in ([victim ^ 1] if level == 10 else [i for i in range(n) if i != victim]):
            ds[i].fail_device()
        assert await same(pool, model)
        await pool.close()

    run(go())


def test_raid5_parity_is_rewritten_from_the_data() -> None:
    async def go() -> None:
        pool, ds, model = await filled(5, 4)
        row = 6
        p = pool.geo.parity_members(row)[0]
        await corrupt(ds[p], row)
        report = await pool.scrub(repair=True)
        assert (report.mismatches, report.repaired) == (1, 1)
        assert report.details[0].members == (p,) and "P disagrees" in report.details[0].what
        assert (await pool.scrub(repair=False)).clean
        d0 = pool.geo.data_members(row)[0]
        ds[d0].fail_device()  # the rewritten P now rebuilds that member's chunk
        assert await same(pool, model)
        await pool.close()

    run(go())


def test_raid5_corrupt_data_is_reported_and_parity_made_to_match() -> None:
    # RAID 5 cannot tell a bad data chunk from a bad P: the scrub reports the stripe and rewrites P, as MD's
    # "repair" does; the bad data stays bad (only RAID 6, or checksums, can locate it)
    async def go() -> None:
        pool, ds, model = await filled(5, 4)
        d = pool.geo.data_members(2)[1]
        await corrupt(ds[d], 2)
        report = await pool.scrub(repair=True)
        assert report.mismatches == 1 and report.details[0].row == 2
        assert (await pool.scrub(repair=False)).clean
        assert not await same(pool, model)
        await pool.close()

    run(go())


def test_raid6_locates_and_repairs_a_corrupt_data_chunk() -> None:
    async def go() -> None:
        pool, ds, model = await filled(6, 6)
        hits = {3: 0, 9: 2, 20: 3}  # row -> data index to corrupt
        for row, index in hits.items():
            await corrupt(ds[pool.geo.data_members(row)[index]], row, block=row % CB, bit=row)
        assert not await same(pool, model)
        report = await pool.scrub(repair=False)
        assert report.mismatches == 3 and report.repaired == 0
        for m in report.details:
            index = hits[m.row]
            assert m.members == (pool.geo.data_members(m.row)[index],)
            assert f"data chunk {index} on member {m.members[0]} is corrupt" in m.what
        report = await pool.scrub(repair=True)
        assert (report.mismatches, report.repaired, report.unrepairable) == (3, 3, 0)
        assert await same(pool, model)
        assert (await pool.scrub(repair=False)).clean
        await pool.close()

    run(go())


def test_raid6_p_or_q_alone_and_two_bad_chunks() -> None:
    async def go() -> None:
        pool, ds, _ = await filled(6, 5)
        p, _ = pool.geo.parity_members(1)
        await corrupt(ds[p], 1)
        _, q4 = pool.geo.parity_members(4)
        await corrupt(ds[q4], 4)
        dm = pool.geo.data_members(7)
        await corrupt(ds[dm[0]], 7)
        await corrupt(ds[dm[1]], 7, block=5)
        report = await pool.scrub(repair=True)
        found = {m.row: m for m in report.details}
        assert found[1].members == (p,) and found[1].what == "P disagrees with the data"
        assert found[4].members == (q4,) and found[4].what == "Q disagrees with the data"
        assert "more than one chunk is bad" in found[7].what
        assert (report.mismatches, report.repaired, report.unrepairable) == (3, 2, 1)
        assert report.as_dict()["unrepairable"] == 1
        await pool.close()

    run(go())


def test_raid0_scrub_reads_every_stripe_and_degraded_rows_are_skipped() -> None:
    async def go() -> None:
        pool, _, _ = await filled(0, 2)
        report = await pool.scrub()
        assert report.clean and report.checked == ROWS and report.skipped == 0  # read, nothing to compare
        await pool.close()
        pool, _, _ = await filled(5, 3)
        await pool.fail_member(0)
        report = await pool.scrub()
        assert pool.level is Level.RAID5 and report.clean
        # rows whose data chunk is on the failed member cannot be compared; the rest check P
        assert report.skipped + report.checked == ROWS and report.skipped > 0
        await pool.close()

    run(go())
