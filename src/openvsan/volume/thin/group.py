"""VolumeGroup: many volumes carved out of one device or pool, thick or thin, with snapshots and clones
(the thin issue; dm-thin's rules, SPDK lvol's operations). This module makes, opens and changes groups and
volumes; the mappings in memory are in state.py, their commits and checkpoints in store.py, reads and
writes in io.py, the on-disk format in format.py.

Every volume has its own mapping (virtual cluster -> physical cluster, from 1; 0: unmapped) and every physical
cluster a reference count; a snapshot or clone copies its origin's mapping and shares the clusters (a write to
a shared cluster copies it first), so a read costs one lookup however long the chain of snapshots is.

The rule that keeps it crash-safe (dm-thin's): a write is acknowledged once its data is written and its
mapping is in memory; the mappings are committed at a flush or FUA write (data flushed, then the journal
written and flushed) and at least every `commit_interval` seconds. A cluster freed in memory is not reused
before the free is committed (and no I/O is still reading or writing it), and a cluster left to one volume
by a change not yet committed (the other sharer copied it, unmapped it or was deleted) is not written in place
before that commit, so a crash can never leave a committed mapping of one volume pointing at another volume's
data. A volume therefore states a volatile write cache (capabilities.volatile_cache): initiators flush, as
they do for any disk with one. Changes of volumes (create, snapshot, delete...) run one at a time, and each
is committed before it returns.

Metadata cannot run out under a write: every change that could grow the checkpoint is admitted against the
checkpoint slot's room first (with a reserve kept for unmaps and deletes, so space can always be given back),
and the journal, when full, is folded into a checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid as uuidlib
from typing import Any

import numpy as np

from openvsan.block.device import BlockDevice
from openvsan.block.errors import Busy, NoSpace
from openvsan.volume.thin import format as fmt
from openvsan.volume.thin.device import LogicalVolume
from openvsan.volume.thin.format import Flag, Op, Superblock
from openvsan.volume.thin.io import GroupIO
from openvsan.volume.thin.state import _view, _Vol, entries

log = logging.getLogger("openvsan.volume.thin")

DEFAULT_CLUSTER = 64 << 10
MIN_CLUSTER, MAX_CLUSTER = 4 << 10, 4 << 20


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


def _runs(vcs: list[int], ps: list[int]) -> list[tuple[int, int, int]]:
    """(virtual, physical, length) runs of parallel lists."""
    out: list[list[int]] = []
    for vc, p in zip(vcs, ps, strict=True):
        if out and out[-1][0] + out[-1][2] == vc and out[-1][1] + out[-1][2] == p:
            out[-1][2] += 1
        else:
            out.append([vc, p, 1])
    return [(a, b, c) for a, b, c in out]


class VolumeGroup(GroupIO):
    def __init__(self, dev: BlockDevice, sb: Superblock) -> None:
        super().__init__(dev, sb)
        self._admin = asyncio.Lock()     # one change of volumes (create, snapshot, delete...) at a time

    # ---- make, find, open, close

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
        if group._cheap_zero:   # the data area reads zero (no transfer): first writes carry only their blocks
            await dev.write_zeroes(group.lba0 + group.cluster_blocks, clusters * group.cluster_blocks)
            group._zeroed[1:] = b"\x01" * clusters
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

    async def close(self) -> None:
        """Commit what is left (a clean stop). The device below belongs to whoever opened it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
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
        async with self._admin:
            self._new_name(name)
            blocks = self._blocks(size)
            n = self._clusters_of(blocks)
            if not thin:
                self._admit(n, volumes=1)
                if n > self._free_now():
                    raise NoSpace(f"a thick volume of {size} bytes needs {n} clusters; the group has "
                                  f"{self._free_now()} free")
            else:
                self._admit(0, volumes=1)
            vid = self.next_id
            self._do((Op.CREATE, vid, Flag.THIN if thin else Flag(0), blocks, 0, time.time_ns(), False, name))
            if not thin:
                self._reserved += n
                try:
                    await self._provision_all(self.vols[vid], 0, n)
                except BaseException:
                    self._do((Op.DELETE, vid))   # not half made
                    raise
                finally:
                    self._reserved -= n
            await self.commit()
            return self.volume(name)

    async def _provision_all(self, v: _Vol, start: int, stop: int) -> None:
        """Map every unmapped cluster of v in [start, stop) to a zeroed private one (thick volumes)."""
        todo = (np.flatnonzero(_view(v.map)[start:stop] == 0) + start).tolist()
        got: list[int] = []
        try:
            for _ in todo:
                got.append(self._alloc())
            cb = self.cluster_blocks
            for _, p0, length in _runs(todo, got):
                await self.dev.write_zeroes(self.lba0 + p0 * cb, length * cb)
            await self.dev.flush()
        finally:
            self._busy.difference_update(got)
        for vc0, p0, length in _runs(todo, got):
            self._do((Op.MAP, v.rec.id, vc0, p0, length))

    async def _drained(self, v: _Vol) -> None:
        """Hold v's new writes and wait for those under way (a crash-consistent point); _unhold() after."""
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
        async with self._admin:
            v = self._vol(name)
            self._new_name(snapshot)
            self._admit(self._runs_of(v), volumes=1)
            await self._drained(v)
            try:
                self._admit(self._runs_of(v), volumes=1)   # the writes drained may have added some
                flags = (v.rec.flags & Flag.THIN) | Flag.SNAPSHOT | Flag.READ_ONLY
                self._do((Op.CREATE, self.next_id, flags, v.rec.blocks, v.rec.id, time.time_ns(), True, snapshot))
            finally:
                self._unhold(v)
            await self.commit()

    async def clone(self, snapshot: str, name: str) -> LogicalVolume:
        """A writable thin volume sharing every cluster of `snapshot` (or of any volume)."""
        async with self._admin:
            s = self._vol(snapshot)
            self._new_name(name)
            self._admit(self._runs_of(s), volumes=1)
            await self._drained(s)
            try:
                self._admit(self._runs_of(s), volumes=1)
                self._do((Op.CREATE, self.next_id, Flag.THIN, s.rec.blocks, s.rec.id, time.time_ns(), True, name))
            finally:
                self._unhold(s)
            await self.commit()
            return self.volume(name)

    async def decouple(self, name: str, *, allocate: bool = False) -> dict[str, int]:
        """Volume `name` gets a cluster of its own for every one it shares with a snapshot or clone (SPDK's
        decouple_parent), and with `allocate` for every one it lacks too, zeroed (SPDK's inflate): afterwards
        no write to it needs space it has not got. Cluster by cluster, while it serves: a write to the cluster
        being copied waits for that copy only. Returns the clusters copied and allocated."""
        v = self._vol(name)
        if not v.writable:
            raise GroupError(f"{name!r} is a snapshot; decouple a writable volume (a clone)")
        bs, cb = self.block_size, self.cluster_blocks
        copied = allocated = 0
        for vc in range(len(v.map)) if allocate else entries(v)[0].tolist():
            p = v.map[vc]
            if not (p and self.ref[p] > 1) and not (not p and allocate):
                continue
            await self._enter(v)
            try:
                while (busy := v.provisioning.get(vc)) is not None:
                    await busy.wait()
                p = v.map[vc]
                if p and self.ref[p] > 1:
                    await self._provision(v, vc, 0, b"")          # the shared copy, nothing merged in
                    copied += 1
                elif not p and allocate:
                    await self._provision(v, vc, 0, bytes(cb * bs))
                    allocated += 1
            finally:
                self._leave(v)
        await self.commit()
        return {"copied": copied, "allocated": allocated}

    async def rollback(self, name: str, snapshot: str) -> None:
        """Volume `name` becomes what `snapshot` holds (its size too); the snapshot stays."""
        async with self._admin:
            v, s = self._vol(name), self._vol(snapshot)
            if not v.writable:
                raise GroupError(f"{name!r} is a snapshot or read-only; roll back a writable volume")
            if s is v:
                raise GroupError("a volume cannot be rolled back to itself; name a snapshot")
            self._admit(self._runs_of(s))
            await self._drained(v)
            try:
                for done in list(v.provisioning.values()):
                    await done.wait()
                self._admit(self._runs_of(s))
                self._do((Op.ROLLBACK, v.rec.id, s.rec.id))
            finally:
                self._unhold(v)
            if v.handle is not None:
                v.handle.changed()
            await self.commit()

    async def delete(self, name: str, *, force: bool = False) -> None:
        """The volume or snapshot goes; its clusters return to the group when nobody else shares them."""
        async with self._admin:
            v = self._vol(name)
            if v.handle is not None and v.handle.in_use and not force:
                raise Busy(f"volume {name!r} is in use (exported); remove its exports first")
            await self._drained(v)
            try:
                for done in list(v.provisioning.values()):
                    await done.wait()
                self._do((Op.DELETE, v.rec.id))
            finally:
                self._unhold(v)
            if v.handle is not None:
                v.handle.closed = True
            await self.commit()

    async def rename(self, name: str, new: str) -> None:
        async with self._admin:
            v = self._vol(name)
            self._new_name(new)
            self._do((Op.RENAME, v.rec.id, new))
            await self.commit()

    async def resize(self, name: str, size: int, *, force: bool = False) -> None:
        """Grow (thick: clusters allocated now) or shrink; a shrink that would drop mapped data is refused
        unless forced."""
        async with self._admin:
            v = self._vol(name)
            if not v.writable:
                raise GroupError(f"{name!r} is a snapshot; snapshots keep their size")
            blocks = self._blocks(size)
            n = self._clusters_of(blocks)
            cb = self.cluster_blocks
            if blocks < v.rec.blocks and not force:
                vcs = entries(v)[0]
                if len(vcs) and vcs[-1] >= n or blocks % cb and v.map[n - 1]:
                    raise GroupError(f"shrinking {name!r} to {size} bytes would drop data mapped beyond that; "
                                     "unmap it first or force")
            need = n - len(v.map) if not v.thin else 0
            if need > 0:
                self._admit(need)
                if need > self._free_now():
                    raise NoSpace(f"growing thick volume {name!r} needs {need} clusters; the group has "
                                  f"{self._free_now()} free")
            end = v.rec.blocks
            if blocks > end and end % cb:
                # the rest of the last cluster joins the volume: zeros there, not what a shrink left beyond it
                await self._zero(v, end, self._clusters_of(end) * cb - end)
            await self._drained(v)
            try:
                old = len(v.map)
                self._do((Op.RESIZE, v.rec.id, blocks))
                if need > 0:
                    self._reserved += need
                    try:
                        await self._provision_all(v, old, n)
                    finally:
                        self._reserved -= need
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

    def origin_of(self, name: str) -> str | None:
        """The name of the volume or snapshot `name` was taken or cloned from, while it exists."""
        origin = self.vols.get(self._vol(name).rec.origin)
        return origin.rec.name if origin else None

    def info(self, name: str) -> dict[str, Any]:
        v = self._vol(name)
        mapped = entries(v)[1]
        exclusive = int(np.count_nonzero(_view(self.ref)[mapped] == 1)) if len(mapped) else 0
        cs = self.sb.cluster_size
        return {
            "name": v.rec.name, "kind": "snapshot" if v.rec.flags & Flag.SNAPSHOT else "volume",
            "thin": v.thin, "read_only": not v.writable, "size": v.rec.blocks * self.block_size,
            "origin": self.origin_of(name), "created": v.rec.created / 1e9,
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
