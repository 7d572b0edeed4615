"""The primary's layer of a replicated volume: every write goes to the local stack and to every in-sync peer
replica, and is acknowledged when all of them have it (DRBD's protocol C); a FUA write or a flush completes
when it is durable on all of them.

A peer is a BlockDevice (in the cluster, our NVMe/TCP initiator to the peer's replica; in tests, a device in
memory). When a peer fails a write or a flush, the layer records it out of sync in the cluster store
(replication/record.py `mark_out_of_sync`, a compare-and-swap) *before* the write is acknowledged, and keeps
the regions it misses (`dirty`, per peer, `region_size` bytes each) for its resync. If that record cannot be
made because another node was elected meanwhile, this node is fenced: the write fails with NotPrimary and
so does every later one (the initiator's multipath retries on the new primary). Reads are served locally.

`resync(peer)` copies a peer's dirty regions back while the volume stays writable: a copy and the writes that
overlap it go one after the other (as do overlapping writes, so every replica sees them in one order), new
writes also go to the syncing peer, and once nothing is dirty and the peer's flush succeeds the peer is
recorded in sync again.

With `dirty_dir`, each out-of-sync peer's regions are also on disk (dirty.py), saved before the write that
dirtied them is acknowledged, so a primary that restarts resyncs that peer by them; a peer that was out of
sync before this node became primary, without a file of that outage, gets a full copy. Regions a crashed or
fenced primary may have left different (its activity log, activity.py) come in as `hot` regions: copied to
every peer, in sync or not.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer, WriteDone
from openvsan.block.errors import Busy
from openvsan.block.layer import Layer
from openvsan.netio import start_inline, start_then
from openvsan.node.statestore import StateStore, StoreError
from openvsan.replication import record as R
from openvsan.replication.dirty import DirtyFile
from openvsan.replication.lease import LeaseKeeper

log = logging.getLogger(__name__)

DEFAULT_REGION = 1 << 20      # bytes a dirty bit covers (DRBD's bitmap: 4 KiB; ours is coarser, in memory)
RESYNC_CHUNK_REGIONS = 1      # regions copied per step of a resync
GRAIN = 4096                  # bytes per grain of the ordering gate's index of small requests (_try_enter)
SMALL_GRAINS = 2              # a request over at most this many grains is small
ZERO_PIECE = 64 << 10         # a resync sends all-zero pieces of this size as Write Zeroes (the thin cluster)


@functools.lru_cache(maxsize=64)       # asked per command by some frontends: one object per distinct input
def replicated_capabilities(caps: Capabilities) -> Capabilities:
    """What a replicated volume states to initiators: a volatile write cache, whatever its local stack's. A
    peer's replica may have one (a carved thin volume whose mappings commit at a flush, a file's page cache)
    that the primary cannot see, and a write is durable on every replica only after a flush (or FUA): the
    initiators must send them."""
    return caps if caps.volatile_cache else caps.but(volatile_cache=True)


class NotPrimary(Busy):
    """This node's epoch is over: the write was not acknowledged. The initiator retries on another path."""


class MirrorLayer(Layer):
    type_name = "mirror"

    def __init__(self, below: BlockDevice, *, me: str, view: R.ReplicaSet, store: StateStore,
                 peers: Mapping[str, BlockDevice], region_size: int = DEFAULT_REGION, name: str | None = None,
                 dirty_dir: Path | None = None, lease: LeaseKeeper | None = None, activity: Any = None,
                 hot: Iterable[int] = (), suspend: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        super().__init__(below, name=name or f"mirror:{view.volume}")
        if view.primary != me:
            raise ValueError(f"volume {view.volume}: {me} is not its primary (epoch {view.epoch}: {view.primary})")
        if region_size % below.block_size or region_size <= 0:
            raise ValueError(f"region size {region_size}: a positive multiple of the block size {below.block_size}")
        missing = [n for n in view.nodes if n != me and n not in peers]
        if missing:
            raise ValueError(f"volume {view.volume}: no device for peer replica(s) {', '.join(missing)}")
        self.me = me
        self.lease = lease          # asked before every acknowledgement (lease.py): None in tests of the rest
        # activity.py's log (or None): every region written is in it, durably, before the write is sent
        self.activity = activity
        self.suspend = suspend      # seconds an acknowledgement waits for the store (lease, marking) before failing
        self.clock, self.sleep = clock, sleep
        self.view = view
        self.store = store
        self.peers = dict(peers)
        self.region_blocks = region_size // below.block_size
        self.fenced = False
        # regions each out-of-sync peer misses, kept in `dirty_dir` (dirty.py) when given; a peer out of sync
        # before we became primary misses what its file says, or, without one for this outage, everything
        self._files = {n: DirtyFile(dirty_dir / f"{view.volume}.{n}.dirty", len(self._all_regions()), region_size)
                       for n in view.nodes if n != me} if dirty_dir is not None else {}
        self.dirty: dict[str, set[int]] = {}
        for n, since in view.out_of_sync.items():
            saved = self._files[n].load(since) if n in self._files else None
            self.dirty[n] = saved if saved is not None else set(self._all_regions())
        # regions that may differ because a primary (this node or another) crashed or was fenced with writes
        # in flight (its activity log, activity.py): copied to every peer, in sync or not
        hot = set(hot)
        if hot:
            for n in view.nodes:
                if n != me:
                    self.dirty.setdefault(n, set()).update(hot)
        self._grown: dict[str, int] = {n: 0 for n in self.dirty}    # times each peer's dirty set grew
        self._saved: dict[str, int] = {n: 0 for n in self.dirty}    # ... as of its last save
        self._save_locks: dict[str, asyncio.Lock] = {}
        self._unflushed: dict[str, set[int]] = {n: set() for n in self._in_sync_peers()}
        self._marking: dict[str, asyncio.Future[None]] = {}
        self._written_lock = asyncio.Lock()
        self._syncing: set[str] = set()               # out of sync, but getting new writes (a resync runs)
        self._ops: dict[int, list[Any]] = {}   # requests in flight: [lba, blocks, done Event or None, grains]
        self._bs = below.block_size
        self._grain = max(1, GRAIN // self._bs)           # blocks per grain (_try_enter)
        self._busy_grains: dict[int, int] = {}  # grain -> small requests in flight on it
        self._large = 0                         # large requests in flight
        self._tokens = itertools.count()
        self._every_peer: tuple[Any, list[str]] = (None, [])     # (the view it is of, its peers): _targets
        self._sends: tuple[Any, list[tuple[int, BlockDevice, Callable[..., bool] | None]]] = (None, [])  # _senders
        self.stats = {"writes": 0, "peer_failures": 0, "resync_regions": 0, "resync_bytes": 0}
        if activity is not None:
            activity.before_evict = self.flush     # a region leaves the log once durable on every replica

    @property
    def capabilities(self) -> Capabilities:
        return replicated_capabilities(super().capabilities)

    # ---- which peers get what

    def _in_sync_peers(self) -> list[str]:
        return [n for n in self.view.in_sync if n != self.me]

    def _targets(self) -> list[str]:
        """Peers a write goes to: the in-sync ones and those catching up in a resync."""
        view = self.view
        if not view.out_of_sync:
            if self._every_peer[0] is not view:
                self._every_peer = (view, [n for n in view.nodes if n != self.me])
            return self._every_peer[1]     # every peer (not to be changed by the caller)
        return [n for n in view.nodes if n != self.me and (n not in view.out_of_sync or n in self._syncing)]

    def _all_regions(self) -> range:
        return range(-(-self.below.num_blocks // self.region_blocks))

    def _regions(self, lba: int, blocks: int) -> range:
        rb = self.region_blocks
        return range(lba // rb, (lba + max(blocks, 1) - 1) // rb + 1)

    # ---- the write path

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        blocks = memoryview(data).nbytes // self.below.block_size
        await self._fan_out(lba, blocks, lambda d: d.write(lba, data, fua=fua), durable=fua)

    async def unmap(self, lba: int, blocks: int) -> None:
        await self._fan_out(lba, blocks, lambda d: d.unmap(lba, blocks), durable=False)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self._fan_out(lba, blocks, lambda d: d.write_zeroes(lba, blocks), durable=False)

    async def _fan_out(self, lba: int, blocks: int, op: Callable[[BlockDevice], Awaitable[None]], *,
                       durable: bool) -> None:
        if self.fenced:
            raise NotPrimary(f"volume {self.view.volume}: {self.me} is no longer its primary")
        regions = self._regions(lba, blocks)
        span = max(blocks, 1)
        token = self._try_enter(lba, span)
        if token is None:
            token = await self._enter(lba, span)
        try:
            grew = []
            for n, d in self.dirty.items():   # out of sync and not getting it: it misses these regions
                if n in self.view.out_of_sync and n not in self._syncing and not d.issuperset(regions):
                    d.update(regions)
                    grew.append(n)
            targets = self._targets()
            if self.activity is not None:
                await self.activity.enter(regions)    # durable before any replica can have the write
            try:
                results = await self._all(op, targets)
            finally:
                if self.activity is not None:
                    self.activity.leave(regions)
        finally:
            self._leave(token)
        await self._settle(regions, targets, results, grew, durable)

    async def _settle(self, regions: range, targets: list[str], results: list[Any], grew: Sequence[str],
                      durable: bool) -> None:
        """What follows a write's fan-out, before it is acknowledged (write() and write_soon() alike): a
        failure recorded (the local one raised, failed peers marked out of sync and their regions saved), the
        regions counted unflushed on the peers that have them, the lease checked. Returns only if the write
        may be acknowledged; it does not suspend when nothing failed and nothing is left to record."""
        if self._settled_now(regions, targets, results, grew, durable):
            return
        local = results[0]
        if local is not None:
            await self._local_failed(local)   # the primary's own replica failed: not acknowledged
        failed = [n for n, r in zip(targets, results[1:], strict=True) if r is not None]
        self._note_unflushed(regions, targets, failed, durable)
        if failed:
            for n, r in zip(targets, results[1:], strict=True):
                if r is not None and n in self.view.in_sync and n not in self._marking:
                    log.warning("volume %s: peer %s failed a write: %s", self.view.volume, n, r)
            for n in failed:
                self.dirty.setdefault(n, set()).update(regions)
            await self._mark_all(failed)      # before the acknowledgement (record.py rule 2)
        if grew or failed:
            await self._save_dirty([*grew, *failed])   # and what they miss is on disk before it too
        if not self.view.written:
            await self._mark_written()
        if self.lease is not None and not self.lease.held:
            await self._check_lease()
        self._count_write()

    def _settled_now(self, regions: range, targets: list[str], results: list[Any], grew: Sequence[str],
                     durable: bool) -> bool:
        """_settle's whole work when nothing failed or grew, the volume is written in this epoch and the lease
        is held (the common case), done here with no coroutine: True. Else False, nothing done."""
        lease = self.lease
        if grew or not self.view.written or (lease is not None and not lease.held):
            return False
        for r in results:
            if r is not None:
                return False
        self._note_unflushed(regions, targets, (), durable)
        self._count_write()
        return True

    def _note_unflushed(self, regions: range, targets: list[str], failed: Iterable[str], durable: bool) -> None:
        """A write not durable yet (no FUA) is in the caches of the peers that took it until their flush."""
        if not durable:
            for n in targets:
                if n in self._unflushed and n not in failed:
                    self._unflushed[n].update(regions)

    def _count_write(self) -> None:
        if not self.stats["writes"]:
            log.info("volume %s: %s acknowledged its first write in epoch %d", self.view.volume, self.me,
                     self.view.epoch)
        self.stats["writes"] += 1

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        """write()'s fast path (block/device.py WriteSoon) for the common case: every peer in sync, the volume
        written in this epoch, the regions in the activity log already and no request in flight overlapping it,
        and a local replica that writes at once (write_now) or soon (its own write_soon: a compressed replica's
        write cache, which write_now declines). (The lease is asked before the acknowledgement, as
        write() asks it: an epoch's writes are fenced on the replicas, not by the sender.) Then the local write is
        made here, each peer's command leaves in this turn (its own write_soon, else its write() started
        eagerly; a fast send that fails is sent again by write(), which retries and reconnects as for any
        write), and when the last answer comes in, _settle (the same as write()'s) decides: done(None), or
        done(exc) after whatever a failure needs. False: nothing was written (write() takes it)."""
        view = self.view
        if self.fenced or view.out_of_sync or not view.written:
            return False
        blocks = memoryview(data).nbytes // self._bs
        regions = self._regions(lba, blocks)
        targets = self._targets()
        if not targets:
            return False
        token = self._try_enter(lba, max(blocks, 1))
        if token is None:
            return False
        activity = self.activity
        if activity is not None and not activity.enter_now(regions):
            self._leave(token)
            return False
        w = _SoonWrite(self, lba, data, fua, done, regions, targets, token, activity)
        now = self.below.write_now(lba, data)
        if not now:
            local_soon = getattr(self.below, "write_soon", None)
            if local_soon is None or not local_soon(lba, data, fua, w.local_done):
                if activity is not None:
                    activity.leave(regions)
                self._leave(token)
                return False
        for i, peer, soon in self._senders(targets):
            if soon is None or not soon(lba, data, fua, w.answer_of(i, peer)):
                start_then(peer.write(lba, data, fua=fua), w.answer_of(i, None))
        if now:
            w.answered(0, None, None)     # the local write, made above: the last answer settles the write
        return True

    def _senders(self, targets: list[str]) -> list[tuple[int, BlockDevice, Callable[..., bool] | None]]:
        """(index in the results, device, its write_soon or None) of each of `targets`: kept while `targets` is
        the same list (_targets' every-peer list, which lasts as long as the view)."""
        cached = self._sends
        if cached[0] is not targets:
            peers = [self.peers[n] for n in targets]
            cached = self._sends = (targets, [(i, p, getattr(p, "write_soon", None)) for i, p in enumerate(peers, 1)])
        return cached[1]

    async def _all(self, op: Callable[[BlockDevice], Awaitable[None]], targets: list[str]) -> list[Any]:
        """`op` on the local stack and on each target peer at once: [local's result, then each peer's], an
        exception in place of a failure. The peers' commands go first; the local one runs inline meanwhile
        (no gather: a task less per write, and on RAM it never waits)."""
        # each peer's command runs at once up to its send (it leaves in this loop turn's batch); the wait for
        # its answer is driven by this task afterwards, one peer after the other (netio.start_inline: no task
        # per command; every command is out before the first wait, so the peers still work at once)
        pending: list[Any] = []
        for n in targets:
            try:
                pending.append(start_inline(op(self.peers[n])))
            except Exception as e:  # noqa: BLE001 - failed before it was sent (not connected)
                pending.append(e)
        results: list[Any] = []
        try:
            await op(self.below)
            results.append(None)
        except Exception as e:  # noqa: BLE001 - reported with the others
            results.append(e)
        except BaseException:
            for t in pending:
                if isinstance(t, Generator):
                    t.close()
            raise
        for i, t in enumerate(pending):
            if not isinstance(t, Generator):
                results.append(t)           # done at once (None), or failed before it was sent
                continue
            try:
                await t
                results.append(None)
            except Exception as e:  # noqa: BLE001
                results.append(e)
            except BaseException:
                for rest in pending[i + 1:]:
                    if isinstance(rest, Generator):
                        rest.close()
                raise
        return results

    async def flush(self) -> None:
        if self.fenced:
            raise NotPrimary(f"volume {self.view.volume}: {self.me} is no longer its primary")
        targets = self._targets()
        pending = {n: self._unflushed.get(n, set()) for n in targets}
        for n in targets:
            if n in self._unflushed:
                self._unflushed[n] = set()
        results = await self._all(lambda d: d.flush(), targets)
        if isinstance(results[0], BaseException):
            await self._local_failed(results[0])
        failed = [n for n, r in zip(targets, results[1:], strict=True) if isinstance(r, BaseException)]
        for n in failed:   # what it held in its cache may be gone: every region written since its last flush
            self.dirty.setdefault(n, set()).update(pending[n])
        await self._mark_all(failed)
        await self._save_dirty(failed)
        await self._check_lease()

    async def _check_lease(self) -> None:
        """A primary whose lease may have lapsed acknowledges nothing (another node may be elected now). While
        the store does not answer, the acknowledgement waits up to `suspend` seconds for a renewal (I/O is
        suspended, not failed: a renewal that gets through proves the lease still lives)."""
        if self.lease is None or self.lease.held:
            return
        deadline = self.clock() + self.suspend
        while not self.lease.held and not self.lease.lost and self.clock() < deadline:
            await self.sleep(min(0.05, max(deadline - self.clock(), 0.001)))
        if not self.lease.held:
            self.fenced = True
            raise NotPrimary(f"volume {self.view.volume}: {self.me}'s lease was not renewed in time; it is no "
                             "longer primary")

    async def _mark_written(self) -> None:
        async with self._written_lock:          # one compare-and-swap for the first writes together
            if self.view.written:
                return
            try:
                self.adopt(await R.mark_written(self.store, self.view))
            except R.Fenced as e:
                self.fenced = True
                raise NotPrimary(str(e)) from None

    def adopt(self, rs: R.ReplicaSet) -> None:
        """A newer record of this epoch (a replica that declared itself stale, record.py declare_stale): a
        peer out of sync that this layer did not mark gets every region copied."""
        if rs.epoch != self.view.epoch or rs.revision < self.view.revision:
            return
        self.view = rs
        for n in rs.out_of_sync:
            if n != self.me and n not in self.dirty:
                self.dirty[n] = set(self._all_regions())
                self._syncing.discard(n)
                self._unflushed.pop(n, None)
                log.warning("volume %s: %s declared its replica stale: a full copy follows", rs.volume, n)

    async def drain(self) -> None:
        """Wait for the requests in flight (after fencing: none of them is acknowledged any more)."""
        while self._ops:
            op = next(iter(self._ops.values()))
            if op[2] is None:
                op[2] = asyncio.Event()
            await op[2].wait()

    async def save_all_dirty(self) -> None:
        """Every out-of-sync peer's dirty regions to its file now (after seeding them with a hot set)."""
        for n in list(self.dirty):
            if n in self._files and n in self.view.out_of_sync:
                await asyncio.to_thread(self._files[n].save, set(self.dirty[n]), self.view.out_of_sync[n])

    async def _local_failed(self, e: BaseException) -> NoReturn:
        """The local replica refused or failed: if a newer epoch took it (its fence refuses ours), this node is
        fenced; else the error is the device's own."""
        try:
            now = await R.load(self.store, self.view.volume)
        except Exception:  # noqa: BLE001 - the store's state unknown: the device's error stands
            raise e from None
        if now.epoch != self.view.epoch:
            self.fenced = True
            raise NotPrimary(f"volume {self.view.volume}: epoch {self.view.epoch} is over (now {now.epoch}, "
                             f"primary {now.primary})") from e
        raise e

    async def _save_dirty(self, nodes: Iterable[str]) -> None:
        """Each of `nodes`' dirty regions to its file (off the loop), once for all the writes that grew them
        meanwhile: a writer whose growth a later save already covered does not save again."""
        for n in dict.fromkeys(nodes):
            if n not in self._files or n not in self.dirty:
                continue
            self._grown[n] = mine = self._grown.get(n, 0) + 1
            async with self._save_locks.setdefault(n, asyncio.Lock()):
                if self._saved.get(n, 0) >= mine or n not in self.dirty:
                    continue
                upto, regions = self._grown[n], set(self.dirty[n])
                since = self.view.out_of_sync.get(n, self.view.epoch)
                await asyncio.to_thread(self._files[n].save, regions, since)
                self._saved[n] = upto

    async def _mark_all(self, failed: Iterable[str]) -> None:
        marks = [self._mark(n) for n in failed]
        if marks:
            await asyncio.gather(*marks)

    async def _copy(self, peer: BlockDevice, lba: int, data: bytes) -> None:
        """One region to a peer in a resync: runs of ZERO_PIECE-sized pieces that are all zeros go as Write
        Zeroes (a thin replica keeps them unallocated, and they cross the wire as a command), the rest as
        writes."""
        bs = self.below.block_size
        piece = max(ZERO_PIECE, bs)
        n = -(-len(data) // piece)
        padded = np.frombuffer(data.ljust(n * piece, b"\0"), dtype=np.uint64).reshape(n, piece // 8)
        zero = ~padded.any(axis=1)
        if not zero.any():
            await peer.write(lba, data)
            return
        edges = np.flatnonzero(np.diff(zero.astype(np.int8))) + 1
        for a, b in zip(np.concatenate(([0], edges)).tolist(), np.concatenate((edges, [n])).tolist(), strict=True):
            start, stop = a * piece, min(b * piece, len(data))
            at = lba + start // bs
            if zero[a]:
                await peer.write_zeroes(at, (stop - start) // bs)
            else:
                await peer.write(at, data[start:stop])

    async def peer_reconnected(self, node: str) -> None:
        """`node`'s link is back after a loss (before it is used): what it had not flushed may be gone (its
        process or host restarted), so those regions are recorded out of sync and copied again."""
        if self._unflushed.get(node):
            log.warning("volume %s: %s's link came back; %d region(s) it had not flushed are copied again",
                        self.view.volume, node, len(self._unflushed[node]))
            await self._mark_all([node])
            await self._save_dirty([node])

    async def _mark(self, node: str) -> None:
        """Record `node` out of sync, once however many writes found it failing at the same time; the regions
        written to it since its last flush are among those it misses (its cache may be gone)."""
        self._syncing.discard(node)
        lost = self._unflushed.pop(node, None)
        if lost:
            self.dirty.setdefault(node, set()).update(lost)
        self.stats["peer_failures"] += 1
        fut = self._marking.get(node)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._marking[node] = fut
            try:
                deadline = self.clock() + self.suspend
                while node in self.view.in_sync:
                    try:
                        self.adopt(await R.mark_out_of_sync(self.store, self.view, node))
                    except StoreError:
                        if self.clock() >= deadline:      # suspended long enough: fail the write
                            raise
                        await self.sleep(0.2)
                        continue
                    log.warning("volume %s: peer %s is out of sync since epoch %d", self.view.volume, node,
                                self.view.epoch)
                fut.set_result(None)
            except R.Fenced as e:
                self.fenced = True
                fut.set_exception(NotPrimary(str(e)))
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - the store unreachable: not recorded, so not acknowledged
                fut.set_exception(e)
            finally:
                del self._marking[node]
        try:
            await fut
        finally:
            if fut.done() and not fut.cancelled():
                fut.exception()           # retrieved by every waiter alike

    # ---- resync

    # Overlapping requests are ordered: one that overlaps a request in flight (a write, or a resync's copy of
    # a region) waits for it. Else two concurrent writes to one block could land in one order here and in
    # the other on a peer (the replicas would differ), and a copy could read old data here and land it on
    # the peer after a newer write did.

    # Small requests (up to SMALL_GRAINS grains of 4 KiB) are also counted per grain in flight, so that one
    # finds it overlaps nothing with a lookup or two instead of a scan of every request in flight (QD 32: 32
    # comparisons per write); a shared grain (two 512-byte writes in one 4 KiB) counts as an overlap there,
    # and _enter's exact scan lets it through. Large requests (and anything while one is in flight) scan.

    def _grains(self, lba: int, blocks: int) -> range | None:
        g = self._grain
        first, last = lba // g, (lba + blocks - 1) // g
        return range(first, last + 1) if last - first < SMALL_GRAINS else None

    def _try_enter(self, lba: int, blocks: int) -> int | None:
        """The token of a request that overlaps none in flight (the common case: no await), else None."""
        grains = self._grains(lba, blocks)
        if grains is not None and not self._large:
            busy = self._busy_grains
            for k in grains:
                if k in busy:
                    return None
        else:
            end = lba + blocks
            for a, n, _, _ in self._ops.values():
                if a < end and lba < a + n:
                    return None
        return self._register(lba, blocks, grains)

    async def _enter(self, lba: int, blocks: int) -> int:
        end = lba + blocks
        while True:
            busy = next((op for op in self._ops.values() if op[0] < end and lba < op[0] + op[1]), None)
            if busy is None:
                break
            if busy[2] is None:
                busy[2] = asyncio.Event()     # made only when someone waits for it
            await busy[2].wait()
        return self._register(lba, blocks, self._grains(lba, blocks))

    def _register(self, lba: int, blocks: int, grains: range | None) -> int:
        token = next(self._tokens)
        self._ops[token] = [lba, blocks, None, grains]
        if grains is None:
            self._large += 1
        else:
            busy = self._busy_grains
            for k in grains:
                busy[k] = busy.get(k, 0) + 1
        return token

    def _leave(self, token: int) -> None:
        _, _, done, grains = self._ops.pop(token)
        if grains is None:
            self._large -= 1
        else:
            busy = self._busy_grains
            for k in grains:
                n = busy[k] - 1
                if n:
                    busy[k] = n
                else:
                    del busy[k]
        if done is not None:
            done.set()

    async def add_hot(self, regions: Iterable[int]) -> None:
        """Regions that may differ between replicas (a crashed or fenced primary's activity log): every peer
        gets them copied, in sync or not (saved first for those out of sync)."""
        hot = set(regions)
        if not hot:
            return
        for n in self.view.nodes:
            if n != self.me:
                self.dirty.setdefault(n, set()).update(hot)
        await self.save_all_dirty()

    async def resync(self, node: str, *, rate: float | None = None,
                     sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                     more: Callable[[], Awaitable[Iterable[int]]] | None = None) -> int:
        """Copy `node`'s dirty regions from the local stack, then record it in sync; returns the bytes sent.
        `rate`: bytes/s at most. The volume takes writes meanwhile (they go to `node` too). `more`: asked
        once the dirty regions are copied, before the peer is recorded in sync: regions learnt meanwhile
        (hot sets published since), copied too."""
        if node not in self.dirty:
            raise ValueError(f"volume {self.view.volume}: {node} is not out of sync")
        peer = self.peers[node]
        sent = 0
        self._syncing.add(node)
        self._unflushed[node] = set()
        try:
            while self.dirty[node]:
                if node not in self._syncing:
                    raise R.ReplicationError(f"volume {self.view.volume}: {node} failed again during its resync")
                r = min(self.dirty[node])
                lba = r * self.region_blocks
                blocks = min(self.region_blocks, self.below.num_blocks - lba)
                token = await self._enter(lba, blocks)
                try:
                    self.dirty[node].discard(r)
                    data = bytes(await self.below.read(lba, blocks))
                    await self._copy(peer, lba, data)
                except BaseException:
                    self.dirty[node].add(r)
                    raise
                finally:
                    self._leave(token)
                nbytes = blocks * self.below.block_size
                sent += nbytes
                self.stats["resync_regions"] += 1
                self.stats["resync_bytes"] += nbytes
                if rate:
                    await sleep(nbytes / rate)
                if not self.dirty[node] and more is not None:
                    extra = set(await more())
                    if extra:
                        await self.add_hot(extra)
            await peer.flush()
            self.adopt(await R.mark_in_sync(self.store, self.view, node))
        except R.Fenced as e:
            self.fenced = True
            raise NotPrimary(str(e)) from None
        except BaseException:
            self._syncing.discard(node)
            self._unflushed.pop(node, None)
            raise
        self._syncing.discard(node)
        del self.dirty[node]
        if node in self._files:
            await asyncio.to_thread(self._files[node].remove)
        log.info("volume %s: peer %s is in sync again (%d bytes copied)", self.view.volume, node, sent)
        return sent

    def replication_stats(self) -> dict[str, Any]:
        return {**self.stats, "epoch": self.view.epoch, "in_sync": list(self.view.in_sync),
                "out_of_sync": {n: len(d) for n, d in self.dirty.items()}, "fenced": self.fenced}


class _SoonWrite:
    """One write on MirrorLayer.write_soon's path, from its send to its acknowledgement: what the answers need,
    in one slotted object. (The closure it replaced referred to itself for the resend, so every write left a
    reference cycle for the garbage collector: about a quarter of the CPU per replicated 4K write in
    bench/mirror_cpu.py.) `answered(i, peer, e)`: the local write (i
    0, at once) or peer i's answer; a fast send that failed (peer given) is sent again the normal way, which
    retries, reconnects or fails as for any write; the last answer settles the write (_settled_now, else
    _settle) and calls `done`."""

    __slots__ = ("activity", "data", "done", "fua", "lba", "left", "mirror", "regions", "results", "targets", "token")

    def __init__(self, mirror: MirrorLayer, lba: int, data: Buffer, fua: bool, done: WriteDone, regions: range,
                 targets: list[str], token: int, activity: Any) -> None:
        self.mirror, self.lba, self.data, self.fua, self.done = mirror, lba, data, fua, done
        self.regions, self.targets, self.token, self.activity = regions, targets, token, activity
        self.results: list[Any] = [None] * (len(targets) + 1)
        self.left = len(targets) + 1     # one more than the peers: the local write's

    def answer_of(self, i: int, peer: BlockDevice | None) -> Callable[[BaseException | None], None]:
        """The callback for peer i's answer (the first peer's, the only one of a 2-way volume, is a bound
        method: no partial)."""
        if i == 1 and peer is not None:
            return self._first_peer
        return functools.partial(self.answered, i, peer)

    def local_done(self, e: BaseException | None) -> None:
        """The local replica's answer, where its own write_soon took the write (maybe before the peers' sends)."""
        self.answered(0, None, e)

    def _first_peer(self, e: BaseException | None) -> None:
        self.answered(1, self.mirror.peers[self.targets[0]], e)

    def answered(self, i: int, peer: BlockDevice | None, e: BaseException | None) -> None:
        if e is not None and peer is not None:
            start_then(peer.write(self.lba, self.data, fua=self.fua), functools.partial(self.answered, i, None))
            return
        self.results[i] = e
        self.left -= 1
        if self.left:
            return
        m = self.mirror
        if self.activity is not None:
            self.activity.leave(self.regions)
        m._leave(self.token)
        if m._settled_now(self.regions, self.targets, self.results, (), self.fua):
            self.done(None)
        else:
            start_then(m._settle(self.regions, self.targets, self.results, (), self.fua), self.done)
