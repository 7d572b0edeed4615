"""The rebuild rate limit on the real clock: a rebuild capped at four a second takes about a quarter second."""

from __future__ import annotations

import asyncio
import time

from pool_members import CHUNK, ROWS, Disk, filled


def run(coro):
    return asyncio.run(coro)


def test_rate_limit_holds() -> None:
    async def go() -> None:
        pool, _, _ = await filled(5)
        await pool.fail_member(2)
        pool.rebuild_rate = ROWS * CHUNK * 4  # four rebuilds a second: 0.25 s
        started = time.monotonic()
        await pool.replace(2, Disk("new"))
        await pool.wait_idle()
        took = time.monotonic() - started
        assert 0.2 <= took < 2.0, took
        await pool.close()

    run(go())
