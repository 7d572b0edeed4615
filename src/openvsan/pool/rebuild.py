"""Background work of a redundant pool: the resync of dirty regions, then the rebuild of new members.

Resync (after a crash, see bitmap.py): each region pending resync is checked row by row with repair on, which
recomputes parity from the data (RAID 5/6; no syndrome decoding, since a torn update is not corruption) or
copies the first mirror to the others; the members are flushed; the region is then left for the bitmap's lazy
clearing.

Rebuild: a member in state REBUILDING is in sync below its checkpoint row. The rebuild walks the rows from the
lowest checkpoint, a batch at a time under the batch's stripe locks, and writes what the member should hold
(a copy; or a data chunk recovered from the others; or parity recomputed), then moves the checkpoint past the
batch. Writes from users go to a rebuilding member for rows below its checkpoint and skip it above, so the
member is right wherever the checkpoint says it is. Every `checkpoint_interval` seconds the rebuilt members are
flushed and the checkpoints written to the superblocks, so a restart resumes there. When a member reaches the
end it becomes ACTIVE. Several members rebuild in one pass (RAID 6 replacing two): members at the lowest
checkpoint are rebuilt together, and the batch stops where another member's checkpoint begins.

Both are limited to `rate` bytes/s of member data written (None: as fast as the members go), and yield to
the event loop between batches. Time is the pool's `clock` and `sleep` (time.monotonic and asyncio.sleep; the
unit tests pass simulated ones).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from openvsan.block.errors import DeviceFailed
from openvsan.pool.members import MemberFaults
from openvsan.pool.superblock import MemberState

if TYPE_CHECKING:
    from openvsan.pool.raid import Pool

log = logging.getLogger("openvsan.pool")

STEP_SECONDS = 0.05

Sleep = Callable[[float], Awaitable[None]]


class Maintenance:
    def __init__(self, pool: Pool, *, rate: float | None = None, checkpoint_interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Sleep = asyncio.sleep) -> None:
        self.pool = pool
        self.clock = clock
        self.sleep = sleep
        self.rate = rate
        self.checkpoint_interval = checkpoint_interval
        self.task: asyncio.Task[None] | None = None
        self.error: str | None = None
        self.resync_total = 0
        self.resync_fixed = 0  # stripes whose parity or copies the resync had to rewrite
        self.bitmap_copy_needed = False
        self._bytes = 0
        self._started = 0.0  # clock time the task started: the rate is kept from there

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def kick(self) -> None:
        """Start the background task if there is work and it is not running."""
        if not self.running and self.pool.has_background_work():
            self.task = asyncio.get_running_loop().create_task(self._run(), name=f"pool-{self.pool.name}-maint")

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        self.task = None

    async def wait(self) -> None:
        """Until no resync or rebuild is left (or the pool failed)."""
        while self.running:
            assert self.task is not None
            await asyncio.shield(self.task)

    def resync_progress(self) -> float | None:
        """Percent of the dirty regions resynced; None when none is pending."""
        bitmap = self.pool.bitmap
        pending = len(bitmap.pending_resync) if bitmap is not None else 0
        if not pending:
            return None
        self.resync_total = max(self.resync_total, pending)
        return 100.0 * (self.resync_total - pending) / self.resync_total

    # --- the task ---------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        self._bytes, self._started = 0, self.clock()
        try:
            while not self.pool.failed:
                bitmap = self.pool.bitmap
                if bitmap is not None and self.bitmap_copy_needed:
                    self.bitmap_copy_needed = False
                    await bitmap.write_all(fua=True)
                if bitmap is not None and bitmap.pending_resync:
                    await self._resync_one(min(bitmap.pending_resync))
                elif any(m.state is MemberState.REBUILDING for m in self.pool.members):
                    await self._rebuild_batch()
                else:
                    break
        except DeviceFailed as e:
            log.error("pool %s: background work stopped: %s", self.pool.name, e)
            self.error = str(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("pool %s: background work failed", self.pool.name)
            self.error = f"{type(e).__name__}: {e}"

    def _step_rows(self) -> int:
        """Rows per step: the pool's batch, or less under a rate limit, so the limit is kept in steps of about
        STEP_SECONDS rather than in bursts of a whole batch."""
        batch = self.pool.batch_rows
        if not self.rate:
            return batch
        return max(1, min(batch, int(self.rate * STEP_SECONDS) // self.pool.chunk_size))

    async def _throttle(self, nbytes: int) -> None:
        self._bytes += nbytes
        if self.rate:
            due = self._started + self._bytes / self.rate
            delay = due - self.clock()
            if delay > 0:
                await self.sleep(delay)
                return
        await asyncio.sleep(0)

    async def _resync_one(self, region: int) -> None:
        pool = self.pool
        assert pool.bitmap is not None
        self.resync_progress()  # counts the regions pending now, the 0 % mark
        first = region * pool.bitmap.region_rows
        last = min(pool.geo.rows, first + pool.bitmap.region_rows)
        step = self._step_rows()
        for start in range(first, last, step):
            end = min(last, start + step)
            rc = await pool.check_rows(start, end, repair=True, locate=False)
            self.resync_fixed += rc.repaired
            await self._throttle((end - start) * pool.chunk_size)
        await pool.flush_members()
        pool.bitmap.pending_resync.discard(region)
        if not pool.bitmap.pending_resync:
            log.info("pool %s: resync done, %d stripes rewritten", pool.name, self.resync_fixed)
            self.resync_total = 0

    async def _rebuild_batch(self) -> None:
        pool = self.pool
        rows = pool.geo.rows
        targets = [m for m in pool.members if m.state is MemberState.REBUILDING]
        start = min(m.checkpoint for m in targets)
        end = min([rows, start + self._step_rows()] + [m.checkpoint for m in targets if m.checkpoint > start])
        group = [m.index for m in targets if m.checkpoint == start]
        if start < rows:
            async with pool.locks.hold_rows(start, end):
                try:
                    await pool.io.rebuild(group, start, end)
                except MemberFaults as e:
                    await pool.fail(e)
                    return  # re-plan: a source or a target is gone
                for i in group:
                    if pool.members[i].state is MemberState.REBUILDING:
                        pool.members[i].checkpoint = end
            await self._throttle((end - start) * pool.chunk_size * len(group))
        finished = [m for m in targets if m.state is MemberState.REBUILDING and m.checkpoint >= rows]
        due = self.clock() - pool.checkpointed_at >= self.checkpoint_interval
        if finished or due:
            # the rebuilt rows must be durable before a superblock says they are in sync
            await pool.flush_members([m.index for m in targets if m.state is MemberState.REBUILDING])
            for m in finished:
                if m.state is MemberState.REBUILDING:
                    m.state = MemberState.ACTIVE
                    log.info("pool %s: member %d (%s) rebuilt", pool.name, m.index, m.name)
            await pool.persist(changed=True)
