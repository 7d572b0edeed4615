"""A primary's activity log: the regions of a replicated volume that may differ between its replicas because
writes to them were in flight, kept on disk so that a primary that crashed (or was fenced while paused)
resyncs only those regions when it comes back, even after every node went down at once (DRBD's activity
log, "al-extents").

The rule a caller relies on: `enter(regions)` returns only once every one of `regions` is durably in the log,
and a region leaves the log only while no write to it is in flight (`leave` was called for each `enter`). So
after `enter` returns, a crash followed by `load()` gives a set holding those regions, unless they were left
and a later update of the log dropped them. The log holds at most `slots` regions (the least recently
entered idle one is evicted for a new one; when all are busy, `enter` waits for a `leave`), which bounds a
crashed primary's resync to slots x region size bytes. An update that drops regions first awaits
`before_evict` (the primary's flush of every replica): a write acknowledged but still in a replica's
volatile cache (a thin volume's mapping not yet committed, a file's page cache) keeps its region in the
log. A region already in the log costs no I/O and no yield to the event loop (the hot path: random writes
inside the hot set); enters that need new regions meanwhile are written together, one update for all of
them (group commit).

A previous run's hot set is read by `load()` (called once, before the first `enter`): None when the file is
unreadable, torn in both copies or another volume's geometry (the caller then copies everything), set()
when there is none. Its regions stay in the log, pinned (never evicted), until `release` or `clear` says
they were resynced, so that no update of this run can drop them first.

The file is two copies of one fixed-size record, each at a 4 KiB boundary. A record, little-endian:

    magic "OVSACTLG" | version u16 | reserved u16 | region size u32 | regions u64 | slots u32 |
    count u32 | generation u64 | count x region u64 (least recently entered first) | CRC32C u32 of all before

An update writes the record of the next generation over the copy that does not hold the last one and
fdatasyncs it (the commit: the waiting enters return); when no enter waits, the same record is written over
the other copy too, so a log at rest survives the loss of either copy. `load()` takes the newest copy that
checks. A crash tears at most the copy being written, and the other holds the previous record or the same
one. After a failed write the copy written is suspect and the next update goes to it again, so the one good
copy is never the one overwritten. The first update of a run replaces the whole file (durable.replace_file),
which also sets its size: a file of any other size is not trusted.

Why not replace_file for every update: measured here (ext4, 200 updates of an 8 KiB record each way),
replace_file took 1.0-1.25 ms an update (two fsyncs, a rename, a directory fsync), pwrite + fdatasync of the
preallocated file 0.16-0.24 ms; an enter that needs new regions waits for one fdatasync.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import crc32c

from openvsan.durable import replace_file

log = logging.getLogger(__name__)

MAGIC = b"OVSACTLG"
VERSION = 1
_HEADER = struct.Struct("<8sHHIQIIQ")
_CRC = struct.Struct("<I")
_ALIGN = 4096          # each copy on its own pages, so a torn write of one cannot reach the other
COPIES = 2

Writer = Callable[[int | None, bytes], None]
"""write(offset, data): `data` at `offset` of the log file, durable (fdatasync) when it returns; offset None:
the whole file replaced by `data` crash-safely. Called off the event loop, one call at a time."""


class ActivityLogError(ValueError):
    """A record of the activity log that cannot be trusted (torn, another format)."""


def record_size(slots: int) -> int:
    """Bytes a copy takes in the file: the largest record, rounded up to 4 KiB."""
    return -(-(_HEADER.size + 8 * slots + _CRC.size) // _ALIGN) * _ALIGN


def encode(regions: Sequence[int], count: int, region_size: int, slots: int, generation: int) -> bytes:
    if len(regions) > slots:
        raise ValueError(f"{len(regions)} regions do not fit in {slots} slots")
    body = (_HEADER.pack(MAGIC, VERSION, 0, region_size, count, slots, len(regions), generation)
            + struct.pack(f"<{len(regions)}Q", *regions))
    return body + _CRC.pack(crc32c.crc32c(body))


def decode(raw: bytes | memoryview) -> tuple[list[int], tuple[int, int, int], int]:
    """(regions least recently entered first, (regions, region size, slots), generation) of one record;
    bytes after the record (a copy's padding) are ignored."""
    raw = memoryview(raw)
    if len(raw) < _HEADER.size:
        raise ActivityLogError(f"{len(raw)} bytes: shorter than the header")
    magic, version, _, region_size, count, slots, used, generation = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ActivityLogError("not an activity log (bad magic)")
    if version != VERSION:
        raise ActivityLogError(f"version {version}; this openvsan reads version {VERSION}")
    end = _HEADER.size + 8 * used
    if used > slots or len(raw) < end + _CRC.size:
        raise ActivityLogError(f"{used} regions in {slots} slots, {len(raw)} bytes")
    (crc,) = _CRC.unpack_from(raw, end)
    if crc32c.crc32c(raw[:end]) != crc:
        raise ActivityLogError("record checksum mismatch")
    regions = list(struct.unpack_from(f"<{used}Q", raw, _HEADER.size))
    if len(set(regions)) != used or any(r >= count for r in regions):
        raise ActivityLogError("a region listed twice or outside the volume")
    return regions, (count, region_size, slots), generation


class LogFile:
    """The default writer (see Writer): pwrite + fdatasync on a descriptor kept open between updates."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __call__(self, offset: int | None, data: bytes) -> None:
        if offset is None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            replace_file(self.path, data)
            self.close()                     # a new inode: the next pwrite opens it
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n
        os.fdatasync(self._fd)               # the size never changes after replace_file: data is enough

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ActivityLog:
    """The hot regions of one replicated volume on its primary, kept in `path` (see the module's rule)."""

    def __init__(self, path: Path, regions: int, region_size: int, *, slots: int = 1024,
                 write: Writer | None = None) -> None:
        if regions <= 0 or not 0 < region_size < 1 << 32 or slots <= 0:
            raise ValueError(f"activity log of {regions} regions of {region_size} bytes in {slots} slots: "
                             f"each a positive number, the region size under 4 GiB")
        self.path = path
        self.regions = regions
        self.region_size = region_size
        self.slots = slots
        self._record = record_size(slots)
        file = LogFile(path)
        self._file = file if write is None else None
        self._write: Writer = write if write is not None else file
        self._lru: OrderedDict[int, None] = OrderedDict()   # the log, least recently entered first
        self._inflight: dict[int, int] = {}                  # writes in flight per region (all in the log)
        self._pinned: set[int] = set()                       # a previous run's hot set, not yet resynced
        self._busy: set[int] = set()                         # not evictable: in flight or pinned
        self._pending: dict[int, int] = {}                   # region -> the change that added it, until committed
        self._changes = 0                                    # changes of the log that must reach the disk
        self._durable = 0                                    # ... the last commit covered up to here
        self._commit_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._slot_waiters: list[asyncio.Future[None]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._generation = 0
        self._good: int | None = None     # the copy that holds the last commit; None: replace the whole file
        self._mirrored = False            # ... and the other copy holds it too
        self._loaded = False
        self._updates = 0
        self._waits = 0
        # awaited before an update that drops regions from the log: the replicas' caches flushed (the
        # primary's mirror sets it), so a region leaves the log only once its last writes are durable on
        # every replica (DRBD's rule: an activity log transaction is written with a preflush)
        self.before_evict: Callable[[], Awaitable[None]] | None = None
        self._evicted = False             # regions dropped since the last before_evict

    # -- a previous run's log

    def load(self) -> set[int] | None:
        if self._loaded:
            raise RuntimeError(f"{self.path}: load() reads a previous run's log: once, before enter()")
        self._loaded = True
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return set()
        except OSError as e:
            log.warning("activity log %s unreadable (%s): a full copy is needed", self.path, e)
            return None
        if len(raw) != COPIES * self._record:
            return None
        best: tuple[int, list[int]] | None = None
        for i in range(COPIES):
            try:
                regions, geometry, generation = decode(raw[i * self._record:(i + 1) * self._record])
            except ActivityLogError:
                continue                                     # torn by a crash, or rotten: the other copy
            if geometry != (self.regions, self.region_size, self.slots):
                return None
            if best is None or generation > best[0]:
                best = (generation, regions)
        if best is None:
            return None
        self._generation, saved = best
        self._lru = OrderedDict.fromkeys(saved)
        self._pinned = set(saved)
        self._busy = set(saved)
        return set(saved)

    def release(self, regions: Iterable[int]) -> None:
        """These regions of the loaded hot set are resynced: evictable from now on (no I/O)."""
        for r in regions:
            if r in self._pinned:
                self._pinned.discard(r)
                if r not in self._inflight:
                    self._busy.discard(r)
        self._wake_slot_waiters()

    # -- the write path

    def enter_now(self, regions: range | tuple[int, ...]) -> bool:
        """enter()'s common case, in the caller's turn: every one of `regions` is in the log and on disk
        already, so it is counted in flight (until `leave(regions)`) and True returned; else False and
        nothing was entered (enter() does the rest)."""
        lru, pending = self._lru, self._pending
        for r in regions:
            if r not in lru or r in pending:
                return False
        for r in regions:
            self._inflight[r] = self._inflight.get(r, 0) + 1
            self._busy.add(r)
            lru.move_to_end(r)
        return True

    async def enter(self, regions: Iterable[int]) -> None:
        """Every one of `regions` is durably in the log when this returns, and counted in flight until
        `leave(regions)`. If it raises, nothing was entered (do not leave)."""
        rs = regions if isinstance(regions, range) else tuple(regions)
        if self.enter_now(rs):                               # all in the log and on disk: no I/O, no yield
            return
        lru, pending = self._lru, self._pending
        if not self._loaded:
            raise RuntimeError(f"{self.path}: load() before enter(): it keeps a previous run's hot set")
        wanted = set(rs)
        bad = [r for r in wanted if not 0 <= r < self.regions]
        if bad:
            raise ValueError(f"region {min(bad)} is outside 0..{self.regions - 1}")
        if len(wanted) > self.slots:
            raise ValueError(f"{len(wanted)} regions entered at once; the log has {self.slots} slots")
        waited = False
        while len(self._busy) + len(wanted - self._busy) > self.slots:
            if not waited:
                waited = True
                self._waits += 1
            slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(slot)
            try:
                await slot
            finally:
                if slot in self._slot_waiters:
                    self._slot_waiters.remove(slot)
        new = [r for r in dict.fromkeys(rs) if r not in lru]
        for r in rs:
            self._inflight[r] = self._inflight.get(r, 0) + 1
            self._busy.add(r)
        if new:
            self._changes += 1
            idle = len(lru) + len(new) - self.slots
            if idle > 0:
                for victim in [r for r in lru if r not in self._busy][:idle]:
                    del lru[victim]
                    pending.pop(victim, None)
                    self._evicted = True
            for r in new:
                lru[r] = None
                pending[r] = self._changes
        for r in rs:
            lru.move_to_end(r)
        target = self._changes if new else max((pending.get(r, 0) for r in rs), default=0)
        if target > self._durable:
            try:
                await self._committed(target)
            except BaseException:
                self.leave(rs)
                raise

    def leave(self, regions: Iterable[int]) -> None:
        """The write to `regions` finished (acknowledged or failed): the same regions that were entered."""
        rs = regions if isinstance(regions, range) else tuple(regions)
        inflight = self._inflight
        for r in rs:        # all checked before any is changed
            if r not in inflight:
                raise ValueError(f"region {r} has no write in flight")
        freed = False
        for r in rs:
            n = inflight[r] - 1
            if n:
                inflight[r] = n
            else:
                del inflight[r]
                if r not in self._pinned:
                    self._busy.discard(r)
                    freed = True
        if freed and self._slot_waiters:
            self._wake_slot_waiters()

    def hot(self) -> set[int]:
        return set(self._lru)

    async def clear(self) -> None:
        """Empty the log durably (its hot set was resynced); regions with a write in flight stay."""
        if not self._loaded:
            raise RuntimeError(f"{self.path}: load() before clear()")
        for r in [r for r in self._lru if r not in self._inflight]:
            del self._lru[r]
            self._pending.pop(r, None)
            self._evicted = True
        self._pinned.clear()
        self._busy = set(self._inflight)
        self._changes += 1
        self._wake_slot_waiters()
        await self._committed(self._changes)

    def stats(self) -> dict[str, Any]:
        """slots, used: regions in the log; updates: commits; waits: enters that waited for a slot, waiting: ...
        now; in_flight: regions with a write in flight; pinned: the loaded hot set not yet resynced."""
        return {"slots": self.slots, "used": len(self._lru), "updates": self._updates, "waits": self._waits,
                "waiting": len(self._slot_waiters), "in_flight": len(self._inflight), "pinned": len(self._pinned)}

    async def idle(self) -> None:
        """Until no update of the log is under way (the second copy's included)."""
        while self._flusher is not None:
            await asyncio.shield(self._flusher)

    async def close(self) -> None:
        """After the last enter: the update under way done, the default writer's file closed."""
        await self.idle()
        if self._file is not None:
            self._file.close()

    # -- group commit

    def _wake_slot_waiters(self) -> None:
        waiters, self._slot_waiters = self._slot_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _committed(self, target: int) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commit_waiters.append((target, fut))
        if self._flusher is None:
            # a task, not an inline call: the enters already scheduled in this loop turn join the same update
            self._flusher = asyncio.create_task(self._flush())
        await fut

    def _waiting(self) -> bool:
        return any(not f.done() for _, f in self._commit_waiters)

    async def _flush(self) -> None:
        try:
            while self._waiting():
                try:
                    # evictions while the flush ran are not covered by it: flushed again before the record
                    while self._evicted and self.before_evict is not None:
                        self._evicted = False
                        await self.before_evict()
                except Exception as e:  # noqa: BLE001 - the log keeps its regions; the waiting enters fail
                    log.warning("activity log %s: flush before dropping regions failed: %s", self.path, e)
                    self._evicted = True
                    self._settle(self._changes, e)
                    continue
                upto = self._changes
                self._generation += 1
                record = encode(list(self._lru), self.regions, self.region_size, self.slots, self._generation)
                try:
                    if self._good is None:
                        copy = record.ljust(self._record, b"\0")
                        await asyncio.to_thread(self._write, None, copy * COPIES)
                        self._good, self._mirrored = 0, True
                    else:
                        target = 1 - self._good                  # never the one good copy (the suspect one)
                        await asyncio.to_thread(self._write, target * self._record, record)
                        self._good, self._mirrored = target, False
                except Exception as e:  # noqa: BLE001 - the waiting enters get it, the loop goes on
                    log.warning("activity log %s: update failed: %s", self.path, e)
                    self._mirrored = False                   # the copy written is suspect now
                    self._settle(upto, e)
                    continue
                self._durable = upto
                self._updates += 1
                for r in [r for r, c in self._pending.items() if c <= upto]:
                    del self._pending[r]
                self._settle(upto, None)
                if not self._waiting() and not self._mirrored:
                    try:
                        await asyncio.to_thread(self._write, (1 - self._good) * self._record, record)
                    except Exception as e:  # noqa: BLE001 - the first copy holds the commit
                        log.warning("activity log %s: second copy not written: %s", self.path, e)
                    else:
                        self._mirrored = True
        finally:
            self._flusher = None

    def _settle(self, upto: int, error: Exception | None) -> None:
        """Answer the enters that the update up to change `upto` covered."""
        rest = []
        for target, fut in self._commit_waiters:
            if fut.done():
                continue
            if target > upto:
                rest.append((target, fut))
            elif error is None:
                fut.set_result(None)
            else:
                fut.set_exception(OSError(f"activity log {self.path}: update failed: {error}"))
        self._commit_waiters = rest
