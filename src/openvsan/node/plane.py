"""The node's data plane: the owner of its devices, volumes and the frontends that serve them, driven only by
messages (node/reconcile.py Change: add / remove / resize / update of one object).

The reconciler never reaches into a volume or a server: it sends the plane a change and, if a later change
fails, the change's inverse. So the owner can move, as issue 13 plans, into a worker process per core with
the same messages. Removals are reversible until `commit()`: a removed device or volume is set aside, not
closed, so undoing its removal puts back the very object (a RAM disk keeps its data)."""

from __future__ import annotations

import logging
import uuid as uuidlib
from typing import TYPE_CHECKING, Any

from openvsan.block import BlockDevice
from openvsan.node.pools import flush_and_close
from openvsan.node.reconcile import Change
from openvsan.node.specs import DeviceSpec, NbdExportSpec, NodeConfig, SubsystemSpec, TargetSpec, VolumeSpec
from openvsan.node.store import VolumeIdentity
from openvsan.volume import Volume
from openvsan.volume.registry import open_stack
from openvsan.volume.volume import SWAP_DRAIN_TIMEOUT

if TYPE_CHECKING:
    from openvsan.node.node import Node

log = logging.getLogger("openvsan.node")


class DataPlane:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.new_identities: dict[str, VolumeIdentity] = {}
        self.desired: NodeConfig | None = None               # while a plan is carried out: where it leads
        self._set_aside: dict[tuple[str, str], Any] = {}     # (kind, name) -> object removed, not yet closed
        self._old_stacks: list[BlockDevice] = []             # stacks swapped out, closed at commit
        self.swap_timeout = SWAP_DRAIN_TIMEOUT               # how long a swap or resize waits for I/O to drain

    @property
    def config(self) -> NodeConfig:
        """The state the objects being built belong to: where a plan leads while it is carried out (and
        undone: Node.apply clears `desired` first), else the node's."""
        return self.desired if self.desired is not None else self.node.state.config

    # ---- one message

    async def handle(self, c: Change) -> None:
        fn = getattr(self, f"_{c.op}_{c.kind.replace(' ', '_')}", None)
        if fn is None:
            raise ValueError(f"{c.kind}: cannot {c.op} while serving")
        await fn(c)

    async def commit(self) -> None:
        """The plan is done and stored (or undone): close what it removed for good, and what undoing it
        set aside (objects it had added)."""
        leaving = {f"device {name}" for kind, name in self._set_aside if kind == "device"}
        for (kind, name), obj in self._set_aside.items():
            if kind == "volume":
                await obj.close()
                lv = obj.device
                if getattr(lv, "in_use", False):
                    lv.in_use = False
                    # a carved volume deleted from the desired state goes from its group (its space returns);
                    # one whose device leaves this process with it (a move to another worker) stays whole
                    where = next((w for w, sg in self.node.groups.items() if sg.group is lv.group), None)
                    if where is not None and where not in leaving and name not in self.node.volumes \
                            and not lv.read_only:   # a served snapshot stops being served; it stays a snapshot
                        await lv.group.delete(lv.name)
                        log.info("%s: volume %s deleted from its volume group", where, name)
        for (kind, name), obj in self._set_aside.items():
            if kind == "device":
                await self.node.groups.close_one(f"device {name}")   # its volume group committed first
                await flush_and_close(obj, name)
        for stack in self._old_stacks:
            await Volume(stack, name="old").close()
        self._set_aside.clear()
        self._old_stacks.clear()
        self.new_identities.clear()

    # ---- what an owned volume reports (the "stats" message: callers never reach into the Volume)

    def stats(self, name: str) -> dict[str, Any] | None:
        vol = self.node.volumes.get(name)
        if vol is None:
            return None
        import dataclasses

        out: dict[str, Any] = {
            "size": vol.size, "block_size": vol.block_size, "blocks": vol.num_blocks,
            "stack": [type(d).__name__ for d in vol.layers], "layers": vol.to_config()["layers"],
            "capabilities": dataclasses.asdict(vol.capabilities),
            "naa": vol.naa.hex(), "eui64": vol.eui64.hex(), "nguid": vol.nguid.hex(),
            "io": vol.meter.report()}
        group = getattr(vol.device, "group", None)
        if group is not None:   # carved from a device or pool (volume/thin)
            out["carved"] = group.info(vol.device.name)
            from openvsan.node.groups import home_of

            spec = next((v for v in self.config.volumes if v.name == name), None)
            out["volume_group"] = (self.node.groups.space(home_of(spec), [v.name for v in self.config.volumes])
                                   if spec is not None else group.space())
        for layer in vol.layers:
            report = getattr(layer, "stats", None)
            if callable(report):
                out[f"{getattr(layer, 'type_name', 'layer')}_stats"] = report()
        return out

    def metrics(self) -> dict[str, Any]:
        """What /metrics shows of every volume here, in one message: size, stack, I/O counters, QoS, and the
        space of each volume group once (not once per volume)."""
        from openvsan.node.groups import home_of

        specs = {v.name: v for v in self.config.volumes}
        volumes: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for name, vol in self.node.volumes.items():
            entry: dict[str, Any] = {"size": vol.size, "stack": [type(d).__name__ for d in vol.layers],
                                     "io": vol.meter.report()}
            for layer in vol.layers:
                if getattr(layer, "type_name", None) in ("qos", "compress"):
                    entry[f"{layer.type_name}_stats"] = layer.stats()  # type: ignore[attr-defined]
            replication = getattr(self.node, "replication", None)
            status = replication.status(name) if replication is not None else None
            if status is not None:      # a replicated volume: its role, replicas, resync (controller.status)
                mirror = status.get("mirror") or {}
                entry["replication"] = {
                    "role": status["role"], "epoch": status["epoch"], "nodes": status["nodes"],
                    "in_sync": status["in_sync"], "fenced_refused": status["fence"]["refused"],
                    "writes": mirror.get("writes"), "peer_failures": mirror.get("peer_failures"),
                    "resync_bytes": mirror.get("resync_bytes"),
                    "dirty_regions": {n: p["dirty_regions"] for n, p in (status.get("peers") or {}).items()},
                    "region_size": status.get("region_size")}
            group = getattr(vol.device, "group", None)
            if group is not None and name in specs:
                home = home_of(specs[name])
                entry["group"] = home
                if home not in groups:
                    groups[home] = group.space()
            volumes[name] = entry
        return {"volumes": volumes, "groups": groups}

    # ---- devices and volumes

    async def _add_device(self, c: Change) -> None:
        spec: DeviceSpec = c.new
        kept = self._set_aside.pop(("device", spec.name), None)
        if kept is not None:
            self.node.devices[spec.name] = kept
            return
        from openvsan.node.node import open_device

        if spec.path is not None:
            spec.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.node.devices[spec.name] = open_device(spec, trust_foreign=self.node.state.config.node.trust_foreign_files,
                                                   memfd=self.node.memfd(spec.name))

    async def _remove_device(self, c: Change) -> None:
        self._set_aside[("device", c.key)] = self.node.devices.pop(c.key)

    async def _resize_device(self, c: Change) -> None:
        spec: DeviceSpec = c.new
        user = next((v for v in self.node.volumes.values() if v.device is self.node.devices[c.key]), None)
        blocks = (spec.size or 0) // spec.block_size
        if user is not None:
            await user.resize(blocks, timeout=self.swap_timeout)   # the frontends report the new capacity
            return
        dev = self.node.devices[c.key]
        if not dev.capabilities.resizable:
            raise ValueError(f"device {c.key}: a {spec.type} device of this kind cannot be resized")
        await dev.resize(blocks)  # type: ignore[attr-defined]

    def identity(self, name: str) -> VolumeIdentity:
        known = self.node.state.identities.get(name) or self.new_identities.get(name)
        if known is None:
            u = uuidlib.uuid4()
            known = self.new_identities[name] = VolumeIdentity(u, u.hex)
        return known

    async def _add_volume(self, c: Change) -> None:
        spec: VolumeSpec = c.new
        kept = self._set_aside.pop(("volume", spec.name), None)
        if kept is not None:
            self.node.volumes[spec.name] = kept
            return
        from openvsan.node.node import open_volume

        if spec.carved:
            await self.node.groups.open(self.config, self.node.base_of)
        base = await self.node.volume_base(spec)
        self.node.volumes[spec.name] = await open_volume(spec, base, self.identity(spec.name))

    async def _remove_volume(self, c: Change) -> None:
        self._set_aside[("volume", c.key)] = self.node.volumes.pop(c.key)

    async def _update_volume(self, c: Change) -> None:
        old: VolumeSpec = c.old
        new: VolumeSpec = c.new
        vol = self.node.volumes[c.key]
        if (old.encryption is None) != (new.encryption is None) or (
                old.encryption is not None and new.encryption is not None
                and (old.encryption.format, old.encryption.cipher) != (new.encryption.format, new.encryption.cipher)):
            from openvsan.node.control import Conflict

            raise Conflict(f"volume {c.key}: whether and how it is encrypted cannot change while it holds data (a new "
                           "container would make what is stored unreadable); create a new volume and copy the data")
        if (old.compression is None) != (new.compression is None) or (
                old.compression is not None and old.chunk_bytes != new.chunk_bytes):
            from openvsan.node.control import Conflict

            raise Conflict(f"volume {c.key}: whether it is compressed, and in what chunks, cannot change while it holds "
                           "data (its chunks are stored in a layout of their own); create a new volume and copy the data")
        if (old.compression, old.compression_frame) != (new.compression, new.compression_frame):
            # another algorithm or frame size: new versions use it, the old ones still read
            squeeze = next(d for d in vol.layers if getattr(d, "type_name", None) == "compress")
            squeeze.set_algorithm(new.compression, new.compression_frame)  # type: ignore[attr-defined]
        if old.compression_cache != new.compression_cache:
            squeeze = next(d for d in vol.layers if getattr(d, "type_name", None) == "compress")
            squeeze.set_cache(new.compression_cache)  # type: ignore[attr-defined]
        # another key file (or setting) for the same container: the stack is opened again below, the container
        # unlocked with it (a key file that does not open it fails the change, and nothing changes)
        qos = next((d for d in vol.layers if getattr(d, "type_name", None) == "qos"), None)
        if old.qos and new.qos and qos is not None and old.encryption == new.encryption and [
                x["type"] for x in old.layers] == [x["type"] for x in new.layers]:
            from openvsan.volume.qos import QosLimits

            qos.set_limits(QosLimits.from_dict(new.qos))   # in place: waiting commands judged anew, no drain
        elif old.layers != new.layers:
            kept = None
            if qos is not None and not new.qos:
                from openvsan.volume.qos import QosLimits

                kept = qos.limits
                qos.set_limits(QosLimits())   # its waiting commands go now, so the drain below is quick
            # the stack changes under the frontends: in-flight I/O drains, new I/O waits, nobody sees an error
            try:
                stack = await open_stack(vol.device, new.layers, name=c.key, reuse=vol.layers)   # crypt: kept
                self._old_stacks.append(await vol.swap(stack, timeout=self.swap_timeout))
            except BaseException:
                if kept is not None:
                    qos.set_limits(kept)      # the swap changed nothing, so neither do the limits
                raise
        if old.size != new.size and new.size is not None:
            # a carved volume's size (volume/thin): the group grows it, or shrinks it if nothing is mapped beyond
            await vol.resize(new.size // vol.block_size, timeout=self.swap_timeout)
        if old.read_only != new.read_only:
            self._set_read_only(c.key, new.read_only)

    def _set_read_only(self, volume: str, read_only: bool) -> None:
        node = self.node
        lun = node.luns.get(volume)
        if lun is not None:
            lun.read_only = read_only
        if node.nvme_server is not None:
            for sub in node.nvme_server.fabric.subsystems.values():
                for ns in sub.namespaces.values():
                    if ns.volume.name == volume:
                        ns.read_only = read_only
        for e in node.nbd_exports:
            if e.volume.name == volume:
                spec = next((x for x in self.config.nbd_exports if x.name == e.name), None)
                e.read_only = read_only or bool(spec and spec.read_only)

    # ---- iSCSI

    def _target(self, iqn: str) -> Any:
        return self.node.server.targets[iqn]

    async def _add_target(self, c: Change) -> None:
        spec: TargetSpec = c.new
        node = self.node
        t = node.build_target(spec)
        await node.server.add_target(t)
        node.targets.append(t)

    async def _remove_target(self, c: Change) -> None:
        t = await self.node.server.remove_target(c.key)
        self.node.targets.remove(t)

    async def _update_target(self, c: Change) -> None:
        spec: TargetSpec = c.new
        t = self._target(c.key)
        fresh = self.node.build_target(spec)
        for name in ("portals", "advertised_portals", "allowed_initiators", "chap", "mutual_chap", "alias",
                     "portal_group_tag"):
            setattr(t, name, getattr(fresh, name))   # new logins see them; sessions logged in keep going
        await self.node.server.sync_portals()

    async def _add_lun(self, c: Change) -> None:
        self._target(c.parent).scsi.add_lun(c.new.lun, self.node.lun_for(c.new.volume))

    async def _remove_lun(self, c: Change) -> None:
        self._target(c.parent).scsi.remove_lun(c.old.lun)
        self.node.drop_lun_if_unused(c.old.volume)

    # ---- NVMe/TCP

    async def _nvme(self) -> Any:
        node = self.node
        if node.nvme_server is None:
            await node.start_nvme([])
        return node.nvme_server

    async def _add_subsystem(self, c: Change) -> None:
        spec: SubsystemSpec = c.new
        server = await self._nvme()
        cfg = self.node.build_subsystem(spec)
        await server.add_subsystem(cfg)
        self.node.subsystems.append(cfg)
        if self.node.replication is not None:
            self.node.replication.refresh_paths()

    async def _remove_subsystem(self, c: Change) -> None:
        await self.node.nvme_server.remove_subsystem(c.key)
        self.node.subsystems = [s for s in self.node.subsystems if s.nqn != c.key]

    async def _update_subsystem(self, c: Change) -> None:
        spec: SubsystemSpec = c.new
        await self.node.nvme_server.update_subsystem(self.node.build_subsystem(spec))

    async def _add_namespace(self, c: Change) -> None:
        from openvsan.protocol.nvme.subsystem import Namespace

        vol = self.node.volumes[c.new.volume]
        read_only = self.config.volume(c.new.volume).read_only
        self.node.nvme_server.subsystem(c.parent).add_namespace(Namespace(c.new.nsid, vol, read_only))
        if self.node.replication is not None:
            self.node.replication.refresh_paths()     # a replicated volume's namespace: its ANA group, shared state

    async def _remove_namespace(self, c: Change) -> None:
        self.node.nvme_server.subsystem(c.parent).remove_namespace(c.old.nsid)

    # ---- NBD

    async def _add_nbd_export(self, c: Change) -> None:
        spec: NbdExportSpec = c.new
        node = self.node
        if node.nbd_server is None:
            await node.start_nbd([])
        e = node.build_nbd_export(spec)
        await node.nbd_server.add_export(e)
        node.nbd_exports.append(e)

    async def _remove_nbd_export(self, c: Change) -> None:
        e = await self.node.nbd_server.remove_export(c.key)
        self.node.nbd_exports.remove(e)


def volume_identities(state: Any) -> dict[str, dict[str, Any]]:
    """Each volume's uuid, serial and read-only flag, from the node's stored state (for /metrics' info)."""
    out = {}
    for v in state.config.volumes:
        ident = state.identities.get(v.name)
        out[v.name] = {"uuid": str(ident.uuid) if ident else "", "serial": ident.serial if ident else "",
                       "read_only": v.read_only}
    return out
