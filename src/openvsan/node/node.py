"""The node daemon: desired state (from the store) -> devices -> volumes -> exports -> servers.

Volumes are exported as LUNs of iSCSI targets, namespaces of NVMe/TCP subsystems and NBD exports; one
volume may be all three at once. Assembly is a chain of small factories so each step can be replaced
(later layers: thin volumes, caches) and so tests can assemble a node around stand-ins of the protocol
layers. Pools, between the devices and the volumes, are node/pools.py's (`ServedPools`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import hashlib
import importlib
import logging
import os
import signal
import socket
import struct
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from openvsan.block import BlockDevice, FileDevice, NullDevice, RamDevice
from openvsan.frontend.busypoll import BusyPoll
from openvsan.frontend.limits import ConnectionLimits, soft_fd_limit
from openvsan.malloc import keep_large_buffers
from openvsan.node.control import ControlServer, RequestError, check_revision, socket_path
from openvsan.node.groups import GroupSetupError, ServedGroups, home_of, snapshot_command
from openvsan.node.plane import DataPlane
from openvsan.node.pools import PoolSetupError, ServedPools, flush_and_close, why
from openvsan.node.reconcile import Change, plan
from openvsan.node.specs import DeviceSpec, NbdExportSpec, NodeConfig, SubsystemSpec, TargetSpec, VolumeSpec
from openvsan.node.store import StoredState, VolumeIdentity, import_desired
from openvsan.node.values import format_size
from openvsan.protocol.auth_throttle import AuthThrottle
from openvsan.volume import Volume
from openvsan.volume.registry import open_stack

log = logging.getLogger("openvsan.node")
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, tcpi_bytes_received (u64) at byte 120, then tcpi_segs_out,
# tcpi_segs_in (u32); the kernel fills what it has of the length asked
_TCP_INFO_LEN = 144
_TCP_COUNTERS = struct.Struct("=QQII")
LOGIN_WAIT = 2.0   # seconds a move waits for iSCSI logins under way to its targets to finish (_release_to)


class NodeError(RuntimeError):
    """The node cannot be assembled or served; str() is one line for the user."""


def os_error_line(e: OSError) -> str:
    """The one line `vsan serve` ends with for an OSError while starting (binding a portal, which names the
    address in its message, or making the data dir), in one process or in a worker (node/worker.py)."""
    if e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


def open_device(spec: DeviceSpec, *, trust_foreign: bool = False, memfd: int | None = None) -> BlockDevice:
    """Open a config device. Its file (or RAM backing) must not be a symlink, another user's, or writable by
    others, unless `trust_foreign` ([node] trust_foreign_files): block/file.py open_backing. `memfd`: a RAM
    device's memory, kept by a worker's supervisor (node/workers.py) so it outlives the worker."""
    if spec.type == "ram":
        assert spec.size is not None
        return RamDevice(spec.size // spec.block_size, spec.block_size,
                         backing=str(spec.backing) if spec.backing else None, name=spec.name,
                         trust_foreign=trust_foreign, memfd=None if spec.backing else memfd)
    if spec.type == "file":
        assert spec.path is not None
        return FileDevice(spec.path, size=spec.size, block_size=spec.block_size, direct=spec.direct, name=spec.name,
                          trust_foreign=trust_foreign)
    if spec.type == "null":
        assert spec.size is not None
        return NullDevice(spec.size // spec.block_size, spec.block_size, name=spec.name)
    raise NodeError(f"device {spec.name}: unknown type {spec.type!r}")


async def open_volume(spec: VolumeSpec, device: BlockDevice, identity: VolumeIdentity) -> Volume:
    """The volume's handle over its stack: the layers its spec names (crypt, QoS) over its device or pool
    (volume/registry.py; an encrypted volume's container is unlocked here)."""
    from openvsan.volume.compress import CompressError
    from openvsan.volume.crypt import CryptError

    try:
        stack = await open_stack(device, spec.layers, name=spec.name)
    except (CryptError, CompressError) as e:
        raise NodeError(str(e)) from None
    return Volume(stack, name=spec.name, uuid=identity.uuid, serial=identity.serial)


@dataclass
class Factories:
    """How the node builds the protocol objects; defaults are the real SCSI, iSCSI, NVMe/TCP and NBD layers."""

    lun: Callable[..., Any]
    scsi_target: Callable[[str, dict[int, Any]], Any]
    target_config: Callable[..., Any]
    chap: Callable[[str, str], Any]
    server: Callable[[list[Any]], Any]
    # None: the real one, imported when the config asks for it (NVMe/TCP only with an [nvme] section)
    nvme_server: Callable[..., Any] | None = None
    nbd_server: Callable[[list[Any]], Any] | None = None
    api: bool = False       # serve the REST API ([api]); the real node's default() does, stand-ins in tests do not

    @classmethod
    def default(cls) -> Factories:
        # imported here: the node module stays importable (and testable) on its own
        try:
            from openvsan.frontend.config import ChapCredential, IscsiTargetConfig
            from openvsan.frontend.iscsi import IscsiServer
            from openvsan.frontend.nbd import NbdServer
            from openvsan.protocol.scsi import Lun, ScsiTarget
        except ImportError as e:
            raise NodeError(f"this build cannot serve iSCSI and NBD: {e}") from e
        return cls(Lun, ScsiTarget, IscsiTargetConfig, ChapCredential, IscsiServer, nbd_server=NbdServer, api=True)


def _real_nvme_server() -> Callable[..., Any]:
    # by name, at run time: the NVMe/TCP target is optional for a node whose config has no [nvme] section
    try:
        module = importlib.import_module("openvsan.frontend.nvme_tcp")
    except ImportError as e:
        raise NodeError(f"this build cannot serve NVMe/TCP ({e}); remove the [nvme] section from the config or "
                        "install an openvsan with openvsan.frontend.nvme_tcp") from e
    server: Callable[..., Any] | None = getattr(module, "NvmeTcpServer", None)
    if server is None:
        raise NodeError("this build cannot serve NVMe/TCP (openvsan.frontend.nvme_tcp has no NvmeTcpServer); remove "
                        "the [nvme] section from the config")
    return server


def _real_nbd_server() -> Callable[[list[Any]], Any]:
    from openvsan.frontend.nbd import NbdServer
    return NbdServer


def subsystem_serial(nqn: str) -> str:
    """A controller serial (Identify Controller SN, 20 ASCII bytes) that stays the same across restarts."""
    return hashlib.sha256(nqn.encode()).hexdigest()[:20]


@dataclass
class Node:
    state: StoredState
    data_dir: Path
    factories: Factories | None = None
    devices: dict[str, BlockDevice] = field(default_factory=dict)
    volumes: dict[str, Volume] = field(default_factory=dict)
    luns: dict[str, Any] = field(default_factory=dict)       # volume name -> Lun (shared by its targets)
    targets: list[Any] = field(default_factory=list)         # IscsiTargetConfig
    server: Any = None                                       # the iSCSI server
    subsystems: list[Any] = field(default_factory=list)      # NvmeSubsystemConfig
    nvme_server: Any = None
    nbd_exports: list[Any] = field(default_factory=list)     # NbdExportConfig
    nbd_server: Any = None
    pools: ServedPools = field(init=False)                   # pool name -> ServedPool (node/pools.py)
    groups: ServedGroups = field(init=False)                 # volume groups: "device X" / "pool X" (groups.py)
    plane: DataPlane = field(init=False)                     # the owner of the above, driven by changes
    control_server: ControlServer | None = None
    api_server: Any = None                                   # api/server.py ApiServer (a node in one process)
    events: Any = None                                       # node/events.py EventLog (a node in one process)
    busy_poll: BusyPoll | None = None
    limits: ConnectionLimits | None = None                   # one for all three servers (frontend/limits.py)
    auth_throttle: AuthThrottle | None = None                # failed logins per (initiator, address)
    replication: Any = None                                  # node/replicas.py NodeReplication with [cluster]
    worker: Any = None                                       # node/workers.py WorkerRole: one of several processes

    def __post_init__(self) -> None:
        self.pools = ServedPools(self.state, self.data_dir, self.devices)
        self.groups = ServedGroups()
        self.plane = DataPlane(self)
        self._applying = asyncio.Lock()
        self._parked: list[Any] | None = None   # connections handed here while volumes move here (worker.expect)
        self._incoming_luns: dict[str, Any] = {}  # volume -> its LU's state from the worker it moved from

    async def start(self) -> None:
        cfg = self.state.config
        f = self.factories = self.factories or Factories.default()
        try:
            # before any device is opened: a build without NVMe/TCP fails at once, touching nothing
            nvme_factory = (f.nvme_server or _real_nvme_server()) if cfg.nvme is not None else None
            for spec in cfg.devices:
                try:
                    self.devices[spec.name] = open_device(spec, trust_foreign=cfg.node.trust_foreign_files,
                                                          memfd=self.memfd(spec.name))
                except (OSError, ValueError) as e:
                    user = cfg.device_user(spec.name)
                    if user is None or not user.startswith("pool "):
                        raise NodeError(f"device {spec.name}: {why(e)}") from e
                    # a pool member that cannot be opened is a missing member: the pool decides if it can go on
                    log.error("device %s (%s): cannot open it: %s", spec.name, user, why(e))
            try:
                await self.pools.assemble()
            except PoolSetupError as e:
                raise NodeError(str(e)) from None
            shared: dict[str, VolumeIdentity] = {}
            if cfg.cluster is not None:
                # the cluster first: a replicated volume's identity is the replica set's, on every node
                from openvsan.node.replicas import NodeReplication, ReplicationSetupError

                self.replication = NodeReplication(self, cfg.cluster)
                try:
                    shared = await self.replication.join()
                except ReplicationSetupError as e:
                    raise NodeError(str(e)) from None
            try:
                await self.groups.open(cfg, self.base_of)
                for vspec in cfg.volumes:
                    base = await self.volume_base(vspec)
                    identity = shared.get(vspec.name) or self.state.identities[vspec.name]
                    self.volumes[vspec.name] = await open_volume(vspec, base, identity)
            except GroupSetupError as e:
                raise NodeError(str(e)) from None
            if self.replication is not None:
                await self.replication.start()      # replicas standby, then served to the primary
            (self.data_dir / "pr").mkdir(mode=0o700, exist_ok=True)
            for t in cfg.targets:
                self.targets.append(self.build_target(t))
            # one poller for the loop: a command on any connection keeps every connection's sockets watched
            self.busy_poll = (BusyPoll(cfg.node.poll_us, max_window_us=cfg.node.poll_max_us) if cfg.node.poll_us
                              else None)
            # one set of caps for every protocol: a flood counts the same whichever portal it comes to
            self.limits = ConnectionLimits(cfg.node.max_connections, cfg.node.max_unauthenticated,
                                           cfg.node.max_unauthenticated_per_source, fd_limit=soft_fd_limit())
            self.targets.extend(self._shells(TargetSpec))
            self.server = f.server(self.targets)
            self.server.busy_poll = self.busy_poll
            self.server.exchange = self._exchange()
            if self.worker is not None:
                # TSIHs unique across the node's workers, so a session keeps its own when its volume moves
                self.server.tsih_stride, self.server.tsih_offset = self.worker.placement.workers, self.worker.index
            # failed CHAP (and DH-HMAC-CHAP) logins: a doubling delay, then a lockout (protocol/auth_throttle.py)
            self.auth_throttle = AuthThrottle(delay_max=cfg.node.auth_delay_max,
                                              lockout_failures=cfg.node.auth_lockout_failures,
                                              lockout_seconds=cfg.node.auth_lockout_seconds)
            self.server.auth_throttle = self.auth_throttle
            self.server.limits = self.limits
            await self.server.start()
            if cfg.nvme is not None:
                await self.start_nvme([self.build_subsystem(sub) for sub in cfg.nvme.subsystems]
                                      + self._shells(SubsystemSpec), nvme_factory)
            nbd = self._nbd_in_order()
            if nbd:
                await self.start_nbd(nbd)
            if self.worker is None:
                from openvsan.node.events import EventLog

                self.events = EventLog(self.data_dir)
                self.control_server = ControlServer(socket_path(self.data_dir), self.events.wrap(self.control))
            else:
                from openvsan.node.workers import worker_socket_path

                self.control_server = ControlServer(worker_socket_path(self.data_dir, self.worker.index),
                                                    self.worker_control)
                self.worker.exchange.watch(self._arrived, self._told)
            await self.control_server.start()
            if self.worker is None and f.api:
                await self._start_api()
            if self.events is not None:
                self.events.watch(self.events.wrap(self.control))
            self.pools.start_meter()
            self.groups.start_watch(self._soft_threshold)
            if self.replication is not None:
                self.replication.refresh_paths()
                self.replication.run()
        except BaseException:
            if self.replication is not None:
                await self.replication.stop()
            await self._stop_servers()
            await self.close_devices()
            raise
        for t in cfg.targets:
            where = ", ".join(str(p) for p in t.portals)
            for lun in t.luns:
                dev = self.volumes[lun.volume]
                log.info("serving %s LUN %d (%s, %s%s) on %s", t.iqn, lun.lun, lun.volume,
                         format_size(dev.num_blocks * dev.block_size),
                         ", read-only" if cfg.volume(lun.volume).read_only else "", where)
            auth = ("mutual CHAP" if t.mutual_chap else "CHAP") if t.chap else "no authentication"
            acl = ("any initiator" if t.allowed_initiators is None
                   else f"{len(t.allowed_initiators)} allowed initiator(s)")
            log.info("%s: %s, %s", t.iqn, auth, acl)
        for sub in cfg.subsystems:
            where = ", ".join(str(p) for p in sub.portals)
            for ns in sub.namespaces:
                dev = self.volumes[ns.volume]
                log.info("serving %s namespace %d (%s, %s%s) on %s", sub.nqn, ns.nsid, ns.volume,
                         format_size(dev.num_blocks * dev.block_size),
                         ", read-only" if cfg.volume(ns.volume).read_only else "", where)
            if sub.hosts:
                both = sum(1 for h in sub.hosts if h.dhchap_ctrl_secret)
                others = len(set(sub.allowed_hosts or ()) - {h.nqn for h in sub.hosts})
                acl = (f"DH-HMAC-CHAP for {len(sub.hosts)} host(s) ({both} bidirectional; "
                       f"{', '.join(sub.dhchap_hashes)}; {', '.join(sub.dhchap_dhgroups)})"
                       + (f", {others} allowed host(s) without authentication" if others else ""))
            else:
                acl = "any host" if sub.allowed_hosts is None else f"{len(sub.allowed_hosts)} allowed host(s)"
            log.info("%s: %s", sub.nqn, acl)
        for x in cfg.nbd_exports:
            dev = self.volumes[x.volume]
            log.info("serving NBD export %s (%s, %s%s%s) on %s", x.name, x.volume,
                     format_size(dev.num_blocks * dev.block_size),
                     ", read-only" if x.read_only or cfg.volume(x.volume).read_only else "",
                     {"off": "", "optional": ", TLS optional", "require": ", TLS required"}.get(x.tls, ""),
                     ", ".join(str(p) for p in x.portals))
        log.info("adaptive polling: %s", (f"{cfg.node.poll_us} µs window after each command"
                                           + (f", up to {cfg.node.poll_max_us} µs learned from the gaps between "
                                              "commands" if cfg.node.poll_max_us > cfg.node.poll_us else ""))
                 if cfg.node.poll_us else "off (poll_us = 0)")
        log.info("connection limits: %d in all, %d not logged in, %d not logged in from one address",
                 cfg.node.max_connections, cfg.node.max_unauthenticated, cfg.node.max_unauthenticated_per_source)
        if not cfg.exports_anything():
            log.warning("no iSCSI targets, NVMe subsystems or NBD exports are configured; nothing is exported")

    def base_of(self, where: str) -> BlockDevice:
        """"device X" / "pool X": the device or pool itself."""
        kind, name = where.split(" ", 1)
        return self.pools[name].pool if kind == "pool" else self.devices[name]

    async def volume_base(self, spec: VolumeSpec) -> BlockDevice:
        """What a volume's stack stands on: its device or pool, or its place in their volume group (carved)."""
        if spec.carved:
            return await self.groups.volume(spec, self.plane.config)
        return self.base_of(home_of(spec))

    async def start_nvme(self, subsystems: list[Any], factory: Callable[..., Any] | None = None) -> None:
        """Start the NVMe/TCP server (at start, or when a running node gets its first subsystem: then the
        discovery portals are those of the state being applied)."""
        cfg = self.plane.config
        self.subsystems = subsystems
        factory = factory or (self.factories.nvme_server if self.factories else None) or _real_nvme_server()
        discovery = [(p.host, p.port) for p in cfg.nvme.portals] if cfg.nvme is not None else []
        self.nvme_server = factory(self.subsystems, discovery_portals=discovery or None)
        self.nvme_server.busy_poll = self.busy_poll
        self.nvme_server.exchange = self._exchange()
        self.nvme_server.limits = self.limits
        self.nvme_server.auth_throttle = self.auth_throttle   # failed DH-HMAC-CHAP, as for CHAP
        await self.nvme_server.start()

    async def start_nbd(self, exports: list[Any]) -> None:
        """Start the NBD server (at start, or when a running node gets its first export)."""
        self.nbd_exports = exports
        factory = (self.factories.nbd_server if self.factories else None) or _real_nbd_server()
        self.nbd_server = factory(self.nbd_exports, **self._nbd_tls())
        self.nbd_server.busy_poll = self.busy_poll
        self.nbd_server.exchange = self._exchange()
        if self.worker is not None and self.worker.index != 0 and self.state.config.nbd_tls is not None:
            self.nbd_server.tls_worker = 0   # with NBD over TLS, worker 0 serves every NBD export (workers.py)
        self.nbd_server.limits = self.limits
        await self.nbd_server.start()

    # ---- a worker of several (node/workers.py): what the others serve, and connections they hand over

    def memfd(self, device: str) -> int | None:
        """A worker's RAM device's memory, made and kept by the supervisor (None: make one here)."""
        return self.worker.memfds.get(device) if self.worker is not None else None

    def _exchange(self) -> Any:
        return self.worker.exchange if self.worker is not None else None

    def _shells(self, kind: type) -> list[Any]:
        """The iSCSI targets or NVMe subsystems other workers serve: named in discovery, handed over at login
        or Connect (frontend/handoff.py); no LUNs or namespaces here."""
        role = self.worker
        if role is None:
            return []
        out: list[Any] = []
        if kind is TargetSpec:
            for t in role.whole.targets:
                w = role.placement.targets[t.iqn]
                if w != role.index:
                    out.append(self.build_target(t, elsewhere=w))
        else:
            from openvsan.frontend.config import NvmeSubsystemConfig

            for sub in role.whole.subsystems:
                w = role.placement.subsystems[sub.nqn]
                if w != role.index:
                    out.append(NvmeSubsystemConfig(
                        sub.nqn, [], [(p.host, p.port) for p in sub.portals],
                        advertised_portals=[(p.host, p.port) for p in sub.advertised_portals],
                        allowed_hosts=list(sub.allowed_hosts) if sub.allowed_hosts is not None else None,
                        serial=sub.serial or subsystem_serial(sub.nqn), model=sub.model,
                        dhchap_hosts=self._dhchap_hosts(sub), elsewhere=w))
        return out

    def _nbd_in_order(self) -> list[Any]:
        """This node's NBD exports in config order (the first is the default export), those of other
        workers as shells."""
        role = self.worker
        if role is None:
            return [self.build_nbd_export(e) for e in self.state.config.nbd_exports]

        return [self.build_nbd_export(e) if role.placement.nbd[e.name] == role.index else self._nbd_shell(e)
                for e in role.whole.nbd_exports]

    def _nbd_shell(self, e: NbdExportSpec) -> Any:
        """An NBD export another worker serves: listed and described here, handed over at NBD_OPT_GO."""
        from openvsan.frontend.config import NbdExportConfig

        role = self.worker
        return NbdExportConfig(e.name, None, [(p.host, p.port) for p in e.portals],
                               read_only=e.read_only or role.whole.volume(e.volume).read_only,
                               description=e.description or f"openvsan volume {e.volume}",
                               tls=e.tls, elsewhere=role.placement.nbd[e.name])

    async def worker_control(self, cmd: str, args: dict[str, Any]) -> Any:
        """A worker's control socket: what its supervisor asks (node/workers.py Supervisor)."""

        if cmd == "worker.metrics":
            return self.plane.metrics()
        if cmd == "worker.sessions":
            from openvsan.node.sessions import connections

            return connections(self)
        if cmd == "worker.stats":
            return self.plane.stats(str(args["name"]))
        if cmd == "worker.geometry":
            return self.geometry()
        if cmd == "worker.pool":
            return self._with_groups(str(args["command"]), await self.pools.control(str(args["command"]),
                                                                                   dict(args["args"])))
        if cmd == "worker.snapshot":
            return await snapshot_command(self, str(args["command"]), dict(args["args"]))
        if cmd == "worker.live":
            from openvsan.node import live
            from openvsan.node.workers import OWNER_COMMANDS

            name = str(args["command"])
            if name not in OWNER_COMMANDS:
                raise RequestError(f"{name} is the supervisor's to answer")
            return await live.COMMANDS[name](self, dict(args["args"]))
        if cmd == "worker.load":
            return [self._activity({str(v) for v in g}) for g in args.get("groups") or []]
        if cmd == "worker.expect":
            return self._expect_move([str(n) for n in args.get("memfds") or []],
                                     {str(v) for v in args.get("volumes") or []})
        if cmd == "worker.release":
            return await self._release(args)
        if cmd != "worker.apply":
            raise RequestError(f"unknown worker command {cmd!r}")
        changes = await self._apply_part(args)
        if args.get("unpark"):
            self._unpark()
        return [str(c) for c in changes]

    async def _apply_part(self, args: dict[str, Any]) -> list[Any]:
        """worker.apply: this worker's new part of the desired state, the whole and the placement."""
        from openvsan.node.config import parse_config
        from openvsan.node.workers import placement_from

        role = self.worker
        part = parse_config(args["config"], data_dir=self.data_dir)
        whole = parse_config(args["whole"], data_dir=self.data_dir)
        for name, (u, serial) in dict(args.get("identities") or {}).items():
            self.state.identities[name] = VolumeIdentity(uuidlib.UUID(u), serial)
        self._incoming_luns = dict(args.get("luns") or {})
        old_whole, old_placement = role.whole, role.placement
        role.whole, role.placement = whole, placement_from(args["placement"])
        try:
            await self.sync_shells(old_whole, old_placement, up=False)   # what comes here is served below
            changes = await self.apply(part, forget=tuple(args.get("forget") or ()))
        except Exception:
            role.whole, role.placement = old_whole, old_placement
            await self.sync_shells(whole, placement_from(args["placement"]))   # the shells taken down, back
            raise
        await self.sync_shells(old_whole, old_placement, down=False)   # what went from here: shells now
        for nqn, namespaces in dict(args.get("nvme") or {}).items():
            # reservations of subsystems that moved here with their volumes
            sub = self.nvme_server.fabric.subsystems.get(nqn) if self.nvme_server is not None else None
            for nsid, state in namespaces.items():
                ns = sub.namespaces.get(int(nsid)) if sub is not None else None
                if ns is not None:
                    ns.reservations.apply_state(state)
        return changes

    # ---- moving volumes between workers (node/workers.py Supervisor.move)

    def _expect_move(self, memfds: list[str], group: set[str]) -> dict[str, Any]:
        """Volumes are about to move here: connections handed here wait (parked) until this worker serves
        them (worker.apply with unpark), and so do new ones that name what exports them (sent to this
        worker's own inbox: _moving). The RAM devices' memory the supervisor sent is in the inbox."""
        self.worker.exchange.poll()
        missing = [n for n in memfds if n not in self.worker.memfds]
        if missing:
            raise RequestError(f"the memory of RAM devices {', '.join(missing)} did not arrive")
        if self._parked is None:
            self._parked = []
        self._moving(group, self.worker.index)
        return {"parked": len(self._parked)}

    def _unpark(self) -> None:
        self._moving(set(), None)     # served here now (or back where they were): names mean what they say
        parked, self._parked = self._parked, None
        for a in parked or []:
            self._arrived(a)

    def _names(self, group: set[str]) -> tuple[set[str], set[str], set[str]]:
        """The iSCSI targets, NVMe subsystems and NBD exports that export volumes of `group`."""
        whole = self.worker.whole
        return ({t.iqn for t in whole.targets if any(x.volume in group for x in t.luns)},
                {x.nqn for x in whole.subsystems if any(ns.volume in group for ns in x.namespaces)},
                {e.name for e in whole.nbd_exports if e.volume in group})

    def _moving(self, group: set[str], to: int | None) -> None:
        """While the volumes of `group` move to worker `to` (None: no move), a new connection naming what
        exports them goes to `to` at once, where it waits until they are served: on the worker they leave,
        from before their connections are suspended until the shells are up; on the one they come to, from
        worker.expect until it serves them. So no connection finds the name unknown in between."""
        iqns, nqns, names = self._names(group)
        for server, these in ((self.server, iqns), (self.nvme_server, nqns), (self.nbd_server, names)):
            if server is not None:
                server.moving.clear()
                if to is not None:
                    server.moving.update(dict.fromkeys(these, to))

    def _activity(self, group: set[str]) -> float:
        """What the connections to the volumes of `group` moved so far, from the kernel's TCP counters
        (segments in and out, plus bytes in and out per 64 KiB): a load measure that costs the data path
        nothing (Supervisor.sample_load)."""
        total = 0.0
        for c in self._moving_connections(group, close_logins=False):
            sock = c.transport.get_extra_info("socket") if c.transport is not None else None
            if sock is None:
                continue
            try:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            except OSError:
                continue
            if len(info) >= _TCP_INFO_LEN:
                acked, received, segs_out, segs_in = _TCP_COUNTERS.unpack_from(info, 120)
                total += segs_out + segs_in + (acked + received) / 65536
        return total

    def _moving_connections(self, group: set[str], *, close_logins: bool = True) -> list[Any]:
        """The connections to what exports the volumes of `group`: NBD connections, iSCSI sessions, NVMe
        queues. iSCSI connections still logging in to a target of the group are closed (they log in again,
        and reach the new worker)."""
        iqns, nqns, names = self._names(group)
        conns: list[Any] = []
        if self.nbd_server is not None:
            conns += [c for c in self.nbd_server.connections if getattr(c, "export", None) is not None
                      and c.export.name in names]
        if self.server is not None:
            for c in list(self.server.connections):
                s = c.session
                if s is not None and s.target is not None and s.target.iqn in iqns:
                    conns.append(c)
                elif close_logins and c.logging_in_to() in iqns:
                    c.dropped("logging in to a target that moves to another worker; it logs in again there")
                    c.close()
        if self.nvme_server is not None:
            # a queue not connected yet goes where its Connect names: to the new worker once the shells say so
            conns += [c for c in self.nvme_server.connections if c.ctrl is not None and c.ctrl.subsystem.nqn in nqns]
        return conns

    async def _release(self, args: dict[str, Any]) -> dict[str, Any]:
        """worker.release: let the volumes of a group go to worker `to`. Their NBD connections are suspended
        (reading stops, what they started finishes), this worker applies its new part (the volumes closed,
        their exports now shells of `to`'s), and each connection goes to `to` with its state, where it goes on
        (the client sees a pause). If applying fails, the connections go on here and nothing moved."""
        group = {str(v) for v in args["volumes"]}
        to = int(args["to"])
        self._moving(group, to)
        try:
            return await self._release_to(group, to, args)
        finally:
            self._moving(set(), None)   # served by `to` now, and a shell here says so (or back: still here)

    async def _release_to(self, group: set[str], to: int, args: dict[str, Any]) -> dict[str, Any]:
        # an iSCSI login to one of the group's targets that is under way here cannot be suspended half done:
        # let it finish (new ones go to `to` meanwhile: _moving), so its session moves with the others; one
        # that takes longer than LOGIN_WAIT is closed below and logs in again
        iqns = self._names(group)[0]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOGIN_WAIT
        while (self.server is not None and loop.time() < deadline
               and any(c.logging_in_to() in iqns for c in self.server.connections)):
            await asyncio.sleep(0.002)
        conns = self._moving_connections(group)
        results = await asyncio.gather(*(c.suspend() for c in conns))
        moving = []
        failed_ctrls = {id(c.ctrl): c.ctrl for c, r in zip(conns, results, strict=True)
                        if r is None and getattr(c, "ctrl", None) is not None}
        for c, r in zip(conns, results, strict=True):
            if r is None or id(getattr(c, "ctrl", None)) in failed_ctrls:
                c.dropped("could not be suspended to move with its volume")
                c.close()
            else:
                moving.append((c, *r))
        for ctrl in failed_ctrls.values():
            # an NVMe controller moves whole or not at all: its other queues go too, and the host reconnects
            self.nvme_server.drop_controller(ctrl, "a queue of it could not be suspended to move")
        for c, state, _ in moving:
            if state.get("qid") == 0 and "cntlid" in state:
                state["controller"] = c.ctrl.moving_state()   # once every queue of it has stopped
        # admin queues first: each brings its controller, which the I/O queues then join
        moving.sort(key=lambda m: 0 if m[1].get("qid") == 0 else 1)
        # what the LUs hold for their nexuses (reservations, unit attentions...), for the worker taking them
        luns = {v: self.luns[v].moving_state() for v in sorted(group) if v in self.luns}
        nvme = {}
        if self.nvme_server is not None:
            for x in self.worker.whole.subsystems:
                sub = self.nvme_server.fabric.subsystems.get(x.nqn)
                if sub is not None and sub.elsewhere is None and any(ns.volume in group for ns in x.namespaces):
                    nvme[x.nqn] = {str(nsid): ns.reservations.state() for nsid, ns in sub.namespaces.items()}
        for c, _, _ in moving:
            c.detach_for_move()     # not closed with its export or its target below
        try:
            await self._apply_part(args)
        except Exception:
            for c, state, received in moving:
                c.reattach()
                c.resume_here(state, received)
            raise
        moved = sum(c.hand_over(self.worker.exchange, to, state, received) for c, state, received in moving)
        log.info("volumes %s moved to worker %d with %d connection(s)", ", ".join(sorted(group)), to, moved)
        return {"connections": moved, "closed": len(conns) - moved, "luns": luns, "nvme": nvme}

    async def sync_shells(self, old_whole: NodeConfig, old_placement: Any, *, down: bool = True,
                          up: bool = True) -> None:
        """After a change: the targets, subsystems and NBD exports other workers serve, as they are now (those
        that went or changed are taken down, those that came or changed are put up). In two steps around a
        change that moves volumes (down before: what comes here is a shell until then; up after: what went
        from here is served until then). Only shells are taken down and only what is not served is put up, so
        running it again after a change that failed puts back what was there."""
        role = self.worker
        assert role is not None

        def others(cfg: NodeConfig, where: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
            return ({t.iqn: (t, where.targets[t.iqn]) for t in cfg.targets if where.targets[t.iqn] != role.index},
                    {x.nqn: (x, where.subsystems[x.nqn]) for x in cfg.subsystems
                     if where.subsystems[x.nqn] != role.index},
                    {e.name: (e, where.nbd[e.name]) for e in cfg.nbd_exports if where.nbd[e.name] != role.index})

        old = others(old_whole, old_placement)
        new = others(role.whole, role.placement)
        gone = [[k for k, v in o.items() if n.get(k) != v] for o, n in zip(old, new, strict=True)] if down else [[]] * 3
        came = [{k for k, v in n.items() if o.get(k) != v} for o, n in zip(old, new, strict=True)] if up else [set()] * 3
        if self.server is not None:
            for iqn in gone[0]:
                if getattr(self.server.targets.get(iqn), "elsewhere", None) is not None:
                    await self.server.remove_target(iqn)
            for t in self._shells(TargetSpec):
                if t.iqn in came[0] and t.iqn not in self.server.targets:
                    await self.server.add_target(t)
        if came[1] and self.nvme_server is None:
            await self.start_nvme([])
        if self.nvme_server is not None:
            shells = {c.nqn for c in self.nvme_server.configs if c.elsewhere is not None}
            for nqn in gone[1]:
                if nqn in shells:
                    await self.nvme_server.remove_subsystem(nqn)
            for c in self._shells(SubsystemSpec):
                if c.nqn in came[1] and c.nqn not in self.nvme_server.fabric.subsystems:
                    await self.nvme_server.add_subsystem(c)
        if came[2] and self.nbd_server is None:
            await self.start_nbd([])
        if self.nbd_server is not None:
            for name in gone[2]:
                if getattr(self.nbd_server.exports.get(name), "elsewhere", None) is not None:
                    await self.nbd_server.remove_export(name)
            for spec in role.whole.nbd_exports:
                if spec.name in came[2] and spec.name not in self.nbd_server.exports:
                    await self.nbd_server.add_export(self._nbd_shell(spec))
            # config order again (the first is the default export, which a client naming none gets)
            ex = self.nbd_server.exports
            order = [e.name for e in role.whole.nbd_exports if e.name in ex]
            kept = {n: ex[n] for n in [*order, *(n for n in ex if n not in order)]}
            ex.clear()
            ex.update(kept)

    def _arrived(self, a: Any) -> None:
        """A connection another worker handed over: to this worker's server of its protocol (or parked while
        volumes move here: worker.expect)."""
        if self._parked is not None:
            self._parked.append(a)
            return
        server = {s.kind: s for s in self._servers()}.get(a.kind)
        if server is None:
            a.sock.close()
            log.error("a %s connection was handed over, but this worker serves no %s", a.kind, a.kind)
            return
        server.adopt(a)

    def _told(self, note: dict[str, Any]) -> None:
        """A note from the supervisor: {"nbd": {export: [blocks, block size]}} for exports other workers serve,
        so NBD_OPT_INFO about them is answered here (node/workers.py)."""
        fds = note.get("fds")
        if isinstance(fds, list) and self.worker is not None:
            # the memory of RAM devices about to move here (Supervisor.move), in the order named
            for name, fd in zip(note.get("memfds") or [], fds, strict=False):
                old = self.worker.memfds.get(name)
                if old is not None and old != fd:
                    os.close(old)
                self.worker.memfds[str(name)] = fd
            return
        geometry = note.get("nbd")
        if isinstance(geometry, dict) and self.nbd_server is not None:
            for e in self.nbd_server.exports.values():
                g = geometry.get(e.name)
                if e.elsewhere is not None and isinstance(g, list) and len(g) == 2:
                    e.geometry = (int(g[0]), int(g[1]))

    def geometry(self) -> dict[str, list[int]]:
        """Blocks and block size of each volume this node (worker) serves."""
        return {name: [v.num_blocks, v.block_size] for name, v in self.volumes.items()}

    def _volume_spec(self, name: str) -> VolumeSpec:
        return self.plane.config.volume(name)

    def lun_for(self, volume: str) -> Any:
        """The one SCSI logical unit of a volume, shared by every target that exports it (one PR state)."""
        if volume not in self.luns:
            f = self.factories or Factories.default()
            self.luns[volume] = f.lun(self.volumes[volume], read_only=self._volume_spec(volume).read_only,
                                      pr_state_path=self.data_dir / "pr" / f"{volume}.json")
            moved = self._incoming_luns.pop(volume, None)
            if moved is not None and hasattr(self.luns[volume], "take_state"):
                self.luns[volume].take_state(moved)    # it moved here from another worker with its sessions
            groups = self.replication.alua.get(volume) if self.replication is not None else None
            if groups is not None and hasattr(self.luns[volume], "set_alua"):
                self.luns[volume].set_alua(groups)   # one target port group per replica node
                self.luns[volume].pr_sync = self.replication.pr.get(volume)   # one PR state on every node
        return self.luns[volume]

    def drop_lun_if_unused(self, volume: str) -> None:
        lun = self.luns.get(volume)
        if lun is not None and not any(lun in t.scsi.luns.values() for t in self.targets):
            del self.luns[volume]
            unlisten = getattr(lun, "unlisten", None)
            if unlisten is not None:
                unlisten()

    def build_target(self, t: TargetSpec, *, elsewhere: int | None = None) -> Any:
        """The target's config for the iSCSI server; `elsewhere`: another worker of this node serves it (a
        shell without LUNs, for discovery and hand-off)."""
        f = self.factories or Factories.default()
        luns = {x.lun: self.lun_for(x.volume) for x in t.luns} if elsewhere is None else {}
        return f.target_config(
            iqn=t.iqn, scsi=f.scsi_target(t.iqn, luns),
            portals=[(p.host, p.port) for p in t.portals],
            advertised_portals=[(p.host, p.port) for p in t.advertised_portals],
            allowed_initiators=list(t.allowed_initiators) if t.allowed_initiators is not None else None,
            chap=f.chap(t.chap.user, t.chap.secret) if t.chap else None,
            mutual_chap=f.chap(t.mutual_chap.user, t.mutual_chap.secret) if t.mutual_chap else None,
            alias=t.alias, portal_group_tag=t.portal_group_tag, **({"elsewhere": elsewhere} if elsewhere is not None
                                                                    else {}))

    def build_subsystem(self, sub: SubsystemSpec) -> Any:
        from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig

        namespaces = [NvmeNamespaceConfig(ns.nsid, self.volumes[ns.volume],
                                          read_only=self._volume_spec(ns.volume).read_only)
                      for ns in sub.namespaces]
        return NvmeSubsystemConfig(
            sub.nqn, namespaces, [(p.host, p.port) for p in sub.portals],
            advertised_portals=[(p.host, p.port) for p in sub.advertised_portals],
            allowed_hosts=list(sub.allowed_hosts) if sub.allowed_hosts is not None else None,
            serial=sub.serial or subsystem_serial(sub.nqn), model=sub.model, dhchap_hosts=self._dhchap_hosts(sub))

    @staticmethod
    def _dhchap_hosts(sub: SubsystemSpec) -> dict[str, Any]:
        """The hosts that authenticate with DH-HMAC-CHAP, their secrets parsed (the config checked them)."""
        from openvsan.protocol.nvme.auth import HostPolicy, parse_secret

        return {h.nqn: HostPolicy(parse_secret(h.dhchap_secret),
                                  parse_secret(h.dhchap_ctrl_secret) if h.dhchap_ctrl_secret else None,
                                  sub.dhchap_hashes, sub.dhchap_dhgroups) for h in sub.hosts}

    def build_nbd_export(self, e: NbdExportSpec) -> Any:
        from openvsan.frontend.config import NbdExportConfig

        read_only = e.read_only or self._volume_spec(e.volume).read_only
        return NbdExportConfig(e.name, self.volumes[e.volume], [(p.host, p.port) for p in e.portals],
                               read_only=read_only, description=e.description or f"openvsan volume {e.volume}",
                               tls=e.tls)

    def _nbd_tls(self) -> dict[str, Any]:
        """The NbdServer's ssl context ([nbd] tls), as keyword arguments: none without TLS."""
        t = self.state.config.nbd_tls
        if t is None:
            return {}
        from openvsan.frontend.nbd import TlsCredentialError, tls_context

        try:
            ctx = tls_context(t.cert, t.key, t.ca, t.verify_client)
        except TlsCredentialError as e:
            raise NodeError(f"nbd.tls.{e.which}: {e}") from None
        log.info("NBD TLS: certificate %s%s", t.cert,
                 f", client certificates signed by {t.ca} {'required' if t.verify_client else 'checked when sent'}"
                 if t.ca is not None else ", no client certificates")
        return {"ssl_context": ctx}

    def _servers(self) -> list[Any]:
        return [s for s in (self.server, self.nvme_server, self.nbd_server) if s is not None]

    async def _stop_servers(self) -> None:
        await self._stop_control()
        servers = self._servers()
        self.server = self.nvme_server = self.nbd_server = None
        # each drains its own in-flight commands; they drain side by side
        results = await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)
        for srv, r in zip(servers, results, strict=True):
            if isinstance(r, BaseException):
                log.error("%s: stop failed: %s", type(srv).__name__, r)

    async def _start_api(self) -> None:
        from openvsan.api.server import ApiStartError, start_api

        try:
            assert self.events is not None
            self.api_server = await start_api(self.state.config, self.data_dir, self.events.wrap(self.control))
        except ApiStartError as e:
            raise NodeError(str(e)) from None

    async def _stop_control(self) -> None:
        if self.events is not None:
            await self.events.stop()
        if self.api_server is not None:
            await self.api_server.stop()
            self.api_server = None
        if self.control_server is not None:
            await self.control_server.stop()
            self.control_server = None
        await self.pools.stop_meter()
        await self.groups.stop_watch()

    async def stop(self) -> None:
        """Stop accepting, drain in-flight commands, make everything acknowledged durable, close."""
        await self._stop_control()
        if self.replication is not None:
            await self.replication.stop()    # a primary steps down (drained), so a peer takes over at once
            self.replication = None
        if self.worker is not None:
            self.worker.exchange.close()   # no more connections from the other workers
        if self._servers():
            log.info("stopping: draining in-flight commands")
            await self._stop_servers()
        for t in self.targets:
            try:
                await t.scsi.flush_all()
            except Exception as e:  # noqa: BLE001 - keep flushing the rest
                log.error("%s: flush failed: %s", t.iqn, e)
        self.targets.clear()
        self.subsystems.clear()
        self.nbd_exports.clear()
        await self.close_devices()
        if self.busy_poll is not None:
            st = self.busy_poll.stats()
            log.info("adaptive polling: %d windows of %d-%d µs opened (%d sized from the gaps between commands), "
                     "%d wasted (%d of them ended because another task wanted the core), %.1f s spent polling",
                     st["windows"], st["window_us"], st["max_window_us"], st["learned"], st["wasted"],
                     st["contended"], st["polled_s"])
        log.info("stopped")

    async def close_devices(self) -> None:
        """Close the volumes' layers, the groups, the pools (clean: flushed, superblocks marked clean; they close
        their members), then the devices no pool holds. A volume that fails to close (a compressed volume's write
        cache that cannot be written back into a full group) is logged; the rest still close."""
        await self._stop_control()
        for name, vol in self.volumes.items():
            try:
                await vol.close()   # its layers; the devices below are closed next
            except Exception as e:  # noqa: BLE001 - the other volumes, groups, pools and devices still close
                log.error("volume %s: closing it failed: %s", name, e)
        await self.groups.close()   # their metadata committed before the pools and devices close
        closed = await self.pools.close()
        for name, dev in reversed(list(self.devices.items())):
            if id(dev) in closed:
                continue
            await flush_and_close(dev, name)
        self.devices.clear()
        self.volumes.clear()
        self.luns.clear()

    async def volume_stats(self, name: str) -> dict[str, Any] | None:
        """What the data plane reports of one volume (DataPlane.stats); a supervisor asks the worker."""
        return self.plane.stats(name)

    async def apply(self, desired: NodeConfig, *, dry_run: bool = False, forget: tuple[str, ...] = (),
                    expect_revision: int | None = None) -> list[Change]:
        """Make `desired` the node's state while it serves: plan the changes (node/reconcile.py), have the
        data plane carry them out one by one, then store the new desired state. If a change or the store
        fails, the changes done are undone in reverse, and desired and actual state stay as they were.
        `expect_revision`: only if the desired state is still at that revision (else control.Stale)."""
        async with self._applying:
            check_revision(self.state.revision, expect_revision)
            changes = plan(self.state.config, desired)
            if dry_run or not changes:
                return changes
            plane = self.plane
            plane.desired = desired
            done: list[Change] = []
            try:
                for c in changes:
                    await plane.handle(c)
                    done.append(c)
                identities = {**self.state.identities, **plane.new_identities}
                for name in forget:
                    identities.pop(name, None)
                if self.worker is None:
                    # off the event loop (a commit waits for fsync); refused if the stored state moved on since
                    revision = await import_desired(self.data_dir, desired, identities=plane.new_identities,
                                                    forget=forget, expect_revision=self.state.revision)
                else:
                    revision = self.state.revision   # a worker's part: its supervisor stores the whole
                runtime = self.state.pool_devices
            except Exception as e:
                failed = changes[len(done)] if len(done) < len(changes) else None
                plane.desired = None   # undoing leads back to the state the node has: build from that
                for c in reversed(done):
                    try:
                        await plane.handle(c.inverse())
                    except Exception:
                        log.exception("undoing %s failed", c)
                await plane.commit()
                what = f"{failed}: " if failed is not None else "storing the new state: "
                line = f"{what.lstrip('+-~ ')}{why(e)}; nothing was changed"
                if isinstance(e, ValueError):   # refused (a key file that opens nothing, a pool that says no)
                    from openvsan.node.control import Conflict, RequestError

                    # a change the data plane will not make as asked stays a conflict (the API's 409)
                    raise (Conflict if isinstance(e, Conflict) else RequestError)(line) from e
                raise NodeError(line) from e
            plane.desired = None
            self.state = StoredState(desired, identities, runtime, revision)
            await plane.commit()
            for c in changes:
                log.info("applied: %s", c)
            return changes

    async def control(self, cmd: str, args: dict[str, Any]) -> Any:
        """The control socket's commands (node/control.py): what `vsan pool ...`, `vsan volume ...`,
        `vsan export ...`, `vsan qos ...`, `vsan config apply` and later the REST API call."""
        if cmd.startswith("pool."):
            return self._with_groups(cmd, await self.pools.control(cmd, args))
        if cmd.startswith("snapshot."):
            return await snapshot_command(self, cmd, args)
        if cmd == "node.sessions":
            from openvsan.node.sessions import connections

            return connections(self)
        if cmd == "node.metrics":
            from openvsan.node.plane import volume_identities

            return {**self.plane.metrics(), "identities": volume_identities(self.state)}
        if cmd == "node.events" and self.events is not None:
            return self.events.since(int(args.get("after") or 0), int(args.get("limit") or 100))
        from openvsan.node import live

        handler = live.COMMANDS.get(cmd)
        if handler is None:
            raise RequestError(f"unknown command {cmd!r}")
        return await handler(self, args)

    def _soft_threshold(self, names: list[str]) -> None:
        """A volume group went above its soft threshold: its served volumes tell their initiators (SCSI: THIN
        PROVISIONING SOFT THRESHOLD REACHED)."""
        for name in names:
            vol = self.volumes.get(name)
            if vol is not None:
                vol.notify("thin-threshold")

    def _with_groups(self, cmd: str, out: Any) -> Any:
        """pool.status and pool.list answers, with the space of the volume group carved from each pool."""
        if cmd in ("pool.status", "pool.list"):
            for entry in out if isinstance(out, list) else [out]:
                if isinstance(entry, dict) and "name" in entry:
                    space = self.groups.space(f"pool {entry['name']}",
                                              [v.name for v in self.state.config.volumes])
                    if space is not None:
                        entry["volume_group"] = space
        return out


class DataDirLock:
    """One `vsan serve` per data dir: a second one would fight over the state store and the devices."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "serve.lock"
        self._fd: int | None = None

    def __enter__(self) -> Self:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NodeError(f"another vsan serve is using {self.path.parent}; stop it or pass another "
                            "--data-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def serve(node: Node, *, stop: asyncio.Event | None = None,
                started: Callable[[], None] | None = None) -> None:
    """Start the node and serve until SIGTERM/SIGINT (or `stop` is set), then shut down cleanly; `started`
    is called once the node is up."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    draining: asyncio.Task[None] | None = None

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("%s: shutting down", sig.name)
            stop.set()
        elif draining is not None and not draining.done():
            # a second signal: stop waiting for the drain; devices are still flushed and closed
            log.warning("%s again: not waiting for in-flight commands", sig.name)
            draining.cancel()

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    try:
        # a signal during start is kept in `stop` and acted on as soon as the node is up
        await node.start()
        if started is not None:
            started()
        await stop.wait()
        draining = asyncio.ensure_future(node.stop())
        try:
            await asyncio.shield(draining)
        except asyncio.CancelledError:
            if not draining.cancelled():
                raise
            node.server = node.nvme_server = node.nbd_server = None
            await node.close_devices()  # closes the pools too
    finally:
        remove_signal_handlers(loop, installed)


def remove_signal_handlers(loop: asyncio.AbstractEventLoop, sigs: list[signal.Signals]) -> None:
    """The loop's signal handlers taken away at the end of `vsan serve`. A signal that arrived moments before
    may still be pending at Python's level: Python runs it at the next signal.signal(), and if that finds its
    handler already gone, it prints "Signal 15 ignored due to race condition" (an unraisable error, on
    stderr). So the pending ones run first, with every handler still in place, by setting one handler to
    itself."""
    if sigs:
        with contextlib.suppress(OSError, RuntimeError, ValueError, TypeError):
            signal.signal(sigs[0], signal.getsignal(sigs[0]))
    for sig in sigs:
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            loop.remove_signal_handler(sig)


GC_GEN0_THRESHOLD = 20000   # allocations between young-generation collections (Python's default: 700)


def _settle_gc() -> None:
    """Once the node is up: what it built to run (configs, targets, tables) moves out of the collector's
    sight (gc.freeze), and young collections come every 20,000 allocations instead of 700. The data path
    makes many short-lived objects and almost no cycles, so a collection every ~100 commands was work for
    nothing; cyclic garbage still goes, a little later."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, g1, g2)


def run(node: Node, started: Callable[[], None] | None = None) -> None:
    """Run `serve(node)` on uvloop when it is importable (OPENVSAN_LOOP=asyncio to opt out); `started` is
    called once the node is up."""
    keep_large_buffers()

    def up() -> None:
        _settle_gc()
        if started is not None:
            started()

    if os.environ.get("OPENVSAN_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(serve(node, started=up))
            return
    asyncio.run(serve(node, started=up))
