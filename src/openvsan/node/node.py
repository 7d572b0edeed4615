"""The node daemon: desired state (from the store) -> devices -> volumes -> exports -> servers.

Volumes are exported as LUNs of iSCSI targets, namespaces of NVMe/TCP subsystems and NBD exports; one
volume may be all three at once. Assembly is a chain of small factories so each step can be replaced
(later layers: pools, thin volumes, caches) and so tests can assemble a node around stand-ins of the
protocol layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import importlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from openvsan.block import BlockDevice, FileDevice, NullDevice, RamDevice
from openvsan.node.config import DeviceSpec, NbdExportSpec, PoolSpec, SubsystemSpec, TargetSpec, VolumeSpec
from openvsan.node.control import ControlServer, RequestError, socket_path
from openvsan.node.store import STATE_DB, Store, StoredState, VolumeIdentity
from openvsan.node.values import format_size, parse_size

if TYPE_CHECKING:
    from openvsan.pool import Pool

log = logging.getLogger("openvsan.node")


class NodeError(RuntimeError):
    """The node cannot be assembled or served; str() is one line for the user."""


def open_device(spec: DeviceSpec) -> BlockDevice:
    if spec.type == "ram":
        assert spec.size is not None
        return RamDevice(spec.size // spec.block_size, spec.block_size,
                         backing=str(spec.backing) if spec.backing else None, name=spec.name)
    if spec.type == "file":
        assert spec.path is not None
        return FileDevice(spec.path, size=spec.size, block_size=spec.block_size, direct=spec.direct, name=spec.name)
    if spec.type == "null":
        assert spec.size is not None
        return NullDevice(spec.size // spec.block_size, spec.block_size, name=spec.name)
    raise NodeError(f"device {spec.name}: unknown type {spec.type!r}")


def open_volume(spec: VolumeSpec, device: BlockDevice) -> BlockDevice:
    # The seam for the volume stack (thin, cache, crypt, QoS...): today a volume is its device (or its pool).
    return device


# --- pools ----------------------------------------------------------------------------------------------------

FILE_REF = "file:"


def parse_file_ref(ref: str) -> tuple[Path, int | None]:
    """`file:PATH:SIZE` or `file:PATH` (an existing file) -> (path, size). The size is the last `:` field when it
    reads as a size, so a path may hold colons."""
    body = ref.removeprefix(FILE_REF)
    path, sep, tail = body.rpartition(":")
    if sep and path:
        try:
            return Path(path), parse_size(tail)
        except ValueError:
            pass
    if not body:
        raise RequestError(f"{ref!r}: name the file, e.g. file:/var/lib/openvsan/d9.img:64MiB")
    return Path(body), None


@dataclass
class RebuildMeter:
    """How fast a pool's rebuild goes, from the members' checkpoints sampled once a second (the pool reports
    progress, not speed)."""

    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=6))
    who: tuple[int, ...] = ()

    def sample(self, pool: Pool) -> None:
        from openvsan.pool.superblock import MemberState

        rebuilding = [m for m in pool.members if m.state is MemberState.REBUILDING]
        who = tuple(id(m.dev) for m in rebuilding)
        if who != self.who:
            self.samples.clear()
            self.who = who
        if rebuilding:
            self.samples.append((time.monotonic(), sum(m.checkpoint for m in rebuilding) * pool.chunk_size))

    def rate(self) -> float | None:
        """Bytes/s of member data rebuilt over the last few seconds; None before two samples."""
        if len(self.samples) < 2:
            return None
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return max(0.0, (b1 - b0) / (t1 - t0)) if t1 > t0 else None


@dataclass
class ServedPool:
    spec: PoolSpec
    pool: Pool
    refs: dict[int, str]  # id(device) -> how the node names it: a config device's name or file:PATH:SIZE
    meter: RebuildMeter = field(default_factory=RebuildMeter)

    def held(self) -> list[BlockDevice]:
        """The devices in the pool's slots and its spares now."""
        return [m.dev for m in self.pool.members if m.dev is not None] + [d for d, _ in self.pool.spares]

    def ref(self, dev: BlockDevice) -> str:
        return self.refs.get(id(dev), str(getattr(dev, "name", "?")))


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

    @classmethod
    def default(cls) -> Factories:
        # imported here: the node module stays importable (and testable) on its own
        try:
            from openvsan.protocol.scsi import Lun, ScsiTarget
            from openvsan.target.config import ChapCredential, IscsiTargetConfig
            from openvsan.target.iscsi import IscsiServer
            from openvsan.target.nbd import NbdServer
        except ImportError as e:
            raise NodeError(f"this build cannot serve iSCSI and NBD: {e}") from e
        return cls(Lun, ScsiTarget, IscsiTargetConfig, ChapCredential, IscsiServer, nbd_server=NbdServer)


def _real_nvme_server() -> Callable[..., Any]:
    # by name, at run time: the NVMe/TCP target is optional for a node whose config has no [nvme] section
    try:
        module = importlib.import_module("openvsan.target.nvme_tcp")
    except ImportError as e:
        raise NodeError(f"this build cannot serve NVMe/TCP ({e}); remove the [nvme] section from the config or "
                        "install an openvsan with openvsan.target.nvme_tcp") from e
    server: Callable[..., Any] | None = getattr(module, "NvmeTcpServer", None)
    if server is None:
        raise NodeError("this build cannot serve NVMe/TCP (openvsan.target.nvme_tcp has no NvmeTcpServer); remove "
                        "the [nvme] section from the config")
    return server


def _real_nbd_server() -> Callable[[list[Any]], Any]:
    from openvsan.target.nbd import NbdServer
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
    volumes: dict[str, BlockDevice] = field(default_factory=dict)
    luns: dict[str, Any] = field(default_factory=dict)       # volume name -> Lun (shared by its targets)
    targets: list[Any] = field(default_factory=list)         # IscsiTargetConfig
    server: Any = None                                       # the iSCSI server
    subsystems: list[Any] = field(default_factory=list)      # NvmeSubsystemConfig
    nvme_server: Any = None
    nbd_exports: list[Any] = field(default_factory=list)     # NbdExportConfig
    nbd_server: Any = None
    pools: dict[str, ServedPool] = field(default_factory=dict)
    control_server: ControlServer | None = None
    _pool_owned: set[int] = field(default_factory=set)       # id() of devices the pools close
    _loose: list[BlockDevice] = field(default_factory=list)  # opened for a pool (file:...) but not taken by it
    _sampler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cfg = self.state.config
        f = self.factories or Factories.default()
        try:
            # before any device is opened: a build without NVMe/TCP fails at once, touching nothing
            nvme_factory = (f.nvme_server or _real_nvme_server()) if cfg.nvme is not None else None
            for spec in cfg.devices:
                try:
                    self.devices[spec.name] = open_device(spec)
                except (OSError, ValueError) as e:
                    user = cfg.device_user(spec.name)
                    if user is None or not user.startswith("pool "):
                        raise NodeError(f"device {spec.name}: {_why(e)}") from e
                    # a pool member that cannot be opened is a missing member: the pool decides if it can go on
                    log.error("device %s (%s): cannot open it: %s", spec.name, user, _why(e))
            for pspec in cfg.pools:
                self.pools[pspec.name] = await self._open_pool(pspec)
            for vspec in cfg.volumes:
                base = self.pools[vspec.pool].pool if vspec.pool is not None else self.devices[str(vspec.device)]
                self.volumes[vspec.name] = open_volume(vspec, base)
            pr_dir = self.data_dir / "pr"
            pr_dir.mkdir(mode=0o700, exist_ok=True)
            for t in cfg.targets:
                self.targets.append(self._build_target(t, f, pr_dir))
            self.server = f.server(self.targets)
            await self.server.start()
            if cfg.nvme is not None:
                assert nvme_factory is not None
                self.subsystems = [self._build_subsystem(sub) for sub in cfg.nvme.subsystems]
                discovery = [(p.host, p.port) for p in cfg.nvme.portals] or None
                self.nvme_server = nvme_factory(self.subsystems, discovery_portals=discovery)
                await self.nvme_server.start()
            if cfg.nbd_exports:
                self.nbd_exports = [self._build_nbd_export(e) for e in cfg.nbd_exports]
                self.nbd_server = (f.nbd_server or _real_nbd_server())(self.nbd_exports)
                await self.nbd_server.start()
            self.control_server = ControlServer(socket_path(self.data_dir), self.control)
            await self.control_server.start()
            if self.pools:
                self._sampler = asyncio.get_running_loop().create_task(self._sample_rebuilds(), name="pool-meter")
        except BaseException:
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
            acl = "any host" if sub.allowed_hosts is None else f"{len(sub.allowed_hosts)} allowed host(s)"
            log.info("%s: %s", sub.nqn, acl)
        for x in cfg.nbd_exports:
            dev = self.volumes[x.volume]
            log.info("serving NBD export %s (%s, %s%s) on %s", x.name, x.volume,
                     format_size(dev.num_blocks * dev.block_size),
                     ", read-only" if x.read_only or cfg.volume(x.volume).read_only else "",
                     ", ".join(str(p) for p in x.portals))
        if not cfg.exports_anything():
            log.warning("no iSCSI targets, NVMe subsystems or NBD exports are configured; nothing is exported")

    def _build_target(self, t: TargetSpec, f: Factories, pr_dir: Path) -> Any:
        luns = {}
        for x in t.luns:
            if x.volume not in self.luns:
                vspec = self.state.config.volume(x.volume)
                ident: VolumeIdentity = self.state.identities[x.volume]
                self.luns[x.volume] = f.lun(self.volumes[x.volume], name=x.volume, uuid=ident.uuid,
                                            serial=ident.serial, read_only=vspec.read_only,
                                            pr_state_path=pr_dir / f"{x.volume}.json")
            luns[x.lun] = self.luns[x.volume]
        return f.target_config(
            iqn=t.iqn, scsi=f.scsi_target(t.iqn, luns),
            portals=[(p.host, p.port) for p in t.portals],
            advertised_portals=[(p.host, p.port) for p in t.advertised_portals],
            allowed_initiators=list(t.allowed_initiators) if t.allowed_initiators is not None else None,
            chap=f.chap(t.chap.user, t.chap.secret) if t.chap else None,
            mutual_chap=f.chap(t.mutual_chap.user, t.mutual_chap.secret) if t.mutual_chap else None,
            alias=t.alias, portal_group_tag=t.portal_group_tag)

    def _build_subsystem(self, sub: SubsystemSpec) -> Any:
        from openvsan.target.config import NvmeNamespaceConfig, NvmeSubsystemConfig

        cfg = self.state.config
        namespaces = [NvmeNamespaceConfig(ns.nsid, self.volumes[ns.volume], ns.volume,
                                          self.state.identities[ns.volume].uuid,
                                          read_only=cfg.volume(ns.volume).read_only)
                      for ns in sub.namespaces]
        return NvmeSubsystemConfig(
            sub.nqn, namespaces, [(p.host, p.port) for p in sub.portals],
            advertised_portals=[(p.host, p.port) for p in sub.advertised_portals],
            allowed_hosts=list(sub.allowed_hosts) if sub.allowed_hosts is not None else None,
            serial=sub.serial or subsystem_serial(sub.nqn), model=sub.model)

    def _build_nbd_export(self, e: NbdExportSpec) -> Any:
        from openvsan.target.config import NbdExportConfig

        read_only = e.read_only or self.state.config.volume(e.volume).read_only
        return NbdExportConfig(e.name, self.volumes[e.volume], [(p.host, p.port) for p in e.portals],
                               read_only=read_only, description=e.description or f"openvsan volume {e.volume}")

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

    async def _stop_control(self) -> None:
        if self.control_server is not None:
            await self.control_server.stop()
            self.control_server = None
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None

    async def stop(self) -> None:
        """Stop accepting, drain in-flight commands, make everything acknowledged durable, close."""
        await self._stop_control()
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
        log.info("stopped")

    async def close_devices(self) -> None:
        """Close the pools (clean: flushed, superblocks marked clean; they close their members), then the
        devices no pool holds."""
        await self._stop_control()
        for name, sp in reversed(list(self.pools.items())):
            try:
                await sp.pool.close()
                log.info("pool %s: closed", name)
            except Exception as e:  # noqa: BLE001 - one bad pool must not keep the others open
                log.error("pool %s: close failed: %s", name, e)
        self.pools.clear()
        loose = [(str(getattr(d, "name", "?")), d) for d in self._loose]
        for name, dev in reversed(list(self.devices.items()) + loose):
            if id(dev) in self._pool_owned:
                continue
            try:
                await dev.flush()
                await dev.close()
            except Exception as e:  # noqa: BLE001 - one bad device must not keep the others unflushed
                log.error("device %s: flush/close failed: %s", name, e)
        self.devices.clear()
        self._loose.clear()
        self._pool_owned.clear()
        self.volumes.clear()
        self.luns.clear()

    # --- pools ------------------------------------------------------------------------------------------------

    async def _open_pool(self, spec: PoolSpec) -> ServedPool:
        """Assemble the pool from whichever of its devices carry its superblock, or create it on first start
        (every member blank). A device that carries another pool's superblock is never written."""
        from openvsan.block.errors import BlockError
        from openvsan.pool import Pool, PoolError
        from openvsan.pool.members import MEMBER_FAULTS
        from openvsan.pool.superblock import read_superblock

        declared = list(spec.members) + list(spec.spares)
        refs: dict[int, str] = {}
        found: list[tuple[str, BlockDevice]] = []
        for ref in declared:
            if ref in self.devices:
                found.append((ref, self.devices[ref]))
        for ref in self.state.pool_devices.get(spec.name, ()):
            dev = self._runtime_device(spec, ref, declared)
            if dev is not None:
                found.append((ref, dev))
        ours: list[BlockDevice] = []
        blank: dict[str, BlockDevice] = {}
        for ref, dev in found:
            refs[id(dev)] = ref
            try:
                sb = await read_superblock(dev)
            except (*MEMBER_FAULTS, OSError) as e:
                log.error("pool %s: %s: cannot read its superblock (%s); leaving it out", spec.name, ref, e)
                continue
            if sb is None:
                blank[ref] = dev
            elif sb.name != spec.name:
                if ref not in declared:
                    log.warning("pool %s: %s now carries pool %r; forgetting it", spec.name, ref, sb.name)
                    continue
                raise NodeError(f"pool {spec.name}: device {ref}{_where(dev)} carries a member of another pool, "
                                f"{sb.name!r} ({sb.pool_uuid}); refusing to touch it: take it out of the pool's "
                                f"devices, or erase that superblock with `vsan pool destroy`")
            else:
                ours.append(dev)
        rate = float(spec.rebuild_rate) if spec.rebuild_rate else None
        try:
            if not ours:
                missing = [r for r in declared if r not in blank]
                if missing:
                    raise NodeError(f"pool {spec.name}: cannot create it: {', '.join(missing)} cannot be opened "
                                    "or read; mend or replace them in the config")
                # spares are added after create: Pool.create(spares=...) fails on a zip of unequal lengths
                pool = await Pool.create([blank[r] for r in spec.members], spec.level, spec.chunk, name=spec.name,
                                         rebuild_rate=rate)
            else:
                pool = await Pool.assemble(ours, rebuild_rate=rate)
        except (PoolError, BlockError) as e:
            text = _pool_text(e).removeprefix(f"pool {spec.name!r}: ")
            raise NodeError(f"pool {spec.name}: {text}") from None
        sp = ServedPool(spec, pool, refs)
        self._pool_owned.update(id(d) for d in sp.held())
        for ref in spec.spares:
            if ref in blank:
                try:
                    await pool.add_spare(blank[ref])
                except (PoolError, BlockError) as e:
                    log.error("pool %s: spare %s not added: %s", spec.name, ref, _pool_text(e))
                    continue
                self._pool_owned.add(id(blank[ref]))
        for i, ref in enumerate(spec.members):
            if ours and ref in blank:
                log.warning("pool %s: %s (members[%d]) carries no superblock, so it is not used; `vsan pool replace "
                            "%s SLOT %s` rebuilds a missing member onto it", spec.name, ref, i, spec.name, ref)
        self._record_runtime(sp)
        st = pool.status()
        lost = [f"{m.index} ({m.state})" for m in st.members if m.state != "active"]
        log.info("pool %s: %s RAID %d over %d members, %s, chunk %s, %s%s", spec.name,
                 "assembled" if ours else "created", st.level, len(st.members), format_size(st.size),
                 format_size(st.chunk_size), st.state, f": members {', '.join(lost)}" if lost else "")
        return sp

    def _runtime_device(self, spec: PoolSpec, ref: str, declared: list[str]) -> BlockDevice | None:
        """A device the running pool took in earlier (replace, add-spare), named by its ref; None if gone."""
        if ref in declared:
            return None
        if not ref.startswith(FILE_REF):
            user = self.state.config.device_user(ref)
            if ref not in self.devices or user is not None:
                log.warning("pool %s: %s was added to it, but the config %s; leaving it out", spec.name, ref,
                            f"gives it to {user}" if user else "has no such device now")
                return None
            return self.devices[ref]
        path, _ = parse_file_ref(ref)
        try:
            # never create it: a file that is gone is a missing member
            dev = FileDevice(path, name=str(path))
        except (OSError, ValueError) as e:
            log.error("pool %s: %s: cannot open it: %s; leaving it out", spec.name, ref, _why(e))
            return None
        self._loose.append(dev)
        return dev

    def _record_runtime(self, sp: ServedPool) -> None:
        """Remember which devices the pool holds beyond the config's, so the next start finds them."""
        declared = set(sp.spec.members) | set(sp.spec.spares)
        extra = [sp.ref(d) for d in sp.held() if sp.ref(d) not in declared]
        try:
            with Store(self.data_dir / STATE_DB) as store:
                store.set_pool_runtime_devices(sp.spec.name, extra)
        except Exception as e:  # noqa: BLE001 - the pool runs on; only the next start would miss the device
            log.error("pool %s: cannot record its devices in %s: %s", sp.spec.name, STATE_DB, e)

    async def _sample_rebuilds(self) -> None:
        while True:
            for sp in self.pools.values():
                sp.meter.sample(sp.pool)
            await asyncio.sleep(1.0)

    def _served(self, args: dict[str, Any]) -> ServedPool:
        name = args.get("name")
        if name not in self.pools:
            known = ", ".join(self.pools) or "none is configured"
            raise RequestError(f"no pool {name!r}; pools: {known}")
        return self.pools[name]

    def _device_for(self, sp: ServedPool, ref: str) -> tuple[BlockDevice, bool]:
        """The device `ref` names for a replace or spare: a config device in no use, or file:PATH:SIZE (opened,
        created if missing). Returns it and whether it was opened just now (to close if the pool refuses it)."""
        cfg = self.state.config
        held = {id(d): (name, s.ref(d)) for name, s in self.pools.items() for d in s.held()}
        if ref.startswith(FILE_REF):
            path, size = parse_file_ref(ref)
            for spec in cfg.devices:
                if spec.path is not None and spec.path.resolve() == path.resolve():
                    raise RequestError(f"{path} is device {spec.name} in the config; name it: {spec.name}")
            for name, s in self.pools.items():
                for d in s.held():
                    if isinstance(d, FileDevice) and d.path.resolve() == path.resolve():
                        raise RequestError(f"{path} is already in pool {name}")
            try:
                fdev = FileDevice(path, size=size, block_size=sp.pool.block_size, name=str(path))
            except (OSError, ValueError) as e:
                raise RequestError(f"{ref}: {_why(e)}") from None
            sp.refs[id(fdev)] = ref if size is not None else f"{FILE_REF}{path}"
            return fdev, True
        if not any(d.name == ref for d in cfg.devices):
            known = [d.name for d in cfg.devices if cfg.device_user(d.name) is None]
            raise RequestError(f"unknown device {ref!r}; name a config device in no use ({', '.join(known) or 'none'})"
                               " or a file: file:PATH:SIZE")
        user = cfg.device_user(ref)
        if user is not None and user != f"pool {sp.spec.name}":
            raise RequestError(f"device {ref} belongs to {user} in the config; pick a device in no use")
        if ref not in self.devices:
            raise RequestError(f"device {ref} could not be opened when vsan serve started (see its log)")
        dev = self.devices[ref]
        if id(dev) in held:
            pool, _ = held[id(dev)]
            raise RequestError(f"device {ref} is already in pool {pool}")
        sp.refs[id(dev)] = ref
        return dev, False

    async def control(self, cmd: str, args: dict[str, Any]) -> Any:
        """The control socket's commands (node/control.py): what `vsan pool ...` and later the REST API call."""
        handler = {
            "pool.list": self._pool_list, "pool.status": self._pool_status, "pool.scrub": self._pool_scrub,
            "pool.fail": self._pool_fail, "pool.replace": self._pool_replace, "pool.add_spare": self._pool_add_spare,
        }.get(cmd)
        if handler is None:
            raise RequestError(f"unknown command {cmd!r}")
        try:
            return await handler(args)
        except ValueError as e:  # PoolError among them
            raise RequestError(_pool_text(e)) from None

    async def _pool_list(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for name, sp in self.pools.items():
            st = sp.pool.status()
            volume = next((v.name for v in self.state.config.volumes if v.pool == name), None)
            out.append({"name": name, "level": st.level, "state": st.state, "size": st.size,
                        "members": len(st.members), "spares": len(st.spares), "volume": volume,
                        "rebuild_progress": st.rebuild_progress, "resync_progress": st.resync_progress})
        return out

    async def _pool_status(self, args: dict[str, Any]) -> dict[str, Any]:
        sp = self._served(args)
        sp.meter.sample(sp.pool)
        st = sp.pool.status().as_dict()
        for m in st["members"]:
            dev = sp.pool.members[m["index"]].dev
            m["device"] = sp.ref(dev) if dev is not None else None
        st["spares"] = [sp.ref(d) for d, _ in sp.pool.spares]
        st["rebuild_rate_limit"] = sp.pool.rebuild_rate
        st["rebuild_speed"] = sp.meter.rate() if st["rebuild_progress"] is not None else None
        return st

    async def _pool_scrub(self, args: dict[str, Any]) -> dict[str, Any]:
        sp = self._served(args)
        report = await sp.pool.scrub(repair=bool(args.get("repair", True)))
        log.info("pool %s: scrub: %d stripes checked, %d mismatches, %d repaired, %d unrepairable", sp.spec.name,
                 report.checked, report.mismatches, report.repaired, report.unrepairable)
        return report.as_dict()

    def _member_index(self, sp: ServedPool, member: object) -> int:
        if isinstance(member, int) or (isinstance(member, str) and member.isdigit()):
            return int(member)
        for m in sp.pool.members:
            if m.dev is not None and member in (sp.ref(m.dev), m.name):
                return m.index
        names = ", ".join(f"{m.index}: {sp.ref(m.dev)}" for m in sp.pool.members if m.dev is not None)
        raise RequestError(f"pool {sp.spec.name} has no member {member!r}; give a slot number or a name ({names})")

    async def _pool_fail(self, args: dict[str, Any]) -> dict[str, Any]:
        from openvsan.pool.superblock import MemberState

        sp = self._served(args)
        pool = sp.pool
        i = self._member_index(sp, args.get("member"))
        if not 0 <= i < len(pool.members):
            raise RequestError(f"no member {i}: pool {sp.spec.name} has members 0..{len(pool.members) - 1}")
        m = pool.members[i]
        if m.state not in (MemberState.ACTIVE, MemberState.REBUILDING):
            raise RequestError(f"member {i} ({m.name}) is already {m.state.name.lower()}")
        lost = [x.index for x in pool.members if x.state is not MemberState.ACTIVE] + [i]
        if not pool.geo.available(lost):
            raise RequestError(f"failing member {i} would leave pool {sp.spec.name} without members "
                               f"{sorted(set(lost))}, more than RAID {int(pool.level)} tolerates "
                               f"({pool.geo.tolerance}); replace a failed member first")
        who = m.name
        await pool.fail_member(i)
        log.warning("pool %s: member %d (%s) failed by request", sp.spec.name, i, who)
        return await self._pool_status({"name": sp.spec.name})

    async def _pool_replace(self, args: dict[str, Any]) -> dict[str, Any]:
        sp = self._served(args)
        index = args.get("index")
        if not isinstance(index, int):
            raise RequestError(f"index must be a member slot number, not {index!r}")
        dev, opened = self._device_for(sp, str(args.get("device", "")))
        try:
            await sp.pool.replace(index, dev, force=bool(args.get("force", False)))
        except BaseException:
            if opened:
                await dev.close()
            raise
        self._took(sp, dev)
        sp.meter.sample(sp.pool)  # the rebuild's starting point
        log.warning("pool %s: member %d replaced by %s; rebuilding", sp.spec.name, index, sp.ref(dev))
        return await self._pool_status({"name": sp.spec.name})

    async def _pool_add_spare(self, args: dict[str, Any]) -> dict[str, Any]:
        sp = self._served(args)
        dev, opened = self._device_for(sp, str(args.get("device", "")))
        try:
            await sp.pool.add_spare(dev, force=bool(args.get("force", False)))
        except BaseException:
            if opened:
                await dev.close()
            raise
        self._took(sp, dev)
        log.info("pool %s: spare %s added", sp.spec.name, sp.ref(dev))
        return await self._pool_status({"name": sp.spec.name})

    def _took(self, sp: ServedPool, dev: BlockDevice) -> None:
        self._pool_owned.add(id(dev))  # the pool closes it from now on
        self._record_runtime(sp)


def _where(dev: BlockDevice) -> str:
    return f" ({dev.path})" if isinstance(dev, FileDevice) else ""


def _pool_text(e: BaseException) -> str:
    # the pool library speaks of its Python argument; a user of the node or the CLI passes --force
    text = str(e).replace("pass force=True", "pass --force").replace("force=True", "--force")
    return text.replace("(fail_member)", "(vsan pool fail)")


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


class DataDirLock:
    """One `vsan serve` per data dir: a second one would fight over state.db and the devices."""

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


async def serve(node: Node, *, stop: asyncio.Event | None = None) -> None:
    """Start the node and serve until SIGTERM/SIGINT (or `stop` is set), then shut down cleanly."""
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
        for sig in installed:
            loop.remove_signal_handler(sig)


def run(node: Node) -> None:
    """Run `serve(node)` on uvloop when it is importable (OPENVSAN_LOOP=asyncio to opt out)."""
    if os.environ.get("OPENVSAN_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(serve(node))
            return
    asyncio.run(serve(node))
