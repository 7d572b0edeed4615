"""The write-intent bitmap: how a redundant pool closes the write hole (Linux MD's choice, not a journal).

A stripe update writes several members; a crash in between leaves parity (or one mirror) disagreeing with the
data, and a later member loss would then rebuild garbage. So before the first write to a region (a run of
`region_rows` chunk rows), its bit is set and made durable on every member (a FUA write of the bitmap block)
before any data write is issued. A bit is cleared lazily: once the region has had no write in flight for
`idle_s` seconds, the members are flushed (the data is durable) and the bit is cleared. At assembly the bits
set on any member mark the regions whose stripes may be torn; their parity is recomputed from the data (or the
first mirror copied to the others), then the bits are cleared: the resync.

The cost is one FUA write per member when a clean region is first written, instead of a journal write of
every stripe update; the price is that a crash costs a resync of the dirty regions, and that a member lost
during that resync leaves the torn stripes unrecoverable (MD has the same window).

In memory two copies are kept: `bits` (what the pool wants) and `durable` (bits known to be on every member).
A writer may go ahead when its region's bit is in `durable`; writes of one bitmap block are serialized, and
each writes the block's latest content.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

# store(block number in the bitmap, block content, fua): writes one bitmap block to every member
Store = Callable[[int, bytes, bool], Awaitable[None]]


class WriteIntentBitmap:
    def __init__(self, regions: int, region_rows: int, block_size: int, store: Store, *,
                 idle_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.regions = regions
        self.region_rows = region_rows
        self.block_size = block_size
        self.idle_s = idle_s
        self.clock = clock  # seconds; the pool's (tests pass a simulated one)
        self._store = store
        size = -(-max(regions, 1) // (8 * block_size)) * block_size
        self.bits = bytearray(size)
        self.durable = bytearray(size)
        self.pending_resync: set[int] = set()
        self._inflight: dict[int, int] = {}
        self._last: dict[int, tuple[int, float]] = {}  # region -> (completion sequence, clock time)
        self._seq = 0
        self._block_locks: dict[int, asyncio.Lock] = {}

    @property
    def byte_size(self) -> int:
        return len(self.bits)

    @staticmethod
    def bytes_needed(regions: int) -> int:
        return -(-regions // 8)

    def load(self, raw: bytes) -> None:
        """OR in a bitmap read from a member (assembly takes the union of every trusted member's)."""
        n = min(len(raw), len(self.bits))
        for i, b in enumerate(raw[:n]):
            if b:
                self.bits[i] |= b
                self.durable[i] |= b

    def region_of(self, row: int) -> int:
        return row // self.region_rows

    def regions_of(self, first_row: int, last_row: int) -> range:
        return range(first_row // self.region_rows, last_row // self.region_rows + 1)

    def is_set(self, region: int) -> bool:
        return bool(self.bits[region >> 3] & (1 << (region & 7)))

    def dirty(self) -> list[int]:
        return [r for r in range(self.regions) if self.is_set(r)]

    # --- the write path ---------------------------------------------------------------------------------------

    def wrote_now(self, regions: range) -> bool:
        """begin() and end() at once, for a write done within this turn of the loop before anything else runs
        (its count in flight would be back where it was): only when every bit is durable already (no bitmap
        write needed); then the regions count as written now, as end() counts them. False, nothing counted,
        otherwise."""
        durable, bits = self.durable, self.bits
        for r in regions:
            if not durable[r >> 3] & (1 << (r & 7)):
                return False
        now = self.clock()
        self._seq += 1
        mark = (self._seq, now)
        for r in regions:
            bits[r >> 3] |= 1 << (r & 7)
            self._last[r] = mark
        return True

    def _enter(self, regions: Iterable[int]) -> set[int]:
        """Count a write in flight in `regions` and set their bits; the bitmap blocks not yet durable."""
        blocks: set[int] = set()
        for r in regions:
            self._inflight[r] = self._inflight.get(r, 0) + 1
            byte, mask = r >> 3, 1 << (r & 7)
            self.bits[byte] |= mask
            if not self.durable[byte] & mask:
                blocks.add(byte // self.block_size)
        return blocks

    async def begin(self, regions: Iterable[int]) -> None:
        """Before writing to `regions`: count the write in flight, and make sure each bit is durable."""
        blocks = self._enter(regions)
        if blocks:
            try:
                await asyncio.gather(*(self._write_block(b, fua=True) for b in blocks))
            except BaseException:
                self.end(regions, wrote=False)
                raise

    def end(self, regions: Iterable[int], *, wrote: bool = True) -> None:
        now = self.clock()
        self._seq += 1
        for r in regions:
            left = self._inflight[r] - 1
            if left:
                self._inflight[r] = left
            else:
                del self._inflight[r]
            if wrote:
                self._last[r] = (self._seq, now)

    async def _write_block(self, block: int, *, fua: bool, force: bool = False) -> None:
        lock = self._block_locks.setdefault(block, asyncio.Lock())
        bs = self.block_size
        span = slice(block * bs, (block + 1) * bs)
        async with lock:
            if fua and not force and self.durable[span] == self.bits[span]:
                return  # someone else's write, started after our bit was set, already made it durable
            content = bytes(self.bits[span])
            await self._store(block, content, fua)
            if fua:
                # on disk now, but only the bits still wanted count: one a lazy clear took away meanwhile is
                # about to be written clear (its write waits for this one), so a writer must not trust it
                self.durable[span] = bytes(a & b for a, b in zip(content, self.bits[span], strict=True))
            else:
                # not durable yet: only bits that are clear in both may be counted as clear on disk
                self.durable[span] = bytes(a & b for a, b in zip(self.durable[span], content, strict=True))

    # --- lazy clearing ----------------------------------------------------------------------------------------

    async def clear_idle(self, flush: Callable[[], Awaitable[None]], *, everything: bool = False) -> int:
        """Clear the bits of regions idle for `idle_s` (all of them, `everything`, at close), after `flush()`
        made their data durable. Returns how many bits were cleared."""
        now = self.clock()
        candidates = [
            r for r in self.dirty()
            if r not in self._inflight and r not in self.pending_resync
            and (everything or now - self._last.get(r, (0, 0.0))[1] >= self.idle_s)
        ]
        if not candidates:
            return 0
        mark = self._seq
        await flush()
        blocks: set[int] = set()
        cleared = 0
        # no await from here to the loop's end: a writer either counted itself in flight before this check
        # (so its region is kept) or finds the bit clear and sets it durably again
        for r in candidates:
            if r in self._inflight or r in self.pending_resync or self._last.get(r, (0, 0.0))[0] > mark:
                continue
            self.bits[r >> 3] &= ~(1 << (r & 7)) & 0xFF
            # and no longer counted as on disk: a writer that comes while the clearing block is being written
            # must write the bit again (FUA, after it), not trust a bit that the clear is about to remove
            self.durable[r >> 3] &= ~(1 << (r & 7)) & 0xFF
            self._last.pop(r, None)
            blocks.add((r >> 3) // self.block_size)
            cleared += 1
        if blocks:
            await asyncio.gather(*(self._write_block(b, fua=everything, force=True) for b in sorted(blocks)))
        return cleared

    async def write_all(self, *, fua: bool = True) -> None:
        """Write every block (a new pool, or a member joining: its header gets the pool's current bitmap)."""
        for b in range(len(self.bits) // self.block_size):
            await self._write_block(b, fua=fua, force=True)

    def mark_all(self) -> None:
        """Every region dirty and pending resync (a pool created without zeroing its members)."""
        for r in range(self.regions):
            self.bits[r >> 3] |= 1 << (r & 7)
        self.pending_resync.update(range(self.regions))
