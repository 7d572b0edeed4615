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
`bitmap.py` (write-intent bitmap: the write-hole choice), `locks.py` (stripe locks), `members.py` (member
state and I/O), `io_mirror.py` / `io_parity.py` (each level's read, write, rebuild and check of rows),
`rebuild.py` (background resync and rebuild), `scrub.py` (the scrub report). This module is the lifecycle:
create, assemble, member failure, replace and spares, status, close.

Member failure: a member request that raises MediumError or DeviceFailed marks the member FAILED; the
superblocks of the others record it (event + 1) before the request that saw it (or any write that skipped the
member) is acknowledged, so a restart never trusts a member that missed writes. The request is then served by
the other copies or by reconstruction. A failure beyond what the level tolerates stops the pool: every request
raises DeviceFailed and the superblocks are left as they were, so the pool can be assembled again once the
members are back.

Assembly: the superblock with the highest event is the truth. Its role table says which slot each member holds
and which were in sync. A member the truth lists as in sync is trusted (its own event may be one behind: a
superblock update torn by a crash); one it lists as failed or missing, or one more than one event behind, is
stale: it is rebuilt from the others, never read. Members of another pool are refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from openvsan.block.device import BlockDevice, Buffer, check_range
from openvsan.block.errors import DeviceFailed
from openvsan.pool.bitmap import WriteIntentBitmap
from openvsan.pool.io_mirror import MirrorIO
from openvsan.pool.layout import Geometry, Level
from openvsan.pool.locks import StripeLocks
from openvsan.pool.members import MEMBER_FAULTS, Member, MemberFaults, MemberSet
from openvsan.pool.rebuild import Maintenance
from openvsan.pool.scrub import RowCheck, ScrubReport, scrub_rows
from openvsan.pool.superblock import (
    BITMAP_OFFSET,
    DEFAULT_DATA_OFFSET,
    MAX_MEMBERS,
    SLOT_SIZE,
    SPARE_INDEX,
    MemberState,
    Role,
    Superblock,
    erase_superblock,
    read_superblock,
    write_superblock,
)

log = logging.getLogger("openvsan.pool")

DEFAULT_CHUNK = 64 * 1024
MAX_CHUNK = 16 << 20
REGION_BYTES = 4 << 20  # member data per write-intent bit, at least (more when the bitmap would not fit)
BATCH_BYTES = 1 << 20  # member data per rebuild / resync / scrub step


class PoolError(ValueError):
    """An impossible request (create, assemble, replace, add_spare); the message says what and how to mend it."""


@dataclass
class MemberStatus:
    index: int
    name: str
    state: str
    rebuild_progress: float | None = None  # percent, REBUILDING only


@dataclass
class PoolStatus:
    name: str
    uuid: str
    level: int
    state: str  # optimal | degraded | rebuilding | failed
    size: int  # bytes
    block_size: int
    chunk_size: int
    members: list[MemberStatus]
    spares: list[str] = field(default_factory=list)
    rebuild_progress: float | None = None  # percent of the slowest rebuilding member
    resync_progress: float | None = None  # percent of the dirty regions resynced
    dirty_regions: int = 0
    event: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dev_name(dev: BlockDevice, fallback: str) -> str:
    return str(getattr(dev, "name", fallback))


async def _zero_member(dev: BlockDevice, *, lba: int, blocks: int, unmap: bool) -> None:
    await (dev.unmap(lba, blocks) if unmap else dev.write_zeroes(lba, blocks))


def _fmt(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % (size // 1024 or 1) == 0:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} bytes"


class Pool:
    """Use `await Pool.create(...)` or `await Pool.assemble(...)`, not the constructor."""

    def __init__(self, base: Superblock, geo: Geometry, members: list[Member],
                 spares: list[tuple[BlockDevice, uuidlib.UUID]], *, event: int, rebuild_rate: float | None,
                 parity: str | None, bitmap_idle_s: float) -> None:
        self._base = base
        self.name = base.name
        self.uuid = base.pool_uuid
        self.level = Level(base.level)
        self.chunk_size = base.chunk_size
        self.block_size = base.block_size
        self.geo = geo
        self.num_blocks = geo.num_blocks
        self.data_offset = base.data_offset
        self.members = members
        self.spares = spares
        self.locks = StripeLocks()
        self.batch_rows = max(1, BATCH_BYTES // self.chunk_size)
        self.failed = False
        self.checkpointed_at = time.monotonic()
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
                                            idle_s=bitmap_idle_s)
        self.io: Any
        if self.level.parity:
            from openvsan.pool.io_parity import ParityIO  # needs the parity kernels; levels 0/1/10 do not

            self.io = ParityIO(self._ms, geo, self.locks, parity)
        else:
            self.io = MirrorIO(self._ms, geo, self.locks)
        self.maintenance = Maintenance(self, rate=rebuild_rate)
        self._cleaner: asyncio.Task[None] | None = None
        self._retired: list[BlockDevice] = []  # members replaced by another device

    # --- creation ---------------------------------------------------------------------------------------------

    @classmethod
    async def create(
        cls, members: Sequence[BlockDevice], level: int | str | Level, chunk_size: int = DEFAULT_CHUNK, *,
        uuid: uuidlib.UUID | str | None = None, name: str = "pool", force: bool = False,
        spares: Sequence[BlockDevice] = (), data_offset: int = DEFAULT_DATA_OFFSET, bitmap_region: int | None = None,
        init: str = "zero", rebuild_rate: float | None = None, parity: str | None = None,
        bitmap_idle_s: float = 5.0,
    ) -> Pool:
        """A new pool over `members` (member i is slot i). `chunk_size` and `data_offset` are in bytes;
        `bitmap_region` in chunk rows per write-intent bit (default: 4 MiB of member data, more if the bitmap
        would not fit in the header). `init`: "zero" writes zeroes over the members' data (parity and mirrors
        agree from the start; cheap on sparse files and RAM), "resync" marks every region dirty and computes
        parity in the background instead, "none" trusts the caller that the members hold zeroes.
        `force` overwrites members that carry another pool's superblock."""
        lvl = Level.parse(level)
        if init not in ("zero", "resync", "none"):
            raise PoolError(f"init must be zero, resync or none, not {init!r}")
        n = len(members)
        if n < lvl.min_members():
            raise PoolError(f"RAID {int(lvl)} needs at least {lvl.min_members()} members, {n} given")
        if lvl is Level.RAID10 and n % 2:
            raise PoolError(f"RAID 10 needs an even number of members (mirrored pairs), {n} given")
        if n > MAX_MEMBERS:
            raise PoolError(f"at most {MAX_MEMBERS} members, {n} given")
        devices = [*members, *spares]
        names = [_dev_name(d, f"member{i}") for i, d in enumerate(devices)]
        if len({id(d) for d in devices}) != len(devices):
            raise PoolError("the same device is given twice")
        bs = members[0].block_size
        for d, nm in zip(devices, names, strict=True):
            if d.block_size != bs:
                raise PoolError(f"{nm} has {d.block_size}-byte blocks, {names[0]} {bs}: members must have one block size")
        if chunk_size % bs or chunk_size & (chunk_size - 1) or not 4096 <= chunk_size <= MAX_CHUNK:
            raise PoolError(f"chunk size {chunk_size} must be a power of two from 4 KiB to {_fmt(MAX_CHUNK)}"
                            f" and a multiple of the {bs}-byte block")
        if data_offset % bs or data_offset % SLOT_SIZE or data_offset <= BITMAP_OFFSET:
            raise PoolError(f"data offset {data_offset} must be a multiple of 4 KiB above {BITMAP_OFFSET}")
        for d, nm, sb in zip(devices, names, await asyncio.gather(*(read_superblock(d) for d in devices)), strict=True):
            if sb is not None and not force:
                raise PoolError(f"{nm} already belongs to pool {sb.name!r} ({sb.pool_uuid}); "
                                "destroy that pool first or pass force=True to overwrite it")
        cb = chunk_size // bs
        off = data_offset // bs
        usable = [d.num_blocks - off for d in members]
        for d, nm in zip(members, names, strict=True):
            if d.num_blocks - off < cb:
                raise PoolError(f"{nm} holds {_fmt(d.num_blocks * bs)}: too small for a {_fmt(data_offset)} header"
                                f" and one {_fmt(chunk_size)} chunk")
        largest = max(range(n), key=lambda i: usable[i])
        for i in range(n):
            short = (usable[largest] - usable[i]) * bs
            if short > chunk_size:
                raise PoolError(f"{names[i]} is {_fmt(short)} smaller than {names[largest]}; members must be within"
                                f" one chunk ({_fmt(chunk_size)}) of each other in size")
        rows = min(usable) // cb
        for d, nm in zip(spares, names[n:], strict=True):
            if d.num_blocks < off + rows * cb:
                raise PoolError(f"spare {nm} holds {_fmt(d.num_blocks * bs)}, fewer than the "
                                f"{_fmt((off + rows * cb) * bs)} a member needs")
        geo = Geometry(lvl, n, cb, rows)
        capacity = (data_offset - BITMAP_OFFSET) * 8
        region = bitmap_region or max(-(-REGION_BYTES // chunk_size), -(-rows // capacity))
        if -(-rows // region) > capacity:
            raise PoolError(f"a bitmap region of {region} rows needs {-(-rows // region)} bits; the header holds "
                            f"{capacity}: use a larger bitmap_region or data_offset")
        pool_uuid = uuidlib.UUID(str(uuid)) if uuid is not None else uuidlib.uuid4()
        base = Superblock(
            pool_uuid=pool_uuid, member_uuid=pool_uuid, level=int(lvl), chunk_size=chunk_size, block_size=bs,
            member_count=n, member_index=0, event=0, data_offset=off, data_size=rows * cb, bitmap_region=region,
            state=MemberState.ACTIVE, created=int(time.time()), name=name,
        )
        base.pack()  # a name too long fails here, before anything is written
        mlist = [Member(i, d, uuidlib.uuid4(), MemberState.ACTIVE) for i, d in enumerate(members)]
        pool = cls(base, geo, mlist, [], event=0, rebuild_rate=rebuild_rate, parity=parity,
                   bitmap_idle_s=bitmap_idle_s)
        # the header area first (an old bitmap must not survive), then the data
        await asyncio.gather(*(d.write_zeroes(0, off) for d in members))
        if init == "zero":
            await asyncio.gather(*(d.write_zeroes(off, rows * cb) for d in members))
        if pool.bitmap is not None and init == "resync":
            pool.bitmap.mark_all()
            await pool.bitmap.write_all(fua=True)
        await asyncio.gather(*(d.flush() for d in members))
        await pool.persist(changed=True)
        for d in spares:
            await pool._write_spare(d)
        pool._start()
        log.info("pool %s: created RAID %d over %d members, %s", name, int(lvl), n, _fmt(geo.num_blocks * bs))
        return pool

    # --- assembly ---------------------------------------------------------------------------------------------

    @classmethod
    async def assemble(cls, devices: Sequence[BlockDevice], *, rebuild_rate: float | None = None,
                       parity: str | None = None, bitmap_idle_s: float = 5.0) -> Pool:
        """The pool these devices belong to, from their superblocks, in any order (see the module doc)."""
        if not devices:
            raise PoolError("no devices to assemble a pool from")
        names = [_dev_name(d, f"device{i}") for i, d in enumerate(devices)]
        sbs = await asyncio.gather(*(read_superblock(d) for d in devices), return_exceptions=True)
        found: list[tuple[BlockDevice, str, Superblock]] = []
        for d, nm, sb in zip(devices, names, sbs, strict=True):
            if isinstance(sb, MEMBER_FAULTS):
                # a device that cannot be read is as good as missing; the tolerance check below decides
                log.error("pool: %s: cannot read its superblock (%s); leaving it out", nm, sb)
            elif isinstance(sb, BaseException):
                raise sb
            elif sb is None:
                raise PoolError(f"{nm} carries no openvsan pool superblock")
            else:
                found.append((d, nm, sb))
        if not found:
            raise PoolError("none of the devices could be read")
        pools = {sb.pool_uuid for _, _, sb in found}
        if len(pools) > 1:
            which = "; ".join(f"{nm}: pool {sb.name!r} ({sb.pool_uuid})" for _, nm, sb in found)
            raise PoolError(f"the devices belong to {len(pools)} different pools ({which}); give one pool's members")
        in_slots = [(d, nm, sb) for d, nm, sb in found if not sb.is_spare]
        if not in_slots:
            raise PoolError("only spares given: no member of the pool")
        # the highest event is the truth; on a tie the lowest slot, so the choice does not depend on the order
        _, _, truth = max(in_slots, key=lambda f: (f[2].event, -f[2].member_index))
        bs = truth.block_size
        for _, nm, sb in found:
            if (sb.level, sb.chunk_size, sb.block_size, sb.member_count, sb.data_offset, sb.data_size) != (
                    truth.level, truth.chunk_size, truth.block_size, truth.member_count, truth.data_offset,
                    truth.data_size):
                raise PoolError(f"{nm}: its superblock disagrees with the newest one about the pool's geometry")
        for d, nm, _ in found:
            if d.block_size != bs or d.num_blocks < truth.data_offset + truth.data_size:
                raise PoolError(f"{nm} is smaller than the pool's members or has another block size")
        lvl = Level(truth.level)
        geo = Geometry(lvl, truth.member_count, truth.chunk_size // bs, truth.data_size // (truth.chunk_size // bs))
        members = [Member(i, None, r.uuid, MemberState.MISSING) for i, r in enumerate(truth.roles)]
        chosen: dict[int, Superblock] = {}
        ignored: list[str] = []
        spares: list[tuple[BlockDevice, uuidlib.UUID]] = []
        for d, nm, sb in found:
            if sb.is_spare:
                spares.append((d, sb.member_uuid))
                continue
            i = sb.member_index
            if i >= len(members) or sb.member_uuid != truth.roles[i].uuid:
                ignored.append(f"{nm} (a former member of slot {i})")
                continue
            if i in chosen:
                raise PoolError(f"{nm} and {members[i].name} both claim slot {i} with the same member UUID")
            chosen[i] = sb
            role = truth.roles[i]
            m = members[i]
            m.dev = d
            stale = sb.event < truth.event - 1
            if role.state is MemberState.ACTIVE and not stale:
                m.state = MemberState.ACTIVE
            elif role.state is MemberState.REBUILDING and not stale:
                m.state, m.checkpoint = MemberState.REBUILDING, role.checkpoint // geo.chunk_blocks
            else:
                # failed or missing at the last update, or it missed updates: its data is not trusted
                log.warning("pool %s: %s (slot %d) is stale (event %d, newest %d): it will be rebuilt",
                            truth.name, nm, i, sb.event, truth.event)
                m.state, m.checkpoint = MemberState.REBUILDING, 0
        for text in ignored:
            log.warning("pool %s: ignoring %s", truth.name, text)
        lost = [m.index for m in members if m.state is not MemberState.ACTIVE]
        if not geo.available(lost):
            missing = ", ".join(f"{m.index} ({'missing' if m.dev is None else 'stale'})" for m in members
                                if m.state is not MemberState.ACTIVE)
            raise PoolError(f"pool {truth.name!r}: members {missing} cannot be used; RAID {int(lvl)} of "
                            f"{geo.members} members tolerates {geo.tolerance} lost (refusing to start)")
        pool = cls(truth.evolve(clean=False), geo, members, spares, event=truth.event, rebuild_rate=rebuild_rate,
                   parity=parity, bitmap_idle_s=bitmap_idle_s)
        if pool.bitmap is not None:
            nbytes = pool.bitmap.byte_size
            trusted = [m for m in members if m.state is MemberState.ACTIVE and m.dev is not None]
            raws = await asyncio.gather(*(
                m.dev.read(BITMAP_OFFSET // bs, nbytes // bs) for m in trusted if m.dev is not None))
            for raw in raws:
                pool.bitmap.load(bytes(raw))
            pool.bitmap.pending_resync = set(pool.bitmap.dirty())
            if pool.bitmap.pending_resync:
                log.warning("pool %s: %d dirty regions (not shut down cleanly): resyncing",
                            pool.name, len(pool.bitmap.pending_resync))
            if any(m.state is MemberState.REBUILDING for m in members):
                pool.maintenance.bitmap_copy_needed = True
        pool._use_spares()
        await pool.persist(changed=True)
        pool._start()
        return pool

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
                    self.checkpointed_at = time.monotonic()
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
                log.warning("pool %s: spare %s takes over member %d", self.name, _dev_name(dev, "spare"), m.index)
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
        nm = _dev_name(dev, what)
        if dev.block_size != self.block_size:
            raise PoolError(f"{nm} has {dev.block_size}-byte blocks, the pool {self.block_size}")
        need = (self.data_offset + self.geo.member_blocks) * self.block_size
        if dev.num_blocks * dev.block_size < need:
            raise PoolError(f"{nm} holds {_fmt(dev.num_blocks * dev.block_size)}, fewer than the {_fmt(need)} "
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
            await asyncio.sleep(self.bitmap.idle_s / 2)
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
        return await scrub_rows(self, self.geo.rows, self.batch_rows, repair=repair)

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
            members=members, spares=[_dev_name(d, "spare") for d, _ in self.spares],
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
        per_row = self.geo.chunk_blocks * self.geo.data_chunks
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
                log.warning("pool %s: %s: superblock not erased: %s", self.name, _dev_name(dev, "member"), e)
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
                log.warning("pool %s: closing %s: %s", self.name, _dev_name(d, "member"), e)

    def to_config(self) -> dict[str, Any]:
        return {
            "type": "pool", "name": self.name, "uuid": str(self.uuid), "level": int(self.level),
            "chunk_size": self.chunk_size,
            "members": [m.dev.to_config() if m.dev is not None else None for m in self.members],
            "spares": [d.to_config() for d, _ in self.spares],
        }
