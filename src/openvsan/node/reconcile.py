"""Desired state against actual state: the plan of changes that turns one NodeConfig into another while the
node serves (DESIGN.md: desired state, actual state, reconcile).

`plan()` is pure: it compares two configs and lists the changes in the order they can be applied (exports
let go before the volumes under them, volumes before their devices; devices before the volumes on them,
volumes before their exports). What cannot change while serving is refused with one line that says what to
do instead. The node's data plane (node/plane.py) carries each change out and can undo it, so a failure
half-way leaves the node as it was (node/node.py Node.apply)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from openvsan.node.specs import NodeConfig
from openvsan.node.values import format_size

INVERSE = {"add": "remove", "remove": "add", "resize": "resize", "update": "update"}


class PlanRefused(ValueError):
    """The desired state cannot be reached while serving; str() is one line with the way out."""


@dataclass(frozen=True)
class Change:
    op: str                 # add | remove | resize | update
    kind: str               # device | volume | target | lun | subsystem | namespace | nbd export
    key: str                # the object's name (iqn, nqn, export name; the LUN or NSID number)
    old: Any = None         # its spec before (None for add)
    new: Any = None         # and after (None for remove)
    parent: str = ""        # a LUN's target IQN, a namespace's subsystem NQN

    def inverse(self) -> Change:
        return dataclasses.replace(self, op=INVERSE[self.op], old=self.new, new=self.old)

    def __str__(self) -> str:
        sign = {"add": "+", "remove": "-", "resize": "~", "update": "~"}[self.op]
        where = f" of {self.parent}" if self.parent else ""
        name = {"lun": "LUN", "namespace": "namespace"}.get(self.kind, self.kind)
        text = f"{sign} {name} {self.key}{where}"
        spec = self.new if self.new is not None else self.old
        if self.op == "resize":
            text += f": {format_size(self.old.size or 0)} -> {format_size(self.new.size or 0)}"
        elif self.kind in ("lun", "namespace", "nbd export") and spec is not None:
            text += f" (volume {spec.volume})"
        elif self.kind == "volume" and self.op == "add":
            text += f" (on {'pool ' + spec.pool if spec.pool else 'device ' + str(spec.device)})"
        elif self.kind == "device" and self.op == "add":
            text += f" ({spec.type}, {format_size(spec.size) if spec.size else 'the file size'})"
        elif self.op == "update":
            text += ": " + ", ".join(_differences(self.old, self.new))
        return text


def _differences(old: Any, new: Any) -> list[str]:
    skip = {"luns", "namespaces"}
    out = []
    for f in dataclasses.fields(old):
        if f.name in skip or not f.compare:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a != b:
            secret = f.name in ("chap", "mutual_chap", "hosts")
            if not secret and dataclasses.is_dataclass(a) and type(a) is type(b):   # e.g. encryption.key_file
                out += [f"{f.name}.{d}" for d in _differences(a, b)]
                continue
            out.append(f.name if secret else f"{f.name} {_show(a)} -> {_show(b)}")
    return out or ["no change"]


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return "none" if v is None else str(v)


def _by(items: Iterable[Any], key: str) -> dict[Any, Any]:
    return {getattr(x, key): x for x in items}


def without_children(spec: Any, *names: str) -> Any:
    """A target or subsystem alone, its LUNs or namespaces (changes of their own) left out. No config declares
    one without them, so the copy is made past the spec's checks (dataclasses.replace would run them)."""
    out = copy.copy(spec)
    for n in names:
        object.__setattr__(out, n, ())
    return out


def _refuse_fixed(actual: NodeConfig, desired: NodeConfig) -> None:
    if actual.node != desired.node:
        changed = [f.name for f in dataclasses.fields(actual.node)
                   if getattr(actual.node, f.name) != getattr(desired.node, f.name)]
        raise PlanRefused(f"[node] {', '.join(changed)}: changes only when vsan serve restarts; restart it with "
                          "--config FILE to use the new settings")
    if actual.pools != desired.pools:
        raise PlanRefused("[[pools]]: pools change with `vsan pool create|add-spare|replace` or a restart with "
                          "--config, not by apply; leave the pools as they are in the file")
    if actual.nvme is not None and desired.nvme is not None and actual.nvme.portals != desired.nvme.portals:
        raise PlanRefused("[nvme] portals (the discovery portals): change only when vsan serve restarts")
    if actual.cluster != desired.cluster:
        raise PlanRefused("[cluster]: the node's cluster membership changes only when vsan serve restarts "
                          "(`vsan cluster join|leave`, then a restart)")
    if actual.api != desired.api:
        raise PlanRefused("[api]: the REST API's address and TLS change only when vsan serve restarts")
    if actual.nbd_tls != desired.nbd_tls:
        raise PlanRefused("[nbd] tls: the NBD server's TLS credentials change only when vsan serve restarts")
    for name, dev in _by(actual.devices, "name").items():
        new = _by(desired.devices, "name").get(name)
        if new is not None and dataclasses.replace(dev, size=new.size) != new:
            raise PlanRefused(f"device {name}: only its size can change while serving (grow a file or ram device); "
                              "to change its type, file or block size, delete its volume and create it anew")
        if new is not None and new.size != dev.size and (new.size is None or dev.size is None):
            raise PlanRefused(f"device {name}: a file device that takes its file's size (no size =) cannot change "
                              "size while serving; give it size = the file's size first (a restart with --config)")
        if new is not None and new.size is not None and dev.size is not None and new.size < dev.size:
            raise PlanRefused(f"device {name}: {format_size(new.size)} is smaller than its {format_size(dev.size)}; "
                              "a device in service does not shrink (data would be cut off)")
    for name, vol in _by(desired.volumes, "name").items():
        if vol.replicated and name not in _by(actual.volumes, "name"):
            raise PlanRefused(f"volume {name}: a replicated volume is added to each of its nodes' configs and served "
                              "at their next restart (its replica service starts with vsan serve)")
    for name, vol in _by(actual.volumes, "name").items():
        new = _by(desired.volumes, "name").get(name)
        if new is not None and (new.replicas, new.nodes) != (vol.replicas, vol.nodes):
            raise PlanRefused(f"volume {name}: its replicas and nodes change only when vsan serve restarts (every "
                              "replica node with the same list)")
        if new is not None and vol.replicated and new.size != vol.size:
            raise PlanRefused(f"volume {name}: a replicated volume keeps its size while it serves (its replicas on "
                              "other nodes would differ); resizing replicated volumes is not supported yet")
        if new is not None and (new.device, new.pool) != (vol.device, vol.pool):
            raise PlanRefused(f"volume {name}: it cannot move to another device or pool while serving; create a new "
                              "volume there and copy the data")


def plan(actual: NodeConfig, desired: NodeConfig) -> list[Change]:
    """The changes, in order, that take a node serving `actual` to `desired` (both valid configs)."""
    _refuse_fixed(actual, desired)
    removes: list[Change] = []
    adds: list[Change] = []

    # NBD exports: a changed one is served anew (a client negotiates its properties once, at the handshake)
    old_nbd, new_nbd = _by(actual.nbd_exports, "name"), _by(desired.nbd_exports, "name")
    for name, e in old_nbd.items():
        if new_nbd.get(name) != e:
            removes.append(Change("remove", "nbd export", name, e))
    for name, e in new_nbd.items():
        if old_nbd.get(name) != e:
            adds.append(Change("add", "nbd export", name, None, e))

    _exports(removes, adds, "subsystem", "namespace", "nsid", _by(actual.subsystems, "nqn"),
             _by(desired.subsystems, "nqn"), "namespaces")
    _exports(removes, adds, "target", "lun", "lun", _by(actual.targets, "iqn"), _by(desired.targets, "iqn"),
             "luns")

    # volumes and devices: removed after their exports, added (or changed) before them
    old_vol, new_vol = _by(actual.volumes, "name"), _by(desired.volumes, "name")
    old_dev, new_dev = _by(actual.devices, "name"), _by(desired.devices, "name")
    vol_removes = [Change("remove", "volume", n, v) for n, v in old_vol.items() if n not in new_vol]
    dev_removes = [Change("remove", "device", n, d) for n, d in old_dev.items() if n not in new_dev]
    dev_adds = [Change("add", "device", n, None, d) for n, d in new_dev.items() if n not in old_dev]
    dev_resizes = [Change("resize", "device", n, old_dev[n], d) for n, d in new_dev.items()
                   if n in old_dev and old_dev[n] != d]
    vol_adds = [Change("add", "volume", n, None, v) for n, v in new_vol.items() if n not in old_vol]
    vol_updates = [Change("update", "volume", n, old_vol[n], v) for n, v in new_vol.items()
                   if n in old_vol and old_vol[n] != v]
    return [*removes, *vol_removes, *dev_removes, *dev_adds, *dev_resizes, *vol_adds, *vol_updates, *adds]


def _exports(removes: list[Change], adds: list[Change], kind: str, child: str, number: str,
             old: dict[str, Any], new: dict[str, Any], field: str) -> None:
    """Targets with their LUNs, subsystems with their namespaces: a parent that goes takes its children;
    one that stays loses and gains children one by one and has its own settings updated in place."""
    parent_removes: list[Change] = []
    for key, spec in old.items():
        if key not in new:
            removes.extend(Change("remove", child, str(getattr(x, number)), x, parent=key)
                           for x in getattr(spec, field))
            parent_removes.append(Change("remove", kind, key, without_children(spec, field)))
            continue
        kept = _by(getattr(new[key], field), number)
        for x in getattr(spec, field):
            if kept.get(getattr(x, number)) != x:
                removes.append(Change("remove", child, str(getattr(x, number)), x, parent=key))
    removes.extend(parent_removes)
    for key, spec in new.items():
        if key not in old:
            adds.append(Change("add", kind, key, None, without_children(spec, field)))
            adds.extend(Change("add", child, str(getattr(x, number)), None, x, parent=key)
                        for x in getattr(spec, field))
            continue
        if without_children(old[key], field) != without_children(spec, field):
            adds.append(Change("update", kind, key, without_children(old[key], field), without_children(spec, field)))
        had = _by(getattr(old[key], field), number)
        for x in getattr(spec, field):
            if had.get(getattr(x, number)) != x:
                adds.append(Change("add", child, str(getattr(x, number)), None, x, parent=key))

