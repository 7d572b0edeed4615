"""The in-memory state of a volume group: every volume's mapping (virtual cluster -> physical cluster, 0:
unmapped; physical clusters are numbered from 1), the reference count of every physical cluster, and
`_apply`, the one place where a logical record (format.Op) changes them, for the live path and the replay
alike. Cluster allocation and the admission of metadata growth live here too; store.py makes the state
durable, io.py reads and writes through it.

Two rules keep a crash from showing one volume's data in another (dm-thin's): a cluster whose last reference
went is not handed out again before that change is committed (`_busy` until `_release`), and a cluster whose
references fell to one is not written in place before that change is committed (`_pin`): the committed
mapping may still give it to a volume (or a snapshot) that in memory no longer has it.

A mapping lives in anonymous memory (mmap) that starts as zeros: pages never written are the kernel's shared
zero page, so a sparse volume's mapping costs memory for what it maps only. Each volume counts its mapped
entries per page of its mapping (`pages`): a snapshot, a clone, a delete or a checkpoint visits the pages
that map something, so their cost follows what is mapped, not the volume's size (a snapshot of a sparse
100 GiB volume takes well under a millisecond)."""

from __future__ import annotations

import asyncio
import mmap
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from openvsan.block.device import BlockDevice
from openvsan.block.errors import NoSpace
from openvsan.volume.thin import format as fmt
from openvsan.volume.thin.format import Flag, Op, Superblock, VolumeRecord

if TYPE_CHECKING:
    from openvsan.volume.thin.device import LogicalVolume

RUNS_COUNTED = 1 << 16          # a volume with more mapped clusters has its runs counted for admission
RUN_RESERVE = 2048               # checkpoint runs kept for unmaps and deletes (space can always be freed)
CANDIDATES = 4096                # free clusters found per scan of the reference counts
SCAN = 1 << 20                   # reference counts looked at per step of a scan
SHIFT = 10
PAGE = 1 << SHIFT                # mapping entries per 4 KiB page of memory (the unit `pages` counts)


@dataclass(eq=False)
class _Vol:
    rec: VolumeRecord
    map: memoryview          # 'i': physical cluster per virtual cluster, 0: unmapped (new_map)
    pages: array[int]        # 'i': mapped entries per PAGE of map
    mapped: int = 0          # clusters mapped
    inflight: int = 0        # writes and unmaps under way (a snapshot drains them)
    idle: asyncio.Event | None = None
    hold: asyncio.Event | None = None            # while a snapshot drains: new writes wait for it
    provisioning: dict[int, asyncio.Event] = field(default_factory=dict)   # virtual cluster -> set when done
    handle: LogicalVolume | None = None
    deleted: bool = False    # gone from the group: reads see zeros, writes fail
    # from the flags, which never change, once: every write asks (an enum flag test costs a few µs)
    thin: bool = field(init=False)
    writable: bool = field(init=False)

    def __post_init__(self) -> None:
        self.thin = bool(self.rec.flags & Flag.THIN)
        self.writable = not self.rec.flags & (Flag.SNAPSHOT | Flag.READ_ONLY)


def _view(a: array[int] | memoryview) -> np.ndarray:
    """The memory as numpy (shared, not copied): int32 for a mapping or page counts, uint32 for references."""
    dtype = np.uint32 if isinstance(a, array) and a.typecode == "I" else np.int32
    return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype=dtype)


def new_map(n: int) -> memoryview:
    """n unmapped entries: a small mapping in the heap, a larger one in fresh anonymous memory (none of whose
    pages is touched; a mapping of its own keeps a thousand small snapshots from taking a thousand of them)."""
    return memoryview(mmap.mmap(-1, 4 * n) if n >= 4 * PAGE else bytearray(4 * n)).cast("i")


def _pages_of(n: int) -> int:
    return -(-n // PAGE)


def entries(v: _Vol, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """v's mapped entries below `stop`: (virtual clusters ascending, their physical clusters), int64. Only
    pages that map something are read when they are few."""
    m = _view(v.map)
    n = len(m) if stop is None else min(stop, len(m))
    used = np.flatnonzero(_view(v.pages)[:_pages_of(n)])
    if 4 * len(used) >= _pages_of(n):
        vcs = np.flatnonzero(m[:n])
    else:
        at = (used[:, None] * PAGE + np.arange(PAGE)).ravel()
        at = at[at < n]
        vcs = at[m[at] != 0]
    return vcs, m[vcs].astype(np.int64)


def _blank(n: int) -> tuple[memoryview, array[int]]:
    """A mapping of n unmapped entries and its page counts."""
    return new_map(n), array("i", bytes(4 * _pages_of(n)))


def _filled(n: int, vcs: np.ndarray, ps: np.ndarray) -> tuple[memoryview, array[int]]:
    """A mapping of n entries with these mapped (virtual clusters below n), and its page counts."""
    m, pages = _blank(n)
    if len(vcs):
        _view(m)[vcs] = ps
        _view(pages)[:] = np.bincount(vcs >> SHIFT, minlength=len(pages))
    return m, pages


class GroupState:
    def __init__(self, dev: BlockDevice, sb: Superblock) -> None:
        self.dev = dev
        self.sb = sb
        self.block_size = dev.block_size
        self.cluster_blocks = sb.cluster_size // dev.block_size
        # where cluster 0 would begin: cluster p (from 1) is at lba0 + p * cluster_blocks
        self.lba0 = sb.data_offset // dev.block_size - self.cluster_blocks
        self.clusters = sb.clusters
        self.ref: array[int] = array("I", bytes(4 * (sb.clusters + 1)))    # [0]: unused (0 is "unmapped")
        self.vols: dict[int, _Vol] = {}
        self.by_name: dict[str, int] = {}
        self.next_id = 1
        self.used = 0                       # clusters with a reference
        self._busy: set[int] = set()        # free clusters not to hand out: frees not committed, being provisioned
        self._io: dict[int, int] = {}       # physical cluster -> reads and writes of it under way
        self._cands: deque[int] = deque()
        self._cursor = 1
        self._replaying = False
        # records in memory order are numbered from 1; [committed, appended] are not yet in the journal
        self._appended = 0
        self._committed = 0
        self._frees: list[tuple[int, int]] = []      # (record number that freed it, physical cluster)
        self._fresh: dict[int, int] = {}             # physical cluster -> record number that mapped it
        self._pin = bytearray(sb.clusters + 1)       # 1: its references fell to one, not yet committed
        # 1: reads zero and was never handed out since (the data area zeroed at format); a first write to part
        # of it writes only its own blocks. Where zeroing costs no transfer (capabilities.write_zeroes, RAM
        # pages dropped, a file's hole punched) a cluster not known zero is zeroed that way first; elsewhere
        # the write carries the whole cluster, the rest as zeros
        self._zeroed = bytearray(sb.clusters + 1)
        self.alloc_zeroed = False                    # whether the cluster _alloc gave last was known zero
        caps = dev.capabilities
        self._cheap_zero = caps.write_zeroes and caps.unmap_reads_zero
        self._pins: list[tuple[int, int | np.ndarray]] = []   # (record number, cluster or clusters) pinned
        self._runs_bound = 0                         # checkpoint runs, at most (exact after _recount)
        self._reserved = 0                           # runs admitted for changes under way, not yet applied

    # ---- mappings and reference counts

    def _clusters_of(self, blocks: int) -> int:
        return -(-blocks // self.cluster_blocks)

    def _set(self, v: _Vol, vc: int, p: int) -> None:
        """One virtual cluster of v now maps to p (a cluster no one references yet)."""
        old = v.map[vc]
        v.map[vc] = p
        if self.ref[p] == 0:
            self.used += 1
        self.ref[p] += 1
        if old:
            self._unref(old)
        else:
            v.mapped += 1
            v.pages[vc >> SHIFT] += 1

    def _unref(self, p: int) -> None:
        left = self.ref[p] - 1
        self.ref[p] = left
        if left == 0:
            self.used -= 1
            if not self._replaying:
                self._busy.add(p)
                self._frees.append((self._appended + 1, p))
        elif left == 1 and not self._replaying:
            self._pin[p] = 1
            self._pins.append((self._appended + 1, p))

    def _drop(self, gone: np.ndarray) -> None:
        """One reference less for each of these clusters (distinct: one mapping names a cluster once)."""
        if not len(gone):
            return
        ref = _view(self.ref)
        ref[gone] -= 1
        left = ref[gone]
        freed = gone[left == 0]
        self.used -= len(freed)
        if not self._replaying:
            n = self._appended + 1
            if len(freed):
                self._busy.update(freed.tolist())
                self._frees.extend((n, p) for p in freed.tolist())
            single = gone[left == 1]
            if len(single):
                np.frombuffer(self._pin, dtype=np.uint8)[single] = 1
                self._pins.append((n, single))

    def _drop_range(self, v: _Vol, start: int, stop: int) -> None:
        """Virtual clusters [start, stop) of v become unmapped."""
        m = _view(v.map)[start:stop]
        at = np.flatnonzero(m)
        if not len(at):
            return
        gone = m[at].astype(np.int64)
        m[at] = 0
        v.mapped -= len(at)
        np.subtract.at(_view(v.pages), (at + start) >> SHIFT, 1)
        self._drop(gone)

    def _drop_all(self, v: _Vol) -> None:
        """Every cluster of v's mapping loses v's reference (delete, rollback)."""
        self._drop(entries(v)[1])
        v.mapped = 0

    def _map_run(self, v: _Vol, vc: int, p: int, n: int) -> None:
        """Virtual clusters vc..vc+n of v map to p..p+n (clusters no one references yet)."""
        if n == 1:
            self._set(v, vc, p)
            return
        m = _view(v.map)
        old = m[vc:vc + n].copy()
        m[vc:vc + n] = np.arange(p, p + n, dtype=np.int32)
        ref = _view(self.ref)
        self.used += int(np.count_nonzero(ref[p:p + n] == 0))
        ref[p:p + n] += 1
        was = old != 0
        new = np.flatnonzero(~was)
        v.mapped += len(new)
        np.add.at(_view(v.pages), (new + vc) >> SHIFT, 1)
        self._drop(old[was].astype(np.int64))

    def _share(self, src: _Vol, clusters: int) -> tuple[memoryview, array[int], int]:
        """A copy of src's mapping, `clusters` long, every mapped cluster of it one reference more; its page
        counts and how many are mapped. It visits the pages of src that map something only."""
        vcs, ps = entries(src, clusters)
        m, pages = _filled(clusters, vcs, ps)
        if len(ps):
            _view(self.ref)[ps] += 1   # a mapping names a physical cluster once, so no index repeats
        self._runs_bound += self._runs_of(src)
        return m, pages, len(ps)

    def _runs_of(self, v: _Vol) -> int:
        """Runs v's map has, at most: its mapped clusters when few (no pass over the map), else counted."""
        return v.mapped if v.mapped <= RUNS_COUNTED else fmt.count_runs(*entries(v))

    def _check_run(self, name: str, vc: int, p: int, n: int, size: int) -> None:
        """A run read from disk (virtual vc..vc+n -> physical p..p+n) lies inside its volume of `size` clusters
        and inside the group (physical clusters from 1), else FormatError."""
        if vc + n > size or p < 1 or p + n - 1 > self.clusters:
            raise fmt.FormatError(f"volume {name}: a mapping beyond its size or the group")

    def _apply(self, rec: fmt.Record) -> None:
        op = rec[0]
        if op == Op.MAP:
            _, vid, vc, p, n = rec
            v = self.vols[vid]
            self._check_run(v.rec.name, vc, p, n, len(v.map))
            self._map_run(v, vc, p, n)
            self._runs_bound += 2     # a run put into another splits it in two at most
        elif op == Op.UNMAP:
            _, vid, vc, n = rec
            self._drop_range(self.vols[vid], vc, vc + n)
            self._runs_bound += 1     # a run split in two at most
        elif op == Op.CREATE:
            _, vid, flags, blocks, origin, created, copy, name = rec
            n = self._clusters_of(blocks)
            if copy:
                m, pages, mapped = self._share(self.vols[origin], n)
            else:
                (m, pages), mapped = _blank(n), 0
            self.vols[vid] = _Vol(VolumeRecord(vid, name, Flag(flags), blocks, origin, created), m, pages, mapped)
            self.by_name[name] = vid
            self.next_id = max(self.next_id, vid + 1)
        elif op == Op.DELETE:
            v = self.vols.pop(rec[1])
            del self.by_name[v.rec.name]
            self._drop_all(v)
            # a handle kept on it reads zeros, not clusters that other volumes get next
            v.map, v.pages = _blank(len(v.map))
            v.deleted = True
        elif op == Op.RESIZE:
            _, vid, blocks = rec
            v = self.vols[vid]
            n = self._clusters_of(blocks)
            # a new mapping, not this one resized: a numpy view of it may be alive somewhere
            if n < len(v.map):
                self._drop_range(v, n, len(v.map))
            v.map, v.pages = _filled(n, *entries(v, n))
            v.rec.blocks = blocks
        elif op == Op.ROLLBACK:
            _, vid, sid = rec
            v, snap = self.vols[vid], self.vols[sid]
            m, pages, mapped = self._share(snap, self._clusters_of(snap.rec.blocks))
            self._drop_all(v)
            v.map, v.pages, v.mapped = m, pages, mapped
            v.rec.blocks = snap.rec.blocks
        elif op == Op.RENAME:
            _, vid, name = rec
            v = self.vols[vid]
            del self.by_name[v.rec.name]
            v.rec.name = name
            self.by_name[name] = vid
        else:  # pragma: no cover - decode_records refuses unknown ops
            raise fmt.FormatError(f"unknown journal op {op}")

    # ---- space for metadata

    def _slot_runs(self, volumes: int) -> int:
        return (self.sb.slot_size - fmt.CHECKPOINT_HEAD - volumes * fmt.VOLUME_BYTES) // fmt.RUN_BYTES

    def _recount(self) -> None:
        self._runs_bound = sum(fmt.count_runs(*entries(v)) for v in self.vols.values())

    def _admit(self, runs: int, *, volumes: int = 0, reserve: bool = True) -> None:
        """Room in the checkpoint for `runs` more runs (and `volumes` more volumes), else NoSpace. A change
        that awaits before it is applied holds its runs in _reserved meanwhile."""
        room = self._slot_runs(len(self.vols) + volumes) - (RUN_RESERVE if reserve else 0) - self._reserved
        if self._runs_bound + runs <= room:
            return
        self._recount()
        if self._runs_bound + runs > room:
            raise NoSpace(f"volume group {self.sb.name or self.sb.uuid}: metadata full "
                          f"({self._runs_bound} mapping runs); delete snapshots or volumes, or unmap")

    # ---- clusters

    def _free_now(self) -> int:
        """Clusters that could be handed out now."""
        return self.clusters - self.used - len(self._busy)

    def _alloc(self, after: int = 0) -> int:
        """A free cluster, taken (busy until mapped): the one after `after` where that is free, else the next
        candidate."""
        ref, busy = self.ref, self._busy
        p = after + 1
        if after and p <= self.clusters and ref[p] == 0 and p not in busy:
            return self._take(p)
        while True:
            while self._cands:
                p = self._cands.popleft()
                if ref[p] == 0 and p not in busy:
                    return self._take(p)
            if not self._refill():
                raise NoSpace(f"volume group {self.sb.name or self.sb.uuid}: no free cluster "
                              f"({self.used} of {self.clusters} in use)")

    def _take(self, p: int) -> int:
        """Free cluster p, taken: busy until mapped. Whoever takes it may write any part of it: it is known zero
        no more (the taker reads alloc_zeroed, in the same turn, to skip zeroing it)."""
        self._busy.add(p)
        self.alloc_zeroed = bool(self._zeroed[p])
        self._zeroed[p] = 0
        return p

    def _refill(self) -> bool:
        """Candidates for _alloc: free clusters from the cursor on (wrapping round), busy ones left out."""
        ref = _view(self.ref)
        busy = np.fromiter(self._busy, dtype=np.int64, count=len(self._busy)) if self._busy else None
        for start, stop in ((self._cursor, self.clusters + 1), (1, self._cursor)):
            for at in range(start, stop, SCAN):
                free = np.flatnonzero(ref[at:min(stop, at + SCAN)] == 0) + at
                if busy is not None and len(free):
                    free = free[:CANDIDATES + len(busy)]     # holds CANDIDATES that are not busy, if any
                    free = free[~np.isin(free, busy)]
                if len(free):
                    cands = free[:CANDIDATES].tolist()
                    self._cands.extend(cands)
                    self._cursor = cands[-1] + 1 if cands[-1] < self.clusters else 1
                    return True
        return False

    def _release(self, upto: int) -> None:
        """Records up to `upto` are committed: the clusters they freed can be handed out (unless I/O still
        touches them), those they left with one reference can be written in place."""
        keep = []
        for n, p in self._frees:
            if n <= upto and not self._io.get(p):
                self._busy.discard(p)
            else:
                keep.append((n, p))
        self._frees = keep
        if self._fresh:
            self._fresh = {p: n for p, n in self._fresh.items() if n > upto}
        if self._pins:
            done = [c for n, c in self._pins if n <= upto]
            if done:
                pins = [(n, c) for n, c in self._pins if n > upto]
                pin = np.frombuffer(self._pin, dtype=np.uint8)
                for c in done:
                    pin[c] = 0
                if self._io:
                    # a read of the volume that let it go may still be under way (a snapshot deleted while
                    # read): not yet written in place, so the read cannot see the other volume's data
                    reading = np.fromiter(self._io, dtype=np.int64, count=len(self._io))
                    for c in done:
                        held = np.intersect1d(np.atleast_1d(c), reading)
                        if len(held):
                            pins.append((upto + 1, held))
                for _, c in pins:     # a cluster pinned again later stays pinned
                    pin[c] = 1
                self._pins = pins
