"""The node's volume groups: a device or pool that volumes with a `size` are carved from (volume/thin), and the
control socket's `snapshot.*` commands on them.

At start the node opens each device or pool that carved volumes name: a blank one is formatted as a volume
group (with the device's or pool's `cluster`), one that holds a group is opened (its journal replayed), and
anything else is refused with one line. Each carved volume of the config is then found in its group, or
created (thin or thick, its size); a volume of the group that the config no longer names is kept (its data is
not thrown away by an edit of the file) and logged. Snapshots live in the group only, until a volume with
`snapshot = true` names one to serve it read-only.

Fill level: once the group's use crosses its `soft_threshold` (% of its clusters), the volumes' listeners hear
"thin-threshold" once per crossing (SCSI: THIN PROVISIONING SOFT THRESHOLD REACHED)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from openvsan.block import BlockDevice
from openvsan.block.errors import BlockError
from openvsan.node.control import RequestError
from openvsan.node.specs import NodeConfig, VolumeSpec
from openvsan.node.values import format_size
from openvsan.volume.thin import GroupError, LogicalVolume, VolumeGroup
from openvsan.volume.thin.format import FormatError

if TYPE_CHECKING:
    from openvsan.node.node import Node

log = logging.getLogger("openvsan.node")


class GroupSetupError(RuntimeError):
    """A volume group cannot be opened or a carved volume made, so the node cannot serve; one line."""


@dataclass
class ServedGroup:
    where: str                 # "device d0" or "pool p0"
    group: VolumeGroup
    soft_threshold: int        # % in use that raises the soft-threshold notice
    over: bool = False         # above it now (the notice is given once per crossing)


def homes(cfg: NodeConfig) -> dict[str, list[VolumeSpec]]:
    """"device X" / "pool X" -> the carved volumes of the config that live there."""
    out: dict[str, list[VolumeSpec]] = {}
    for v in cfg.volumes:
        if v.carved:
            out.setdefault(home_of(v), []).append(v)
    return out


def home_of(v: VolumeSpec) -> str:
    return f"pool {v.pool}" if v.pool is not None else f"device {v.device}"


WATCH_INTERVAL = 1.0    # seconds between looks at the groups' fill level (the soft threshold)


class ServedGroups(Mapping[str, ServedGroup]):
    def __init__(self) -> None:
        self._groups: dict[str, ServedGroup] = {}
        self._watch: asyncio.Task[None] | None = None

    def start_watch(self, notify: Callable[[list[str]], None]) -> None:
        """Once a second: a group whose use went above its soft threshold has notify(its volume names) called."""
        async def watch() -> None:
            while True:
                await asyncio.sleep(WATCH_INTERVAL)
                for where in list(self._groups):
                    try:
                        self.check_threshold(where, notify)
                    except Exception:  # a notice is not worth stopping the watch for
                        log.exception("%s: soft threshold check failed", where)

        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(watch())

    async def stop_watch(self) -> None:
        task, self._watch = self._watch, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __getitem__(self, where: str) -> ServedGroup:
        return self._groups[where]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    async def open(self, cfg: NodeConfig, base_of: Any) -> None:
        """Open (or format) the group under every device or pool carved volumes name; base_of(where) gives
        the device or pool."""
        for where, volumes in homes(cfg).items():
            if where in self._groups:
                continue
            kind, name = where.split(" ", 1)
            spec = cfg.pool(name) if kind == "pool" else cfg.device(name)
            base: BlockDevice = base_of(where)
            try:
                sb = await VolumeGroup.probe(base)
                if sb is None:
                    group = await VolumeGroup.format(base, cluster_size=spec.cluster, name=name)
                    log.info("%s: a new volume group (%s clusters of %s, %s for data)", where, group.clusters,
                             format_size(spec.cluster), format_size(group.clusters * spec.cluster))
                else:
                    group = await VolumeGroup.open(base)
            except (GroupError, FormatError, BlockError) as e:
                raise GroupSetupError(f"{where}: {e}") from None
            self._groups[where] = ServedGroup(where, group, spec.soft_threshold)
            known = {v.name for v in volumes}
            for lv in group.names():
                info = group.info(lv)
                if lv not in known and info["kind"] == "volume":
                    log.warning("%s: volume %s (%s) is in its volume group but not in the config; it is kept "
                                "(`vsan volume delete %s` after adding it back removes it)", where, lv,
                                format_size(info["size"]), lv)

    async def volume(self, v: VolumeSpec, cfg: NodeConfig | None = None) -> LogicalVolume:
        """The carved volume's device: found in its group, or made there now (its size and thin-ness). A
        snapshot is checked against the volume it was taken of (in `cfg`): it is read through the same
        encryption and compression, or its bytes would be served as they lie on the device."""
        sg = self._groups[home_of(v)]
        g = sg.group
        try:
            if v.name not in g.by_name:
                if v.snapshot:
                    raise GroupSetupError(f"volume {v.name}: no snapshot {v.name!r} in the volume group of "
                                          f"{sg.where}; `vsan snapshot list` shows what there is")
                assert v.carved_size is not None
                lv = await g.create(v.name, v.carved_size, thin=v.thin)
                log.info("%s: volume %s created (%s, %s)", sg.where, v.name, format_size(v.size),
                         "thin" if v.thin else "thick")
            else:
                lv = g.volume(v.name)
                info = g.info(v.name)
                if v.snapshot and info["kind"] != "snapshot":
                    raise GroupSetupError(f"volume {v.name}: {v.name!r} in {sg.where} is a volume, not a snapshot; "
                                          "remove snapshot = true")
                if v.snapshot and cfg is not None:
                    _same_layers_as_origin(v, g, cfg)
                if not v.snapshot and info["kind"] == "snapshot":
                    raise GroupSetupError(f"volume {v.name}: {v.name!r} in {sg.where} is a snapshot; serve it with "
                                          "snapshot = true (read-only), or clone it")
                if v.carved_size is not None and v.carved_size > info["size"]:
                    await g.resize(v.name, v.carved_size)
                    log.info("%s: volume %s grown to %s", sg.where, v.name, format_size(v.size))
                elif v.carved_size is not None and v.carved_size < info["size"]:
                    log.warning("%s: volume %s is %s in its group, more than the config's %s; it keeps its size "
                                "(`vsan volume resize` shrinks it)", sg.where, v.name, format_size(info["size"]),
                                format_size(v.size))
        except (GroupError, BlockError) as e:
            raise GroupSetupError(f"volume {v.name}: {e}") from None
        lv.in_use = True
        lv.on_change = None
        return lv

    def check_threshold(self, where: str, notify: Callable[[list[str]], None]) -> None:
        """The soft threshold: notify(volume names of the group) once each time its use goes above it."""
        sg = self._groups.get(where)
        if sg is None:
            return
        g = sg.group
        over = g.used * 100 >= sg.soft_threshold * g.clusters
        if over and not sg.over:
            log.warning("%s: volume group %d%% in use, above its soft threshold (%d%%)", where,
                        g.used * 100 // max(1, g.clusters), sg.soft_threshold)
            notify(g.names())
        sg.over = over

    async def close_one(self, where: str) -> None:
        sg = self._groups.pop(where, None)
        if sg is not None:
            await sg.group.close()

    async def close(self) -> None:
        await self.stop_watch()
        for where, sg in self._groups.items():
            try:
                await sg.group.close()
            except Exception as e:  # noqa: BLE001 - close the others
                log.error("%s: closing its volume group failed: %s", where, e)
        self._groups.clear()

    def space(self, where: str, served: Iterable[str] = ()) -> dict[str, Any] | None:
        """The group's space and its volumes, snapshots and clones; each marked served when `served` (the
        config's volume names) holds it, so a clone or snapshot nobody serves is seen."""
        sg = self._groups.get(where)
        if sg is None:
            return None
        out = sg.group.space()
        out["soft_threshold"] = sg.soft_threshold
        names = set(served)
        out["listing"] = [sg.group.info(n) | {"served": n in names} for n in sg.group.names()]
        return out


def _sealed_kinds(v: VolumeSpec) -> list[str]:
    """The layers of a volume's stack that change how its bytes lie on the device."""
    return [layer["type"] for layer in v.layers if layer["type"] in ("crypt", "compress")]


def _same_layers_as_origin(snap: VolumeSpec, g: VolumeGroup, cfg: NodeConfig) -> None:
    """GroupSetupError unless a served snapshot names the encryption and compression of the volume it comes
    from (the nearest one up its chain that the config serves as a volume)."""
    origin = g.origin_of(snap.name)
    seen = {snap.name}
    while origin is not None and origin not in seen:
        seen.add(origin)
        spec = next((x for x in cfg.volumes if x.name == origin and not x.snapshot), None)
        if spec is not None:
            if _sealed_kinds(spec) != _sealed_kinds(snap):
                words = {"crypt": "encryption", "compress": "compression"}
                need = " and ".join(words[k] for k in _sealed_kinds(spec)) or "no encryption or compression"
                raise GroupSetupError(f"volume {snap.name}: a snapshot of volume {origin}, so it is read through "
                                      f"{need}, as {origin} is; give it the same (with --key-file and "
                                      "--compression)")
            return
        origin = g.origin_of(origin)


# ---- snapshot.* commands (the node's control socket; node/live.py routes them here)

def _group_of(node: Node, volume: str) -> ServedGroup:
    cfg = node.state.config
    try:
        spec = cfg.volume(volume)
    except StopIteration:
        names = [v.name for v in cfg.volumes if v.carved]
        raise RequestError(f"no volume named {volume!r} (carved volumes: {', '.join(names) or 'none'})") from None
    if not spec.carved:
        raise RequestError(f"volume {volume} is its {'pool' if spec.pool else 'device'}'s whole size; snapshots are "
                           "of volumes carved from a device or pool (give a volume a size)")
    if spec.replicated:
        raise RequestError(f"volume {volume} is replicated: a snapshot of this node's replica alone would not be "
                           "on the others (nor survive a failover); snapshots of replicated volumes are not "
                           "supported yet")
    return node.groups[home_of(spec)]


async def snapshot_command(node: Node, cmd: str, args: dict[str, Any]) -> Any:
    volume = str(args.get("volume") or "")
    sg = _group_of(node, volume)
    g = sg.group
    try:
        if cmd == "snapshot.create":
            name = str(args["name"])
            vol = node.volumes.get(volume)
            if vol is not None:
                # what its stack holds in memory (a compressed volume's write cache) goes into the snapshot too:
                # it holds every write completed before it
                await vol.write_back()
            await g.snapshot(volume, name)
            return g.info(name)
        if cmd == "snapshot.list":
            infos = {n: g.info(n) for n in g.names()}
            return [i for n, i in infos.items() if i["kind"] == "snapshot"
                    and (args.get("all") or _descends(infos, n, volume))]
        if cmd == "snapshot.delete":
            name = str(args["name"])
            info = g.info(name) if name in g.by_name else None
            if info is None or not (info["kind"] == "snapshot" or info["origin"] is not None):
                raise RequestError(f"no snapshot or clone {name!r} in this volume group; `vsan snapshot list` shows "
                                   "the snapshots (a volume is deleted with `vsan volume delete`)")
            if any(v.name == name for v in node.state.config.volumes):
                raise RequestError(f"{info['kind'] if info['kind'] == 'snapshot' else 'clone'} {name} is served (a "
                                   "volume of the config); remove that volume first")
            await g.delete(name)
            return {"deleted": name}
        if cmd == "snapshot.rollback":
            name = str(args["name"])
            _is_snapshot(g, name)
            vol = node.volumes.get(volume)
            if vol is None:
                await g.rollback(volume, name)
            else:
                await vol.change_contents(lambda: g.rollback(volume, name))
            return g.info(volume)
        if cmd == "snapshot.decouple":
            done = await g.decouple(volume, allocate=bool(args.get("allocate")))
            return g.info(volume) | done
        if cmd == "snapshot.clone":
            name, new = str(args["name"]), str(args["clone"])
            _is_snapshot(g, name)
            await g.clone(name, new)
            return g.info(new)
    except GroupError as e:
        raise RequestError(str(e)) from None
    raise RequestError(f"unknown command {cmd}")


def _is_snapshot(g: VolumeGroup, name: str) -> None:
    if name not in g.by_name or g.info(name)["kind"] != "snapshot":
        raise RequestError(f"no snapshot {name!r} in this volume group; `vsan snapshot list` shows them")


def _descends(infos: dict[str, dict[str, Any]], name: str, volume: str) -> bool:
    """Is snapshot `name` of `volume` (directly, or of a snapshot of it)? `infos`: the group's, by name."""
    seen: set[str] = set()
    origin = infos[name]["origin"]
    while origin is not None and origin not in seen:
        if origin == volume:
            return True
        seen.add(origin)
        origin = infos[origin]["origin"] if origin in infos else None
    return False
