"""One node's part in a replicated volume, running: its replica served to the primary, the election, and, while
it is primary, the mirror layer over its stack and the peers' replicas.

Every replica node runs a `ReplicaController` per replicated volume:
- its local stack is served to the other nodes on the replication portal (`ReplicaServer`: our NVMe/TCP,
  subsystem `replica_nqn(volume)`, only the volume's other nodes admitted), behind an EpochFence whose
  floor is in the data dir (fence.py, peer.py FloorFile);
- as a **secondary** its frontends report ALUA standby / ANA inaccessible for its own paths, the primary's
  target port group active/optimized; it polls the primary's key and, when the key is gone (the primary's
  lease expired) and the record says it is in sync, it claims the primary (record.py claim_primary);
- as the **primary** of epoch E it keeps its lease (lease.py), takes its own replica in-process (its fence
  floor becomes E, so once a newer primary preempts it, its own late writes are refused too), connects to
  each peer's replica (peer.py connect_peer: taken for E), puts a MirrorLayer (mirror.py) on top of the
  volume's stack under the frontends (Volume.swap), turns its paths active/optimized, and resyncs peers
  that are out of sync (or hold hot regions) whenever they can be reached. When its lease is lost, or a
  newer epoch fences it, it turns its paths standby, drains what is in flight, publishes its activity log's
  regions, and takes the mirror off again.

Hot regions (`/replication/hot/<volume>/<node>`): the regions a node had in its activity log (activity.py)
when it stopped being primary, by a crash or a fence: writes to them may have reached some replicas and not
others. A node publishes them before it serves its replica (so before any primary can resync it) and the
primary copies them to every peer before deleting the key: replicas end bit-identical without a full copy,
even after every node went down at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer, WriteDone
from openvsan.block.layer import Layer
from openvsan.durable import replace_file
from openvsan.node.statestore import Lease, StateStore, StoreError
from openvsan.protocol.nvme.auth import Secret, format_secret
from openvsan.replication import record as R
from openvsan.replication.fence import EpochFence
from openvsan.replication.lease import LeaseKeeper
from openvsan.replication.mirror import DEFAULT_REGION, MirrorLayer, NotPrimary, replicated_capabilities
from openvsan.replication.peer import FloorFile, PeerFenced, connect_peer, node_nqn
from openvsan.volume import Volume

log = logging.getLogger("openvsan.replication")

HOT = "/replication/hot/"
POLL = 0.5                     # seconds between a secondary's looks at the primary's key
CONNECT_WAIT = 0.3             # seconds a new primary waits for its peers' replicas to answer before serving
PEER_QUEUE_DEPTH = 256         # commands in flight to each peer replica (its NVMe/TCP I/O queue)
RESYNC_RATE = 200 << 20        # bytes/s a resync sends at most (DRBD's c-max-rate is of this order)


def host_id(node: str) -> bytes:
    """The NVMe Host Identifier our initiator sends for `node` (initiator/nvme_tcp.py derives it the same way):
    the node's own in-process take of its replica registers as the same host."""
    return uuidlib.uuid5(uuidlib.NAMESPACE_URL, node_nqn(node)).bytes


class ReplicaFenced(NotPrimary):
    """This node's own replica is held by a newer epoch: its write was not made."""


class LocalReplica(Layer):
    """The primary's own replica, written in-process only while its epoch holds the replica's fence."""

    type_name = "local-replica"

    def __init__(self, below: BlockDevice, fence: EpochFence, host: bytes, epoch: int, volume: str) -> None:
        super().__init__(below, name=f"local-replica:{volume}")
        self.fence, self.host, self.epoch, self.volume = fence, host, epoch, volume
        self._below_now: Callable[[int, Buffer], bool] = getattr(below, "write_now", lambda lba, data: False)
        self._below_soon: Callable[[int, Buffer, bool, WriteDone], bool] = getattr(
            below, "write_soon", lambda lba, data, fua, done: False)

    def _check(self) -> None:
        if not self.fence.holds(self.host, self.epoch):
            self.fence.refused += 1
            raise ReplicaFenced(f"volume {self.volume}: epoch {self.epoch} no longer holds this node's replica "
                                f"(floor {self.fence.floor})")

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        self._check()
        await self.below.write(lba, data, fua=fua)

    def write_now(self, lba: int, data: Buffer) -> bool:
        """The device's write_now while the fence is held; else declined, and write() refuses it."""
        return self.fence.holds(self.host, self.epoch) and self._below_now(lba, data)

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        """The device's write_soon (a compressed replica's write cache) while the fence is held; else declined,
        and write() refuses it."""
        return self.fence.holds(self.host, self.epoch) and self._below_soon(lba, data, fua, done)

    async def unmap(self, lba: int, blocks: int) -> None:
        self._check()
        await self.below.unmap(lba, blocks)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        self._check()
        await self.below.write_zeroes(lba, blocks)


class Standby(Layer):
    """A secondary's stack under its frontends: no I/O (the primary's path serves it; ALUA/ANA refuse it
    first with their own status, this refuses what has no such state, an NBD export)."""

    type_name = "standby"

    def __init__(self, below: BlockDevice, volume: str, why: Callable[[], str]) -> None:
        super().__init__(below, name=f"standby:{volume}")
        self.volume, self.why = volume, why

    @property
    def capabilities(self) -> Capabilities:
        return replicated_capabilities(super().capabilities)    # the same as the primary's (mirror.py)

    def _refuse(self) -> NotPrimary:
        return NotPrimary(f"volume {self.volume}: {self.why()}")

    async def read(self, lba: int, blocks: int) -> Buffer:
        raise self._refuse()

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        raise self._refuse()

    async def flush(self) -> None:
        raise self._refuse()

    async def unmap(self, lba: int, blocks: int) -> None:
        raise self._refuse()

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        raise self._refuse()


class PeerLink(BlockDevice):
    """A peer's replica as a BlockDevice for the mirror: our NVMe/TCP initiator while connected; while not,
    every command fails at once (the mirror records the peer out of sync) and a task reconnects."""

    def __init__(self, node: str, address_of: Callable[[], Awaitable[str | None]], volume: str, me: str, epoch: int,
                 geometry: BlockDevice, *, timeout: float,
                 before_use: Callable[[], Awaitable[None]] | None = None,
                 auth: tuple[Secret, Secret] | None = None) -> None:
        self.node, self.volume, self.me, self.epoch = node, volume, me, epoch
        self.auth = auth                 # the replication path's DH-HMAC-CHAP keys (peer.replication_keys)
        self.address_of = address_of     # the peer's replication address as the cluster says now (None: no member)
        # awaited after each (re)connection, before the link is used: the primary reads the record again, so a
        # peer that restarted and declared its replica stale is never taken for in sync on the new connection
        self.before_use = before_use
        self.address: str | None = None
        self.geometry = geometry
        self.timeout = timeout
        self.name = f"peer:{node}:{volume}"
        self.dev: Any = None
        self.pending: asyncio.Future[bool] | None = None
        self.fenced: PeerFenced | None = None
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def num_blocks(self) -> int:
        return self.geometry.num_blocks

    @property
    def capabilities(self) -> Any:
        return self.geometry.capabilities

    def to_config(self) -> dict[str, Any]:
        return {"type": "peer", "node": self.node, "address": self.address}

    async def connect(self) -> bool:
        from openvsan.initiator.nvme_tcp import NvmeOptions

        try:
            self.address = await self.address_of()
        except Exception as e:  # noqa: BLE001 - the store did not answer: try again later
            log.debug("volume %s: address of %s: %s", self.volume, self.node, e)
            return False
        if self.address is None:
            return False
        host, _, port = self.address.rpartition(":")
        # no reconnects inside the initiator: a connection that dropped may come back to a restarted replica,
        # which must be taken for this epoch again (connect_peer) and whose record may have changed
        # a deep queue: every write the initiators have in flight on this volume is in flight to the peer too,
        # and one that finds no slot free waits for one on the slower path (a coroutine and a Task)
        opts = NvmeOptions(command_timeout=self.timeout, reconnect_timeout=0.0, connect_timeout=self.timeout,
                           kato_ms=max(int(self.timeout * 4000), 2000), reconnect=False, queue_depth=PEER_QUEUE_DEPTH)
        if self.auth is not None:
            opts.dhchap_secret, opts.dhchap_ctrl_secret = (format_secret(k) for k in self.auth)
        try:
            # asyncio.timeout, not wait_for: wait_for runs the attempt as a Task of its own, which Python 3.11
            # lets finish unobserved when a cancel and a completion meet (its PeerFenced never retrieved)
            async with asyncio.timeout(self.timeout * 2):
                dev = await connect_peer(host.strip("[]"), int(port), self.volume, self.me, self.epoch, opts=opts)
        except PeerFenced as e:
            self.fenced = e
            return False
        except Exception as e:  # noqa: BLE001 - unreachable (refused, timed out, reset): try again later
            log.debug("volume %s: peer %s not reachable: %s", self.volume, self.node, e)
            return False
        if (dev.block_size, dev.num_blocks) != (self.block_size, self.num_blocks):
            log.error("volume %s: %s's replica is %d x %d bytes, this one %d x %d: not used", self.volume, self.node,
                      dev.num_blocks, dev.block_size, self.num_blocks, self.block_size)
            with contextlib.suppress(Exception):
                await dev.close()
            return False
        if self.before_use is not None:
            try:
                await self.before_use()
            except Exception as e:  # noqa: BLE001 - the store did not answer: this connection is not used yet
                log.debug("volume %s: peer %s connected, record not read: %s", self.volume, self.node, e)
                with contextlib.suppress(Exception):
                    await dev.close()
                return False
        self.dev = dev
        self.connected.set()
        log.info("volume %s: connected to %s's replica at %s (epoch %d)", self.volume, self.node, self.address,
                 self.epoch)
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_connected())

    async def _keep_connected(self) -> None:
        if self.pending is not None:        # the first attempt, still under way when the primary began to serve
            with contextlib.suppress(Exception):
                await self.pending
            self.pending = None
        while not self.closed and self.fenced is None:
            if self.dev is not None and self.dev.lost:
                await self._drop()        # the connection dropped (the peer died or restarted): taken again
            if self.dev is None and not await self.connect():
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(0.5)

    async def _drop(self) -> None:
        dev, self.dev = self.dev, None
        self.connected.clear()
        if dev is not None:
            with contextlib.suppress(Exception):
                await dev.close()

    async def _do(self, call: Callable[[Any], Awaitable[Any]]) -> Any:
        if self.dev is None:
            raise ConnectionError(f"{self.node}'s replica of {self.volume} is not connected")
        try:
            # no wait_for of its own: the initiator's command timeout (= self.timeout) ends a command unanswered
            return await call(self.dev)
        except GeneratorExit:      # closed unfinished (a hurried exit left it waiting): nothing may be awaited
            raise
        except BaseException:
            await self._drop()
            raise

    async def read(self, lba: int, blocks: int) -> Buffer:
        result: Buffer = await self._do(lambda d: d.read(lba, blocks))
        return result

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        dev = self.dev            # _do's work, written out: this is every replicated write's path
        if dev is None:
            raise ConnectionError(f"{self.node}'s replica of {self.volume} is not connected")
        try:
            await dev.write(lba, data, fua=fua)
        except GeneratorExit:
            raise
        except BaseException:
            await self._drop()
            raise

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        """The initiator's write_soon while connected; else declined (write() reports it). The mirror sends a
        write whose fast send failed again with write(), which retries, reconnects, or drops the link."""
        dev = self.dev
        return dev is not None and dev.write_soon(lba, data, fua, done)

    async def flush(self) -> None:
        await self._do(lambda d: d.flush())

    async def unmap(self, lba: int, blocks: int) -> None:
        await self._do(lambda d: d.unmap(lba, blocks))

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self._do(lambda d: d.write_zeroes(lba, blocks))

    async def close(self) -> None:
        self.closed = True
        if self.pending is not None:
            self.pending.cancel()
            with contextlib.suppress(BaseException):
                await self.pending
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self._drop()


@dataclass
class Paths:
    """How the node turns a volume's paths (its frontends): set(role) -> ALUA/ANA states; the controller
    calls it, the node implements it (node/replicas.py)."""

    set: Callable[[str, str | None], None]     # (this node's role, the primary's name or None)


@dataclass
class ReplicaController:
    volume: Volume                       # the frontends' handle: its stack is swapped to the mirror and back
    local: BlockDevice                   # this node's replica: the volume's own stack (served to the primary)
    me: str
    nodes: tuple[str, ...]
    store: StateStore
    addresses: Callable[[], Awaitable[Mapping[str, str]]]   # node -> replication address (the cluster's members)
    fence: EpochFence
    data_dir: Path
    paths: Paths
    lease_ttl: int = 5
    suspend: float = 30.0
    region_size: int = DEFAULT_REGION
    activity: Any = None                 # activity.py ActivityLog, or None (no hot-set tracking)
    resync_rate: float = RESYNC_RATE
    before_primary: Callable[[], Awaitable[None]] | None = None   # e.g. the shared PR state brought up to date
    persistent: bool = True             # the replica's data survives a restart (not a RAM device)
    auth: tuple[Secret, Secret] | None = None   # the replication path's DH-HMAC-CHAP keys (peer.py)
    role: str = "starting"
    view: R.ReplicaSet | None = None
    mirror: MirrorLayer | None = None
    links: dict[str, PeerLink] = field(default_factory=dict)
    keeper: LeaseKeeper | None = None
    resyncing: dict[str, asyncio.Task[int]] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)   # role changes, for status and tests
    _task: asyncio.Task[None] | None = None
    _keeper_task: asyncio.Task[None] | None = None
    _lease: Lease | None = None
    _stopping: bool = False
    _hot_keys: list[str] = field(default_factory=list)
    _hot_checked: float = 0.0
    _hold_until: float = 0.0            # after a move-primary: no claim before this (another node's turn)
    _standby: Standby | None = None

    @property
    def name(self) -> str:
        return self.volume.name

    # ---- start: what must come before the replica is served

    async def prepare(self, identity: str) -> R.ReplicaSet:
        """The replica set (made if this is the first node to serve it); this node's hot regions from a
        crash published. Before the replica server starts."""
        try:
            rs = await R.load(self.store, self.name)
        except R.ReplicationError:
            try:
                rs = await R.create(self.store, self.name, self.nodes, uuid=identity)
            except R.ReplicationError:
                rs = await R.load(self.store, self.name)     # another node made it meanwhile
        if set(rs.nodes) != set(self.nodes):
            raise R.ReplicationError(f"volume {self.name}: this node lists replicas on {', '.join(self.nodes)}, "
                                     f"the cluster on {', '.join(rs.nodes)}; give every node the same nodes list")
        # this data dir's replica state: without it (a new node, or a wiped one) the local copy may lack
        # acknowledged writes, so the replica declares itself stale and gets a full copy
        marker = self.data_dir / f"{self.name}.replica"
        known = marker.read_text().strip() if marker.exists() else None
        lost = known != (rs.uuid or "") or not self.persistent     # a RAM replica starts empty every time
        if lost and rs.written and self.me in rs.in_sync:
            rs = await R.declare_stale(self.store, self.name, self.me)
            log.warning("volume %s: this node's replica is new (or its state was lost): out of sync until the "
                        "primary has copied it in full", self.name)
        if known != (rs.uuid or ""):
            await asyncio.to_thread(replace_file, marker, (rs.uuid or "").encode() + b"\n")
        if self.activity is not None:
            hot = self.activity.load()
            if hot is None:          # unreadable: every region may differ
                hot = set(range(-(-self.volume.num_blocks * self.volume.block_size // self.region_size)))
            if hot:
                await self.store.put(f"{HOT}{self.name}/{self.me}", {"regions": sorted(hot)})
                log.warning("volume %s: %d region(s) were in flight when this node stopped as primary: published "
                            "for the next resync", self.name, len(hot))
            await self.activity.clear()
        self.view = rs
        return rs

    async def start(self) -> None:
        """Standby under the frontends (before they serve): no I/O through this node until it is elected."""
        self._standby = Standby(self.local, self.name, self._standby_why)
        await self.volume.swap(self._standby)
        self._set_role("secondary", None)

    def run_loop(self) -> None:
        """Elections, and the primary's duties, from now on (once the frontends serve)."""
        self._task = asyncio.create_task(self._run(), name=f"replica {self.name}")

    def _standby_why(self) -> str:
        primary = self.history[-1]["primary"] if self.history else None
        return (f"this node is a secondary; its primary is {primary}" if primary else
                "no node is its primary now (an election is under way)")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self._step_down(planned=True)
        if self.volume.stack is self._standby:
            await self.volume.swap(self.local)

    # ---- the loop

    async def _run(self) -> None:
        while not self._stopping:
            try:
                if self.role == "primary":
                    await self._serve_as_primary()
                else:
                    await self._watch_as_secondary()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the store or a peer failed: look again in a moment
                log.warning("volume %s: %s", self.name, e)
                await asyncio.sleep(POLL)

    async def _watch_as_secondary(self) -> None:
        rs = await R.load(self.store, self.name)
        self.view = rs
        held = await self.store.get(R.PRIMARY + self.name)
        if held is not None:
            self._set_role("secondary", str(held.value.get("node")))
            await asyncio.sleep(POLL)
            return
        if self.me in rs.out_of_sync or time.monotonic() < self._hold_until:
            self._set_role("secondary", None)
            await asyncio.sleep(POLL)
            return
        # no primary: the node that was primary last goes first (a restart of it), the others give it a moment,
        # unless it is down (its node's own lease, /cluster/alive, expired too): then no waiting
        if (rs.primary not in (None, self.me) and rs.primary in rs.in_sync
                and await self.store.get(f"/cluster/alive/{rs.primary}") is not None):
            await asyncio.sleep(POLL)
        await self._elect()

    async def _elect(self) -> None:
        granted_at = time.monotonic()
        lease = await self.store.grant_lease(self.lease_ttl)
        try:
            rs = await R.claim_primary(self.store, self.name, self.me, lease)
        except R.ReplicationError as e:
            with contextlib.suppress(Exception):
                await lease.revoke()
            log.debug("volume %s: not elected: %s", self.name, e)
            await asyncio.sleep(POLL)
            return
        self._lease = lease
        self.keeper = LeaseKeeper(lease, granted_at)
        self._keeper_task = asyncio.create_task(self.keeper.run())
        try:
            await self._become_primary(rs)
        except BaseException:
            await self._step_down(planned=False)
            raise

    async def _become_primary(self, rs: R.ReplicaSet) -> None:
        if not self.fence.take_local(host_id(self.me), rs.epoch):
            raise NotPrimary(f"volume {self.name}: a newer epoch than {rs.epoch} holds this node's replica")
        timeout = max(1.0, self.lease_ttl / 3)
        for n in rs.nodes:
            if n == self.me:
                continue

            async def address_of(n: str = n) -> str | None:
                return (await self.addresses()).get(n)     # a node not joined yet: unreachable, for now

            self.links[n] = PeerLink(n, address_of, self.name, self.me, rs.epoch, self.local, timeout=timeout,
                                     before_use=functools.partial(self._before_use, n), auth=self.auth)
        # the peers that answer at once get the first writes; the others are recorded out of sync by them. A
        # peer cut off does not answer at all: the new primary does not wait for it (it keeps trying)
        connects = [asyncio.ensure_future(link.connect()) for link in self.links.values()]
        await asyncio.wait(connects, timeout=CONNECT_WAIT)
        for link, task in zip(self.links.values(), connects, strict=True):
            if not task.done():
                link.pending = task         # its keeper adopts it
        hot_entries = await self.store.list(f"{HOT}{self.name}/")
        hot = {r for e in hot_entries for r in e.value.get("regions", ())}
        local = LocalReplica(self.local, self.fence, host_id(self.me), rs.epoch, self.name)
        self.mirror = MirrorLayer(local, me=self.me, view=rs, store=self.store, peers=self.links,
                                  region_size=self.region_size, dirty_dir=self.data_dir, lease=self.keeper,
                                  activity=self.activity, hot=hot, suspend=self.suspend)
        await self.mirror.save_all_dirty()        # the hot regions of out-of-sync peers are on disk now
        self._hot_keys = [e.key for e in hot_entries]
        if self.before_primary is not None:
            await self.before_primary()
        await self.volume.swap(self.mirror)
        self.view = rs
        for link in self.links.values():
            link.start()
        self._set_role("primary", self.me)
        log.warning("volume %s: this node is primary (epoch %d; in sync: %s%s)", self.name, rs.epoch,
                    ", ".join(rs.in_sync), f"; hot regions to copy: {len(hot)}" if hot else "")

    async def _serve_as_primary(self) -> None:
        m, keeper = self.mirror, self.keeper
        assert m is not None and keeper is not None
        lost = (m.fenced or keeper.lost or any(link.fenced for link in self.links.values())
                or not (keeper.held or keeper.clock() < keeper.valid_until + self.suspend))
        if lost:
            log.warning("volume %s: epoch %d is over for this node (%s)", self.name, m.view.epoch,
                        "fenced by a newer epoch" if m.fenced else "its lease was not renewed")
            m.fenced = True
            await self._step_down(planned=False)
            return
        self.view = m.view
        now = time.monotonic()
        if now >= self._hot_checked + 1.0:
            self._hot_checked = now
            await m.add_hot(await self._new_hot())
            try:
                await self._reread()      # a replica that declared itself stale: copied in full
            except NotPrimary:
                return                    # another node was elected: the next turn steps down
        for n in list(m.dirty):
            link = self.links[n]
            task = self.resyncing.get(n)
            if task is not None and task.done():
                del self.resyncing[n]
                with contextlib.suppress(BaseException):
                    task.result()
                task = None
            if task is None and link.dev is not None:
                self.resyncing[n] = asyncio.create_task(m.resync(n, rate=self.resync_rate, more=self._new_hot))
        if not m.dirty and self._hot_keys:
            for k in self._hot_keys:
                with contextlib.suppress(StoreError):
                    await self.store.delete(k)
            self._hot_keys = []
        await asyncio.sleep(0.2)

    async def _before_use(self, node: str) -> None:
        """`node`'s link (re)connected, not used yet: the record read again, and what the peer had not flushed
        before a loss of the link recorded out of sync (mirror.peer_reconnected)."""
        await self._reread()
        if self.mirror is not None:
            await self.mirror.peer_reconnected(node)

    async def _reread(self) -> None:
        """The record again, adopted by the mirror (a peer link about to be used after a (re)connection)."""
        m = self.mirror
        if m is None:                 # still becoming primary: the record was read by the claim just now
            return
        rs = await R.load(self.store, self.name)
        if rs.epoch != m.view.epoch:
            m.fenced = True           # another node was elected: the loop's next turn steps down
            raise NotPrimary(f"volume {self.name}: epoch {m.view.epoch} is over (now {rs.epoch})")
        m.adopt(rs)

    async def _new_hot(self) -> set[int]:
        """Regions of hot sets published since this node looked (a node that restarted after a crash as
        primary publishes its own before it serves its replica: a resync to it sees them before it ends)."""
        entries = await self.store.list(f"{HOT}{self.name}/")
        fresh = [e for e in entries if e.key not in self._hot_keys]
        self._hot_keys += [e.key for e in fresh]
        return {r for e in fresh for r in e.value.get("regions", ())}

    async def _step_down(self, *, planned: bool) -> None:
        """Stop being primary: paths standby first, then drain, publish the hot set, take the mirror off."""
        m = self.mirror
        if m is None and self.keeper is None:
            return
        self._set_role("secondary", None)
        for task in self.resyncing.values():
            task.cancel()
        for task in self.resyncing.values():
            with contextlib.suppress(BaseException):
                await task
        self.resyncing.clear()
        if m is not None:
            if not planned:
                m.fenced = True
            await m.drain()
            if self.activity is not None and not planned:
                hot = self.activity.hot()
                if hot:
                    with contextlib.suppress(StoreError):
                        await self.store.put(f"{HOT}{self.name}/{self.me}", {"regions": sorted(hot)})
            if planned:
                with contextlib.suppress(Exception):
                    await m.flush()
            if self.volume.stack is m and self._standby is not None:
                await self.volume.swap(self._standby)
            self.mirror = None
        for link in self.links.values():
            await link.close()
        self.links.clear()
        if self._keeper_task is not None:
            self._keeper_task.cancel()
            with contextlib.suppress(BaseException):
                await self._keeper_task
            self._keeper_task = None
        if planned and m is not None and self.view is not None and not m.fenced:
            with contextlib.suppress(Exception):
                await R.step_down(self.store, m.view)
        if self._lease is not None:
            # planned or not, nothing is acknowledged under it any more (the mirror is fenced and drained):
            # giving the key back lets another node claim now instead of after the TTL (if the store answers)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.lease_ttl):
                    await self._lease.revoke()
        self._lease = None
        self.keeper = None

    async def force(self) -> dict[str, Any]:
        """No replica in sync: this node's is declared in sync as it is (record.py force_in_sync), to be elected."""
        self.view = await R.force_in_sync(self.store, self.name, self.me)
        log.warning("volume %s: this node's replica was FORCED in sync (epoch %d): writes it missed are lost",
                    self.name, self.view.epoch)
        return self.status()

    async def move_primary(self) -> None:
        """A planned switchover away from this node: drain, give up the epoch; another in-sync node claims it."""
        if self.role != "primary":
            raise R.ReplicationError(f"volume {self.name}: this node is not its primary")
        self._hold_until = time.monotonic() + 2 * self.lease_ttl   # another node claims; this one stands by
        if self._task is not None:           # the loop stops first: one place changes the role at a time
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        try:
            await self._step_down(planned=True)
        finally:
            self.run_loop()

    # ---- what it reports

    def _set_role(self, role: str, primary: str | None) -> None:
        if (role, primary) != (self.role, self.history[-1]["primary"] if self.history else None):
            self.history.append({"role": role, "primary": primary, "time": time.time(),
                                 "epoch": self.view.epoch if self.view else 0})
        self.role = role
        self.paths.set(role, primary)

    def status(self) -> dict[str, Any]:
        v = self.view
        out: dict[str, Any] = {"role": self.role, "nodes": list(self.nodes),
                               "epoch": v.epoch if v else 0, "primary": v.primary if v else None,
                               "in_sync": list(v.in_sync) if v else [], "out_of_sync": dict(v.out_of_sync) if v else {},
                               "fence": {"floor": self.fence.floor, "refused": self.fence.refused}}
        if self.mirror is not None:
            rs = self.mirror.replication_stats()
            out.update(epoch=rs["epoch"], in_sync=rs["in_sync"], primary=self.me)
            out["mirror"] = rs
            out["peers"] = {n: {"connected": link.dev is not None, "address": link.address,
                                "dirty_regions": len(self.mirror.dirty.get(n, ())),
                                "resyncing": n in self.resyncing}
                            for n, link in self.links.items()}
            out["region_size"] = self.region_size
        if self.activity is not None:
            out["activity_log"] = self.activity.stats()
        return out


def all_regions(volume: Volume, region_size: int) -> Iterable[int]:
    return range(-(-volume.num_blocks * volume.block_size // region_size))


def floor_file(data_dir: Path, volume: str) -> FloorFile:
    return FloorFile(data_dir / f"{volume}.floor")
