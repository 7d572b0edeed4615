"""The live node's control commands: `vsan volume|export|qos|config apply` over the control socket (and, later,
the REST API). Each one edits the node's desired state as a config document (node/render.py), parses it
again with every check a config file gets (node/config.py, the same one-line errors), and has the node apply
the difference while it serves (Node.apply). Nothing is stored unless all of it was applied."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from openvsan.node import requests as R
from openvsan.node.config import ConfigError, load_config, one_line, parse_config
from openvsan.node.control import Conflict, NotFound, RequestError
from openvsan.node.reconcile import Change, PlanRefused
from openvsan.node.render import config_document
from openvsan.node.specs import NodeConfig

if TYPE_CHECKING:
    from openvsan.node.node import Node

log = logging.getLogger("openvsan.node.live")

Command = Callable[["Node", dict[str, Any]], Awaitable[Any]]
# the revision of the desired state a request was made against (the REST API's If-Match), or None: a change
# is then applied only if the node's desired state is still at that revision (else Stale)
EXPECTED_REVISION: ContextVar[int | None] = ContextVar("expected_revision", default=None)
COMMANDS: dict[str, Command] = {}

DEFAULT_PORT = {"iscsi": 3260, "nvme": 4420, "nbd": 10809}


def command(name: str, body: type[Any] = R.Plain) -> Callable[[Callable[[Node, Any], Awaitable[Any]]], Command]:
    """Register a command whose arguments are a `body` (node/requests.py): validated there, with the
    one-line errors a config gets, before the command runs."""
    adapter: TypeAdapter[Any] = TypeAdapter(body)

    def register(fn: Callable[[Node, Any], Awaitable[Any]]) -> Command:
        async def run(node: Node, args: dict[str, Any]) -> Any:
            try:
                request = adapter.validate_python(args)
            except ValidationError as e:
                raise RequestError(one_line(e, body)) from None
            return await fn(node, request)
        COMMANDS[name] = run
        return run
    return register


async def _apply(node: Node, doc: dict[str, Any], *, dry_run: bool = False,
                 forget: tuple[str, ...] = ()) -> list[str]:
    try:
        desired = parse_config(doc, data_dir=node.data_dir)
    except ConfigError as e:
        raise RequestError(str(e)) from None
    desired = dataclasses.replace(desired, source=node.state.config.source)
    return await _apply_config(node, desired, dry_run=dry_run, forget=forget)


async def _apply_config(node: Node, desired: NodeConfig, *, dry_run: bool = False,
                        forget: tuple[str, ...] = ()) -> list[str]:
    try:
        changes: list[Change] = await node.apply(desired, dry_run=dry_run, forget=forget,
                                                 expect_revision=EXPECTED_REVISION.get())
    except PlanRefused as e:
        raise Conflict(str(e)) from None
    return [str(c) for c in changes]


def _doc(node: Node) -> dict[str, Any]:
    # config_document builds every table and list anew: the command may edit it in place
    return config_document(node.state.config)


def _no_volume(name: str, known: list[str]) -> NotFound:
    return NotFound(f"no volume named {name!r} (volumes: {', '.join(known) or 'none'}); `vsan volume list` "
                        "shows them")


def _volume_entry(doc: dict[str, Any], name: str) -> dict[str, Any]:
    for v in doc.get("volumes", []):
        if v["name"] == name:
            return v  # type: ignore[no-any-return]
    raise _no_volume(name, [v["name"] for v in doc.get("volumes", [])])


def _known_volume(node: Node, name: str) -> None:
    names = [v.name for v in node.state.config.volumes]
    if name not in names:
        raise _no_volume(name, names)


# ---- volumes

@command("volume.create", R.VolumeCreate)
async def volume_create(node: Node, args: R.VolumeCreate) -> Any:
    name = args.name
    doc = _doc(node)
    if any(v["name"] == name for v in doc.get("volumes", [])):
        raise Conflict(f"volume {name} exists; pick another name, or `vsan volume delete {name}` first")
    volume: dict[str, Any] = {"name": name, "read_only": args.read_only}
    if args.pool is not None:
        volume["pool"] = args.pool
    elif args.device is not None:
        volume["device"] = args.device
    if args.pool is not None or args.device is not None:
        if args.snapshot:    # a snapshot of the group there, served read-only
            volume.update(snapshot=True, read_only=True)
        elif args.size is not None:    # carved from it, with the other volumes there (volume/thin)
            volume.update(size=args.size, thin=args.thin)
    else:
        if any(d["name"] == name for d in doc.get("devices", [])):
            raise Conflict(f"a device named {name} exists; give the volume another name, or put it on that "
                               f"device with --device {name}")
        if args.size is None:
            raise RequestError("size: missing; give the volume's size (e.g. 256MiB), or a device or pool to put "
                               "it on")
        device: dict[str, Any] = {"name": name, "type": args.backing, "size": args.size,
                                  "block_size": args.block_size}
        if args.backing == "file":
            path = args.path or str(node.data_dir / "volumes" / f"{name}.img")
            device["path"] = str(Path(path).absolute())
        doc.setdefault("devices", []).append(device)
        volume["device"] = name
    if args.key_file is not None:
        volume["encryption"] = {"key_file": str(Path(args.key_file).absolute())}
        if args.compression is not None:
            volume["encryption"]["allow_discards"] = True   # the compressed chunks' old versions go back
    if args.compression is not None:
        volume["compression"] = args.compression
    if args.compression_chunk is not None:
        volume["compression_chunk"] = args.compression_chunk
    if args.compression_frame is not None:
        volume["compression_frame"] = args.compression_frame
    if args.compression_cache is not None:
        volume["compression_cache"] = args.compression_cache
    doc.setdefault("volumes", []).append(volume)
    return {"changes": await _apply(node, doc, dry_run=args.dry_run),
            "volume": await _describe(node, name) if not args.dry_run else None}


@command("volume.resize", R.VolumeResize)
async def volume_resize(node: Node, args: R.VolumeResize) -> Any:
    name = args.name
    doc = _doc(node)
    v = _volume_entry(doc, name)
    if v.get("snapshot"):
        raise Conflict(f"volume {name} serves a snapshot, which keeps the size it was taken with")
    if "size" in v:    # carved from its device or pool: the group resizes it
        v["size"] = args.size
        return {"changes": await _apply(node, doc, dry_run=args.dry_run), "volume": await _describe(node, name)}
    if "pool" in v:
        raise Conflict(f"volume {name} is its pool's whole size; grow the pool instead")
    dev = next(d for d in doc["devices"] if d["name"] == v["device"])
    size = args.size
    if size % dev["block_size"]:
        raise RequestError(f"size: {size} bytes is not a whole number of {dev['block_size']}-byte blocks")
    dev["size"] = size
    return {"changes": await _apply(node, doc, dry_run=args.dry_run), "volume": await _describe(node, name)}


def _exports_of(doc: dict[str, Any], name: str) -> list[str]:
    out = [f"iSCSI {t['iqn']} LUN {x['lun']}" for t in doc.get("iscsi", {}).get("targets", [])
           for x in t["luns"] if x["volume"] == name]
    out += [f"NVMe {s['nqn']} namespace {x['nsid']}" for s in doc.get("nvme", {}).get("subsystems", [])
            for x in s["namespaces"] if x["volume"] == name]
    out += [f"NBD {e['name']}" for e in doc.get("nbd", {}).get("exports", []) if e["volume"] == name]
    return out


def _drop_exports(doc: dict[str, Any], name: str) -> None:
    iscsi = doc.get("iscsi", {})
    for t in iscsi.get("targets", []):
        t["luns"] = [x for x in t["luns"] if x["volume"] != name]
    if iscsi:
        iscsi["targets"] = [t for t in iscsi["targets"] if t["luns"]]
    nvme = doc.get("nvme", {})
    for s in nvme.get("subsystems", []):
        s["namespaces"] = [x for x in s["namespaces"] if x["volume"] != name]
    if nvme:
        nvme["subsystems"] = [s for s in nvme["subsystems"] if s["namespaces"]]
    nbd = doc.get("nbd", {})
    if nbd:
        nbd["exports"] = [e for e in nbd["exports"] if e["volume"] != name]


@command("volume.delete", R.VolumeDelete)
async def volume_delete(node: Node, args: R.VolumeDelete) -> Any:
    name = args.name
    doc = _doc(node)
    v = _volume_entry(doc, name)
    exports = _exports_of(doc, name)
    if exports and not args.force:
        raise Conflict(f"volume {name} is exported ({'; '.join(exports)}); remove the exports first "
                           "(`vsan export remove ...`), or pass --force to remove them with it")
    _drop_exports(doc, name)
    doc["volumes"] = [x for x in doc["volumes"] if x["name"] != name]
    own = None
    if v.get("device") == name:   # made for it by `vsan volume create`: it goes too
        own = next(d for d in doc["devices"] if d["name"] == name)
        doc["devices"] = [d for d in doc["devices"] if d["name"] != name]
    changes = await _apply(node, doc, dry_run=args.dry_run, forget=(name,))
    if own is not None and own.get("path") and not args.dry_run:
        path = Path(own["path"])
        if path.parent == node.data_dir / "volumes" and path.is_file():
            path.unlink()   # a file we made in the data dir: its space comes back
    return {"changes": changes}


async def _describe(node: Node, name: str, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """One volume as `vsan volume show` prints it; `doc` is the node's config document, when the caller
    has it already (volume list: rendered once for every volume)."""
    cfg = node.state.config
    spec = cfg.volume(name)
    ident = node.state.identities.get(name)
    out: dict[str, Any] = {"name": name, "read_only": spec.read_only, "device": spec.device, "pool": spec.pool,
                           "exports": _exports_of(doc if doc is not None else config_document(cfg), name),
                           "qos": dict(spec.qos)}
    if ident is not None:
        out.update(uuid=str(ident.uuid), serial=ident.serial)
    out.update(await node.volume_stats(name) or {})
    return out


@command("volume.list")
async def volume_list(node: Node, args: R.Plain) -> Any:
    doc = config_document(node.state.config)
    return [await _describe(node, v.name, doc) for v in node.state.config.volumes]


@command("volume.show", R.VolumeShow)
async def volume_show(node: Node, args: R.VolumeShow) -> Any:
    _known_volume(node, args.name)
    return await _describe(node, args.name)


@command("volume.status", R.VolumeShow)
async def volume_status(node: Node, args: R.VolumeShow) -> Any:
    """A volume's replication: this node's role, the epoch and primary, replicas in and out of sync, resync
    progress, fence counters (replication/controller.py status)."""
    _known_volume(node, args.name)
    status = node.replication.status(args.name) if node.replication is not None else None
    return {"volume": args.name, "replicated": status is not None, **(status or {})}


async def _replication_call(node: Node, name: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
    """`call(node.replication)` for a replicated volume; what it refuses is one line for the user."""
    _known_volume(node, name)
    if node.replication is None or node.replication.status(name) is None:
        raise RequestError(f"volume {name} is not replicated")
    try:
        return await call(node.replication)
    except Exception as e:  # noqa: BLE001 - not the primary, another replica in sync, or the store: one line
        raise RequestError(str(e)) from None


@command("volume.move_primary", R.VolumeShow)
async def volume_move_primary(node: Node, args: R.VolumeShow) -> Any:
    """A planned switchover: this node, the primary, drains and gives up its epoch; an in-sync peer claims it."""
    return await _replication_call(node, args.name, lambda r: r.move_primary(args.name))


@command("volume.force_in_sync", R.VolumeShow)
async def volume_force_in_sync(node: Node, args: R.VolumeShow) -> Any:
    """Last resort when no replica is in sync: this node's replica is declared in sync as it is."""
    return await _replication_call(node, args.name, lambda r: r.force(args.name))


def _crypt_layer(node: Node, name: str) -> Any:
    from openvsan.volume.crypt import CryptLayer

    _known_volume(node, name)
    vol = node.volumes.get(name)
    layer = next((d for d in vol.layers if isinstance(d, CryptLayer)), None) if vol is not None else None
    if layer is None:
        raise RequestError(f"volume {name} is not encrypted (its config has no encryption table)")
    return layer


async def _keyslot_change(node: Node, args: R.VolumeKey, add: bool) -> Any:
    """A keyslot added (add) or wiped for the passphrase `args.key_file` holds; its answer, or the refusal."""
    from openvsan.volume.crypt import CryptError, read_key_file

    layer = _crypt_layer(node, args.name)
    try:
        passphrase = read_key_file(args.key_file)
        slot, keyslots = await (layer.add_passphrase(passphrase) if add else layer.remove_passphrase(passphrase))
    except (CryptError, ValueError) as e:
        raise RequestError(f"volume {args.name}: {e}") from None
    done = f"opens it now (keyslot {slot})" if add else f"no longer opens it (keyslot {slot} wiped)"
    return {"volume": args.name, "keyslot": slot, "keyslots": keyslots,
            "message": f"volume {args.name}: key file {args.key_file} {done}"}


@command("volume.add_key", R.VolumeKey)
async def volume_add_key(node: Node, args: R.VolumeKey) -> Any:
    """Another passphrase (a key file's bytes) for an encrypted volume: a new LUKS2 keyslot, written while the
    volume serves; the data is not re-encrypted. The node holds the volume key, so no old passphrase is asked."""
    return await _keyslot_change(node, args, add=True)


@command("volume.remove_key", R.VolumeKey)
async def volume_remove_key(node: Node, args: R.VolumeKey) -> Any:
    """Forget the passphrase a key file holds (its keyslot is overwritten). Refused for the key file the node
    unlocks the volume with at start, and for the last keyslot."""
    layer = _crypt_layer(node, args.name)
    if layer.settings.get("key_file") and Path(args.key_file).absolute() == Path(layer.settings["key_file"]).absolute():
        raise Conflict(f"volume {args.name}: {args.key_file} is the key file this node unlocks it with at start; "
                       "point encryption.key_file at another key file first (vsan config apply)")
    return await _keyslot_change(node, args, add=False)


def _encrypted_spec(node: Node, name: str) -> Any:
    _known_volume(node, name)
    spec = node.state.config.volume(name)
    if spec.encryption is None:
        raise RequestError(f"volume {name} is not encrypted (its config has no encryption table)")
    if node.volumes.get(name) is None:
        raise RequestError(f"volume {name} is not open on this node")
    return spec


def _locked_layer(node: Node, name: str) -> Any:
    from openvsan.volume.crypt import LockedLayer

    vol = node.volumes[name]
    return next((d for d in vol.layers if isinstance(d, LockedLayer)), None)


@command("volume.lock", R.VolumeShow)
async def volume_lock(node: Node, args: R.VolumeShow) -> Any:
    """Lock an encrypted volume while it is exported: I/O in flight finishes and is flushed, the key leaves
    the node's memory, and every command from then on is answered "not ready" (sessions stay) until unlock."""
    from openvsan.volume.crypt import CryptError, locked_stack

    name = args.name
    spec = _encrypted_spec(node, name)
    vol = node.volumes[name]
    if _locked_layer(node, name) is not None:
        return {"volume": name, "locked": True, "message": f"volume {name} is already locked"}
    try:
        stack = await locked_stack(vol.device, spec.layers, name=name)
    except CryptError as e:
        raise RequestError(str(e)) from None
    old = await vol.swap(stack, timeout=node.plane.swap_timeout)
    try:
        await old.flush()          # what the stack held in a volatile cache (a compress layer's versions)
    finally:
        for layer in _layers_over(old, vol.device):
            await layer.close()
    log.info("volume %s locked: its key is no longer in memory", name)
    return {"volume": name, "locked": True, "message": f"volume {name} locked"}


def _layers_over(top: Any, device: Any) -> list[Any]:
    """The layers of a stack over `device` (the node's, not the layers' to close)."""
    from openvsan.block.layer import Layer, stack_of

    return [d for d in stack_of(top) if d is not device and isinstance(d, Layer)]


@command("volume.unlock", R.VolumeUnlock)
async def volume_unlock(node: Node, args: R.VolumeUnlock) -> Any:
    """Unlock a locked encrypted volume with its passphrase (typed, a key file, or what its config names):
    the container is opened, the stack above it built, and the volume serves again."""
    from openvsan.volume.crypt import CryptError, read_key_file
    from openvsan.volume.registry import open_stack

    name = args.name
    spec = _encrypted_spec(node, name)
    vol = node.volumes[name]
    if _locked_layer(node, name) is None:
        raise Conflict(f"volume {name} is not locked")
    try:
        passphrase = (args.passphrase.encode() if args.passphrase is not None else
                      read_key_file(args.key_file) if args.key_file is not None else None)
        if passphrase is None and spec.encryption.prompt:
            raise CryptError("it needs its passphrase: type it at the prompt of `vsan volume unlock`, or give "
                             "--key-file")
        stack = await open_stack(vol.device, spec.layers, name=name, passphrase=passphrase)
    except CryptError as e:
        raise RequestError(str(e) if str(e).startswith("volume ") else f"volume {name}: {e}") from None
    await vol.swap(stack, timeout=node.plane.swap_timeout)
    log.info("volume %s unlocked", name)
    return {"volume": name, "locked": False, "message": f"volume {name} unlocked"}


# ---- exports

def _portals(args: R.ExportAdd, fallback: list[str]) -> list[str]:
    return [str(p) for p in args.portals] or fallback or [f"127.0.0.1:{DEFAULT_PORT[args.protocol]}"]


def _free(used: set[int], first: int) -> int:
    n = first
    while n in used:
        n += 1
    return n


@command("export.add", R.ExportAdd)
async def export_add(node: Node, args: R.ExportAdd) -> Any:
    protocol, name, volume = args.protocol, args.name, args.volume
    doc = _doc(node)
    _volume_entry(doc, volume)
    if protocol == "iscsi":
        targets = doc.setdefault("iscsi", {}).setdefault("targets", [])
        t = next((x for x in targets if x["iqn"] == name), None)
        if t is None:
            t = {"iqn": name, "luns": [], "portals": _portals(args, targets[0]["portals"] if targets else [])}
            targets.append(t)
        lun = args.lun if args.lun is not None else _free({x["lun"] for x in t["luns"]}, 0)
        t["luns"].append({"lun": lun, "volume": volume})
    elif protocol == "nvme":
        nvme = doc.setdefault("nvme", {})
        subs = nvme.setdefault("subsystems", [])
        s = next((x for x in subs if x["nqn"] == name), None)
        if s is None:
            fallback = subs[0]["portals"] if subs else nvme.get("portals", [])
            s = {"nqn": name, "namespaces": [], "portals": _portals(args, fallback)}
            subs.append(s)
            nvme.setdefault("portals", s["portals"]) if not subs[:-1] and not nvme.get("portals") else None
        nsid = args.nsid if args.nsid is not None else _free({x["nsid"] for x in s["namespaces"]}, 1)
        s["namespaces"].append({"nsid": nsid, "volume": volume})
    elif protocol == "nbd":
        exports = doc.setdefault("nbd", {}).setdefault("exports", [])
        if any(e["name"] == name for e in exports):
            raise Conflict(f"NBD export {name} exists; pick another name or remove it first")
        exports.append({"name": name, "volume": volume, "read_only": args.read_only,
                        "portals": _portals(args, exports[0]["portals"] if exports else [])})
    return {"changes": await _apply(node, doc, dry_run=args.dry_run)}


@command("export.remove", R.ExportRemove)
async def export_remove(node: Node, args: R.ExportRemove) -> Any:
    protocol, name = args.protocol, args.name
    doc = _doc(node)
    if protocol == "iscsi":
        iscsi = doc.get("iscsi", {})
        t = next((x for x in iscsi.get("targets", []) if x["iqn"] == name), None)
        if t is None:
            raise NotFound(f"no iSCSI target {name}; `vsan export list` shows the exports")
        lun = args.lun
        if lun is None:
            iscsi["targets"].remove(t)
        else:
            if not any(x["lun"] == lun for x in t["luns"]):
                raise NotFound(f"{name} has no LUN {lun}")
            t["luns"] = [x for x in t["luns"] if x["lun"] != lun]
            if not t["luns"]:
                iscsi["targets"].remove(t)   # a target with no LUN serves nothing
    elif protocol == "nvme":
        nvme = doc.get("nvme", {})
        s = next((x for x in nvme.get("subsystems", []) if x["nqn"] == name), None)
        if s is None:
            raise NotFound(f"no NVMe subsystem {name}; `vsan export list` shows the exports")
        nsid = args.nsid
        if nsid is None:
            nvme["subsystems"].remove(s)
        else:
            if not any(x["nsid"] == nsid for x in s["namespaces"]):
                raise NotFound(f"{name} has no namespace {nsid}")
            s["namespaces"] = [x for x in s["namespaces"] if x["nsid"] != nsid]
            if not s["namespaces"]:
                nvme["subsystems"].remove(s)
    elif protocol == "nbd":
        nbd = doc.get("nbd", {})
        if not any(e["name"] == name for e in nbd.get("exports", [])):
            raise NotFound(f"no NBD export {name}; `vsan export list` shows the exports")
        nbd["exports"] = [e for e in nbd["exports"] if e["name"] != name]
    return {"changes": await _apply(node, doc, dry_run=args.dry_run)}


@command("export.list")
async def export_list(node: Node, args: R.Plain) -> Any:
    cfg = node.state.config
    out: list[dict[str, Any]] = []
    for t in cfg.targets:
        out += [{"protocol": "iscsi", "name": t.iqn, "lun": x.lun, "volume": x.volume,
                 "portals": [str(p) for p in t.portals]} for x in t.luns]
    for s in cfg.subsystems:
        out += [{"protocol": "nvme", "name": s.nqn, "nsid": x.nsid, "volume": x.volume,
                 "portals": [str(p) for p in s.portals]} for x in s.namespaces]
    out += [{"protocol": "nbd", "name": e.name, "volume": e.volume, "portals": [str(p) for p in e.portals]}
            for e in cfg.nbd_exports]
    return out


# ---- QoS

@command("qos.set", R.QosSet)
async def qos_set(node: Node, args: R.QosSet) -> Any:
    name = args.volume
    doc = _doc(node)
    v = _volume_entry(doc, name)
    qos = {} if args.clear else dict(v.get("qos", {}))
    for key, value in args.limits.items():
        if value in (0, None):
            qos.pop(key, None)
        else:
            qos[key] = value
    if qos:
        v["qos"] = qos
    else:
        v.pop("qos", None)
    return {"changes": await _apply(node, doc, dry_run=args.dry_run), "volume": await _describe(node, name)}


@command("qos.show", R.QosShow)
async def qos_show(node: Node, args: R.QosShow) -> Any:
    name = args.volume
    _known_volume(node, name)
    d = await _describe(node, name)
    return {"volume": name, "qos": d["qos"], "stats": d.get("qos_stats")}


# ---- the whole desired state

@command("config.apply", R.ConfigApply)
async def config_apply(node: Node, args: R.ConfigApply) -> Any:
    path = Path(args.path)
    try:
        desired = load_config(path, data_dir=node.data_dir)
    except ConfigError as e:
        raise RequestError(str(e)) from None
    except OSError as e:
        raise RequestError(f"{path}: {e.strerror}") from None
    gone = tuple(v.name for v in node.state.config.volumes if v.name not in {x.name for x in desired.volumes})
    return {"changes": await _apply_config(node, desired, dry_run=args.dry_run, forget=gone)}


@command("config.put", R.ConfigPut)
async def config_put(node: Node, args: R.ConfigPut) -> Any:
    gone = tuple(v.name for v in node.state.config.volumes
                 if v.name not in {x.get("name") for x in args.document.get("volumes", ()) if isinstance(x, dict)})
    return {"changes": await _apply(node, dict(args.document), dry_run=args.dry_run, forget=gone)}


@command("node.info")
async def node_info(node: Node, args: R.Plain) -> Any:
    """The node as the REST API's /api/v1/node shows it: its name, desired-state revision and shape."""
    from openvsan import __version__

    cfg = node.state.config
    workers = getattr(node, "workers", None)   # a supervisor's count; a node in one process has none
    return {"name": cfg.node.name, "version": __version__, "revision": node.state.revision,
            "data_dir": str(node.data_dir), "workers": workers if isinstance(workers, int) else 1,
            "cluster": cfg.cluster.id if cfg.cluster is not None else None,
            "devices": len(cfg.devices), "pools": len(cfg.pools), "volumes": len(cfg.volumes),
            "exports": len(cfg.targets) + len(cfg.subsystems) + len(cfg.nbd_exports)}


@command("cluster.status")
async def cluster_status(node: Node, args: R.Plain) -> Any:
    """The whole cluster as its store has it (members up or not, every replicated volume's primary, epoch and
    replicas): what `vsan cluster status` prints, from any member."""
    from openvsan.cluster.membership import status

    replication = node.replication
    if replication is None or getattr(replication, "store", None) is None:
        raise RequestError("this node is not in a cluster (its config has no [cluster] table)")
    return await status(replication.store)


@command("device.list")
async def device_list(node: Node, args: R.Plain) -> Any:
    """The node's devices: type, size, where their data lives, and who uses each (a volume, a pool, or the
    volume group carved from it)."""
    cfg = node.state.config
    carved = {v.device for v in cfg.volumes if v.device is not None and v.size is not None}
    return [{"name": d.name, "type": d.type, "size": d.size, "block_size": d.block_size,
             "path": str(d.path) if d.path else None, "backing": str(d.backing) if d.backing else None,
             "used_by": f"volume group device {d.name}" if d.name in carved else cfg.device_user(d.name)}
            for d in cfg.devices]


@command("node.health")
async def node_health(node: Node, args: R.Plain) -> Any:
    """What is not right on this node, why, and what to do (node/health.py)."""
    from openvsan.node.health import report

    cfg = node.state.config
    cert = cfg.api.tls.cert if cfg.api is not None and cfg.api.tls is not None else None
    return await report(node.control, cert=cert, replicated=[v.name for v in cfg.volumes if v.replicas > 1])


@command("config.show")
async def config_show(node: Node, args: R.Plain) -> Any:
    return config_document(node.state.config)
