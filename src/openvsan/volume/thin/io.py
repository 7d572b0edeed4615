"""The I/O paths of a volume group's volumes (device.py's LogicalVolume calls these).

A write to a cluster this volume alone holds goes in place; to an unmapped or shared one, a new cluster is
provisioned: it gets the old contents (zeros, or the shared copy) with the write merged in, and once written
it replaces the old one in the mapping (a record, committed by the next flush). A cluster whose references
fell to one by a change not yet committed is written in place only after that commit (state.py, `_pin`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np

from openvsan.block.device import Buffer
from openvsan.block.errors import BlockError, DeviceFailed, ReadOnly
from openvsan.volume.thin.format import Op
from openvsan.volume.thin.state import _view, _Vol
from openvsan.volume.thin.store import GroupStore

MAX_EXTENTS = 4096               # extents one lba_status answer gives at most


class GroupIO(GroupStore):
    def _guard(self, p: int) -> None:
        self._io[p] = self._io.get(p, 0) + 1

    def _unguard(self, p: int) -> None:
        n = self._io[p] - 1
        if n:
            self._io[p] = n
        else:
            del self._io[p]

    def in_place(self, v: _Vol, vc: int, p: int, k: int = 1) -> bool:
        """A write to virtual cluster vc of v, mapped to physical cluster p, may go in place: p is mapped, v alone
        holds it, with no reference change pending commit, and no provisioning of vc under way (both write paths
        ask this). With k: the same of the k clusters from vc on, mapped to p, p+1, ... (the caller saw to that)."""
        if k == 1:
            return bool(p) and self.ref[p] == 1 and not self._pin[p] and vc not in v.provisioning
        prov = v.provisioning
        return (bool(p) and self.ref[p:p + k].count(1) == k and self._pin.count(0, p, p + k) == k
                and not (prov and any(vc + i in prov for i in range(k))))

    @staticmethod
    def _refused(v: _Vol) -> BlockError:
        if v.deleted:
            return DeviceFailed(f"volume {v.rec.name} was deleted from its group")
        return ReadOnly(f"{v.rec.name} is a snapshot (read-only)")

    async def _enter(self, v: _Vol) -> None:
        while v.hold is not None:
            await v.hold.wait()
        if self._failed is not None:
            raise DeviceFailed(f"volume group {self.sb.uuid}: metadata commit failed: {self._failed}")
        if v.deleted:
            raise self._refused(v)
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
        bs, cb = self.block_size, self.cluster_blocks
        vc, off = divmod(lba, cb)
        if off + blocks <= cb:   # one cluster: the device's own buffer, as it came
            p = v.map[vc]
            return await self._read_run([p], off, blocks) if p else bytes(blocks * bs)
        ps = v.map[vc:(lba + blocks - 1) // cb + 1].tolist()
        if ps[0] and ps == list(range(ps[0], ps[0] + len(ps))):   # physically consecutive: one read, as it came
            return await self._read_run(ps, off, blocks)
        out = bytearray(blocks * bs)
        at = 0
        run: list[int] = []      # clusters of one device read: physically consecutive, in order
        run_at = run_off = run_n = 0
        for vc, off, n in self._segments(lba, blocks):
            p = int(v.map[vc])
            if run and p == run[-1] + 1 and not run_off + run_n - (len(run) - 1) * cb - cb:
                run.append(p)       # this cluster goes on where the last one ended: one read for both
                run_n += n
            else:
                if run:
                    out[run_at:run_at + run_n * bs] = await self._read_run(run, run_off, run_n)
                run, run_at, run_off, run_n = ([p] if p else []), at, off, n
            at += n * bs
        if run:
            out[run_at:run_at + run_n * bs] = await self._read_run(run, run_off, run_n)
        return out

    async def _read_run(self, run: list[int], off: int, n: int) -> Buffer:
        """n blocks from `off` in physical clusters run[0], run[0]+1, ..., each kept from reuse meanwhile."""
        for p in run:
            self._guard(p)
        try:
            return await self.dev.read(self.lba0 + run[0] * self.cluster_blocks + off, n)
        finally:
            for p in run:
                self._unguard(p)

    async def write(self, v: _Vol, lba: int, data: Buffer, fua: bool) -> None:
        if not v.writable:
            raise self._refused(v)
        await self._enter(v)
        try:
            bs = self.block_size
            view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
            cb, dlba, in_place = self.cluster_blocks, self.lba0, self.in_place
            at = 0
            segments = list(self._segments(lba, len(view) // bs))
            i = 0
            while i < len(segments):
                vc, off, n = segments[i]
                p = int(v.map[vc])
                if in_place(v, vc, p):
                    # and the clusters after it that go on where it ends, physically too: one device write
                    run, k = [p], i + 1
                    while k < len(segments) and off + n == len(run) * cb:
                        q = int(v.map[segments[k][0]])
                        if q != run[-1] + 1 or not in_place(v, segments[k][0], q):
                            break
                        run.append(q)
                        n += segments[k][2]
                        k += 1
                    for q in run:
                        self._guard(q)
                    try:
                        await self.dev.write(dlba + p * cb + off, view[at:at + n * bs])
                    finally:
                        for q in run:
                            self._unguard(q)
                    at, i = at + n * bs, k
                    continue
                # whole clusters that nothing maps yet, one after another: provisioned together
                j = i
                while j < len(segments) and segments[j][2] == cb and not v.map[segments[j][0]] and \
                        segments[j][0] not in v.provisioning:
                    j += 1
                if j - i >= 2:
                    await self._provision_run(v, vc, j - i, view[at:at + (j - i) * cb * bs])
                    at, i = at + (j - i) * cb * bs, j
                    continue
                await self._write_cluster(v, vc, off, n, view[at:at + n * bs])
                at, i = at + n * bs, i + 1
            if fua:
                await self.commit()
        finally:
            self._leave(v)

    async def _write_cluster(self, v: _Vol, vc: int, off: int, n: int, chunk: memoryview | None) -> None:
        """Write n blocks at `off` of virtual cluster vc (zeros when chunk is None: then a thin volume's
        unmapped cluster stays so, and one in place is zeroed without data). The caller holds _enter."""
        cb, dlba = self.cluster_blocks, self.lba0
        committed = False
        while True:
            busy = v.provisioning.get(vc)
            if busy is not None:
                await busy.wait()
                continue
            p = v.map[vc]
            if p and self.ref[p] == 1 and not (self._pin[p] and committed):
                if self._pin[p]:
                    # the committed mapping may still give p to another volume, or to a snapshot: commit
                    # first (should it stay pinned, a read of it still under way, the write copies it)
                    await self.commit()
                    committed = True
                    continue
                self._guard(p)
                try:
                    if chunk is None:
                        await self.dev.write_zeroes(dlba + p * cb + off, n)
                    else:
                        await self.dev.write(dlba + p * cb + off, chunk)
                finally:
                    self._unguard(p)
            elif chunk is not None or p or not v.thin:
                await self._provision(v, vc, off, chunk if chunk is not None else bytes(n * self.block_size))
            return

    async def _provision(self, v: _Vol, vc: int, off: int, chunk: memoryview | bytes) -> None:
        """A write to an unmapped or shared cluster: a new cluster gets the old contents (zeros or the shared
        copy) with the write merged in; then, written, it replaces the old one in the mapping."""
        bs, cb, dlba = self.block_size, self.cluster_blocks, self.lba0
        old = v.map[vc]
        self._admit(2)
        new = self._alloc(int(v.map[vc - 1]) if vc else 0)    # right after the cluster before, where free
        zeroed = self.alloc_zeroed
        self._reserved += 2
        # an Event, not a future: each waiter gets a future of its own (two writes started eagerly in one turn,
        # netio.start_eagerly, may both wait before a Task has taken either)
        done = v.provisioning[vc] = asyncio.Event()
        at = dlba + new * cb
        try:
            if off == 0 and len(chunk) == cb * bs:
                buf: Buffer = chunk
            elif not old and (zeroed or self._cheap_zero):
                # a cluster that reads zero gets only the write's blocks
                if not zeroed:
                    await self.dev.write_zeroes(dlba + new * cb, cb)
                buf, at = chunk, dlba + new * cb + off
            else:
                if old:
                    self._guard(old)
                    try:
                        full = bytearray(await self.dev.read(dlba + old * cb, cb))
                    finally:
                        self._unguard(old)
                else:
                    full = bytearray(cb * bs)
                full[off * bs:off * bs + len(chunk)] = chunk
                buf = full
            await self.dev.write(at, buf)
            self._busy.discard(new)
            self._fresh[new] = self._do((Op.MAP, v.rec.id, vc, new, 1))
        except BaseException:
            if self.ref[new] == 0:
                self._busy.discard(new)
            raise
        finally:
            self._reserved -= 2
            del v.provisioning[vc]
            done.set()

    async def _provision_run(self, v: _Vol, vc0: int, k: int, data: memoryview) -> None:
        """_provision for k whole clusters from vc0 that nothing maps: new clusters get the data (one device
        write per physically consecutive run of them), then the mapping (one record per run)."""
        bs, cb, dlba = self.block_size, self.cluster_blocks, self.lba0
        self._admit(2 * k)
        news: list[int] = []
        self._reserved += 2 * k
        made: list[int] = []
        try:
            # each one right after the one before it where that is free: the run, and the cluster mapped just
            # before it, physically consecutive (one device write; the fast paths read and write such runs)
            near = int(v.map[vc0 - 1]) if vc0 else 0
            for _ in range(k):
                near = self._alloc(near)
                news.append(near)
            for i in range(k):
                v.provisioning[vc0 + i] = asyncio.Event()
                made.append(vc0 + i)
            runs = []
            i = 0
            while i < k:
                j = i + 1
                while j < k and news[j] == news[j - 1] + 1:
                    j += 1
                runs.append((i, j))
                i = j
            for i, j in runs:
                await self.dev.write(dlba + news[i] * cb, data[i * cb * bs:j * cb * bs])
            for i, j in runs:
                self._busy.difference_update(news[i:j])
                seq = self._do((Op.MAP, v.rec.id, vc0 + i, news[i], j - i))
                for p in news[i:j]:
                    self._fresh[p] = seq
        except BaseException:
            for p in news:
                if self.ref[p] == 0:
                    self._busy.discard(p)
            raise
        finally:
            self._reserved -= 2 * k
            for vc in made:
                v.provisioning.pop(vc).set()

    async def unmap(self, v: _Vol, lba: int, blocks: int) -> None:
        """Deallocate (thin: whole clusters leave the mapping, the volume's last one too when the range runs
        to the end; partial ones, and thick volumes, get zeros)."""
        if not v.writable:
            raise self._refused(v)
        cb = self.cluster_blocks
        end = lba + blocks
        first = -(-lba // cb)
        last = len(v.map) if end >= v.rec.blocks else end // cb
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
                await asyncio.gather(*(w.wait() for w in waits))
            if np.any(_view(v.map)[first:last]):
                self._admit(1, reserve=False)
                self._do((Op.UNMAP, v.rec.id, first, last - first))
        finally:
            self._leave(v)
        if end > last * cb:
            await self._zero(v, last * cb, end - last * cb)

    async def _zero(self, v: _Vol, lba: int, blocks: int) -> None:
        """Zeros written over [lba, lba+blocks): unmapped clusters of a thin volume already read as zeros."""
        await self._enter(v)
        try:
            for vc, off, n in self._segments(lba, blocks):
                await self._write_cluster(v, vc, off, n, None)
        finally:
            self._leave(v)

    def extents(self, v: _Vol, lba: int, blocks: int) -> list[tuple[int, int, int]]:
        """(lba, blocks, 0 mapped | 1 deallocated) runs over [lba, lba+blocks) (SBC-4 GET LBA STATUS)."""
        cb = self.cluster_blocks
        end = min(lba + blocks, v.rec.blocks)
        first, last = lba // cb, -(-end // cb)
        state = (_view(v.map)[first:last] == 0).astype(np.int8)
        if not len(state) or lba >= end:
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
