"""LogicalVolume: one volume (or snapshot) of a volume group as a block device (group.py and io.py do the work).

Reads and writes that stay in one cluster, or whose clusters are physically consecutive, take the device's
fast path when the device below has one: a read looks its clusters up and reads there in the caller's turn; a
write goes in place when its clusters are mapped, owned by this volume alone and their mappings already
committed, their references too (then it is as durable on return as a FUA write). Anything else (a cluster
to allocate or copy, a mapping not yet committed) declines to the normal path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import Buffer

if TYPE_CHECKING:
    from openvsan.volume.thin.group import VolumeGroup
    from openvsan.volume.thin.state import _Vol


class LogicalVolume:
    def __init__(self, group: VolumeGroup, vol: _Vol) -> None:
        self.group = group
        self.vol = vol
        self.block_size = group.block_size
        self.closed = False
        self.in_use = False     # served (the node sets it): delete refuses it unless forced
        self.on_change: Callable[[], None] | None = None   # the size or contents changed (resize, rollback)
        below = group.dev.capabilities
        self._read_now = getattr(group.dev, "read_now", None) if below.sync_read else None
        self._write_now = getattr(group.dev, "write_now", None) if below.sync_write else None
        self.capabilities = Capabilities(
            sync_read=self._read_now is not None, sync_write=self._write_now is not None,
            unmap_reads_zero=True, write_zeroes=True, extents=True,
            max_transfer=below.max_transfer, atomic_write=0, volatile_cache=True, resizable=True,
            thin=vol.thin)

    @property
    def name(self) -> str:
        return self.vol.rec.name

    @property
    def num_blocks(self) -> int:
        return self.vol.rec.blocks

    @property
    def thin(self) -> bool:
        return self.vol.thin

    @property
    def read_only(self) -> bool:
        return not self.vol.writable

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def free_share(self) -> float:
        """The share of its group's clusters free now (the compression layer gives back the slots it keeps for
        its next versions when this runs low)."""
        g = self.group
        return g._free_now() / g.clusters if g.clusters else 0.0

    # ---- BlockDevice

    async def read(self, lba: int, blocks: int) -> Buffer:
        return await self.group.read(self.vol, lba, blocks)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        await self.group.write(self.vol, lba, data, fua)

    async def flush(self) -> None:
        await self.group.commit()

    async def unmap(self, lba: int, blocks: int) -> None:
        await self.group.unmap(self.vol, lba, blocks)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self.group.unmap(self.vol, lba, blocks)

    async def lba_status(self, lba: int, blocks: int) -> list[tuple[int, int, int]]:
        return self.group.extents(self.vol, lba, blocks)

    def allocated_blocks(self) -> int:
        """Blocks of this volume that have a cluster (NVMe NUSE; a shared cluster counts for each sharer)."""
        return min(self.vol.rec.blocks, self.vol.mapped * self.group.cluster_blocks)

    async def resize(self, num_blocks: int) -> None:
        await self.group.resize(self.name, num_blocks * self.block_size)

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        """Within a cluster, or over clusters that are all unmapped or physically consecutive (one device
        read, as the async path's runs); else None."""
        g = self.group
        cb = g.cluster_blocks
        vc, off = divmod(lba, cb)
        if self._read_now is None:
            return None
        m = self.vol.map
        p = m[vc]
        if off + blocks > cb:
            for i in range(1, (off + blocks - 1) // cb + 1):
                if m[vc + i] != (p + i if p else 0):
                    return None
        if not p:
            return bytes(blocks * self.block_size)
        data = self._read_now(g.lba0 + p * cb + off, blocks)
        # a lent view could outlive the cluster's time in this volume (unmapped and given to another before
        # the send is done): the bytes go out as a copy
        return bytes(data) if isinstance(data, memoryview) else data

    def can_write_now(self, lba: int, blocks: int) -> bool:
        """write_now of these blocks would write (the device has a fast path; within a cluster, or over
        clusters physically consecutive, each of which may be written in place (io.py in_place) and whose
        mapping is committed): a caller with work to do before its write asks first."""
        g = self.group
        v = self.vol
        if self._write_now is None or v.hold is not None or not v.writable:
            return False
        cb = g.cluster_blocks
        vc, off = divmod(lba, cb)
        k = max(1, (off + blocks - 1) // cb + 1)
        m, fresh = v.map, g._fresh
        p = m[vc]
        if k > 1 and m[vc:vc + k].tolist() != list(range(p, p + k)):
            return False
        return g.in_place(v, vc, p, k) and not (fresh and any(q in fresh for q in range(p, p + k)))

    def write_now(self, lba: int, data: Buffer) -> bool:
        """At once where can_write_now says so, as durable on return as a FUA write; else False."""
        write = self._write_now
        if write is None or not self.can_write_now(lba, len(data) // self.block_size):
            return False
        g = self.group
        return bool(write(g.lba0 + int(self.vol.map[lba // g.cluster_blocks]) * g.cluster_blocks
                                    + lba % g.cluster_blocks, data))

    async def close(self) -> None:
        """The volume stays in its group; the group closes with the node."""
        self.closed = True

    def to_config(self) -> dict[str, Any]:
        return {"type": "lv", "name": self.name, "group": str(self.group.sb.uuid)}
