"""Creating a pool, and assembling one from its members' superblocks (Pool.create / Pool.assemble).

Create checks everything before it writes anything, and says in one PoolError line what is impossible and how
to mend it: the member count for the level, one block size, the chunk size, members within one chunk of each
other in size (naming the short one and by how much), devices that already carry a pool's superblock (unless
`force`), a header too small for the bitmap.

Assembly: the superblock with the highest event is the truth (on a tie, the lowest slot, so the choice does
not depend on the order the devices come in). Its role table says which slot each member holds and which were
in sync. A member the truth lists ACTIVE is trusted when its own event is at most one behind (a superblock
update torn by a crash: nothing was written that skipped it); one the truth lists FAILED or MISSING, or more
than one event behind, is stale and is rebuilt from the others, never read; a device whose member UUID is not
the one its slot holds now (a replaced member) is ignored; a device that cannot be read counts as missing.
Missing and stale members within the level's tolerance start the pool degraded; beyond it assembly refuses.
The trusted members' write-intent bitmaps are OR-ed together: those regions are resynced in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid as uuidlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from openvsan.block.device import BlockDevice
from openvsan.pool.layout import Geometry, Level
from openvsan.pool.members import MEMBER_FAULTS, Member, MemberFaults
from openvsan.pool.superblock import (
    BITMAP_OFFSET,
    DEFAULT_DATA_OFFSET,
    MAX_MEMBERS,
    SLOT_SIZE,
    MemberState,
    Superblock,
    read_superblock,
)

if TYPE_CHECKING:
    from openvsan.pool.raid import Pool
    from openvsan.pool.rebuild import Sleep

log = logging.getLogger("openvsan.pool")

DEFAULT_CHUNK = 64 * 1024
MAX_CHUNK = 16 << 20
REGION_BYTES = 4 << 20  # member data per write-intent bit, at least (more when the bitmap would not fit)


class PoolError(ValueError):
    """An impossible request (create, assemble, replace, add_spare); the message says what and how to mend it."""


def dev_name(dev: BlockDevice, fallback: str) -> str:
    return str(getattr(dev, "name", fallback))


def fmt(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % (size // 1024 or 1) == 0:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} bytes"


async def create(
    cls: type[Pool], members: Sequence[BlockDevice], level: int | str | Level, chunk_size: int = DEFAULT_CHUNK, *,
    uuid: uuidlib.UUID | str | None = None, name: str = "pool", force: bool = False,
    spares: Sequence[BlockDevice] = (), data_offset: int = DEFAULT_DATA_OFFSET, bitmap_region: int | None = None,
    init: str = "zero", rebuild_rate: float | None = None, parity: str | None = None,
    bitmap_idle_s: float = 5.0, clock: Callable[[], float] = time.monotonic, sleep: Sleep = asyncio.sleep,
) -> Pool:
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
    names = [dev_name(d, f"member{i}") for i, d in enumerate(devices)]
    if len({id(d) for d in devices}) != len(devices):
        raise PoolError("the same device is given twice")
    bs = members[0].block_size
    for d, nm in zip(devices, names, strict=True):
        if d.block_size != bs:
            raise PoolError(f"{nm} has {d.block_size}-byte blocks, {names[0]} {bs}: members must have one block size")
    if chunk_size % bs or chunk_size & (chunk_size - 1) or not 4096 <= chunk_size <= MAX_CHUNK:
        raise PoolError(f"chunk size {chunk_size} must be a power of two from 4 KiB to {fmt(MAX_CHUNK)}"
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
    for d, nm in zip(members, names[:n], strict=True):   # names holds the spares' too, after the members
        if d.num_blocks - off < cb:
            raise PoolError(f"{nm} holds {fmt(d.num_blocks * bs)}: too small for a {fmt(data_offset)} header"
                            f" and one {fmt(chunk_size)} chunk")
    largest = max(range(n), key=lambda i: usable[i])
    for i in range(n):
        short = (usable[largest] - usable[i]) * bs
        if short > chunk_size:
            raise PoolError(f"{names[i]} is {fmt(short)} smaller than {names[largest]}; members must be within"
                            f" one chunk ({fmt(chunk_size)}) of each other in size")
    rows = min(usable) // cb
    for d, nm in zip(spares, names[n:], strict=True):
        if d.num_blocks < off + rows * cb:
            raise PoolError(f"spare {nm} holds {fmt(d.num_blocks * bs)}, fewer than the "
                            f"{fmt((off + rows * cb) * bs)} a member needs")
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
               bitmap_idle_s=bitmap_idle_s, clock=clock, sleep=sleep)
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
    log.info("pool %s: created RAID %d over %d members, %s", name, int(lvl), n, fmt(geo.num_blocks * bs))
    return pool


async def assemble(cls: type[Pool], devices: Sequence[BlockDevice], *, rebuild_rate: float | None = None,
                   parity: str | None = None, bitmap_idle_s: float = 5.0,
                   clock: Callable[[], float] = time.monotonic, sleep: Sleep = asyncio.sleep) -> Pool:
    if not devices:
        raise PoolError("no devices to assemble a pool from")
    names = [dev_name(d, f"device{i}") for i, d in enumerate(devices)]
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
               parity=parity, bitmap_idle_s=bitmap_idle_s, clock=clock, sleep=sleep)
    if pool.bitmap is not None:
        nbytes = pool.bitmap.byte_size
        trusted = [m for m in members if m.state is MemberState.ACTIVE and m.dev is not None]
        raws = await asyncio.gather(*(
            m.dev.read(BITMAP_OFFSET // bs, nbytes // bs) for m in trusted if m.dev is not None),
            return_exceptions=True)
        errors: dict[int, BaseException] = {}
        for m, raw in zip(trusted, raws, strict=True):
            if isinstance(raw, MEMBER_FAULTS):
                errors[m.index] = raw   # a member that cannot read its bitmap is failed, like any I/O error
            elif isinstance(raw, BaseException):
                raise raw
            else:
                pool.bitmap.load(bytes(raw))
        if errors:
            pool._mark_failed(MemberFaults(errors, {i: members[i].dev for i in errors}))
            if pool.failed:
                raise PoolError(pool._failure_text() + " (while reading the write-intent bitmaps)")
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
