"""VolumeGroup: many volumes carved out of one device or pool, thick or thin, with snapshots and clones
(the thin issue; dm-thin's rules, SPDK lvol's operations). The format is in format.py.

Every volume has its own mapping (virtual cluster -> physical cluster, -1: unmapped) and every physical
cluster a reference count; a snapshot or clone copies its origin's mapping and shares the clusters (a write to
a shared cluster copies it first), so a read costs one lookup however long the chain of snapshots is.

The rule that keeps it crash-safe (dm-thin's): a write is acknowledged once its data is written and its
mapping is in memory; the mappings are committed at a flush or FUA write (data flushed, then the journal
written and flushed) and at least every `commit_interval` seconds. A cluster freed in memory is not reused
before the free is committed (and no I/O is still reading or writing it), so a crash can never leave a
committed mapping of one volume pointing at another volume's data. A volume therefore states a volatile
write cache (capabilities.volatile_cache): initiators flush, as they do for any disk with one.

Metadata cannot run out under a write: every change that could grow the checkpoint is admitted against the
checkpoint slot's room first (with a reserve kept for unmaps and deletes, so space can always be given back),
and the journal, when full, is folded into a checkpoint."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid as uuidlib
from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from openvsan.block.device import BlockDevice, Buffer
from openvsan.block.errors import Busy, DeviceFailed, NoSpace, ReadOnly
from openvsan.volume.thin import format as fmt
from openvsan.volume.thin.format import Flag, Op, Superblock, VolumeRecord

log = logging.getLogger("openvsan.volume.thin")

DEFAULT_CLUSTER = 64 << 10
MIN_CLUSTER, MAX_CLUSTER = 4 << 10, 4 << 20
COMMIT_INTERVAL = 1.0            # seconds an uncommitted mapping may wait for a flush before it is committed
RUN_RESERVE = 2048               # checkpoint runs kept for unmaps and deletes (space can always be freed)
CANDIDATES = 4096                # free clusters found per scan of the reference counts
MAX_EXTENTS = 4096               # extents one lba_status answer gives at most


class GroupError(ValueError):
    """A request the group refuses as it stands (a name taken, a snapshot written to); one line for the user."""


def default_metadata_size(device_bytes: int, cluster_size: int) -> int:
    """Room for the checkpoint of eight full copies of the pool's mapping (snapshots and clones of full
    volumes), one MiB of journal, at least 4 MiB in all: about 0.3 % of the pool at 64 KiB clusters."""
    clusters = device_bytes // cluster_size
    slot = max(1 << 20, 8 * fmt.RUN_BYTES * clusters + 64 * fmt.VOLUME_BYTES)
    total = 2 * fmt.META_BLOCK + 2 * slot + (1 << 20)
    return max(4 << 20, -(-total // fmt.META_BLOCK) * fmt.META_BLOCK)


def _geometry(device_bytes: int, block_size: int, cluster_size: int,
              metadata_size: int | None) -> tuple[int, int, int, int, int]:
    """(slot size, journal offset, journal size, data offset, clusters) for a device of this size."""
    if cluster_size & (cluster_size - 1) or not MIN_CLUSTER <= cluster_size <= MAX_CLUSTER \
            or cluster_size % block_size:
        raise GroupError(f"cluster size {cluster_size} bytes; use a power of two from 4KiB to 4MiB")
    meta = metadata_size or default_metadata_size(device_bytes, cluster_size)
    meta = -(-meta // fmt.META_BLOCK) * fmt.META_BLOCK
    journal = max(16 * fmt.META_BLOCK, min(8 << 20, meta // 8) // fmt.META_BLOCK * fmt.META_BLOCK)
    slot = (meta - fmt.SUPER_COPIES * fmt.META_BLOCK - journal) // 2 // fmt.META_BLOCK * fmt.META_BLOCK
    if slot < 16 * fmt.META_BLOCK:
        raise GroupError(f"metadata size {meta} bytes is too small; use at least "
                         f"{fmt.SUPER_COPIES * fmt.META_BLOCK + 16 * fmt.META_BLOCK + 32 * fmt.META_BLOCK} bytes")
    joff = fmt.SUPER_COPIES * fmt.META_BLOCK + 2 * slot
    data = -(-(joff + journal) // cluster_size) * cluster_size
    clusters = (device_bytes - data) // cluster_size
    if clusters < 1:
        raise GroupError(f"the device ({device_bytes} bytes) has no room for data after {data} bytes of metadata")
    return slot, joff, journal, data, clusters


@dataclass(eq=False)
class _Vol:
    rec: VolumeRecord
    map: array               # 'i': physical cluster per virtual cluster, -1: unmapped
    mapped: int = 0          # clusters mapped
    inflight: int = 0        # writes and unmaps under way (a snapshot drains them)
    idle: asyncio.Event | None = None
    hold: asyncio.Event | None = None            # while a snapshot drains: new writes wait for it
    provisioning: dict[int, asyncio.Future[None]] = field(default_factory=dict)   # virtual cluster -> done
    handle: LogicalVolume | None = None

    @property
    def thin(self) -> bool:
        return bool(self.rec.flags & Flag.THIN)

    @property
    def writable(self) -> bool:
        return not self.rec.flags & (Flag.SNAPSHOT | Flag.READ_ONLY)


def _view(a: array) -> np.ndarray:
    return np.frombuffer(a, dtype=np.int32 if a.typecode == "i" else np.uint32) if len(a) else np.zeros(
        0, dtype=np.int32 if a.typecode == "i" else np.uint32)


class VolumeGroup:
    def __init__(self, dev: BlockDevice, sb: Superblock) -> None:
        self.dev = dev
        self.sb = sb
        self.block_size = dev.block_size
        self.cluster_blocks = sb.cluster_size // dev.block_size
        self.data_lba = sb.data_offset // dev.block_size
        self.clusters = sb.clusters
        self.commit_interval = COMMIT_INTERVAL
        self.ref = array("I", bytes(4 * sb.clusters))
        self.vols: dict[int, _Vol] = {}
        self.by_name: dict[str, int] = {}
        self.next_id = 1
        self.used = 0                       # clusters with a reference
        self._busy: set[int] = set()        # free clusters not to hand out: frees not committed, being provisioned
        self._io: dict[int, int] = {}       # physical cluster -> reads and writes of it under way
        self._cands: deque[int] = deque()
        self._cursor = 0
        self._replaying = False
        # commit state: records in memory order; [committed, appended) are not yet in the journal
        self._pending: list[bytes] = []
        self._appended = 0
        self._committed = 0
        self._frees: list[tuple[int, int]] = []      # (record number that freed it, physical cluster)
        self._fresh: dict[int, int] = {}             # physical cluster -> record number that mapped it
        self._lock = asyncio.Lock()
        self._started = 0                            # commits begun
        self._done = 0                               # commits finished
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: BaseException | None = None
        self.ck_seq = 0
        self.journal_base = 0
        self.journal_pos = 0                         # journal blocks written since the checkpoint
        self.journal_cap = sb.journal_size // fmt.META_BLOCK
        self._runs_bound = 0                         # checkpoint runs, at most (exact after _recount)
        self.commits = self.checkpoints = 0          # for tests and status

    # ---- make, find, open

    @staticmethod
    async def probe(dev: BlockDevice) -> Superblock | None:
        """The group's superblock on dev, None when dev is blank; GroupError when it holds something else."""
        head = bytes(await dev.read(0, fmt.SUPER_COPIES * fmt.META_BLOCK // dev.block_size))
        for copy in range(fmt.SUPER_COPIES):
            sb = Superblock.decode(head[copy * fmt.META_BLOCK:])
            if sb is not None:
                return sb
        if fmt.is_blank(head):
            return None
        raise GroupError(f"{getattr(dev, 'name', 'the device')} holds data that is not an openvsan volume group; "
                         "carve volumes from a blank device or pool (or wipe it)")

    @classmethod
    async def format(cls, dev: BlockDevice, *, cluster_size: int = DEFAULT_CLUSTER,
                     metadata_size: int | None = None, name: str = "") -> VolumeGroup:
        size = dev.num_blocks * dev.block_size
        slot, joff, jsize, doff, clusters = _geometry(size, dev.block_size, cluster_size, metadata_size)
        sb = Superblock(uuidlib.uuid4(), dev.block_size, cluster_size, slot, joff, jsize, doff, clusters,
                        int(time.time()), name)
        group = cls(dev, sb)
        group.journal_base = 1
        await group._checkpoint_now()
        raw = sb.encode()
        await dev.write(0, raw * fmt.SUPER_COPIES)
        await dev.flush()
        return group

    @classmethod
    async def open(cls, dev: BlockDevice) -> VolumeGroup:
        sb = await cls.probe(dev)
        if sb is None:
            raise GroupError(f"{getattr(dev, 'name', 'the device')} holds no volume group")
        if sb.block_size != dev.block_size or sb.data_offset + sb.clusters * sb.cluster_size > \
                dev.num_blocks * dev.block_size:
            raise fmt.FormatError(f"the volume group's geometry ({sb.clusters} clusters of {sb.cluster_size} "
                                  f"bytes, {sb.block_size}-byte blocks) does not fit {getattr(dev, 'name', 'it')}")
        group = cls(dev, sb)
        ck = await group._read_checkpoint()
        group._replaying = True
        group._load(ck)
        replayed = await group._replay()
        group._replaying = False
        group._recount()
        log.info("volume group %s: %d volumes, checkpoint %d and %d journal blocks", sb.uuid, len(group.vols),
                 ck.seq, replayed)
        await group._checkpoint_now()   # a new journal epoch: a torn tail of the old one is never continued
        return group

    async def _read_checkpoint(self) -> fmt.Checkpoint:
        bs = self.block_size
        found: list[tuple[int, int, int]] = []
        for offset in self.sb.slot_offsets:
            head = await self.dev.read(offset // bs, fmt.META_BLOCK // bs)
            info = fmt.checkpoint_head(head)
            if info is not None and fmt.CHECKPOINT_HEAD + info[1] <= self.sb.slot_size:
                found.append((info[0], offset, info[1]))
        for _, offset, length in sorted(found, reverse=True):
            total = -(-(fmt.CHECKPOINT_HEAD + length) // fmt.META_BLOCK) * fmt.META_BLOCK
            raw = await self._read_bytes(offset, total)
            ck = fmt.decode_checkpoint(raw)
            if ck is not None:
                return ck
        raise fmt.FormatError("no valid checkpoint in the volume group's metadata (both copies damaged)")

    async def _read_bytes(self, offset: int, length: int) -> bytes:
        bs, step = self.block_size, 4 << 20
        parts = []
        for at in range(offset, offset + length, step):
            n = min(step, offset + length - at)
            parts.append(bytes(await self.dev.read(at // bs, n // bs)))
        return b"".join(parts)

    async def _write_bytes(self, offset: int, data: bytes) -> None:
        bs, step = self.block_size, 4 << 20
        for at in range(0, len(data), step):
            await self.dev.write((offset + at) // bs, data[at:at + step])

    def _load(self, ck: fmt.Checkpoint) -> None:
        self.ck_seq, self.journal_base, self.next_id = ck.seq, ck.journal_base, ck.next_id
        ref = _view(self.ref)
        for rec, runs in ck.volumes:
            n = self._clusters_of(rec.blocks)
            m = np.full(n, -1, dtype=np.int32)
            for v, p, length in runs.tolist():
                if v + length > n or p + length > self.clusters:
                    raise fmt.FormatError(f"volume {rec.name}: a mapping beyond its size or the group")
                m[v:v + length] = np.arange(p, p + length, dtype=np.int32)
            mapped = m[m >= 0]
            np.add.at(ref, mapped, 1)
            vol = _Vol(rec, array("i", m.tobytes()), len(mapped))
            self.vols[rec.id] = vol
            self.by_name[rec.name] = rec.id
        self.used = int(np.count_nonzero(ref))

    async def _replay(self) -> int:
        bs = self.block_size
        per = 64
        pos = 0
        while pos < self.journal_cap:
            n = min(per, self.journal_cap - pos)
            raw = await self._read_bytes(self.sb.journal_offset + pos * fmt.META_BLOCK, n * fmt.META_BLOCK)
            for i in range(n):
                recs = fmt.open_journal_block(raw[i * fmt.META_BLOCK:(i + 1) * fmt.META_BLOCK],
                                              self.journal_base + pos + i)
                if recs is None:
                    self.journal_pos = pos + i
                    return pos + i
                for rec in recs:
                    self._apply(rec)
            pos += n
        del bs
        self.journal_pos = pos
        return pos

    # ---- the state changes, one place for the live path and the replay

    def _clusters_of(self, blocks: int) -> int:
        return -(-blocks // self.cluster_blocks)

    def _set(self, v: _Vol, vc: int, p: int) -> None:
        old = v.map[vc]
        v.map[vc] = p
        if p >= 0:
            if self.ref[p] == 0:
                self.used += 1
            self.ref[p] += 1
            if old < 0:
                v.mapped += 1
        elif old >= 0:
            v.mapped -= 1
        if old >= 0:
            self._unref(old)
        self._runs_bound += 2

    def _unref(self, p: int) -> None:
        self.ref[p] -= 1
        if self.ref[p] == 0:
            self.used -= 1
            if not self._replaying:
                self._busy.add(p)
                self._frees.append((self._appended + 1, p))

    def _drop_all(self, v: _Vol) -> None:
        """Every cluster of v's mapping loses v's reference (delete, rollback, copy over)."""
        m = _view(v.map)
        mapped = m[m >= 0]
        if not len(mapped):
            return
        ref = _view(self.ref)
        np.subtract.at(ref, mapped, 1)
        gone = np.unique(mapped[ref[mapped] == 0])
        self.used -= len(gone)
        if not self._replaying:
            n = self._appended + 1
            self._busy.update(gone.tolist())
            self._frees.extend((n, int(p)) for p in gone)
        v.mapped = 0

    def _share(self, src: _Vol, clusters: int) -> array:
        """A copy of src's mapping, `clusters` long, every mapped cluster of it one reference more."""
        m = _view(src.map)[:clusters].copy()
        if len(m) < clusters:
            m = np.concatenate((m, np.full(clusters - len(m), -1, dtype=np.int32)))
        mapped = m[m >= 0]
        if len(mapped):
            ref = _view(self.ref)
            ref[mapped] += 1   # a mapping names a physical cluster once, so no index repeats
        self._runs_bound += fmt.count_runs(m)
        return array("i", m.tobytes())

    def _apply(self, rec: fmt.Record) -> None:
        op = rec[0]
        if op == Op.MAP:
            _, vid, vc, p, n = rec
            v = self.vols[vid]
            for i in range(n):
                self._set(v, vc + i, p + i)
        elif op == Op.UNMAP:
            _, vid, vc, n = rec
            v = self.vols[vid]
            for i in range(vc, vc + n):
                if v.map[i] >= 0:
                    self._set(v, i, -1)
        elif op == Op.CREATE:
            _, vid, flags, blocks, origin, created, copy, name = rec
            n = self._clusters_of(blocks)
            if copy:
                src = self.vols[origin]
                m = self._share(src, n)
                mapped = int(np.count_nonzero(_view(m) >= 0))
            else:
                m, mapped = array("i", b"\xff" * 4 * n), 0
            self.vols[vid] = _Vol(VolumeRecord(vid, name, Flag(flags), blocks, origin, created), m, mapped)
            self.by_name[name] = vid
            self.next_id = max(self.next_id, vid + 1)
        elif op == Op.DELETE:
            v = self.vols.pop(rec[1])
            del self.by_name[v.rec.name]
            self._drop_all(v)
        elif op == Op.RESIZE:
            _, vid, blocks = rec
            v = self.vols[vid]
            n = self._clusters_of(blocks)
            if n < len(v.map):
                for i in range(n, len(v.map)):
                    if v.map[i] >= 0:
                        self._set(v, i, -1)
                del v.map[n:]
            else:
                v.map.extend(array("i", b"\xff" * 4 * (n - len(v.map))))
            v.rec.blocks = blocks
        elif op == Op.ROLLBACK:
            _, vid, sid = rec
            v, snap = self.vols[vid], self.vols[sid]
            n = self._clusters_of(snap.rec.blocks)
            m = self._share(snap, n)
            self._drop_all(v)
            v.map = m
            v.mapped = int(np.count_nonzero(_view(m) >= 0))
            v.rec.blocks = snap.rec.blocks
        elif op == Op.RENAME:
            _, vid, name = rec
            v = self.vols[vid]
            del self.by_name[v.rec.name]
            v.rec.name = name
            self.by_name[name] = vid
        else:  # pragma: no cover - decode_records refuses unknown ops
            raise fmt.FormatError(f"unknown journal op {op}")

    def _log(self, rec: fmt.Record) -> int:
        """Append a record (its change is already in memory); its number. The timer commits it if no flush does."""
        self._pending.append(fmt.encode_record(rec))
        self._appended += 1
        if self._timer is None and not self._replaying:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return self._appended
            self._timer = loop.call_later(self.commit_interval, self._tick)
        return self._appended

    def _do(self, rec: fmt.Record) -> int:
        self._apply(rec)
        return self._log(rec)

    def _tick(self) -> None:
        self._timer = None
        if self._appended > self._committed and self._failed is None:
            task = asyncio.get_running_loop().create_task(self._background_commit())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _background_commit(self) -> None:
        try:
            await self.commit()
        except Exception as e:  # noqa: BLE001 - the next flush reports it to someone who can act
            log.error("volume group %s: background commit failed: %s", self.sb.uuid, e)

    # ---- space for metadata

    def _slot_runs(self, volumes: int) -> int:
        return (self.sb.slot_size - fmt.CHECKPOINT_HEAD - volumes * fmt.VOLUME_BYTES) // fmt.RUN_BYTES

    def _recount(self) -> None:
        self._runs_bound = sum(fmt.count_runs(_view(v.map)) for v in self.vols.values())

    def _admit(self, runs: int, *, volumes: int = 0, reserve: bool = True) -> None:
        """Room in the checkpoint for `runs` more runs (and `volumes` more volumes), else NoSpace."""
        room = self._slot_runs(len(self.vols) + volumes) - (RUN_RESERVE if reserve else 0)
        if self._runs_bound + runs <= room:
            return
        self._recount()
        if self._runs_bound + runs > room:
            raise NoSpace(f"volume group {self.sb.name or self.sb.uuid}: metadata full "
                          f"({self._runs_bound} mapping runs); delete snapshots or volumes, or unmap")

    # ---- clusters

    def _alloc(self) -> int:
        ref, busy = self.ref, self._busy
        while True:
            while self._cands:
                p = self._cands.popleft()
                if ref[p] == 0 and p not in busy:
                    busy.add(p)
                    return p
            if not self._refill():
                raise NoSpace(f"volume group {self.sb.name or self.sb.uuid}: no free cluster "
                              f"({self.used} of {self.clusters} in use)")

    def _refill(self) -> bool:
        ref = _view(self.ref)
        for start, stop in ((self._cursor, self.clusters), (0, self._cursor)):
            at = start
            while at < stop:
                chunk = np.flatnonzero(ref[at:min(stop, at + (1 << 20))] == 0)
                if len(chunk):
                    cands = [int(p) + at for p in chunk[:4 * CANDIDATES] if int(p) + at not in self._busy]
                    if cands:
                        cands = cands[:CANDIDATES]
                        self._cands.extend(cands)
                        self._cursor = (cands[-1] + 1) % self.clusters
                        return True
                at += 1 << 20
        return False

    def _release(self, upto: int) -> None:
        """Frees committed by record `upto` make their clusters allocatable (unless I/O still touches them)."""
        keep = []
        for n, p in self._frees:
            if n <= upto and not self._io.get(p):
                self._busy.discard(p)
            else:
                keep.append((n, p))
        self._frees = keep
        if self._fresh:
            self._fresh = {p: n for p, n in self._fresh.items() if n > upto}

    # ---- commit

    async def commit(self) -> None:
        """Make every acknowledged write durable: data flushed, then the mappings journaled and flushed."""
        want, ticket = self._appended, self._started
        async with self._lock:
            if self._failed is not None:
                raise DeviceFailed(f"volume group {self.sb.uuid}: metadata commit failed earlier: {self._failed}")
            if self._committed >= want and self._done > ticket:
                return   # a commit that began after this call covered it
            try:
                await self._commit_now()
            except BaseException as e:
                if not isinstance(e, asyncio.CancelledError):
                    self._failed = e
                raise

    async def _commit_now(self) -> None:
        self._started += 1
        mine = self._started
        upto = self._appended
        recs = self._pending[:upto - self._committed]
        await self.dev.flush()
        if recs:
            blocks = fmt.journal_blocks(recs, self.journal_base + self.journal_pos)
            if self.journal_pos + len(blocks) > self.journal_cap:
                await self._checkpoint_now(mine)
                return
            await self._write_bytes(self.sb.journal_offset + self.journal_pos * fmt.META_BLOCK, b"".join(blocks))
            await self.dev.flush()
            self.journal_pos += len(blocks)
            self.commits += 1
        self._committed = upto
        del self._pending[:len(recs)]
        self._release(upto)
        self._done = mine

    async def checkpoint(self) -> None:
        async with self._lock:
            self._started += 1
            await self._checkpoint_now(self._started)

    async def _checkpoint_now(self, mine: int = 0) -> None:
        upto = self._appended
        seq, base = self.ck_seq + 1, self.journal_base + max(self.journal_cap, 1)
        body = fmt.encode_checkpoint(seq, base, self.next_id, [(v.rec, _view(v.map)) for v in self.vols.values()])
        if len(body) > self.sb.slot_size:   # _admit keeps this from happening
            raise NoSpace(f"volume group {self.sb.uuid}: checkpoint of {len(body)} bytes exceeds its slot")
        await self.dev.flush()
        body = body.ljust(-(-len(body) // fmt.META_BLOCK) * fmt.META_BLOCK, b"\0")
        await self._write_bytes(self.sb.slot_offsets[seq % 2], body)
        await self.dev.flush()
        self.ck_seq, self.journal_base, self.journal_pos = seq, base, 0
        del self._pending[:upto - self._committed]
        self._committed = upto
        self._release(upto)
        self._done = max(self._done, mine)
        self.checkpoints += 1
        self._recount()

    async def close(self) -> None:
        """Commit what is left (a clean stop). The device below belongs to whoever opened it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for v in self.vols.values():
            if v.handle is not None:
                v.handle.closed = True
        if self._failed is None:
            await self.checkpoint()

    # ---- volumes

    def _vol(self, name: str) -> _Vol:
        vid = self.by_name.get(name)
        if vid is None:
            raise GroupError(f"no volume or snapshot {name!r} in this group")
        return self.vols[vid]

    def _new_name(self, name: str) -> None:
        if not name or len(name.encode()) > fmt.MAX_NAME or "/" in name or "@" in name:
            raise GroupError(f"name {name!r}: use 1 to {fmt.MAX_NAME} bytes, without '/' or '@'")
        if name in self.by_name:
            raise GroupError(f"a volume or snapshot named {name!r} exists in this group; choose another name")

    def _blocks(self, size: int) -> int:
        if size <= 0 or size % self.block_size:
            raise GroupError(f"size {size} bytes: use a positive multiple of the {self.block_size}-byte block")
        return size // self.block_size

    async def create(self, name: str, size: int, *, thin: bool = True) -> LogicalVolume:
        """A new volume of `size` bytes: thin (clusters on first write) or thick (all of them now, zeroed)."""
        self._new_name(name)
        blocks = self._blocks(size)
        n = self._clusters_of(blocks)
        if not thin:
            self._admit(n, volumes=1)
            if n > self.clusters - self.used - len(self._busy):
                raise NoSpace(f"a thick volume of {size} bytes needs {n} clusters; the group has "
                              f"{self.clusters - self.used - len(self._busy)} free")
        else:
            self._admit(0, volumes=1)
        vid = self.next_id
        self._do((Op.CREATE, vid, Flag.THIN if thin else Flag(0), blocks, 0, time.time_ns(), False, name))
        if not thin:
            await self._provision_all(self.vols[vid], 0, n)
        await self.commit()
        return self.volume(name)

    async def _provision_all(self, v: _Vol, start: int, stop: int) -> None:
        """Map every unmapped cluster of v in [start, stop) to a zeroed private one (thick volumes)."""
        todo = [vc for vc in range(start, stop) if v.map[vc] < 0]
        got: list[int] = []
        try:
            for _ in todo:
                got.append(self._alloc())
        except NoSpace:
            self._busy.difference_update(got)
            raise
        cb = self.cluster_blocks
        for vc0, p0, length in _runs(todo, got):
            await self.dev.write_zeroes(self.data_lba + p0 * cb, length * cb)
        await self.dev.flush()
        self._busy.difference_update(got)
        for vc0, p0, length in _runs(todo, got):
            self._do((Op.MAP, v.rec.id, vc0, p0, length))

    async def _drained(self, v: _Vol) -> None:
        """Hold v's new writes and wait for those under way (a crash-consistent point); release() after."""
        if v.hold is None:
            v.hold = asyncio.Event()
        while v.inflight:
            v.idle = v.idle or asyncio.Event()
            await v.idle.wait()
            v.idle = None

    def _unhold(self, v: _Vol) -> None:
        hold, v.hold = v.hold, None
        if hold is not None:
            hold.set()

    async def snapshot(self, name: str, snapshot: str) -> None:
        """A read-only copy of volume `name` as it is now (writes under way finish first; new ones wait)."""
        v = self._vol(name)
        self._new_name(snapshot)
        self._admit(fmt.count_runs(_view(v.map)), volumes=1)
        await self._drained(v)
        try:
            flags = (v.rec.flags & Flag.THIN) | Flag.SNAPSHOT | Flag.READ_ONLY
            self._do((Op.CREATE, self.next_id, flags, v.rec.blocks, v.rec.id, time.time_ns(), True, snapshot))
        finally:
            self._unhold(v)
        await self.commit()

    async def clone(self, snapshot: str, name: str) -> LogicalVolume:
        """A writable thin volume sharing every cluster of `snapshot` (or of any volume)."""
        s = self._vol(snapshot)
        self._new_name(name)
        self._admit(fmt.count_runs(_view(s.map)), volumes=1)
        await self._drained(s)
        try:
            self._do((Op.CREATE, self.next_id, Flag.THIN, s.rec.blocks, s.rec.id, time.time_ns(), True, name))
        finally:
            self._unhold(s)
        await self.commit()
        return self.volume(name)

    async def rollback(self, name: str, snapshot: str) -> None:
        """Volume `name` becomes what `snapshot` holds (its size too); the snapshot stays."""
        v, s = self._vol(name), self._vol(snapshot)
        if not v.writable:
            raise GroupError(f"{name!r} is a snapshot or read-only; roll back a writable volume")
        if s is v:
            raise GroupError("a volume cannot be rolled back to itself; name a snapshot")
        self._admit(fmt.count_runs(_view(s.map)))
        await self._drained(v)
        try:
            for fut in list(v.provisioning.values()):
                await fut
            self._do((Op.ROLLBACK, v.rec.id, s.rec.id))
        finally:
            self._unhold(v)
        if v.handle is not None:
            v.handle.changed()
        await self.commit()

    async def delete(self, name: str, *, force: bool = False) -> None:
        """The volume or snapshot goes; its clusters return to the group when nobody else shares them."""
        v = self._vol(name)
        if v.handle is not None and v.handle.in_use and not force:
            raise Busy(f"volume {name!r} is in use (exported); remove its exports first")
        await self._drained(v)
        try:
            for fut in list(v.provisioning.values()):
                await fut
            self._do((Op.DELETE, v.rec.id))
        finally:
            self._unhold(v)
        if v.handle is not None:
            v.handle.closed = True
        await self.commit()

    async def rename(self, name: str, new: str) -> None:
        v = self._vol(name)
        self._new_name(new)
        self._do((Op.RENAME, v.rec.id, new))
        await self.commit()

    async def resize(self, name: str, size: int, *, force: bool = False) -> None:
        """Grow (thick: clusters allocated now) or shrink; a shrink that would drop mapped data is refused
        unless forced."""
        v = self._vol(name)
        if not v.writable:
            raise GroupError(f"{name!r} is a snapshot; snapshots keep their size")
        blocks = self._blocks(size)
        n = self._clusters_of(blocks)
        if blocks < v.rec.blocks and not force:
            tail = _view(v.map)[n:]
            partial = blocks % self.cluster_blocks and v.map[n - 1] >= 0
            if np.count_nonzero(tail >= 0) or partial:
                raise GroupError(f"shrinking {name!r} to {size} bytes would drop data mapped beyond that; "
                                 "unmap it first or force")
        if not v.thin and n > len(v.map):
            need = n - len(v.map)
            self._admit(need)
            if need > self.clusters - self.used - len(self._busy):
                raise NoSpace(f"growing thick volume {name!r} needs {need} clusters; the group has "
                              f"{self.clusters - self.used - len(self._busy)} free")
        await self._drained(v)
        try:
            old = len(v.map)
            self._do((Op.RESIZE, v.rec.id, blocks))
            if not v.thin and n > old:
                await self._provision_all(v, old, n)
        finally:
            self._unhold(v)
        if v.handle is not None:
            v.handle.changed()
        await self.commit()

    def volume(self, name: str) -> LogicalVolume:
        """The block device of a volume or snapshot (one per volume, kept while the group is open)."""
        v = self._vol(name)
        if v.handle is None or v.handle.closed:
            v.handle = LogicalVolume(self, v)
        return v.handle

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def info(self, name: str) -> dict[str, Any]:
        v = self._vol(name)
        m = _view(v.map)
        mapped = m[m >= 0]
        exclusive = int(np.count_nonzero(_view(self.ref)[mapped] == 1)) if len(mapped) else 0
        origin = self.vols.get(v.rec.origin)
        cs = self.sb.cluster_size
        return {
            "name": v.rec.name, "kind": "snapshot" if v.rec.flags & Flag.SNAPSHOT else "volume",
            "thin": v.thin, "read_only": not v.writable, "size": v.rec.blocks * self.block_size,
            "origin": origin.rec.name if origin else None, "created": v.rec.created / 1e9,
            "mapped": v.mapped * cs, "exclusive": exclusive * cs,
        }

    def space(self) -> dict[str, Any]:
        cs = self.sb.cluster_size
        capacity = self.clusters * cs
        provisioned = sum(v.rec.blocks * self.block_size for v in self.vols.values()
                          if not v.rec.flags & Flag.SNAPSHOT)
        room = self._slot_runs(len(self.vols))
        return {
            "uuid": str(self.sb.uuid), "cluster_size": cs, "capacity": capacity,
            "used": self.used * cs, "free": (self.clusters - self.used) * cs,
            "volumes": sum(1 for v in self.vols.values() if not v.rec.flags & Flag.SNAPSHOT),
            "snapshots": sum(1 for v in self.vols.values() if v.rec.flags & Flag.SNAPSHOT),
            "provisioned": provisioned, "overcommit": round(provisioned / capacity, 3) if capacity else 0.0,
            "metadata_used": round(min(1.0, self._runs_bound / room), 4) if room > 0 else 1.0,
        }

    # ---- I/O (LogicalVolume calls these)

    def _guard(self, p: int) -> None:
        self._io[p] = self._io.get(p, 0) + 1

    def _unguard(self, p: int) -> None:
        n = self._io[p] - 1
        if n:
            self._io[p] = n
        else:
            del self._io[p]

    async def _enter(self, v: _Vol) -> None:
        while v.hold is not None:
            await v.hold.wait()
        if self._failed is not None:
            raise DeviceFailed(f"volume group {self.sb.uuid}: metadata commit failed: {self._failed}")
        v.inflight += 1

    def _leave(self, v: _Vol) -> None:
        v.inflight -= 1
        if not v.inflight and v.idle is not None:
            v.idle.set()

    def _segments(self, lba: int, blocks: int) -> Iterator[tuple[int, int, int]]:
        """(virtual cluster, first block in it, blocks) pieces of a range."""
        cb = self.cluster_blocks
        end = lba + blocks
        while lba < end:
            vc, off = divmod(lba, cb)
            n = min(cb - off, end - lba)
            yield vc, off, n
            lba += n

    async def read(self, v: _Vol, lba: int, blocks: int) -> Buffer:
        bs, cb, dlba = self.block_size, self.cluster_blocks, self.data_lba
        vc, off = divmod(lba, cb)
        if off + blocks <= cb:   # one cluster: the device's own buffer, as it came
            p = v.map[vc]
            if p < 0:
                return bytes(blocks * bs)
            self._guard(p)
            try:
                return await self.dev.read(dlba + p * cb + off, blocks)
            finally:
                self._unguard(p)
        out = bytearray(blocks * bs)
        at = 0
        for vc, off, n in self._segments(lba, blocks):
            p = v.map[vc]
            if p >= 0:
                self._guard(p)
                try:
                    out[at:at + n * bs] = await self.dev.read(dlba + p * cb + off, n)
                finally:
                    self._unguard(p)
            at += n * bs
        return out

    async def write(self, v: _Vol, lba: int, data: Buffer, fua: bool) -> None:
        if not v.writable:
            raise ReadOnly(f"{v.rec.name} is a snapshot (read-only)")
        await self._enter(v)
        try:
            bs, cb, dlba = self.block_size, self.cluster_blocks, self.data_lba
            view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
            at = 0
            for vc, off, n in self._segments(lba, len(view) // bs):
                chunk = view[at:at + n * bs]
                at += n * bs
                while True:
                    p = v.map[vc]
                    fut = v.provisioning.get(vc)
                    if fut is not None:
                        await fut
                        continue
                    if p >= 0 and self.ref[p] == 1:
                        self._guard(p)
                        try:
                            await self.dev.write(dlba + p * cb + off, chunk)
                        finally:
                            self._unguard(p)
                    else:
                        await self._provision(v, vc, off, chunk)
                    break
            if fua:
                await self.commit()
        finally:
            self._leave(v)

    async def _provision(self, v: _Vol, vc: int, off: int, chunk: memoryview | bytes) -> None:
        """A write to an unmapped or shared cluster: a new cluster gets the old contents (zeros or the shared
        copy) with the write merged in; then, written, it replaces the old one in the mapping."""
        bs, cb, dlba = self.block_size, self.cluster_blocks, self.data_lba
        old = v.map[vc]
        self._admit(2)
        new = self._alloc()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        v.provisioning[vc] = fut
        try:
            if off == 0 and len(chunk) == cb * bs:
                buf: Buffer = chunk
            else:
                if old >= 0:
                    self._guard(old)
                    try:
                        full = bytearray(await self.dev.read(dlba + old * cb, cb))
                    finally:
                        self._unguard(old)
                else:
                    full = bytearray(cb * bs)
                full[off * bs:off * bs + len(chunk)] = chunk
                buf = full
            await self.dev.write(dlba + new * cb, buf)
            self._busy.discard(new)
            n = self._do((Op.MAP, v.rec.id, vc, new, 1))
            self._fresh[new] = n
        except BaseException:
            if self.ref[new] == 0:
                self._busy.discard(new)
            raise
        finally:
            del v.provisioning[vc]
            fut.set_result(None)

    async def unmap(self, v: _Vol, lba: int, blocks: int) -> None:
        """Deallocate (thin: whole clusters leave the mapping; partial ones, and thick volumes, get zeros)."""
        if not v.writable:
            raise ReadOnly(f"{v.rec.name} is a snapshot (read-only)")
        cb, bs = self.cluster_blocks, self.block_size
        first = -(-lba // cb)
        last = (lba + blocks) // cb
        if not v.thin or first >= last:
            await self._zero(v, lba, blocks)
            return
        if lba < first * cb:
            await self._zero(v, lba, first * cb - lba)
        await self._enter(v)
        try:
            while True:
                waits = [f for vc, f in v.provisioning.items() if first <= vc < last]
                if not waits:
                    break
                await asyncio.gather(*waits)
            m = _view(v.map)[first:last]
            if np.count_nonzero(m >= 0):
                self._admit(1, reserve=False)
                self._do((Op.UNMAP, v.rec.id, first, last - first))
        finally:
            self._leave(v)
        if (lba + blocks) > last * cb:
            await self._zero(v, last * cb, lba + blocks - last * cb)
        del bs

    async def _zero(self, v: _Vol, lba: int, blocks: int) -> None:
        """Zeros written over [lba, lba+blocks): unmapped clusters of a thin volume already read as zeros."""
        bs = self.block_size
        step = self.cluster_blocks
        for vc, off, n in self._segments(lba, blocks):
            if v.thin and v.map[vc] < 0 and vc not in v.provisioning:
                continue
            p = v.map[vc]
            if p >= 0 and self.ref[p] == 1 and vc not in v.provisioning:
                await self._enter(v)
                try:
                    self._guard(p)
                    try:
                        await self.dev.write_zeroes(self.data_lba + p * step + off, n)
                    finally:
                        self._unguard(p)
                finally:
                    self._leave(v)
            else:
                await self.write(v, vc * step + off, bytes(n * bs), False)

    def extents(self, v: _Vol, lba: int, blocks: int) -> list[tuple[int, int, int]]:
        """(lba, blocks, 0 mapped | 1 deallocated) runs over [lba, lba+blocks) (SBC-4 GET LBA STATUS)."""
        cb = self.cluster_blocks
        end = min(lba + blocks, v.rec.blocks)
        first, last = lba // cb, -(-end // cb)
        state = (_view(v.map)[first:last] < 0).astype(np.int8)
        if not len(state):
            return []
        breaks = np.flatnonzero(np.diff(state)) + 1
        out = []
        for s, e in zip(np.concatenate(([0], breaks)).tolist(), np.concatenate((breaks, [len(state)])).tolist(),
                        strict=True):
            a = max(lba, (first + s) * cb)
            b = min(end, (first + e) * cb)
            out.append((a, b - a, int(state[s])))
            if len(out) >= MAX_EXTENTS:
                break
        return out


def _runs(vcs: list[int], ps: list[int]) -> list[tuple[int, int, int]]:
    """(virtual, physical, length) runs of parallel lists."""
    out: list[list[int]] = []
    for vc, p in zip(vcs, ps, strict=True):
        if out and out[-1][0] + out[-1][2] == vc and out[-1][1] + out[-1][2] == p:
            out[-1][2] += 1
        else:
            out.append([vc, p, 1])
    return [(a, b, c) for a, b, c in out]


from openvsan.volume.thin.device import LogicalVolume  # the device refers back to the group
