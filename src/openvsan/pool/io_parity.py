"""RAID 5 and 6 I/O: data chunks plus P (and Q), rotating over the members (layout.py).

Reads of a chunk whose member is in sync go straight to it. A chunk on a failed (or not yet rebuilt) member is
rebuilt from the rest of its stripe: the other data chunks and P, or Q, or both (openvsan.pool.parity), over
just the block range asked for, under the stripe lock so no write is half-way through that stripe.

Writes run one task per stripe (row), each under its stripe lock, concurrently for a request spanning rows:

- every data chunk of the row written whole: parity from the new data, nothing read;
- otherwise, with every member in sync, whichever reads fewer blocks: read-modify-write (read the old data
  being replaced and the parity, `pq_update`) or reconstruct-write (read the data not being replaced,
  recompute parity); parity is only touched over the block range the write covers;
- with a member out of sync (degraded): the row's data over that range is rebuilt, the new data laid over it,
  parity recomputed, and every in-sync member written (a lost data chunk then lives on in the parity).

A read phase that hits a failing member raises MemberFaults (nothing written yet; the pool marks the member
failed and plans the request again). In the write phase a failing member is marked failed and the write
stands: the members that took it hold a consistent stripe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from openvsan.block.device import Buffer
from openvsan.block.errors import DeviceFailed
from openvsan.pool.layout import Geometry, Level, Segment
from openvsan.pool.locks import StripeLocks
from openvsan.pool.members import MemberSet
from openvsan.pool.parity import Stripe, backend
from openvsan.pool.scrub import RowCheck

FULL, RMW, RCW = 0, 1, 2   # how a row's parity is made for a write (ParityIO._how)


class _Plan(NamedTuple):
    new: dict[int, tuple[int, int, memoryview]]   # data index -> (block offset in the chunk, blocks, data)
    lo: int                                      # the blocks of the chunk the write spans: [lo, hi)
    hi: int
    total: int                                   # blocks written
    full: int                                    # data chunks the write covers over all of [lo, hi)


class _Span(NamedTuple):
    """Where a write spanning rows goes in the members' memory (_rows_now), relative to its first row: the same
    for every request of the same length that starts at the same place in a row of the same rotation, so it is
    made once for them all (_span)."""
    rows: int                                        # rows the request touches, from its first
    base: int                                        # block offset in the chunk where each member's window starts
    size: int                                        # blocks of each window
    copies: tuple[tuple[int, int, int, int, int], ...]   # (member, window byte start, end, request byte start, end)
    stripes: tuple[Stripe, ...]   # each row's (data members, parity members, window byte start, length)


SPANS_KEPT = 4096   # _span plans kept per pool (sequential and aligned writes need a handful; odd ones start over)


class ParityIO:
    def __init__(self, ms: MemberSet, geo: Geometry, locks: StripeLocks, parity: str | None = None) -> None:
        self.torn: set[int] = set()   # rows a fast-path write left half written: write() reconstructs them
        self.ms = ms
        self.geo = geo
        self.locks = locks
        self.par = backend(parity)
        self.bs = ms.block_size
        self.cb = geo.chunk_blocks
        self.k = geo.data_chunks
        self.raid6 = geo.level is Level.RAID6
        # a small write of a RAID 6 row of up to 4 data chunks recomputes P and Q over the row (one encode from
        # the members' memory: 11.5 us for 2 data chunks of 4 KiB through ISA-L) rather than updating them
        # (14-17 us: its update must make P' and Q' apart from P and Q, then copy them over); wider rows, and
        # RAID 5's XOR, update in place (_chunk_now)
        self._narrow_pq = self.raid6 and self.k <= 4
        self._data_members = geo.data_member_rows   # a small read looks its member up there, with no call
        self._spans: dict[tuple[int, int, int], _Span] = {}   # _span's plans by (rotation, start in row, blocks)

    def _parity(self, chunks: Sequence[Buffer]) -> list[Buffer]:
        if self.raid6:
            return list(self.par.pq(chunks))
        return [self.par.xor(chunks)]

    # --- read -------------------------------------------------------------------------------------------------

    async def read(self, lba: int, blocks: int) -> Buffer:
        segs = self.geo.segments(lba, blocks)
        ms, geo, bs = self.ms, self.geo, self.bs
        if len(segs) == 1:
            s = segs[0]
            m = geo.data_member(s.row, s.column)
            if ms.valid(m, s.row):
                return await ms.read(m, s.row, s.offset, s.blocks)
            return (await self._read_degraded(s.row, segs))[0]
        direct = []
        degraded: dict[int, list[Segment]] = {}
        for s in segs:
            if ms.valid(geo.data_member(s.row, s.column), s.row):
                direct.append(s)
            else:
                degraded.setdefault(s.row, []).append(s)
        ops = [ms.read(geo.data_member(s.row, s.column), s.row, s.offset, s.blocks) for s in direct]
        ops += [self._read_degraded(row, rsegs) for row, rsegs in degraded.items()]  # type: ignore[misc]
        results = await ms.gather(ops)
        out = bytearray(blocks * bs)
        view = memoryview(out)
        placed: list[tuple[Segment, Buffer]] = list(zip(direct, results, strict=False))
        for rsegs, parts in zip(degraded.values(), results[len(direct):], strict=True):
            placed += zip(rsegs, parts, strict=True)  # type: ignore[arg-type]
        for s, data in placed:
            view[s.start * bs:(s.start + s.blocks) * bs] = data
        return out

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        """read() in the caller's turn where every chunk it needs is on an in-sync member with a fast path
        (a healthy pool of RAM members: no parity involved); None otherwise (read() rebuilds what it must)."""
        row, column, off = self.geo.locate(lba)
        if off + blocks <= self.cb:  # inside one chunk, as most small reads are: no segment list
            m = self._data_members[row % self.geo.members][column]
            return self.ms.read_now(m, row, off, blocks) if self.ms.valid(m, row) else None
        segs = self.geo.segments(lba, blocks)
        if len(segs) == 1:
            return self._segment_now(segs[0])
        bs = self.bs
        out = bytearray(blocks * bs)
        view = memoryview(out)
        for s in segs:
            data = self._segment_now(s)
            if data is None:
                return None
            view[s.start * bs:(s.start + s.blocks) * bs] = data
        return out

    def _segment_now(self, s: Segment) -> Buffer | None:
        m = self.geo.data_member(s.row, s.column)
        return self.ms.read_now(m, s.row, s.offset, s.blocks) if self.ms.valid(m, s.row) else None

    async def _read_degraded(self, row: int, segs: list[Segment]) -> list[Buffer]:
        bs = self.bs
        async with self.locks.hold(row):
            lo = min(s.offset for s in segs)
            hi = max(s.offset + s.blocks for s in segs)
            chunks = await self._stripe_data(row, lo, hi)
        return [memoryview(chunks[s.column])[(s.offset - lo) * bs:(s.offset - lo + s.blocks) * bs] for s in segs]

    async def _stripe_data(self, row: int, lo: int, hi: int) -> list[Buffer]:
        """Every data chunk of `row` over blocks [lo, hi) of the chunk, the out-of-sync ones rebuilt."""
        ms = self.ms
        dm = self.geo.data_members(row)
        pm = self.geo.parity_members(row)
        missing = [i for i, m in enumerate(dm) if not ms.valid(m, row)]
        readable_parity = [j for j, m in enumerate(pm) if ms.valid(m, row)]
        use = readable_parity[:len(missing)]
        if len(use) < len(missing):
            raise DeviceFailed(f"pool: stripe {row} has lost {len(missing)} data chunks and "
                               f"{len(pm) - len(readable_parity)} of {len(pm)} parity chunks")
        present = [i for i in range(self.k) if i not in missing]
        ops = [ms.read(dm[i], row, lo, hi - lo) for i in present] + [ms.read(pm[j], row, lo, hi - lo) for j in use]
        got = await ms.gather(ops)
        data: list[Buffer | None] = [None] * self.k
        for i, d in zip(present, got, strict=False):
            data[i] = d
        if not missing:
            return data  # type: ignore[return-value]
        par = dict(zip(use, got[len(present):], strict=True))
        return self.par.recover(data, par.get(0), par.get(1) if self.raid6 else None)  # type: ignore[return-value]

    # --- write ------------------------------------------------------------------------------------------------

    def _by_row(self, segs: list[Segment]) -> dict[int, list[Segment]]:
        """A request's segments grouped by row, rows in ascending order."""
        rows: dict[int, list[Segment]] = {}
        for s in segs:
            rows.setdefault(s.row, []).append(s)
        return rows

    async def write(self, lba: int, data: Buffer, fua: bool) -> None:
        view = memoryview(data).cast("B")
        rows = self._by_row(self.geo.segments(lba, len(view) // self.bs))
        if len(rows) == 1:
            ((row, segs),) = rows.items()
            await self._write_row(row, segs, view, fua)
        else:
            await self.ms.gather([self._write_row(row, segs, view, fua) for row, segs in rows.items()])

    def _plan(self, segs: list[Segment], view: memoryview) -> _Plan:
        """What a write changes in one row: each data chunk's new blocks, and the span [lo, hi) they cover."""
        bs, cb = self.bs, self.cb
        # plain loops, not comprehensions: this runs for every small write
        new: dict[int, tuple[int, int, memoryview]] = {}
        lo, hi, total = cb, 0, 0
        for s in segs:
            off, n = s.offset, s.blocks
            new[s.column] = (off, n, view[s.start * bs:(s.start + n) * bs])
            lo = min(lo, off)
            hi = max(hi, off + n)
            total += n
        width = hi - lo
        full = 0  # chunks the new data covers over all of [lo, hi)
        for _, n, _ in new.values():
            full += n == width
        return _Plan(new, lo, hi, total, full)

    def _how(self, row: int, plan: _Plan, nparity: int) -> int:
        """With every member of the row in sync: parity from the new data alone (a full stripe), or whichever
        of read-modify-write and reconstruct-write reads fewer blocks. A row a fast-path write left half
        written is reconstructed (its old parity cannot be trusted for a read-modify-write)."""
        width = plan.hi - plan.lo
        if plan.full == self.k and width == self.cb:
            return FULL
        if row not in self.torn and plan.total + nparity * width < (self.k - plan.full) * width:
            return RMW
        return RCW

    def _rcw_needs(self, plan: _Plan) -> list[int]:
        """Reconstruct-write's reads: every data chunk over [lo, hi) that the new data does not cover whole."""
        width = plan.hi - plan.lo
        return [i for i in range(self.k) if i not in plan.new or plan.new[i][1] < width]

    def _reads(self, how: int, plan: _Plan, dm: tuple[int, ...], pm: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """(member, block offset in the row, blocks) to read before the parity can be computed."""
        if how == FULL:
            return []
        if how == RMW:
            reads = [(dm[i], off, n) for i, (off, n, _) in plan.new.items()]
            return reads + [(m, plan.lo, plan.hi - plan.lo) for m in pm]
        return [(dm[i], plan.lo, plan.hi - plan.lo) for i in self._rcw_needs(plan)]

    def _new_parity(self, how: int, plan: _Plan, got: Sequence[Buffer]) -> list[Buffer]:
        """The row's parity over [lo, hi) after the write, from what `_reads` asked for (in its order)."""
        new, lo, bs = plan.new, plan.lo, self.bs
        if how != RMW:
            return self._parity(self._stripe(how, plan, got))
        p = bytearray(got[len(new)])
        q = bytearray(got[len(new) + 1]) if self.raid6 else None
        for i, old in zip(new, got, strict=False):
            off, n, buf = new[i]
            a, b = (off - lo) * bs, (off - lo + n) * bs
            p2, q2 = self.par.pq_update(i, old, buf, p[a:b], q[a:b] if q is not None else None)
            p[a:b] = p2
            if q is not None and q2 is not None:
                q[a:b] = q2
        return [p] if q is None else [p, q]

    def _stripe(self, how: int, plan: _Plan, got: Sequence[Buffer]) -> list[Buffer]:
        """The row's data over [lo, hi) after the write, for a full stripe (the new data) or a reconstruct-write
        (what `_reads` got, with the new data laid over it)."""
        new = plan.new
        if how == FULL:
            return [new[i][2] for i in range(self.k)]
        chunks: list[Buffer | None] = [None] * self.k
        for i, d in zip(self._rcw_needs(plan), got, strict=True):
            chunks[i] = d
        return self._overlay(plan.lo, plan.hi, new, chunks)

    def _parity_in_place(self, how: int, row: int, plan: _Plan, pm: tuple[int, ...], got: Sequence[Buffer]) -> bool:
        """The parity of a full stripe or a reconstruct-write (which need no old parity) computed straight into
        its members' memory (RAM members lend it: MemberSet window), so it is neither made in a buffer of its
        own nor copied; False where a member lends none (or a read-modify-write: it starts from the old parity)."""
        if how == RMW:
            return False
        outs = []
        for m in pm:
            w = self.ms.window(m, row, plan.lo, plan.hi - plan.lo)
            if w is None:
                return False
            outs.append(w)
        self.par.encode_into(self._stripe(how, plan, got), outs)
        return True

    def _writes(self, row: int, plan: _Plan, dm: tuple[int, ...], pm: tuple[int, ...], parity: list[Buffer],
                parity_ok: list[bool]) -> list[tuple[int, int, Buffer]]:
        """(member, block offset in the row, data): the new data to in-sync members, the parity computed."""
        ms = self.ms
        out = [(dm[i], off, buf) for i, (off, _, buf) in plan.new.items() if ms.valid(dm[i], row)]
        return out + [(pm[j], plan.lo, p) for j, p in enumerate(parity) if parity_ok[j]]

    async def _write_row(self, row: int, segs: list[Segment], view: memoryview, fua: bool) -> None:
        ms = self.ms
        dm = self.geo.data_members(row)
        pm = self.geo.parity_members(row)
        plan = self._plan(segs, view)
        async with self.locks.hold(row):
            if ms.optimal:
                data_ok, parity_ok = True, [True] * len(pm)
            else:
                data_ok = all(ms.valid(m, row) for m in dm)
                parity_ok = [ms.valid(m, row) for m in pm]
            parity: list[Buffer]
            if data_ok and all(parity_ok):
                how = self._how(row, plan, len(pm))
                reads = self._reads(how, plan, dm, pm)
                got = await ms.gather([ms.read(m, row, off, n) for m, off, n in reads]) if reads else []
                parity = self._new_parity(how, plan, got)
            elif data_ok and not any(parity_ok):
                parity = []  # nothing to keep in step: write the data alone
            else:
                parity = self._parity(self._overlay(plan.lo, plan.hi, plan.new,
                                                    await self._stripe_data(row, plan.lo, plan.hi)))
            writes = self._writes(row, plan, dm, pm, parity, parity_ok)
            await ms.write_all([ms.write(m, row, off, buf, fua) for m, off, buf in writes])
            self.torn.discard(row)

    def write_now(self, lba: int, data: Buffer) -> bool:
        """A write of a healthy pool whose members have the fast path (RAM), done in the caller's turn: through
        the members' own memory where they lend it (_chunk_now, _rows_now), else row by row with the same plan,
        reads, parity and writes as `_write_row` (a row the request covers whole is a full stripe: parity from
        the new data, nothing read); False where it cannot be (a member out of sync
        or without the fast path, a row held by a request or rebuild in flight, or a row a fast-path write left
        torn): then write() writes the whole request, the rows this wrote before declining included, which is
        harmless (the same data again). A member that declines after others took their part of a row (a file
        in memory out of space) marks that row torn: write() reconstructs its parity."""
        if not self.ms.optimal:
            return False
        view = memoryview(data).cast("B")
        blocks = len(view) // self.bs
        locks, torn = self.locks, self.torn
        row, column, off = self.geo.locate(lba)
        if off + blocks <= self.cb:   # inside one chunk, as most small writes are: no segment list
            if locks.busy(row) or row in torn:
                return False
            return self._chunk_now(row, column, off, view) or self._row_now(row, [Segment(row, column, off, blocks, 0)],
                                                                          view)
        span = self._span(lba, blocks, row)
        for r in range(row, row + span.rows):   # every row free before the first is written
            if locks.busy(r) or r in torn:
                return False
        if self._rows_now(row, span, view):
            return True
        for row, rsegs in self._by_row(self.geo.segments(lba, blocks)).items():
            if not self._row_now(row, rsegs, view):
                return False
        return True

    def _chunk_now(self, row: int, column: int, off: int, view: memoryview) -> bool:
        """A write inside one data chunk, through the row's members' own memory (RAM members lend it:
        MemberSet.window). The row is in sync and not torn (write_now asked): its parity can be trusted.
        - RAID 5, and RAID 6 rows of more than 4 data chunks: a read-modify-write done where the chunks lie,
          P ^= old ^ new (and Q ^= g^i (old ^ new)) from the data member's memory before the new data is copied
          over it. Of the row's members it touches only those it writes, where a reconstruct-write would read
          every other data member too (cold memory, for a random write).
        - RAID 6 rows of up to 4 data chunks (_narrow_pq): the new data copied in, then P and Q encoded again
          over the part of the row it covers, from the data members' memory (a reconstruct-write).
        False, nothing written: a member lends no window (then _row_now writes it)."""
        ms, geo = self.ms, self.geo
        blocks = len(view) // self.bs
        pm = geo.parity_members(row)
        dm = self._data_members[row % geo.members]
        if self._narrow_pq:
            lent = [ms.window(m, row, off, blocks) for m in (*dm, *pm)]
            wins = [w for w in lent if w is not None]
            if len(wins) < len(lent):
                return False
            wins[column][:] = view
            self.par.encode_into(wins[:self.k], wins[self.k:])
            return True
        d = ms.window(dm[column], row, off, blocks)
        p = ms.window(pm[0], row, off, blocks)
        q = ms.window(pm[1], row, off, blocks) if self.raid6 else None
        if d is None or p is None or (self.raid6 and q is None):
            return False
        self.par.update_into(column, d, view, p, q)
        d[:] = view
        return True

    def _span(self, lba: int, blocks: int, row: int) -> _Span:
        """The _Span of a write of `blocks` from `lba` (in row `row`), made from its segments the first time a
        write starts at that place of a row of that rotation with that length, then looked up."""
        geo = self.geo
        rotation, start = row % geo.members, lba - row * self.cb * self.k
        key = (rotation, start, blocks)
        span = self._spans.get(key)
        if span is None:
            if len(self._spans) >= SPANS_KEPT:
                self._spans.clear()
            span = self._spans[key] = self._make_span(geo.segments(lba, blocks))
        return span

    def _make_span(self, segs: list[Segment]) -> _Span:
        """One window per member over the span of rows the segments touch, from block `base` of the first row's
        chunks; in each row the data goes to its data members, and parity is computed over the part [lo, hi)
        of the row the request touches."""
        geo, bs, cb = self.geo, self.bs, self.cb
        rows = list(self._by_row(segs).items())
        spans = [(min(s.offset for s in rsegs), max(s.offset + s.blocks for s in rsegs)) for _, rsegs in rows]
        base = spans[0][0]
        copies, stripes = [], []
        for j, (row, rsegs) in enumerate(rows):
            at = (j * cb - base) * bs
            dm = geo.data_members(row)
            for s in rsegs:
                a = at + s.offset * bs
                copies.append((dm[s.column], a, a + s.blocks * bs, s.start * bs, (s.start + s.blocks) * bs))
            lo, hi = spans[j]
            stripes.append((dm, geo.parity_members(row), at + lo * bs, (hi - lo) * bs))
        return _Span(len(rows), base, (len(rows) - 1) * cb + spans[-1][1] - base, tuple(copies), tuple(stripes))

    def _rows_now(self, first: int, span: _Span, view: memoryview) -> bool:
        """A request's rows written through their members' own memory (RAM members lend it: MemberSet.window),
        one window per member over the rows it touches (`span`, from row `first`): in each row the new data is
        copied into its data members, then the parity over the part of the row the request touches is computed
        from the data members' memory (new data and old alike) straight into the parity members. That is a
        reconstruct-write whose reads copy nothing and whose parity needs no buffer of its own (a row covered
        whole: a full stripe, as _row_now makes it). False, nothing written: a member lends no window (then
        _row_now writes each row through member calls)."""
        ms, base, size = self.ms, span.base, span.size
        wins = []
        for m in range(self.geo.members):
            w = ms.window(m, first, base, size)
            if w is None:
                return False
            wins.append(w)
        for m, a, b, s, e in span.copies:
            wins[m][a:b] = view[s:e]
        self.par.encode_stripes_into(wins, span.stripes)   # each row's parity from its members' memory, data and all
        return True

    def _row_now(self, row: int, segs: list[Segment], view: memoryview) -> bool:
        ms = self.ms
        if self.locks.busy(row) or row in self.torn:
            return False
        dm = self.geo.data_members(row)
        pm = self.geo.parity_members(row)
        plan = self._plan(segs, view)
        # the members _writes will write (every one in sync: ms.optimal), asked before any read or parity, so a
        # pool of members without the fast path (files on disk) declines at once: write() tries this first
        for m in (*(dm[i] for i in plan.new), *pm):
            if not ms.can_write_now(m):
                return False
        how = self._how(row, plan, len(pm))
        got = []
        for m, off, n in self._reads(how, plan, dm, pm):
            d = ms.read_now(m, row, off, n)
            if d is None:
                return False
            got.append(d)
        if self._parity_in_place(how, row, plan, pm, got):
            # the parity is written already: the data alone is left (a decline from here on leaves the row torn)
            writes = self._writes(row, plan, dm, pm, [], [])
            written = True
        else:
            writes = self._writes(row, plan, dm, pm, self._new_parity(how, plan, got), [True] * len(pm))
            written = False
        for m, off, buf in writes:
            if not ms.write_now(m, row, off, buf):
                if written:
                    self.torn.add(row)
                return False
            written = True
        return True

    def _overlay(self, lo: int, hi: int, new: dict[int, tuple[int, int, memoryview]],
                 chunks: Sequence[Buffer | None]) -> list[Buffer]:
        """The row's data over [lo, hi) after the write: `chunks` (old data) with the new data laid over it."""
        bs = self.bs
        out: list[Buffer] = []
        for i in range(self.k):
            old = chunks[i]
            if i in new:
                off, n, buf = new[i]
                if n == hi - lo:
                    out.append(buf)
                    continue
                assert old is not None
                merged = bytearray(old)
                merged[(off - lo) * bs:(off - lo + n) * bs] = buf
                out.append(merged)
            else:
                assert old is not None
                out.append(old)
        return out

    # --- rebuild ----------------------------------------------------------------------------------------------

    async def rebuild(self, targets: list[int], start: int, end: int) -> None:
        """Rows [start, end) of each target member, recomputed from the in-sync members (stripe locks held)."""
        ms, geo = self.ms, self.geo
        chunk = self.cb * self.bs
        nrows = end - start
        sources = [m for m in range(geo.members) if m not in targets and ms.members[m].valid_rows(start, end)]
        got = await ms.gather([ms.read(m, start, 0, nrows * self.cb) for m in sources])
        bufs = {m: memoryview(d).cast("B") for m, d in zip(sources, got, strict=True)}
        out = {t: bytearray(nrows * chunk) for t in targets}
        for row in range(start, end):
            span = slice((row - start) * chunk, (row - start + 1) * chunk)
            dm = geo.data_members(row)
            pm = geo.parity_members(row)
            data: list[Buffer | None] = [bufs[m][span] if m in bufs else None for m in dm]
            if any(d is None for d in data):
                p = bufs[pm[0]][span] if pm[0] in bufs else None
                q = bufs[pm[1]][span] if self.raid6 and pm[1] in bufs else None
                try:
                    data = self.par.recover(data, p, q)  # type: ignore[assignment]
                except ValueError as e:
                    raise DeviceFailed(f"pool: cannot rebuild stripe {row}: {e}") from e
            parity = self._parity(data) if any(t in pm for t in targets) else []  # type: ignore[arg-type]
            for t in targets:
                piece = data[dm.index(t)] if t in dm else parity[pm.index(t)]
                assert piece is not None
                out[t][span] = piece
        await ms.write_all([ms.write(t, start, 0, out[t]) for t in targets])

    # --- scrub and resync -------------------------------------------------------------------------------------

    async def check(self, start: int, end: int, *, repair: bool, locate: bool = False) -> RowCheck:
        """Compare P (and Q) with the data of rows [start, end); see scrub.py. Without `locate` (the resync), a
        mismatch is always settled by rewriting parity from the data."""
        ms, geo = self.ms, self.geo
        chunk = self.cb * self.bs
        result = RowCheck()
        sources = [m for m in range(geo.members) if ms.members[m].valid_rows(start, end)]
        got = await ms.gather([ms.read(m, start, 0, (end - start) * self.cb) for m in sources])
        bufs = {m: memoryview(d).cast("B") for m, d in zip(sources, got, strict=True)}
        fixes = []
        for row in range(start, end):
            span = slice((row - start) * chunk, (row - start + 1) * chunk)
            dm = geo.data_members(row)
            pm = geo.parity_members(row)
            if any(m not in bufs for m in dm) or not any(m in bufs for m in pm):
                result.skipped += 1
                continue
            result.checked += 1
            data = [bufs[m][span] for m in dm]
            want = self._parity(data)
            bad = [j for j, m in enumerate(pm) if m in bufs and bufs[m][span] != want[j]]
            if not bad:
                continue
            if locate and len(bad) == 2:
                z = self._locate(data, bufs[pm[0]][span], bufs[pm[1]][span])
                if z is None:
                    result.mismatch(row, list(pm), "P and Q both disagree with the data and no single data chunk"
                                    " explains it: more than one chunk is bad")
                    result.unrepairable += 1
                    continue
                fixed = self.par.recover([None if i == z else d for i, d in enumerate(data)],
                                         bufs[pm[0]][span], None)[z]
                result.mismatch(row, [dm[z]], f"data chunk {z} on member {dm[z]} is corrupt (located by P and Q)")
                if repair:
                    fixes.append(ms.write(dm[z], row, 0, fixed))
                    result.repaired += 1
                continue
            names = "/".join("PQ"[j] for j in bad)
            result.mismatch(row, [pm[j] for j in bad], f"{names} disagrees with the data")
            if repair:
                fixes += [ms.write(pm[j], row, 0, want[j]) for j in bad]
                result.repaired += 1
        if fixes:
            await ms.write_all(fixes)
        return result

    def _locate(self, data: list[memoryview], p: Buffer, q: Buffer) -> int | None:
        """The one data chunk whose replacement (rebuilt from the others and P) makes Q right again."""
        for z in range(self.k):
            trial: list[Buffer | None] = [None if i == z else d for i, d in enumerate(data)]
            candidate = self.par.recover(trial, p, None)
            if self.par.pq(candidate)[1] == bytes(q):
                return z
        return None
