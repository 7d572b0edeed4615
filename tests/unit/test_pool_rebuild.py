"""Rebuild: replace a member, hot spares, writes during a rebuild, progress, resume after a restart, the rate
limit, all on simulated time (FakeClock; the rate on the real clock: tests/integration/test_pool_rebuild_timing.py).
Each rebuild is proven by failing a different member afterwards: the rebuilt chunks must then carry the data."""

from __future__ import annotations

import asyncio
import random

import pytest
from fake_clock import FakeClock
from pool_members import BS, CHUNK, COUNTS, ROWS, Disk, filled, scribble

from openvsan.pool.raid import Pool, PoolError
from openvsan.pool.rebuild import STEP_SECONDS
from openvsan.pool.superblock import MemberState, read_superblock


async def same(pool: Pool, model: bytearray) -> bool:
    return bytes(await pool.read(0, pool.num_blocks)) == bytes(model)


def run(coro):
    return asyncio.run(coro)


def timed(clock: FakeClock) -> dict[str, object]:
    """A pool's clock and sleep: simulated."""
    return {"clock": clock, "sleep": clock.sleep}


def other_victim(level: int, replaced: int) -> int:
    # RAID 10: the replaced member's partner, so the rebuilt copy is the only one left
    return replaced ^ 1 if level == 10 else (replaced + 1) % COUNTS[level]


@pytest.mark.parametrize("level", [1, 10, 5, 6])
def test_replace_rebuild_then_lose_another(level: int) -> None:
    async def go() -> None:
        pool, ds, model = await filled(level, **timed(FakeClock()))
        ds[0].fail_device()
        await scribble(pool, model, random.Random(99), 20)  # the failure is found, and writes go on degraded
        assert pool.status().state == "degraded"
        with pytest.raises(PoolError, match="member 1 .* is active; fail it first"):
            await pool.replace(1, Disk("x"))
        with pytest.raises(PoolError, match="fewer than"):
            await pool.replace(0, Disk("tiny", rows=2))
        new = Disk("new")
        await pool.replace(0, new)
        await pool.wait_idle()
        st = pool.status()
        assert st.state == "optimal" and st.members[0].name == "new", st
        ds[other_victim(level, 0)].fail_device()
        assert await same(pool, model)
        await pool.close()

    run(go())


def test_raid6_two_members_rebuilt_in_one_pass() -> None:
    async def go() -> None:
        pool, ds, model = await filled(6, **timed(FakeClock()))
        ds[1].fail_device()
        ds[3].fail_device()
        assert await same(pool, model)
        await pool.replace(1, Disk("n1"))
        await pool.replace(3, Disk("n3"))
        await pool.wait_idle()
        assert pool.status().state == "optimal"
        ds[0].fail_device()
        ds[2].fail_device()  # now only d4 and the two rebuilt members are left
        assert await same(pool, model)
        await pool.close()

    run(go())


@pytest.mark.parametrize("level", [1, 5, 6])
def test_hot_spare_takes_over(level: int) -> None:
    async def go() -> None:
        pool, ds, model = await filled(level, **timed(FakeClock()))
        spare = Disk("spare")
        await pool.add_spare(spare)
        assert pool.status().spares == ["spare"]
        ds[1].fail_device()
        await scribble(pool, model, random.Random(3), 5)  # a write finds the failure; the spare steps in
        st = pool.status()
        assert st.spares == [] and st.members[1].name == "spare" and st.members[1].state in ("rebuilding", "active")
        await pool.wait_idle()
        assert pool.status().state == "optimal"
        ds[other_victim(level, 1)].fail_device()
        assert await same(pool, model)
        await pool.close()

    run(go())


@pytest.mark.parametrize("level", [1, 10, 5, 6])
def test_writes_during_a_slow_rebuild(level: int) -> None:
    async def go() -> None:
        clock = FakeClock()
        pool, ds, model = await filled(level, rebuild_rate=ROWS * CHUNK * 3, **timed(clock))  # a third of a second
        await pool.fail_member(0)
        await pool.replace(0, Disk("new"))
        rng = random.Random(7)
        seen = []
        while pool.status().state == "rebuilding":
            seen.append(pool.status().rebuild_progress)
            await scribble(pool, model, rng, 3)  # above and below the checkpoint
            assert await same(pool, model)
            await clock.sleep(0.01)
        assert 30 <= len(seen) <= 36 and seen == sorted(seen), seen  # every 10 ms of 1/3 s; only forward
        assert pool.status().state == "optimal"
        ds[other_victim(level, 0)].fail_device()
        assert await same(pool, model)
        await pool.close()

    run(go())


@pytest.mark.parametrize("level", [1, 5, 6])
def test_interrupted_rebuild_resumes_from_checkpoint(level: int) -> None:
    async def go() -> None:
        clock = FakeClock()
        pool, ds, model = await filled(level, rebuild_rate=ROWS * CHUNK * 2, **timed(clock))  # half a second
        pool.maintenance.checkpoint_interval = 0.05
        await pool.fail_member(1)
        new = Disk("new")
        await pool.replace(1, new)
        await clock.sleep(0.25)  # half way
        await pool.close()  # mid-rebuild: the checkpoint is flushed and recorded
        sb = await read_superblock(new)
        assert sb is not None and sb.state is MemberState.REBUILDING
        resumed_at = sb.checkpoint // (CHUNK // BS)
        step = pool.maintenance._step_rows()
        assert ROWS // 2 <= resumed_at <= ROWS // 2 + step, (resumed_at, step)  # half the rows, or one step on
        pool = await Pool.assemble([ds[0], new, *ds[2:]], rebuild_rate=ROWS * CHUNK * 2, **timed(clock))
        m = pool.members[1]
        assert m.state is MemberState.REBUILDING and m.checkpoint == resumed_at
        steps: list[int] = []
        rebuild = pool.io.rebuild

        async def spy(targets: list[int], start: int, end: int) -> None:
            steps.append(start)
            await rebuild(targets, start, end)

        pool.io.rebuild = spy  # the background task has not run yet: assemble returned without yielding
        await pool.wait_idle()
        assert steps and steps[0] == resumed_at  # not from the start
        assert pool.status().state == "optimal"
        ds[other_victim(level, 1)].fail_device()
        assert await same(pool, model)
        await pool.close()

    run(go())


@pytest.mark.parametrize(("level", "copies"), [(1, 1), (6, 2)])
def test_rate_limit_over_simulated_time(level: int, copies: int) -> None:
    """`rebuild_rate` bytes/s of member data written: a rebuild of ROWS chunks onto `copies` members at a rate
    of 8 rows a second takes ROWS / 8 simulated seconds (to within the last step), and moves at that rate."""

    async def go() -> None:
        clock = FakeClock()
        rate = 8 * CHUNK
        pool, _, model = await filled(level, rebuild_rate=rate, **timed(clock))
        for m in range(copies):
            await pool.fail_member(m)
        started = clock.now
        for m in range(copies):
            await pool.replace(m, Disk(f"new{m}"))
        await clock.sleep(2.0)
        rows = pool.members[0].checkpoint
        assert pool.status().state == "rebuilding" and abs(rows - 2.0 * rate / CHUNK / copies) <= 1, rows
        await pool.wait_idle()
        took = clock.now - started
        want = ROWS * CHUNK * copies / rate
        assert want - STEP_SECONDS <= took <= want + STEP_SECONDS, (took, want)
        assert pool.status().state == "optimal" and await same(pool, model)
        await pool.close()

    run(go())
