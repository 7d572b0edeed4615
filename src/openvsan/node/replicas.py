"""The node's replicated volumes ([cluster] and volumes with replicas > 1): the cluster store, the replica
server on the replication portal, one ReplicaController per volume (replication/controller.py), and the
volume's paths on this node (ALUA target port groups of its LUN, ANA groups and controller IDs of the NVMe
subsystems that export it), turned as the controller's role changes.

Identity: every replica node exports the volume as one disk. Its UUID (hence NAA, EUI-64, NGUID and serial)
is the replica set's, in the cluster store, made by the first node that serves it. This node's cluster
member number (cluster/membership.py) is its ALUA target port group and picks its range of NVMe controller
IDs, so the paths of one volume differ on every node."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid as uuidlib
from typing import TYPE_CHECKING, Any

from openvsan.cluster import membership as M
from openvsan.node.specs import ClusterSpec, VolumeSpec
from openvsan.node.store import VolumeIdentity
from openvsan.protocol.nvme import ana
from openvsan.protocol.nvme.auth import HostPolicy, Secret
from openvsan.protocol.nvme.reservations import Reservations
from openvsan.protocol.scsi.alua import AccessState, TargetPortGroup, TargetPortGroups
from openvsan.replication import record as R
from openvsan.replication.controller import Paths, ReplicaController, floor_file
from openvsan.replication.fence import EpochFence
from openvsan.replication.lease import LeaseKeeper
from openvsan.replication.peer import node_nqn, replica_nqn, replication_keys

if TYPE_CHECKING:
    from openvsan.node.node import Node
    from openvsan.node.statestore import Lease, StateStore
    from openvsan.volume import Volume

log = logging.getLogger("openvsan.node")

ETCD_PREFIX = "/openvsan"
REPLICATION_IN_CAPSULE = 1 << 20   # = MDTS (protocol/nvme/identify.py): any write the primary sends fits
CNTLIDS_PER_NODE = 0x0800          # NVMe controller IDs each node hands out (1..0xFFEF in all: 31 nodes)


class SharedState:
    """One reservation state for every node of a replicated volume: SCSI persistent reservations (kind "pr":
    SPC-4 5.13, they are the logical unit's, whichever port a command comes through) or NVMe reservations
    (kind "resv", Base 2.0 §8.19, the namespace's). A reservation command on any node first reads the shared
    state (`/replication/<kind>/<volume>`), then runs, then commits it with a compare-and-swap (a command of
    another node that came first: run again on the new state); on a secondary it completes once the primary,
    the only node doing I/O, confirms it enforces it (`/replication/<kind>-applied/<volume>`)."""

    def __init__(self, store: StateStore, volume: str, kind: str, role: Any) -> None:
        self.store, self.volume, self.role = store, volume, role
        self.key, self.applied_key = f"/replication/{kind}/{volume}", f"/replication/{kind}-applied/{volume}"
        self.revision = 0          # of the state applied here

    async def refresh(self, state: Any) -> bool:
        e = await self.store.get(self.key)
        if e is None or e.revision == self.revision:
            return False
        state.apply_state(e.value)
        self.revision = e.revision
        return True

    async def commit(self, state: dict[str, Any]) -> bool:
        from openvsan.node.statestore import Conflict

        try:
            self.revision = await self.store.put(self.key, state, expect=self.revision)
        except Conflict:
            return False
        if self.role() != "primary" and await self.store.get(R.PRIMARY + self.volume) is not None:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                e = await self.store.get(self.applied_key)
                if e is not None and int(e.value.get("revision", 0)) >= self.revision:
                    break
                await asyncio.sleep(0.02)
            else:
                log.warning("volume %s: the primary did not confirm %s state %d within 2 s", self.volume,
                            self.key, self.revision)
        return True

    async def confirm(self) -> None:
        await self.store.put(self.applied_key, {"revision": self.revision})


def group_of(volume: VolumeSpec, node: str) -> int:
    """`node`'s ALUA target port group for `volume`: its place among the volume's nodes, sorted (every node
    computes the same from its own config, before the others have even joined)."""
    return sorted(volume.nodes).index(node) + 1


class ReplicationSetupError(RuntimeError):
    """str() is one line for the user."""


class NodeReplication:
    def __init__(self, node: Node, cluster: ClusterSpec) -> None:
        self.node = node
        self.spec = cluster
        self.me = node.state.config.node.name
        self.dir = node.data_dir / "replication"
        self.store: StateStore | None = None
        self.members: dict[str, M.Member] = {}
        self.number = 0
        self.auth: tuple[Secret, Secret] | None = None     # the replication path's DH-HMAC-CHAP keys (join)
        self.controllers: dict[str, ReplicaController] = {}
        self.fences: dict[str, EpochFence] = {}
        self.alua: dict[str, TargetPortGroups] = {}
        self.server: Any = None
        self.pr: dict[str, SharedState] = {}         # SCSI PR of each volume's LUN
        self.resv: dict[str, SharedState] = {}       # NVMe reservations of its namespaces
        self.nvme_resv: dict[str, Reservations] = {}  # ... one state for all of them on this node
        self._pr_tasks: dict[str, asyncio.Task[None]] = {}
        self._alive: Lease | None = None
        self._alive_task: asyncio.Task[None] | None = None

    @property
    def volumes(self) -> list[VolumeSpec]:
        return [v for v in self.node.state.config.volumes if v.replicated]

    def open_store(self) -> StateStore:
        from openvsan.cluster.etcd import EtcdStateStore

        return EtcdStateStore(list(self.spec.etcd), prefix=ETCD_PREFIX)

    # ---- before the volumes are opened: the cluster, this node's membership, each volume's identity

    async def join(self) -> dict[str, VolumeIdentity]:
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.store = self.open_store()
        try:
            await M.check(self.store, self.spec.id)
            from openvsan.api.peers import published_api

            me = await M.join(self.store, self.spec.id, self.me, str(self.spec.replication),
                              published_api(self.node.state.config))
            self.auth = replication_keys(await M.secret(self.store, self.spec.id))
        except M.ClusterError as e:
            raise ReplicationSetupError(f"cluster {self.spec.id}: {e}") from None
        except Exception as e:  # noqa: BLE001 - the store unreachable: say which
            raise ReplicationSetupError(f"cluster {self.spec.id}: etcd at {', '.join(self.spec.etcd)}: {e}") from None
        self.number = me.number
        self.members = await M.members(self.store)
        granted_at = time.monotonic()
        self._alive = await self.store.grant_lease(self.spec.lease_ttl)
        self._alive_task = asyncio.create_task(LeaseKeeper(self._alive, granted_at).run())
        await M.announce(self.store, self.me, self._alive, replication=str(self.spec.replication))
        identities: dict[str, VolumeIdentity] = {}
        for v in self.volumes:
            local = self.node.state.identities.get(v.name)
            u = local.uuid if local is not None else uuidlib.uuid4()
            try:
                rs = await R.load(self.store, v.name)
            except R.ReplicationError:
                try:
                    rs = await R.create(self.store, v.name, v.nodes, uuid=str(u))
                except R.ReplicationError:
                    rs = await R.load(self.store, v.name)
            if set(rs.nodes) != set(v.nodes):
                raise ReplicationSetupError(f"volume {v.name}: this node lists replicas on {', '.join(v.nodes)}, the "
                                            f"cluster on {', '.join(rs.nodes)}; give every node the same nodes list")
            shared = uuidlib.UUID(rs.uuid) if rs.uuid else u
            identities[v.name] = VolumeIdentity(shared, shared.hex)
            groups = [TargetPortGroup(group_of(v, n), state=AccessState.STANDBY) for n in v.nodes]
            self.alua[v.name] = TargetPortGroups(groups, default=group_of(v, self.me))
        return identities

    # ---- after the volumes are opened: their controllers, in standby, and the replica server

    async def start(self) -> None:
        from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
        from openvsan.frontend.nvme_tcp import NvmeTcpServer
        from openvsan.volume import Volume

        assert self.store is not None
        subsystems = []
        for v in self.volumes:
            vol = self.node.volumes[v.name]
            floor = floor_file(self.dir, v.name)
            fence = self.fences[v.name] = EpochFence(floor=floor.load(), persist=floor.save)
            c = self.controllers[v.name] = ReplicaController(
                volume=vol, local=vol.stack, me=self.me, nodes=v.nodes, store=self.store,
                addresses=self._addresses, fence=fence, data_dir=self.dir,
                paths=Paths(functools.partial(self.turn_paths, v.name)),
                lease_ttl=self.spec.lease_ttl, suspend=self.spec.suspend_seconds,
                activity=self._activity_log(v.name, vol),
                before_primary=functools.partial(self._pr_catch_up, v.name), persistent=self._persistent(v),
                auth=self.auth)
            self.pr[v.name] = SharedState(self.store, v.name, "pr", lambda c=c: c.role)
            self.resv[v.name] = SharedState(self.store, v.name, "resv", lambda c=c: c.role)
            self.nvme_resv[v.name] = Reservations()
            await c.prepare(str(vol.uuid))          # hot regions published before anyone can resync us
            await c.start()                         # standby under the frontends until elected
            handle = Volume(c.local, name=v.name, uuid=vol.uuid, serial=vol.serial)
            others = [node_nqn(n) for n in v.nodes if n != self.me]
            # only the volume's other nodes, and each must prove it holds the cluster's keys (DH-HMAC-CHAP)
            assert self.auth is not None
            host_key, ctrl_key = self.auth
            subsystems.append(NvmeSubsystemConfig(replica_nqn(v.name), [NvmeNamespaceConfig(1, handle)],
                                                  [(self.spec.replication.host, self.spec.replication.port)],
                                                  allowed_hosts=others, serial=vol.serial[:20],
                                                  model="openvsan replica",
                                                  dhchap_hosts={n: HostPolicy(host_key, ctrl_key) for n in others}))
        if not subsystems:
            return
        # a 1 MiB write in one capsule (no R2T round trip on the replication path; hosts' portals keep 8 KiB)
        self.server = NvmeTcpServer(subsystems, in_capsule=REPLICATION_IN_CAPSULE)
        for v in self.volumes:
            sub = self.server.subsystem(replica_nqn(v.name))
            sub.namespaces[1].reservations = self.fences[v.name]
        await self.server.start()
        log.info("replication: %d replicated volume(s), replicas served on %s (node %s, number %d, cluster %s)",
                 len(subsystems), self.spec.replication, self.me, self.number, self.spec.id)

    def _persistent(self, v: VolumeSpec) -> bool:
        """Whether the volume's data outlives vsan serve: not on a RAM device without a backing file."""
        cfg = self.node.state.config
        names = [str(v.device)] if v.device is not None else list(cfg.pool(str(v.pool)).members)
        return all(not (d.type == "ram" and d.backing is None) for d in (cfg.device(n) for n in names))

    async def force(self, volume: str) -> dict[str, Any]:
        c = self.controllers.get(volume)
        if c is None:
            raise ValueError(f"volume {volume} is not replicated on this node")
        return await c.force()

    def _activity_log(self, name: str, vol: Volume) -> Any:
        try:
            from openvsan.replication.activity import ActivityLog
        except ImportError:       # not built yet: no hot-set tracking (a crashed primary's peer gets a full copy)
            return None
        from openvsan.replication.mirror import DEFAULT_REGION

        regions = -(-vol.num_blocks * vol.block_size // DEFAULT_REGION)
        return ActivityLog(self.dir / f"{name}.al", regions, DEFAULT_REGION)

    def run(self) -> None:
        """Elections start once the frontends serve."""
        for c in self.controllers.values():
            c.run_loop()

    async def _addresses(self) -> dict[str, str]:
        assert self.store is not None
        self.members = await M.members(self.store)
        return {n: m.replication for n, m in self.members.items()}

    # ---- paths

    # ---- persistent reservations, shared

    async def _pr_catch_up(self, volume: str) -> None:
        """Before this node serves I/O as primary: the latest shared reservations are the ones it enforces."""
        await self._follow_once(volume)

    async def _follow_once(self, volume: str) -> None:
        lun = self.node.luns.get(volume)
        if lun is not None:
            async with lun.pr_lock:
                await self.pr[volume].refresh(lun.pr)
            await self.pr[volume].confirm()
        await self.resv[volume].refresh(self.nvme_resv[volume])
        await self.resv[volume].confirm()

    async def _pr_follow(self, volume: str) -> None:
        """While primary: every reservation change another node commits is applied here, then confirmed."""
        await asyncio.gather(self._watch(volume, self.pr[volume].key), self._watch(volume, self.resv[volume].key))

    async def _watch(self, volume: str, key: str) -> None:
        assert self.store is not None
        while True:
            try:
                async for _ in self.store.watch(key):
                    if self.controllers[volume].role == "primary":
                        await self._follow_once(volume)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the store failed: watch again
                log.debug("volume %s: watch of %s: %s", volume, key, e)
                await asyncio.sleep(0.5)

    def turn_paths(self, volume: str, role: str, primary: str | None) -> None:
        """ALUA and ANA states of `volume` on this node after a role change."""
        task = self._pr_tasks.get(volume)
        if role == "primary" and task is None and self.store is not None:
            self._pr_tasks[volume] = asyncio.get_running_loop().create_task(self._pr_follow(volume))
        elif role != "primary" and task is not None:
            task.cancel()
            del self._pr_tasks[volume]
        groups = self.alua.get(volume)
        if groups is not None:
            spec = self.node.state.config.volume(volume)
            groups.set_states({group_of(spec, n): AccessState.ACTIVE_OPTIMIZED if n == primary else AccessState.STANDBY
                               for n in spec.nodes})
        self.turn_nvme(volume, role)

    def turn_nvme(self, volume: str, role: str) -> None:
        server = self.node.nvme_server
        if server is None:
            return
        lo = (self.number - 1) * CNTLIDS_PER_NODE + 1
        for sub in server.fabric.subsystems.values():
            for ns in list(sub.namespaces.values()):
                if ns.volume.name != volume or ns.volume is not self.node.volumes.get(volume):
                    continue
                group = ns.nsid + 1
                if group > ana.ANAGRPMAX:
                    log.error("%s namespace %d: replicated namespaces need NSIDs up to %d (one ANA group each)",
                              sub.nqn, ns.nsid, ana.ANAGRPMAX - 1)
                    continue
                if ns.reservations is not self.nvme_resv[volume]:
                    ns.reservations = self.nvme_resv[volume]    # one state, shared with the other nodes
                    ns.reservation_sync = self.resv[volume]
                if sub.cntlids != (lo, lo + CNTLIDS_PER_NODE - 1):
                    sub.set_cntlid_range(lo, lo + CNTLIDS_PER_NODE - 1)
                sub.set_ana_group(ns.nsid, group)
                sub.set_ana_state(group, ana.OPTIMIZED if role == "primary" else ana.INACCESSIBLE)

    def refresh_paths(self) -> None:
        """After the frontends are built (or changed): every volume's paths as its controller's role says."""
        for name, c in self.controllers.items():
            primary = c.history[-1]["primary"] if c.history else None
            self.turn_paths(name, c.role, primary)

    # ---- status, switchover, stop

    def status(self, volume: str) -> dict[str, Any] | None:
        c = self.controllers.get(volume)
        return c.status() if c is not None else None

    async def move_primary(self, volume: str) -> dict[str, Any]:
        c = self.controllers.get(volume)
        if c is None:
            raise ValueError(f"volume {volume} is not replicated on this node")
        await c.move_primary()
        return c.status()

    async def stop(self) -> None:
        for c in self.controllers.values():
            await c.stop()
        for task in self._pr_tasks.values():
            task.cancel()
        self._pr_tasks.clear()
        if self.server is not None:
            await self.server.stop()
        if self._alive_task is not None:
            self._alive_task.cancel()
            with contextlib.suppress(BaseException):
                await self._alive_task
        if self.store is not None:
            if self._alive is not None:
                with contextlib.suppress(Exception):   # the store gone: the lease expires by itself
                    await self._alive.revoke()
            await self.store.close()

