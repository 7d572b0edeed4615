"""Pool: a RAID 0/1/10/5/6 BlockDevice over member BlockDevices.

```python
pool = await Pool.create([d0, d1, d2, d3], "raid5", chunk_size=64 * 1024, name="tank")
pool = await Pool.assemble([d2, d0, d3])        # any order; a missing member within tolerance: degraded
await pool.write(lba, data); await pool.read(lba, blocks)
await pool.add_spare(d4)                        # takes over a failed member by itself
await pool.replace(1, d5)                       # rebuilds member 1 onto d5 in the background
pool.status()                                   # PoolStatus: state, members, rebuild/resync progress
await pool.scrub(repair=True)                   # ScrubReport
await pool.close()                              # clean shutdown (closes the members too)
```

The pieces, one concept per module: `layout.py` (where blocks live), `superblock.py` (the member header),
`assembly.py` (create's checks, and which members assembly trusts), `bitmap.py` (write-intent bitmap: the
write-hole choice), `locks.py` (stripe locks), `members.py` (member state and I/O), `io_mirror.py` /
`io_parity.py` (each level's read, write, rebuild and check of rows), `rebuild.py` (background resync and
rebuild), `scrub.py` (the scrub report), `status.py` (what status() says). This module is the Pool itself:
member failure, replace and spares, superblock updates, background work, status, the BlockDevice calls, close.

Member failure: a member request that raises MediumError or DeviceFailed marks the member FAILED; the
superblocks of the others record it (event + 1) before the request that saw it (or any write that skipped the
member) is acknowledged, so a restart never trusts a member that missed writes. The request is then served by
the other copies or by reconstruction. A failure beyond what the level tolerates stops the pool: every request
raises DeviceFailed and the superblocks are left as they were, so the pool can be assembled again once the
members are back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid as uuidlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer, check_range
from openvsan.block.errors import DeviceFailed
from openvsan.pool import assembly
from openvsan.pool.assembly import DEFAULT_CHUNK, PoolError, dev_name, fmt
from openvsan.pool.bitmap import WriteIntentBitmap
from openvsan.pool.io_mirror import MirrorIO
from openvsan.pool.layout import Geometry, Level
from openvsan.pool.locks import StripeLocks
from openvsan.pool.members import MEMBER_FAULTS, Member, MemberFaults, MemberSet
from openvsan.pool.rebuild import Maintenance, Sleep
from openvsan.pool.scrub import RowCheck, ScrubReport, scrub_rows
from openvsan.pool.status import MemberStatus, PoolStatus
from openvsan.pool.superblock import (
    BITMAP_OFFSET,
    DEFAULT_DATA_OFFSET,
    SPARE_INDEX,
    MemberState,
    Role,
    Superblock,
    erase_superblock,
    read_superblock,
    write_superblock,
)

log = logging.getLogger("openvsan.pool")

BATCH_BYTES = 1 << 20  # member data per rebuild / resync / scrub step


async def _zero_member(dev: BlockDevice, *, lba: int, blocks: int, unmap: bool) -> None:
    await (dev.unmap(lba, blocks) if unmap else dev.write_zeroes(lba, blocks))


class Pool:
    """Use `await Pool.create(...)` or `await Pool.assemble(...)`, not the constructor."""

    def __init__(self, base: Superblock, geo: Geometry, members: list[Member],
                 spares: list[tuple[BlockDevice, uuidlib.UUID]], *, event: int, rebuild_rate: float | None,
                 parity: str | None, bitmap_idle_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Sleep = asyncio.sleep) -> None:
        self._base = base
        self.clock = clock  # seconds, and how to wait for them: the bitmap's idle time, the rebuild's rate
        self.sleep = sleep
        self.name = base.name
        self.uuid = base.pool_uuid
        self.level = Level(base.level)
        self.chunk_size = base.chunk_size
        self.block_size = base.block_size
        self.geo = geo
        self._row_blocks = geo.chunk_blocks * geo.data_chunks   # logical blocks of a stripe row
        self.num_blocks = geo.num_blocks
        # a write without FUA may sit in a member's cache until flush; a fixed size. Reads and writes have the
        # fast path (read_now, write_now) where the members do, and the pool is healthy (they decline otherwise)
        self.capabilities = Capabilities(volatile_cache=True, sync_read=True, sync_write=True)
        self.data_offset = base.data_offset
        self.members = members
        self.spares = spares
        self.locks = StripeLocks()
        self.batch_rows = max(1, BATCH_BYTES // self.chunk_size)
        self.failed = False
        self.checkpointed_at = self.clock()
        self._event = event
        self._state_gen = 1  # bumped by every change the superblocks must learn; written up to _durable_gen
        self._durable_gen = 0
        self._sb_lock = asyncio.Lock()
        self._closed = False
        self._ms = MemberSet(members, base.data_offset, geo.chunk_blocks, base.block_size, self.fail)
        self._ms.optimal = all(m.state is MemberState.ACTIVE for m in members)
        self.bitmap: WriteIntentBitmap | None = None
        if self.level.redundant:
            regions = -(-geo.rows // base.bitmap_region)
            self.bitmap = WriteIntentBitmap(regions, base.bitmap_region, base.block_size, self._store_bitmap,
                                            idle_s=bitmap_idle_s, clock=clock)
        self.io: Any
        if self.level.parity:
            from openvsan.pool.io_parity import ParityIO  # needs the parity kernels; levels 0/1/10 do not

            self.io = ParityIO(self._ms, geo, self.locks, parity)
        else:
            self.io = MirrorIO(self._ms, geo, self.locks)
        self.maintenance = Maintenance(self, rate=rebuild_rate, clock=clock, sleep=sleep)
        self._cleaner: asyncio.Task[None] | None = None
        self._retired: list[BlockDevice] = []  # members replaced by another device

    # --- creation and assembly (assembly.py) -------------------------------------------------------------------

    @classmethod
    async def create(
        cls, members: Sequence[BlockDevice], level: int | str | Level, chunk_size: int = DEFAULT_CHUNK, *,
        uuid: uuidlib.UUID | str | None = None, name: str = "pool", force: bool = False,
        spares: Sequence[BlockDevice] = (), data_offset: int = DEFAULT_DATA_OFFSET, bitmap_region: int | None = None,
        init: str = "zero", rebuild_rate: float | None = None, parity: str | None = None,
        bitmap_idle_s: float = 5.0, clock: Callable[[], float] = time.monotonic, sleep: Sleep = asyncio.sleep,
    ) -> Pool:
        """A new pool over `members` (member i is slot i). `chunk_size` and `data_offset` are in bytes;
        `bitmap_region` in chunk rows per write-intent bit (default: 4 MiB of member data, more if the bitmap
        would not fit in the header). `init`: "zero" writes zeroes over the members' data (parity and mirrors
        agree from the start; cheap on sparse files and RAM), "resync" marks every region dirty and computes
        parity in the background instead, "none" trusts the caller that the members hold zeroes.
        `force` overwrites members that carry another pool's superblock. `parity`: the parity backend's name
        (None: openvsan.pool.parity's automatic choice). `rebuild_rate`: bytes/s, None for no limit. `clock`
        (seconds) and `sleep` time the bitmap's lazy clearing and the rebuild's rate (tests simulate them)."""
        return await assembly.create(
            cls, members, level, chunk_size, uuid=uuid, name=name, force=force, spares=spares,
            data_offset=data_offset, bitmap_region=bitmap_region, init=init, rebuild_rate=rebuild_rate,
            parity=parity, bitmap_idle_s=bitmap_idle_s, clock=clock, sleep=sleep)

    @classmethod
    async def assemble(cls, devices: Sequence[BlockDevice], *, rebuild_rate: float | None = None,
                       parity: str | None = None, bitmap_idle_s: float = 5.0,
                       clock: Callable[[], float] = time.monotonic, sleep: Sleep = asyncio.sleep) -> Pool:
        """The pool these devices belong to, from their superblocks, in any order (see the module doc)."""
        return await assembly.assemble(cls, devices, rebuild_rate=rebuild_rate, parity=parity,
                                       bitmap_idle_s=bitmap_idle_s, clock=clock, sleep=sleep)

    # --- superblocks ------------------------------------------------------------------------------------------

    def _changed(self) -> None:
        """A member's state changed: the superblocks must learn it (persist), and the I/O paths' shortcut for
        a pool with every member in sync is recomputed."""
        self._state_gen += 1
        self._ms.optimal = all(m.state is MemberState.ACTIVE for m in self.members)

    def _roles(self) -> tuple[Role, ...]:
        cb = self.geo.chunk_blocks
        return tuple(Role(m.uuid, m.state, m.checkpoint * cb if m.state is MemberState.REBUILDING else 0)
                     for m in self.members)

    def _superblock(self, m: Member, *, clean: bool) -> Superblock:
        cb = self.geo.chunk_blocks
        return self._base.evolve(
            member_uuid=m.uuid, member_index=m.index, event=self._event, state=m.state,
            checkpoint=m.checkpoint * cb if m.state is MemberState.REBUILDING else 0, clean=clean,
            roles=self._roles(),
        )

    async def persist(self, *, changed: bool = False, clean: bool = False) -> None:
        """Write the member states to every present member's superblock (event + 1), unless already written;
        `changed`: there is something new to write. Returns once it is durable."""
        if changed:
            self._changed()
        async with self._sb_lock:
            while self._durable_gen < self._state_gen and not self.failed:
                gen = self._state_gen
                self._event += 1
                present = [m for m in self.members if m.present]
                sbs = [self._superblock(m, clean=clean) for m in present]
                results = await asyncio.gather(
                    *(write_superblock(m.dev, sb) for m, sb in zip(present, sbs, strict=True) if m.dev is not None),
                    return_exceptions=True)
                faults = {m.index: r for m, r in zip(present, results, strict=True) if isinstance(r, BaseException)}
                for r in faults.values():
                    if not isinstance(r, MEMBER_FAULTS):
                        raise r
                if faults:
                    # and write again, without them
                    self._mark_failed(MemberFaults(faults, {i: self.members[i].dev for i in faults}))
                else:
                    self._durable_gen = gen
                    self.checkpointed_at = self.clock()
        if self.failed:
            raise DeviceFailed(self._failure_text())

    async def _write_spare(self, dev: BlockDevice) -> None:
        u = uuidlib.uuid4()
        await dev.write_zeroes(0, self.data_offset)
        sb = self._base.evolve(member_uuid=u, member_index=SPARE_INDEX, event=self._event, state=MemberState.SPARE,
                               checkpoint=0, roles=())
        await write_superblock(dev, sb)
        await dev.flush()
        self.spares.append((dev, u))

    async def _store_bitmap(self, block: int, content: bytes, fua: bool) -> None:
        lba = BITMAP_OFFSET // self.block_size + block
        present = [m for m in self.members if m.present]
        await self._ms.write_all([self._ms.raw(m.index, lambda d: d.write(lba, content, fua=fua)) for m in present])

    # --- member failure, spares, replace ----------------------------------------------------------------------

    def _mark_failed(self, faults: MemberFaults) -> bool:
        changed = False
        for i, err in faults.faults.items():
            m = self.members[i]
            if faults.devices.get(i, m.dev) is not m.dev:
                continue  # the slot has a new device since: the old one's error is not its fault
            if m.state in (MemberState.ACTIVE, MemberState.REBUILDING):
                log.error("pool %s: member %d (%s) failed: %s", self.name, i, m.name, err)
                m.state = MemberState.FAILED
                changed = True
        if changed:
            self._changed()
            if not self.geo.available(self._lost()):
                self.failed = True
                log.error("pool %s: %s", self.name, self._failure_text())
            else:
                self._use_spares()
        return changed

    def _lost(self) -> list[int]:
        return [m.index for m in self.members if m.state is not MemberState.ACTIVE]

    def _failure_text(self) -> str:
        return (f"pool {self.name}: RAID {int(self.level)} has lost members {self._lost()}, more than it "
                f"tolerates ({self.geo.tolerance}); stopped")

    async def fail(self, faults: MemberFaults) -> None:
        """Members that returned errors: marked failed and recorded durably before this returns; DeviceFailed
        when the pool cannot go on without them."""
        self._mark_failed(faults)
        if self.failed:
            raise DeviceFailed(self._failure_text())
        await self.persist()

    async def fail_member(self, index: int) -> None:
        """Take a member out by hand (mdadm --fail): it stops being used and is rebuilt when replaced."""
        self._check_index(index)
        await self.fail(MemberFaults({index: DeviceFailed("failed by request")}, {index: self.members[index].dev}))

    def _use_spares(self) -> None:
        for m in self.members:
            if not self.spares:
                return
            if m.state in (MemberState.FAILED, MemberState.MISSING):
                dev, u = self.spares.pop(0)
                log.warning("pool %s: spare %s takes over member %d", self.name, dev_name(dev, "spare"), m.index)
                self._install(m, dev, u)

    def _install(self, m: Member, dev: BlockDevice, member_uuid: uuidlib.UUID) -> None:
        if m.dev is not None and m.dev is not dev:
            self._retired.append(m.dev)  # closed with the pool: a request may still be in flight on it
        m.dev, m.uuid, m.state, m.checkpoint = dev, member_uuid, MemberState.REBUILDING, 0
        self._changed()
        self.maintenance.bitmap_copy_needed = True
        if not self._closed:
            self.maintenance.kick()

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self.members):
            raise PoolError(f"no member {index}: the pool has members 0..{len(self.members) - 1}")

    async def _check_new_device(self, dev: BlockDevice, what: str, force: bool) -> None:
        nm = dev_name(dev, what)
        if dev.block_size != self.block_size:
            raise PoolError(f"{nm} has {dev.block_size}-byte blocks, the pool {self.block_size}")
        need = (self.data_offset + self.geo.member_blocks) * self.block_size
        if dev.num_blocks * dev.block_size < need:
            raise PoolError(f"{nm} holds {fmt(dev.num_blocks * dev.block_size)}, fewer than the {fmt(need)} "
                            f"a member of this pool needs")
        if any(m.dev is dev for m in self.members) or any(s is dev for s, _ in self.spares):
            raise PoolError(f"{nm} is already in this pool")
        sb = await read_superblock(dev)
        if sb is not None and not force:
            raise PoolError(f"{nm} already belongs to pool {sb.name!r} ({sb.pool_uuid}); pass force=True to"
                            " overwrite it")

    async def replace(self, index: int, dev: BlockDevice, *, force: bool = False) -> None:
        """Put `dev` in slot `index` (failed, missing or rebuilding) and rebuild it in the background."""
        self._check_index(index)
        m = self.members[index]
        if m.state is MemberState.ACTIVE:
            raise PoolError(f"member {index} ({m.name}) is active; fail it first (fail_member) to replace it")
        if self.failed:
            raise DeviceFailed(self._failure_text())
        await self._check_new_device(dev, f"member{index}", force)
        await dev.write_zeroes(0, self.data_offset)
        self._install(m, dev, uuidlib.uuid4())
        await self.persist(changed=True)

    async def add_spare(self, dev: BlockDevice, *, force: bool = False) -> None:
        """A hot spare: it takes over the first failed member at once, and any that fails later."""
        await self._check_new_device(dev, "spare", force)
        await self._write_spare(dev)
        if any(m.state in (MemberState.FAILED, MemberState.MISSING) for m in self.members):
            self._use_spares()
            await self.persist(changed=True)

    # --- background -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self.bitmap is not None:
            self._cleaner = asyncio.get_running_loop().create_task(self._clean_bitmap(), name=f"pool-{self.name}-bm")
        self.maintenance.kick()

    def has_background_work(self) -> bool:
        if self.failed:
            return False
        pending = self.bitmap is not None and bool(self.bitmap.pending_resync)
        return pending or any(m.state is MemberState.REBUILDING for m in self.members)

    async def _clean_bitmap(self) -> None:
        assert self.bitmap is not None
        while True:
            await self.sleep(self.bitmap.idle_s / 2)
            try:
                await self.bitmap.clear_idle(self.flush_members)
            except DeviceFailed:
                return

    async def wait_idle(self) -> None:
        """Until the background resync and rebuild are done (tests, `vsan pool wait`)."""
        await self.maintenance.wait()

    @property
    def rebuild_rate(self) -> float | None:
        return self.maintenance.rate

    @rebuild_rate.setter
    def rebuild_rate(self, rate: float | None) -> None:
        self.maintenance.rate = rate

    async def flush_members(self, indices: Sequence[int] | None = None) -> None:
        chosen = [m for m in self.members if m.present and (indices is None or m.index in indices)]
        await self._ms.write_all([self._ms.raw(m.index, lambda d: d.flush()) for m in chosen])

    async def check_rows(self, start: int, end: int, *, repair: bool, locate: bool) -> RowCheck:
        """One step of a scrub or resync: rows [start, end) under their stripe locks."""
        while True:
            self._check_open()
            async with self.locks.hold_rows(start, end):
                try:
                    return await self.io.check(start, end, repair=repair, locate=locate)  # type: ignore[no-any-return]
                except MemberFaults as e:
                    await self.fail(e)

    async def scrub(self, *, repair: bool = True) -> ScrubReport:
        """Read every stripe and check its redundancy (see scrub.py for what is repaired and how)."""
        self._check_open()
        return await scrub_rows(self, self.geo.rows, self.batch_rows, repair=repair, clock=self.clock)

    # --- status -----------------------------------------------------------------------------------------------

    def status(self) -> PoolStatus:
        rows = self.geo.rows
        members = [
            MemberStatus(m.index, m.name, m.state.name.lower(),
                         round(100.0 * m.checkpoint / rows, 2) if m.state is MemberState.REBUILDING else None)
            for m in self.members
        ]
        rebuilding = [m for m in self.members if m.state is MemberState.REBUILDING]
        if self.failed:
            state = "failed"
        elif rebuilding:
            state = "rebuilding"
        elif any(m.state is not MemberState.ACTIVE for m in self.members):
            state = "degraded"
        else:
            state = "optimal"
        return PoolStatus(
            name=self.name, uuid=str(self.uuid), level=int(self.level), state=state,
            size=self.num_blocks * self.block_size, block_size=self.block_size, chunk_size=self.chunk_size,
            members=members, spares=[dev_name(d, "spare") for d, _ in self.spares],
            rebuild_progress=round(100.0 * min(m.checkpoint for m in rebuilding) / rows, 2) if rebuilding else None,
            resync_progress=self.maintenance.resync_progress(),
            dirty_regions=len(self.bitmap.dirty()) if self.bitmap is not None else 0,
            event=self._event, error=self.maintenance.error,
        )

    # --- BlockDevice ------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceFailed(f"pool {self.name} is closed")
        if self.failed:
            raise DeviceFailed(self._failure_text())

    def _rows(self, lba: int, blocks: int) -> range:
        per_row = self._row_blocks
        return range(lba // per_row, (lba + blocks - 1) // per_row + 1)

    async def _retrying(self, op: Any) -> Any:
        # a read phase that hit a failing member: the member is now failed, and the request is planned again
        # around it (replaying a write is harmless: it writes the same data and recomputes parity)
        for _ in range(len(self.members) + 1):
            self._check_open()
            try:
                return await op()
            except MemberFaults as e:
                await self.fail(e)
        raise DeviceFailed(f"pool {self.name}: request failed on every attempt")

    async def read(self, lba: int, blocks: int) -> Buffer:
        check_range(self, lba, blocks)
        self._check_open()
        if not blocks:
            return b""
        return await self._retrying(lambda: self.io.read(lba, blocks))  # type: ignore[no-any-return]

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        """read() in the caller's turn when the level's I/O can serve it from members with a fast path (RAM)
        and in sync for it (block/device.py SyncRead; the caller checked the range); None: use read(), which
        also meets what this declines (a closed or failed pool, a member that faults, a degraded stripe)."""
        if self._closed or self.failed or not blocks:
            return None
        return self.io.read_now(lba, blocks)  # type: ignore[no-any-return]

    def write_now(self, lba: int, data: Buffer) -> bool:
        """write() in the caller's turn (block/device.py SyncWrite: as durable as FUA, the members' own fast
        path being so) where the level's I/O can do it at once: a healthy pool, members with the fast path, the
        rows free, the bitmap's bits for them already on disk (the write-intent rule holds: no member is written
        before its region's bit is durable) and no superblock update owed. False, nothing written: write()."""
        n = memoryview(data).nbytes
        if (self._closed or self.failed or not n or n % self.block_size
                or self._durable_gen < self._state_gen):
            return False
        bitmap = self.bitmap
        if bitmap is None:
            return self.io.write_now(lba, data)  # type: ignore[no-any-return]
        per_row = self._row_blocks
        regions = bitmap.regions_of(lba // per_row, (lba + n // self.block_size - 1) // per_row)
        # counted as written even when declined: a decline after part of a stripe was written leaves it torn
        # until write() writes it again, and its bit must not be cleared as idle meanwhile
        return bitmap.wrote_now(regions) and self.io.write_now(lba, data)  # type: ignore[no-any-return]

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        bs = self.block_size
        n = memoryview(data).nbytes
        if n % bs:
            raise ValueError(f"write of {n} bytes is not a multiple of the block size {bs}")
        check_range(self, lba, n // bs)
        self._check_open()
        if not n:
            if fua:
                await self.flush()
            return
        if self.write_now(lba, data):
            return  # the members answered at once (RAM): no task per row, no lock to wait for; durable as FUA
        await self._modify(lba, n // bs, lambda: self.io.write(lba, data, fua))

    async def _modify(self, lba: int, blocks: int, op: Any) -> None:
        regions: range | None = None
        if self.bitmap is not None:
            rows = self._rows(lba, blocks)
            regions = self.bitmap.regions_of(rows[0], rows[-1])
            await self.bitmap.begin(regions)
        try:
            await self._retrying(op)
        finally:
            if self.bitmap is not None and regions is not None:
                self.bitmap.end(regions)
        if self._durable_gen < self._state_gen:
            await self.persist()  # a member this write skipped must be on record as failed before the ack

    async def flush(self) -> None:
        self._check_open()
        await self.flush_members()
        if self._durable_gen < self._state_gen:
            await self.persist()

    async def unmap(self, lba: int, blocks: int) -> None:
        # RAID 0 passes the unmap down; the redundant levels write zeroes (which the members deallocate where
        # they can), since an unmapped block may read back differently on each copy and break parity
        await self._zero(lba, blocks, unmap=self.level is Level.RAID0)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self._zero(lba, blocks, unmap=False)

    async def _zero(self, lba: int, blocks: int, *, unmap: bool) -> None:
        check_range(self, lba, blocks)
        self._check_open()
        if not blocks:
            return
        per_row = self.geo.chunk_blocks * self.geo.data_chunks
        first_full = -(-lba // per_row)
        end_full = (lba + blocks) // per_row
        if end_full <= first_full:
            await self.write(lba, bytes(blocks * self.block_size))
            return
        # partial rows at either end go through the write path; whole rows are zeroed on every member (all
        # zero data has all zero parity)
        head = first_full * per_row - lba
        tail = lba + blocks - end_full * per_row
        if head:
            await self.write(lba, bytes(head * self.block_size))
        if tail:
            await self.write(end_full * per_row, bytes(tail * self.block_size))
        step = max(self.batch_rows * 64, 1)
        for start in range(first_full, end_full, step):
            end = min(end_full, start + step)
            await self._modify(start * per_row, (end - start) * per_row,
                               lambda s=start, e=end: self._zero_rows(s, e, unmap))

    async def _zero_rows(self, start: int, end: int, unmap: bool) -> None:
        cb = self.geo.chunk_blocks
        async with self.locks.hold_rows(start, end):
            ops = []
            for m in self.members:
                upto = min(end, m.valid_until(self.geo.rows))
                if m.present and upto > start:
                    op = partial(_zero_member, lba=self.data_offset + start * cb, blocks=(upto - start) * cb,
                                 unmap=unmap)
                    ops.append(self._ms.raw(m.index, op))
            await self._ms.write_all(ops)

    async def close(self) -> None:
        """Stop background work, flush, clear the bitmap, mark the superblocks clean, close the members."""
        if self._closed:
            return
        await self._stop_background()
        if not self.failed:
            try:
                if self.bitmap is not None:
                    await self.bitmap.clear_idle(self.flush_members, everything=True)
                await self.flush_members()
                await self.persist(changed=True, clean=True)
            except DeviceFailed as e:
                log.error("pool %s: not closed cleanly: %s", self.name, e)
        await self._close_devices()

    async def destroy(self) -> None:
        """Stop the pool and erase the superblocks of its members and spares (the devices can then join
        another pool without force), then close them. The data is not erased."""
        if self._closed:
            raise DeviceFailed(f"pool {self.name} is closed")
        await self._stop_background()
        for dev in self._devices():
            try:
                await erase_superblock(dev)
            except MEMBER_FAULTS as e:
                log.warning("pool %s: %s: superblock not erased: %s", self.name, dev_name(dev, "member"), e)
        log.info("pool %s: destroyed", self.name)
        await self._close_devices()

    async def _stop_background(self) -> None:
        await self.maintenance.stop()
        if self._cleaner is not None:
            self._cleaner.cancel()
            try:
                await self._cleaner
            except asyncio.CancelledError:
                pass
            self._cleaner = None

    def _devices(self) -> list[BlockDevice]:
        return [m.dev for m in self.members if m.dev is not None] + [d for d, _ in self.spares]

    async def _close_devices(self) -> None:
        self._closed = True
        for d in self._devices() + self._retired:
            try:
                await d.close()
            except Exception as e:  # noqa: BLE001  (one member's close must not keep the others open)
                log.warning("pool %s: closing %s: %s", self.name, dev_name(d, "member"), e)

    def to_config(self) -> dict[str, Any]:
        return {
            "type": "pool", "name": self.name, "uuid": str(self.uuid), "level": int(self.level),
            "chunk_size": self.chunk_size,
            "members": [m.dev.to_config() if m.dev is not None else None for m in self.members],
            "spares": [d.to_config() for d, _ in self.spares],
        }
