"""RAID 0, 1 and 10 I/O: data chunks with one copy (RAID 0) or several (RAID 1, 10), no parity.

A request touches, for each data index, a run of chunks that is contiguous on the members holding that index
(consecutive rows), so it becomes one member request per copy and index, not one per chunk. Writes to a
mirrored level hold the rows' stripe locks so two overlapping writes land in the same order on every copy.
Reads need no lock: a read racing a write may see either, as on a single disk.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from openvsan.block.device import Buffer
from openvsan.block.errors import DeviceFailed
from openvsan.pool.layout import Geometry, Level, Segment
from openvsan.pool.locks import StripeLocks
from openvsan.pool.members import MemberFaults, MemberSet
from openvsan.pool.scrub import RowCheck


def extents(segments: list[Segment]) -> dict[int, list[Segment]]:
    """Segments grouped by data index; each group is contiguous on its members."""
    groups: dict[int, list[Segment]] = {}
    for s in segments:
        groups.setdefault(s.column, []).append(s)
    return groups


class MirrorIO:
    def __init__(self, ms: MemberSet, geo: Geometry, locks: StripeLocks) -> None:
        self.ms = ms
        self.geo = geo
        self.locks = locks
        self.bs = ms.block_size

    # --- read -------------------------------------------------------------------------------------------------

    async def read(self, lba: int, blocks: int) -> Buffer:
        groups = extents(self.geo.segments(lba, blocks))
        if len(groups) == 1:
            (segs,) = groups.values()
            if len(segs) == 1:
                return await self._read_extent(segs)
        out = bytearray(blocks * self.bs)
        view = memoryview(out)
        parts = await asyncio.gather(*(self._read_extent(segs) for segs in groups.values()))
        for segs, data in zip(groups.values(), parts, strict=True):
            self._scatter(segs, data, view)
        return out

    def _scatter(self, segs: list[Segment], data: Buffer, out: memoryview) -> None:
        bs = self.bs
        src = memoryview(data).cast("B")
        pos = 0
        for s in segs:
            n = s.blocks * bs
            out[s.start * bs:s.start * bs + n] = src[pos:pos + n]
            pos += n

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        """read() in the caller's turn, from the copy read() would choose, where that copy's member has a fast
        path; None otherwise."""
        groups = extents(self.geo.segments(lba, blocks))
        if len(groups) == 1:
            (segs,) = groups.values()
            if len(segs) == 1:
                return self._read_extent_now(segs)
        out = bytearray(blocks * self.bs)
        view = memoryview(out)
        for segs in groups.values():
            data = self._read_extent_now(segs)
            if data is None:
                return None
            self._scatter(segs, data, view)
        return out

    def _copy(self, segs: list[Segment], tried: set[int]) -> int | None:
        """The member to read an extent from: of its copies in sync for all its rows and not tried yet, one
        chosen by row, so concurrent requests use every mirror; None when there is none."""
        first, last = segs[0], segs[-1]
        copies = [m for m in self.geo.copies(first.row, first.column)
                  if m not in tried and self.ms.members[m].valid_rows(first.row, last.row + 1)]
        return copies[first.row % len(copies)] if copies else None

    def _read_extent_now(self, segs: list[Segment]) -> Buffer | None:
        m = self._copy(segs, set())
        if m is None:
            return None
        return self.ms.read_now(m, segs[0].row, segs[0].offset, sum(s.blocks for s in segs))

    async def _read_extent(self, segs: list[Segment]) -> Buffer:
        first, last = segs[0], segs[-1]
        blocks = sum(s.blocks for s in segs)
        tried: set[int] = set()
        while True:
            m = self._copy(segs, tried)
            if m is None:
                raise DeviceFailed(f"pool: no readable copy of rows {first.row}..{last.row} left")
            try:
                return await self.ms.read(m, first.row, first.offset, blocks)
            except MemberFaults as e:
                tried.update(e.faults)
                await self.ms.fail(e)

    # --- write ------------------------------------------------------------------------------------------------

    async def write(self, lba: int, data: Buffer, fua: bool) -> None:
        view = memoryview(data).cast("B")
        bs = self.bs
        segs = self.geo.segments(lba, len(view) // bs)
        groups = extents(segs)
        async with AsyncExitStack() as stack:
            if self.geo.level.mirrored:
                await stack.enter_async_context(self.locks.hold_rows(segs[0].row, segs[-1].row + 1))
            ops = []
            for group in groups.values():
                first, last = group[0], group[-1]
                payload = self._payload(group, view)
                copies = [m for m in self.geo.copies(first.row, first.column)
                          if self.ms.members[m].valid_rows(first.row, last.row + 1)]
                # a rebuilding copy in sync for only some of these rows gets its in-sync part
                partial = [m for m in self.geo.copies(first.row, first.column)
                           if m not in copies and self.ms.members[m].valid(first.row)]
                if not copies and not partial:
                    raise DeviceFailed(f"pool: no writable copy of rows {first.row}..{last.row} left")
                ops += [self.ms.write(m, first.row, first.offset, payload, fua) for m in copies]
                for m in partial:
                    upto = self.ms.members[m].checkpoint
                    n = sum(s.blocks for s in group if s.row < upto) * bs
                    ops.append(self.ms.write(m, first.row, first.offset, memoryview(payload)[:n], fua))
            await self.ms.write_all(ops)

    def _payload(self, group: list[Segment], view: memoryview) -> Buffer:
        """An extent's data: one member request per copy and data index."""
        bs = self.bs
        first = group[0]
        if len(group) == 1:
            return view[first.start * bs:(first.start + first.blocks) * bs]
        return b"".join(view[s.start * bs:(s.start + s.blocks) * bs] for s in group)

    def write_now(self, lba: int, data: Buffer) -> bool:
        """write() of a healthy pool whose members have the fast path, done in the caller's turn: every copy
        of every extent; False, nothing written, where that cannot be (a member out of sync or without the
        fast path, a mirrored row held by a request or rebuild in flight). A member that declines after others
        took their part leaves copies that write() then writes again whole, which is all it takes here."""
        ms = self.ms
        if not ms.optimal:
            return False
        view = memoryview(data).cast("B")
        segs = self.geo.segments(lba, len(view) // self.bs)
        if self.geo.level.mirrored:
            for row in range(segs[0].row, segs[-1].row + 1):
                if self.locks.busy(row):
                    return False
        # chunk by chunk from the request's buffer: no extent is joined into one payload first (that copy
        # costs more than the members' calls it saves when they answer at once)
        bs = self.bs
        writes = []
        for s in segs:
            part = view[s.start * bs:(s.start + s.blocks) * bs]
            for m in self.geo.copies(s.row, s.column):
                if not ms.can_write_now(m):
                    return False
                writes.append((m, s.row, s.offset, part))
        for m, row, off, part in writes:
            if not ms.write_now(m, row, off, part):
                return False
        return True

    # --- rebuild, resync, scrub -------------------------------------------------------------------------------

    async def rebuild(self, targets: list[int], start: int, end: int) -> None:
        """Rows [start, end) of each target member, copied from an in-sync copy (stripe locks held)."""
        cb = self.geo.chunk_blocks
        by_index: dict[int, list[int]] = {}
        for t in targets:
            index = self.geo.data_index(start, t)
            assert index is not None  # mirrors hold no parity
            by_index.setdefault(index, []).append(t)
        for index, group in by_index.items():
            while True:
                sources = [m for m in self.geo.copies(start, index)
                           if m not in group and self.ms.members[m].valid_rows(start, end)]
                if not sources:
                    raise DeviceFailed(f"pool: no in-sync copy to rebuild rows {start}..{end - 1} from")
                try:
                    data = await self.ms.read(sources[0], start, 0, (end - start) * cb)
                    break
                except MemberFaults as e:
                    await self.ms.fail(e)
            await self.ms.write_all([self.ms.write(t, start, 0, data) for t in group])

    async def check(self, start: int, end: int, *, repair: bool, locate: bool = False) -> RowCheck:
        """Compare every copy of rows [start, end) with the first in-sync copy; `repair` rewrites the others from
        it (a mirror cannot tell which copy is right, so the first one wins, as in MD)."""
        cb, bs = self.geo.chunk_blocks, self.bs
        result = RowCheck()
        for index in range(self.geo.data_chunks):
            copies = [m for m in self.geo.copies(start, index) if self.ms.members[m].valid_rows(start, end)]
            if len(copies) < 2:
                if self.geo.level is Level.RAID0 and copies:
                    await self.ms.read(copies[0], start, 0, (end - start) * cb)  # a media error shows here
                else:
                    result.skipped += end - start
                continue
            datas = await self.ms.gather([self.ms.read(m, start, 0, (end - start) * cb) for m in copies])
            first = memoryview(datas[0]).cast("B")
            fixes = []
            for row in range(start, end):
                span = slice((row - start) * cb * bs, (row - start + 1) * cb * bs)
                bad = [m for m, d in zip(copies[1:], datas[1:], strict=True)
                       if memoryview(d).cast("B")[span] != first[span]]
                if bad:
                    result.mismatch(row, bad, f"copy differs from member {copies[0]}")
                    if repair:
                        fixes += [self.ms.write(m, row, 0, first[span]) for m in bad]
                        result.repaired += 1
            if fixes:
                await self.ms.write_all(fixes)
        result.checked = end - start
        return result
