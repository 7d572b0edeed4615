"""The node's TOML config (examples/single-node.toml) read into typed, fully validated dataclasses.

A bad config raises ConfigError with one line: the key path, what is wrong, how to mend it, e.g.
`iscsi.targets[0].luns[1].volume: unknown volume "disk9"; define it under [[volumes]] or use one of: disk0`.
Validation is complete before anything is stored or started (STYLE.md §5).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import socket
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from openvsan.block.file import UnsafeFile, check_backing
from openvsan.node.specs import (
    DEFAULT_AUTH_DELAY_MAX,
    DEFAULT_AUTH_LOCKOUT_FAILURES,
    DEFAULT_AUTH_LOCKOUT_SECONDS,
    DEFAULT_CHUNK,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_UNAUTHENTICATED,
    DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE,
    DEFAULT_POLL_US,
    DHCHAP_DHGROUPS,
    DHCHAP_HASHES,
    ChapSpec,
    DeviceSpec,
    HostAuthSpec,
    LunSpec,
    NamespaceSpec,
    NbdExportSpec,
    NbdTlsSpec,
    NodeConfig,
    NodeSettings,
    NvmeSpec,
    PoolSpec,
    SubsystemSpec,
    TargetSpec,
    VolumeSpec,
)
from openvsan.node.values import (
    Portal,
    check_chap_secret,
    check_iscsi_name,
    check_nbd_export_name,
    check_nqn,
    check_object_name,
    parse_portal,
    parse_size,
)

T = TypeVar("T")

DEVICE_TYPES = ("ram", "file", "null")
# the pool levels a config names, and the fewest members each needs (RAID 10: mirrored pairs, so also even)
POOL_LEVELS = {"raid0": 1, "raid1": 2, "raid10": 4, "raid5": 3, "raid6": 4}
MAX_CHUNK = 16 << 20
BLOCK_SIZES = (512, 4096)
MAX_LUN = 16383  # SAM-5 flat/peripheral addressing as Linux and Windows use it: 14 bits
MAX_NSID = 0xFFFFFFFE  # NVMe Base 2.0 §3.2.1.2: 0 and FFFFFFFFh are not valid namespace IDs
NVME_PORT, NBD_PORT = 4420, 10809  # IANA: NVMe/TCP I/O controllers; NBD
MAX_POLL_US = 10_000
NBD_TLS_MODES = ("off", "optional", "require")


class ConfigError(ValueError):
    """A config that cannot be served; str() is one line naming the key."""


def default_data_dir() -> Path:
    """Where state lives without [node].data_dir or --data-dir: $XDG_STATE_HOME/openvsan, else
    ~/.local/state/openvsan."""
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state else Path.home() / ".local" / "state"
    return base / "openvsan"


def load_config(path: str | Path, *, data_dir: Path | None = None) -> NodeConfig:
    """Read and validate a config file; relative paths inside it are relative to the file, and a device path
    that starts with ${data_dir} is in the data dir (`data_dir`, the --data-dir of the command, else
    [node].data_dir, else the default)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the config as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    cfg = parse_config(data, base_dir=path.resolve().parent, data_dir=data_dir)
    return dataclasses.replace(cfg, source=path.resolve())


def _fmt(v: object) -> str:
    return f'"{v}"' if isinstance(v, str) else repr(v)


class _Table:
    """One TOML table being read: typed access by key, unknown keys reported with a suggestion."""

    def __init__(self, value: object, path: str, *, what: str = "a table") -> None:
        if not isinstance(value, dict):
            raise ConfigError(f"{path or 'config'}: expected {what}, found {_fmt(value)}")
        self.data: dict[str, Any] = value
        self.path = path
        self.used: set[str] = set()

    def key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, kind: type[T] | tuple[type, ...], default: Any = None, *, required: bool = False,
            hint: str = "") -> Any:
        self.used.add(key)
        if key not in self.data:
            if required:
                raise ConfigError(f"{self.key(key)}: missing; {hint or 'add it'}")
            return default
        value = self.data[key]
        # TOML booleans are not numbers here, even though Python thinks bool is an int
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            names = {str: "a string", int: "an integer", bool: "true or false", list: "a list", dict: "a table"}
            want = " or ".join(names.get(k, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ConfigError(f"{self.key(key)}: expected {want}, found {_fmt(value)}")
        return value

    def check(self, key: str, fn: Callable[[Any], T], value: Any) -> T:
        try:
            return fn(value)
        except ValueError as e:
            raise ConfigError(f"{self.key(key)}: {e}") from None

    def done(self, allowed: tuple[str, ...] | None = None) -> None:
        allowed = allowed if allowed is not None else tuple(self.used)
        for key in self.data:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                mend = f'did you mean "{close[0]}"?' if close else "remove it"
                raise ConfigError(f"{self.key(key)}: unknown key; {mend} (known keys: {', '.join(sorted(allowed))})")


def _items(table: _Table, key: str, *, hint: str) -> list[tuple[str, Any]]:
    values = table.get(key, list, [], hint=hint)
    return [(f"{table.key(key)}[{i}]", v) for i, v in enumerate(values)]


def _resolve(p: str, base_dir: Path | None) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() or base_dir is None else base_dir / path


DATA_DIR_REF = "${data_dir}"   # a device path or backing starting with this lies in the node's data dir


def _device_file(t: _Table, key: str, value: str, base_dir: Path | None, data_dir: Path) -> Path:
    if not value.startswith(DATA_DIR_REF):
        if DATA_DIR_REF in value:
            raise ConfigError(f"{t.key(key)}: {DATA_DIR_REF} may only start a path, e.g. "
                              f'"{DATA_DIR_REF}/disk0.img"')
        return _resolve(value, base_dir)
    rest = value[len(DATA_DIR_REF):]
    if not rest.startswith("/") or not rest.strip("/"):
        raise ConfigError(f'{t.key(key)}: name a file in the data dir, e.g. "{DATA_DIR_REF}/disk0.img"')
    return data_dir / rest.lstrip("/")


def effective_data_dir(node: NodeSettings, override: Path | None = None) -> Path:
    """The data dir a command uses: its --data-dir, else [node].data_dir, else the default."""
    return (override or node.data_dir or default_data_dir()).expanduser().absolute()


def parse_config(data: dict[str, Any], *, base_dir: Path | None = None, data_dir: Path | None = None) -> NodeConfig:
    top = _Table(data, "")
    node = _parse_node(top, base_dir)
    devices = _parse_devices(top, base_dir, effective_data_dir(node, data_dir))
    pools = _parse_pools(top, devices)
    volumes = _parse_volumes(top, devices, pools)
    targets = _parse_iscsi(top, volumes)
    nvme = _parse_nvme(top, volumes)
    nbd, nbd_tls = _parse_nbd(top, volumes, base_dir)
    top.done(("node", "devices", "pools", "volumes", "iscsi", "nvme", "nbd"))
    cfg = NodeConfig(node, devices, volumes, targets, nvme=nvme, nbd_exports=nbd, pools=pools,
                     nbd_tls=nbd_tls)
    _check_portal_clashes(cfg)
    from openvsan.node.access import check_access_policy  # it reads these specs: imported late, no cycle
    check_access_policy(cfg)
    return cfg


MAX_AUTH_DELAY = 60.0   # seconds: beyond it a held login runs into the initiator's own login timeout


def _parse_auth(t: _Table) -> dict[str, Any]:
    """[node] trust_foreign_files and the throttling of failed authentications (protocol/auth_throttle.py)."""
    trust = t.get("trust_foreign_files", bool, False)
    delay = t.get("auth_delay_max", (int, float), DEFAULT_AUTH_DELAY_MAX)
    if not 0 <= delay <= MAX_AUTH_DELAY:
        raise ConfigError(f"{t.key('auth_delay_max')}: {delay} is out of range; use 0 (no delay) to "
                          f"{MAX_AUTH_DELAY:g} seconds (default {DEFAULT_AUTH_DELAY_MAX:g})")
    failures = t.get("auth_lockout_failures", int, DEFAULT_AUTH_LOCKOUT_FAILURES)
    if not 0 <= failures <= 1_000_000:
        raise ConfigError(f"{t.key('auth_lockout_failures')}: {failures} is out of range; use 0 (never lock out) "
                          f"or the failures in a row that lock a peer out (default {DEFAULT_AUTH_LOCKOUT_FAILURES})")
    seconds = t.get("auth_lockout_seconds", int, DEFAULT_AUTH_LOCKOUT_SECONDS)
    if not 1 <= seconds <= 86_400:
        raise ConfigError(f"{t.key('auth_lockout_seconds')}: {seconds} is out of range; use 1 to 86400 seconds "
                          f"(default {DEFAULT_AUTH_LOCKOUT_SECONDS}; auth_lockout_failures = 0 turns lockouts off)")
    return {"trust_foreign_files": trust, "auth_delay_max": float(delay), "auth_lockout_failures": failures,
            "auth_lockout_seconds": seconds}


def _parse_node(top: _Table, base_dir: Path | None) -> NodeSettings:
    t = _Table(top.get("node", dict, {}), "node")
    name = t.get("name", str, None)
    name = t.check("name", check_object_name, name) if name is not None else socket.gethostname().split(".")[0]
    data_dir = t.get("data_dir", str, None)
    poll_us = t.get("poll_us", int, DEFAULT_POLL_US)
    if not 0 <= poll_us <= MAX_POLL_US:
        raise ConfigError(f"{t.key('poll_us')}: {poll_us} is out of range; use 0 (no polling) to {MAX_POLL_US} "
                          f"microseconds (default {DEFAULT_POLL_US})")
    limits = _parse_limits(t)
    auth = _parse_auth(t)
    t.done(("name", "data_dir", "poll_us", *limits, *auth))
    return NodeSettings(name, _resolve(data_dir, base_dir) if data_dir else None, poll_us, **limits, **auth)


MAX_MAX_CONNECTIONS = 1 << 20   # Linux's default fs.nr_open: no process can hold more descriptors


def _parse_limits(t: _Table) -> dict[str, int]:
    """[node] max_connections, max_unauthenticated, max_unauthenticated_per_source: each within 1 and the one
    before it (a cap on a part cannot be above the cap on the whole; one left out is at most the one before)."""
    out: dict[str, int] = {}
    top = MAX_MAX_CONNECTIONS
    for key, default, what in (
            ("max_connections", DEFAULT_MAX_CONNECTIONS, "connections of all protocols together"),
            ("max_unauthenticated", DEFAULT_MAX_UNAUTHENTICATED, "connections that have not logged in"),
            ("max_unauthenticated_per_source", DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE,
             "connections not logged in from one address")):
        value = t.get(key, int, min(default, top))   # unset below a lower cap: that cap
        if not 1 <= value <= top:
            above = f" (it cannot be above {list(out)[-1]} = {top})" if out else ""
            raise ConfigError(f"{t.key(key)}: {value} is out of range{above}; use 1 to {top} {what} "
                              f"(default {default})")
        out[key] = top = value
    return out


_DEVICE_KEYS = {
    "ram": ("name", "type", "size", "block_size", "backing"),
    "file": ("name", "type", "size", "block_size", "path", "direct"),
    "null": ("name", "type", "size", "block_size"),
}


def _new_name(t: _Table, what: str, example: str, earlier: Sequence[DeviceSpec | PoolSpec | VolumeSpec],
              seen: set[str] | None = None) -> str:
    """The `name` of a [[devices]], [[pools]] or [[volumes]] table: a valid name no earlier table of its kind has
    (`seen`, when given, holds the earlier names: a set, so a config of thousands of volumes parses in
    linear time, as each live change parses the node's whole desired state again)."""
    name: str = t.check("name", check_object_name, t.get("name", str, required=True,
                                                      hint=f'give the {what} a name, e.g. name = "{example}"'))
    if (name in seen) if seen is not None else any(x.name == name for x in earlier):
        raise ConfigError(f"{t.key('name')}: a {what} named {_fmt(name)} is already defined; "
                          f"give each {what} its own name")
    return name


def _parse_devices(top: _Table, base_dir: Path | None, data_dir: Path) -> tuple[DeviceSpec, ...]:
    out: list[DeviceSpec] = []
    seen: set[str] = set()
    seen_paths: dict[Path, str] = {}
    for path, raw in _items(top, "devices", hint="add [[devices]] tables"):
        t = _Table(raw, path, what="a [[devices]] table")
        name = _new_name(t, "device", "ram0", out, seen)
        seen.add(name)
        kind = t.get("type", str, required=True, hint=f'add type = "ram" (one of: {", ".join(DEVICE_TYPES)})')
        if kind not in DEVICE_TYPES:
            raise ConfigError(f"{t.key('type')}: unknown device type {_fmt(kind)}; use one of: "
                              f"{', '.join(DEVICE_TYPES)}")
        for key in t.data:
            if key not in _DEVICE_KEYS[kind] and any(key in keys for keys in _DEVICE_KEYS.values()):
                owner = [k for k, keys in _DEVICE_KEYS.items() if key in keys]
                raise ConfigError(f"{t.key(key)}: not a key of a {kind} device (it belongs to type = "
                                  f"{' or '.join(_fmt(o) for o in owner)}); remove it")
        t.done(_DEVICE_KEYS[kind])
        block_size = t.get("block_size", int, 512)
        if block_size not in BLOCK_SIZES:
            raise ConfigError(f"{t.key('block_size')}: {block_size} is not supported; use 512 or 4096")
        size = None
        if t.has("size"):
            size = t.check("size", parse_size, t.get("size", (int, str)))
            if size % block_size:
                raise ConfigError(f"{t.key('size')}: {size} bytes is not a whole number of {block_size}-byte "
                                  f"blocks; use {size - size % block_size or block_size}")
        elif kind != "file":
            raise ConfigError(f'{t.key("size")}: missing; a {kind} device needs a size, e.g. size = "1GiB"')
        backing = dev_path = None
        if kind == "ram" and t.has("backing"):
            backing = _device_file(t, "backing", t.get("backing", str), base_dir, data_dir)
        if kind == "file":
            dev_path = _device_file(t, "path", t.get("path", str, required=True,
                                                     hint='add path = "${data_dir}/disk0.img" (a file or block '
                                                          'device)'),
                                    base_dir, data_dir)
        direct = t.get("direct", bool, False) if kind == "file" else False
        for key, p in (("backing", backing), ("path", dev_path)):
            if p is not None:
                other = seen_paths.get(p.resolve())
                if other is not None:
                    raise ConfigError(f"{t.key(key)}: {_fmt(str(p))} is already used by device {_fmt(other)}; "
                                      "give each device its own file")
                seen_paths[p.resolve()] = name
        out.append(DeviceSpec(name, kind, size, block_size, backing, dev_path, direct))
    return tuple(out)


def _parse_pools(top: _Table, devices: tuple[DeviceSpec, ...]) -> tuple[PoolSpec, ...]:
    out: list[PoolSpec] = []
    owner: dict[str, str] = {}  # device -> the pool it is a member or spare of
    by_name = {d.name: d for d in devices}
    for path, raw in _items(top, "pools", hint="add [[pools]] tables"):
        t = _Table(raw, path, what="a [[pools]] table")
        name = _new_name(t, "pool", "pool0", out)
        levels = ", ".join(POOL_LEVELS)
        level = t.get("level", str, required=True, hint=f'add level = "raid5" (one of: {levels})').lower()
        if level not in POOL_LEVELS:
            raise ConfigError(f"{t.key('level')}: unknown level {_fmt(level)}; use one of: {levels}")
        members = _pool_devices(t, "members", name, by_name, owner)
        spares = _pool_devices(t, "spares", name, by_name, owner)
        need = POOL_LEVELS[level]
        if len(members) < need:
            raise ConfigError(f"{t.key('members')}: {level} needs at least {need} members, {len(members)} given; "
                              f"add {need - len(members)} more")
        if level == "raid10" and len(members) % 2:
            raise ConfigError(f"{t.key('members')}: raid10 needs an even number of members (mirrored pairs), "
                              f"{len(members)} given; add or remove one")
        if spares and level == "raid0":
            raise ConfigError(f"{t.key('spares')}: raid0 has no redundancy to rebuild a spare from; remove spares "
                              "or use a redundant level")
        first = by_name[members[0]]
        for i, d in enumerate(members + spares):
            if by_name[d].block_size != first.block_size:
                key = f"members[{i}]" if i < len(members) else f"spares[{i - len(members)}]"
                raise ConfigError(f"{t.key(key)}: device {_fmt(d)} has {by_name[d].block_size}-byte blocks, "
                                  f"{_fmt(first.name)} {first.block_size}; a pool's devices have one block size")
        chunk = DEFAULT_CHUNK
        if t.has("chunk"):
            chunk = t.check("chunk", parse_size, t.get("chunk", (int, str)))
            if chunk & (chunk - 1) or not 4096 <= chunk <= MAX_CHUNK or chunk % first.block_size:
                raise ConfigError(f"{t.key('chunk')}: {chunk} bytes; use a power of two from 4KiB to 16MiB, "
                                  'e.g. chunk = "64KiB"')
        rate = None
        if t.has("rebuild_rate"):
            value = t.get("rebuild_rate", (int, str))
            # "200MiB/s" reads as well as "200MiB": the unit is per second either way
            rate = t.check("rebuild_rate", parse_size, value.removesuffix("/s") if isinstance(value, str) else value)
        t.done(("name", "level", "members", "spares", "chunk", "rebuild_rate"))
        out.append(PoolSpec(name, level, members, spares, chunk, rate))
    return tuple(out)


def _pool_devices(t: _Table, key: str, pool: str, by_name: dict[str, DeviceSpec],
                  owner: dict[str, str]) -> tuple[str, ...]:
    values = t.get(key, list, None if key == "members" else [], required=key == "members",
                   hint='list its devices, e.g. members = ["d0", "d1", "d2"]')
    out: list[str] = []
    for i, d in enumerate(values):
        k = f"{t.key(key)}[{i}]"
        if not isinstance(d, str):
            raise ConfigError(f"{k}: expected a device name, found {_fmt(d)}")
        if d not in by_name:
            known = f"use one of: {', '.join(by_name)}" if by_name else "none is defined"
            raise ConfigError(f"{k}: unknown device {_fmt(d)}; define it under [[devices]] or {known}")
        if by_name[d].type == "null":
            raise ConfigError(f"{k}: device {_fmt(d)} is a null device, which keeps nothing (not even the pool's "
                              "superblock); use a file or ram device")
        if d in out:
            raise ConfigError(f"{k}: device {_fmt(d)} is listed twice in this pool; list it once")
        if d in owner:
            where = "this pool" if owner[d] == pool else f"pool {_fmt(owner[d])}"
            raise ConfigError(f"{k}: device {_fmt(d)} is already in {where}; a device belongs to one pool, once")
        owner[d] = pool
        out.append(d)
    return tuple(out)


def _parse_volumes(top: _Table, devices: tuple[DeviceSpec, ...],
                   pools: tuple[PoolSpec, ...] = ()) -> tuple[VolumeSpec, ...]:
    out: list[VolumeSpec] = []
    seen: set[str] = set()
    owner: dict[str, str] = {}
    pool_owner: dict[str, str] = {}
    names = [d.name for d in devices]
    pool_names = [p.name for p in pools]
    name_set, pool_set = set(names), set(pool_names)
    for path, raw in _items(top, "volumes", hint="add [[volumes]] tables"):
        t = _Table(raw, path, what="a [[volumes]] table")
        name = _new_name(t, "volume", "disk0", out, seen)
        seen.add(name)
        read_only = t.get("read_only", bool, False)
        if t.has("pool"):
            pool = t.get("pool", str)
            if t.has("device"):
                raise ConfigError(f"{path}: names both device {_fmt(t.get('device', str))} and pool {_fmt(pool)}; "
                                  "a volume lives on one of them: remove one")
            if pool not in pool_set:
                known = f"use one of: {', '.join(pool_names)}" if pool_names else "none is defined"
                raise ConfigError(f"{t.key('pool')}: unknown pool {_fmt(pool)}; define it under [[pools]] or {known}")
            if pool in pool_owner:
                raise ConfigError(f"{t.key('pool')}: pool {_fmt(pool)} is already used by volume "
                                  f"{_fmt(pool_owner[pool])}; give each volume its own pool")
            pool_owner[pool] = name
            qos = _parse_qos(t)
            t.done(("name", "pool", "read_only", "qos"))
            out.append(VolumeSpec(name, None, read_only, pool=pool, qos=qos))
            continue
        device = t.get("device", str, required=True,
                       hint='name the device it lives on, e.g. device = "ram0" (or a pool: pool = "pool0")')
        if device not in name_set:
            known = f"use one of: {', '.join(names)}" if names else "none is defined"
            raise ConfigError(f"{t.key('device')}: unknown device {_fmt(device)}; define it under [[devices]] "
                              f"or {known}")
        if device in owner:
            raise ConfigError(f"{t.key('device')}: device {_fmt(device)} is already used by volume "
                              f"{_fmt(owner[device])}; give each volume its own device")
        in_pool = next((p.name for p in pools if device in p.members or device in p.spares), None) if pools else None
        if in_pool is not None:
            raise ConfigError(f"{t.key('device')}: device {_fmt(device)} is in pool {_fmt(in_pool)}; a volume on "
                              f"the pool names it: pool = {_fmt(in_pool)}")
        owner[device] = name
        qos = _parse_qos(t)
        t.done(("name", "device", "read_only", "qos"))
        out.append(VolumeSpec(name, device, read_only, qos=qos))
    return tuple(out)


def _parse_qos(t: _Table) -> dict[str, float]:
    """A volume's qos = { read_iops_limit = 1000, bps_limit = "100MB", ... } (volume/qos.py QosLimits, Ceph
    librbd's knobs): the knobs set, validated; bytes/s knobs take sizes ("100MB", "1GiB"); 0 means no limit."""
    if not t.has("qos"):
        return {}
    from openvsan.volume.qos import QosError, QosLimits

    q = _Table(t.get("qos", dict), t.key("qos"), what='a table, e.g. qos = { read_iops_limit = 1000 }')
    values: dict[str, float] = {}
    for key, value in q.data.items():
        if isinstance(value, str) and "_bps_" in f"_{key}" and not key.endswith("_seconds"):
            value = q.check(key, parse_size, value)
        values[key] = value
    try:
        limits = QosLimits.from_dict(values)
    except QosError as e:
        raise ConfigError(f"{t.key('qos')}.{str(e).removeprefix('qos: ')}") from None
    return dict(limits.to_dict()) if not limits.unlimited else {}


def _portals(t: _Table, key: str, *, required: bool, port: int = 3260) -> tuple[Portal, ...]:
    values = t.get(key, list, None)
    if values is None:
        if required:
            raise ConfigError(f'{t.key(key)}: missing; add portals = ["127.0.0.1:{port}"]')
        return ()
    out: list[Portal] = []
    for i, v in enumerate(values):
        portal = t.check(f"{key}[{i}]", parse_portal, v)
        if portal in out:
            raise ConfigError(f"{t.key(key)}[{i}]: {portal} is listed twice; remove one")
        out.append(portal)
    if required and not out:
        raise ConfigError(f'{t.key(key)}: empty; list at least one, e.g. ["127.0.0.1:{port}"]')
    return tuple(out)


def _chap(t: _Table, key: str) -> ChapSpec | None:
    if not t.has(key):
        return None
    c = _Table(t.get(key, dict), t.key(key), what='a table { user = "...", secret = "..." }')
    user = c.get("user", str, required=True, hint='add user = "name"')
    if not user or not user.isprintable():
        raise ConfigError(f"{c.key('user')}: the user name must be printable and not empty")
    secret = c.check("secret", check_chap_secret, c.get("secret", str, required=True,
                                                         hint='add secret = "12 to 16 bytes"'))
    c.done(("user", "secret"))
    return ChapSpec(user, secret)


def _parse_iscsi(top: _Table, volumes: tuple[VolumeSpec, ...]) -> tuple[TargetSpec, ...]:
    if not top.has("iscsi"):
        return ()
    t = _Table(top.get("iscsi", dict), "iscsi")
    raw_targets = t.get("targets", list, [])
    portals = _portals(t, "portals", required=any(isinstance(x, dict) and "portals" not in x for x in raw_targets))
    advertised = _portals(t, "advertised_portals", required=False)
    t.done(("portals", "advertised_portals", "targets"))
    volume_names = [v.name for v in volumes]
    known_volumes = set(volume_names)
    seen: set[str] = set()
    out: list[TargetSpec] = []
    for i, raw in enumerate(raw_targets):
        tt = _Table(raw, f"iscsi.targets[{i}]", what="an [[iscsi.targets]] table")
        iqn = tt.check("iqn", check_iscsi_name, tt.get("iqn", str, required=True,
                                                       hint='add iqn = "iqn.2026-11.org.example:disk0"'))
        if iqn in seen:
            raise ConfigError(f"{tt.key('iqn')}: target {_fmt(iqn)} is already defined; give each target its "
                              "own iqn")
        seen.add(iqn)
        luns: list[LunSpec] = []
        numbers: set[int] = set()
        exported: set[str] = set()
        for lpath, lraw in _items(tt, "luns", hint='add luns = [{ lun = 0, volume = "disk0" }]'):
            lt = _Table(lraw, lpath, what='a table { lun = 0, volume = "disk0" }')
            lun = lt.get("lun", int, required=True, hint="add lun = 0")
            if not 0 <= lun <= MAX_LUN:
                raise ConfigError(f"{lt.key('lun')}: {lun} is out of range; use 0 to {MAX_LUN}")
            if lun in numbers:
                raise ConfigError(f"{lt.key('lun')}: LUN {lun} is already used in this target; pick another number")
            volume = lt.get("volume", str, required=True, hint='add volume = "disk0"')
            if volume not in known_volumes:
                known = f"use one of: {', '.join(volume_names)}" if volume_names else "none is defined"
                raise ConfigError(f"{lt.key('volume')}: unknown volume {_fmt(volume)}; define it under "
                                  f"[[volumes]] or {known}")
            if volume in exported:
                raise ConfigError(f"{lt.key('volume')}: volume {_fmt(volume)} is already a LUN of this target; "
                                  "export it once")
            lt.done(("lun", "volume"))
            luns.append(LunSpec(lun, volume))
            numbers.add(lun)
            exported.add(volume)
        if not luns:
            raise ConfigError(f'{tt.key("luns")}: missing or empty; add luns = [{{ lun = 0, volume = "disk0" }}]')
        own_portals = _portals(tt, "portals", required=False) or portals
        own_advertised = _portals(tt, "advertised_portals", required=False) or advertised
        allowed: tuple[str, ...] | None = None
        if tt.has("allowed_initiators"):
            names: list[str] = []
            for j, n in enumerate(tt.get("allowed_initiators", list)):
                n = tt.check(f"allowed_initiators[{j}]", check_iscsi_name, n)
                if n in names:
                    raise ConfigError(f"{tt.key('allowed_initiators')}[{j}]: {_fmt(n)} is listed twice; remove one")
                names.append(n)
            allowed = tuple(names)
        chap = _chap(tt, "chap")
        mutual = _chap(tt, "mutual_chap")
        if mutual and not chap:
            raise ConfigError(f"{tt.key('mutual_chap')}: needs chap too (the initiator authenticates first); "
                              'add chap = { user = "...", secret = "..." }')
        if mutual and chap and mutual.secret == chap.secret:
            # RFC 7143 §12.1.3: a secret is never used in both directions
            raise ConfigError(f"{tt.key('mutual_chap')}.secret: must differ from chap.secret (RFC 7143 §12.1.3)")
        alias = tt.get("alias", str, None)
        if alias is not None and (len(alias.encode()) > 255 or not alias.isprintable()):
            raise ConfigError(f"{tt.key('alias')}: use up to 255 bytes of printable text")
        tpgt = tt.get("portal_group_tag", int, 1)
        if not 1 <= tpgt <= 65535:
            raise ConfigError(f"{tt.key('portal_group_tag')}: {tpgt} is out of range; use 1 to 65535")
        open_ = tt.get("allow_unauthenticated", bool, False)
        tt.done(("iqn", "luns", "portals", "advertised_portals", "allowed_initiators", "chap", "mutual_chap",
                 "alias", "portal_group_tag", "allow_unauthenticated"))
        luns.sort(key=lambda x: x.lun)
        out.append(TargetSpec(iqn, tuple(luns), own_portals, own_advertised, allowed, chap, mutual, alias, tpgt,
                              open_))
    return tuple(out)


def _volume_names(volumes: tuple[VolumeSpec, ...]) -> frozenset[str]:
    return frozenset(v.name for v in volumes)


def _volume_ref(t: _Table, key: str, volumes: tuple[VolumeSpec, ...], known: frozenset[str] | None = None) -> str:
    volume = t.get(key, str, required=True, hint='add volume = "disk0"')
    if volume not in (known if known is not None else _volume_names(volumes)):
        names = [v.name for v in volumes]
        known = f"use one of: {', '.join(names)}" if names else "none is defined"
        raise ConfigError(f"{t.key(key)}: unknown volume {_fmt(volume)}; define it under [[volumes]] or {known}")
    return str(volume)


def _parse_nvme(top: _Table, volumes: tuple[VolumeSpec, ...]) -> NvmeSpec | None:
    if not top.has("nvme"):
        return None
    t = _Table(top.get("nvme", dict), "nvme")
    known = _volume_names(volumes)
    seen: set[str] = set()
    raw = t.get("subsystems", list, [])
    portals = _portals(t, "portals", required=not raw or any(isinstance(x, dict) and "portals" not in x for x in raw),
                       port=NVME_PORT)
    t.done(("portals", "subsystems"))
    out: list[SubsystemSpec] = []
    for i, rs in enumerate(raw):
        st = _Table(rs, f"nvme.subsystems[{i}]", what="an [[nvme.subsystems]] table")
        nqn = st.check("nqn", check_nqn, st.get("nqn", str, required=True,
                                                hint='add nqn = "nqn.2026-11.org.example:disk0"'))
        if nqn in seen:
            raise ConfigError(f"{st.key('nqn')}: subsystem {_fmt(nqn)} is already defined; give each subsystem "
                              "its own nqn")
        seen.add(nqn)
        namespaces: list[NamespaceSpec] = []
        for npath, nraw in _items(st, "namespaces", hint='add namespaces = [{ nsid = 1, volume = "disk0" }]'):
            nt = _Table(nraw, npath, what='a table { nsid = 1, volume = "disk0" }')
            nsid = nt.get("nsid", int, required=True, hint="add nsid = 1 (namespace IDs start at 1)")
            if not 1 <= nsid <= MAX_NSID:
                raise ConfigError(f"{nt.key('nsid')}: {nsid} is out of range; use 1 to {MAX_NSID} "
                                  "(NVMe Base 2.0 §3.2.1.2)")
            if any(x.nsid == nsid for x in namespaces):
                raise ConfigError(f"{nt.key('nsid')}: namespace {nsid} is already used in this subsystem; "
                                  "pick another number")
            volume = _volume_ref(nt, "volume", volumes, known)
            if any(x.volume == volume for x in namespaces):
                raise ConfigError(f"{nt.key('volume')}: volume {_fmt(volume)} is already a namespace of this "
                                  "subsystem; export it once")
            nt.done(("nsid", "volume"))
            namespaces.append(NamespaceSpec(nsid, volume))
        if not namespaces:
            raise ConfigError(f'{st.key("namespaces")}: missing or empty; add namespaces = '
                              '[{ nsid = 1, volume = "disk0" }]')
        own = _portals(st, "portals", required=False, port=NVME_PORT) or portals
        advertised = _portals(st, "advertised_portals", required=False, port=NVME_PORT)
        allowed: tuple[str, ...] | None = None
        if st.has("allowed_hosts"):
            hosts: list[str] = []
            for j, h in enumerate(st.get("allowed_hosts", list)):
                h = st.check(f"allowed_hosts[{j}]", lambda v: check_nqn(v, subsystem=False), h)
                if h in hosts:
                    raise ConfigError(f"{st.key('allowed_hosts')}[{j}]: {_fmt(h)} is listed twice; remove one")
                hosts.append(h)
            allowed = tuple(hosts)
        serial = st.get("serial", str, "")
        # NVMe Base 2.0 Figure 275 (Identify Controller SN): 20 bytes of printable ASCII
        if serial and (len(serial) > 20 or not serial.isascii() or not serial.isprintable()):
            raise ConfigError(f"{st.key('serial')}: use up to 20 printable ASCII characters (Identify Controller SN)")
        model = st.get("model", str, "openvsan")
        if not model or len(model) > 40 or not model.isascii() or not model.isprintable():
            raise ConfigError(f"{st.key('model')}: use 1 to 40 printable ASCII characters (Identify Controller MN)")
        open_ = st.get("allow_unauthenticated", bool, False)
        dhchap_hosts = _parse_dhchap_hosts(st)
        hashes = _names(st, "dhchap_hashes", DHCHAP_HASHES, "hash functions")
        dhgroups = _names(st, "dhchap_dhgroups", DHCHAP_DHGROUPS, "DH groups")
        st.done(("nqn", "namespaces", "portals", "advertised_portals", "allowed_hosts", "serial", "model",
                 "allow_unauthenticated", "hosts", "dhchap_hashes", "dhchap_dhgroups"))
        namespaces.sort(key=lambda x: x.nsid)
        out.append(SubsystemSpec(nqn, tuple(namespaces), own, advertised, allowed, serial, model,
                                 hosts=dhchap_hosts, dhchap_hashes=hashes, dhchap_dhgroups=dhgroups,
                                 allow_unauthenticated=open_))
    return NvmeSpec(portals, tuple(out))


def _dhchap_secret(value: object) -> str:
    from openvsan.protocol.nvme.auth import parse_secret  # NVMe Base 2.0 §8.13.5.7: the DHHC-1 form

    if not isinstance(value, str):
        raise ValueError('expected a string "DHHC-1:00:<base64>:" as `nvme gen-dhchap-key` prints it')  # noqa: TRY004
    parse_secret(value)      # its SecretError (a ValueError) says what is wrong, never the secret
    return value.strip()


def _parse_dhchap_hosts(st: _Table) -> tuple[HostAuthSpec, ...]:
    """hosts = [{ nqn, dhchap_secret, dhchap_ctrl_secret }]: hosts that must authenticate (DH-HMAC-CHAP)."""
    from openvsan.protocol.nvme.auth import parse_secret

    out: list[HostAuthSpec] = []
    hint = 'add hosts = [{ nqn = "nqn.2014-08.org.nvmexpress:uuid:...", dhchap_secret = "DHHC-1:00:...:" }]'
    for hpath, hraw in _items(st, "hosts", hint=hint):
        ht = _Table(hraw, hpath, what='a table { nqn = "nqn.2014-08.org.nvmexpress:uuid:...", '
                                      'dhchap_secret = "DHHC-1:00:...:" }')
        nqn = ht.check("nqn", lambda v: check_nqn(v, subsystem=False),
                       ht.get("nqn", str, required=True, hint='add nqn = "<the host NQN>" (nvme show-hostnqn)'))
        if any(h.nqn == nqn for h in out):
            raise ConfigError(f"{ht.key('nqn')}: host {_fmt(nqn)} is listed twice in this subsystem; remove one")
        secret = ht.check("dhchap_secret", _dhchap_secret, ht.get(
            "dhchap_secret", object, required=True,
            hint='add dhchap_secret = "DHHC-1:00:...:" (make one with nvme gen-dhchap-key)'))
        ctrl = ht.get("dhchap_ctrl_secret", object, None)
        if ctrl is not None:
            ctrl = ht.check("dhchap_ctrl_secret", _dhchap_secret, ctrl)
            if parse_secret(ctrl).key == parse_secret(secret).key:
                raise ConfigError(f"{ht.key('dhchap_ctrl_secret')}: the same key as dhchap_secret; give the "
                                  "controller a secret of its own (nvme gen-dhchap-key)")
        ht.done(("nqn", "dhchap_secret", "dhchap_ctrl_secret"))
        out.append(HostAuthSpec(nqn, secret, ctrl))
    return tuple(out)


def _names(t: _Table, key: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A list of names out of `known`, each once, not empty; the order is the preference."""
    if not t.has(key):
        return known
    values = t.get(key, list)
    names: list[str] = []
    for j, v in enumerate(values):
        if not isinstance(v, str) or v not in known:
            raise ConfigError(f"{t.key(key)}[{j}]: {_fmt(v)} is not one of the {what}: {', '.join(known)}")
        if v in names:
            raise ConfigError(f"{t.key(key)}[{j}]: {_fmt(v)} is listed twice; remove one")
        names.append(v)
    if not names:
        raise ConfigError(f"{t.key(key)}: empty; list one or more of {', '.join(known)} (or leave it out for all)")
    return tuple(names)


def _parse_nbd(top: _Table, volumes: tuple[VolumeSpec, ...],
               base_dir: Path | None) -> tuple[tuple[NbdExportSpec, ...], NbdTlsSpec | None]:
    if not top.has("nbd"):
        return (), None
    t = _Table(top.get("nbd", dict), "nbd")
    known = _volume_names(volumes)
    seen: set[str] = set()
    raw = t.get("exports", list, [])
    portals = _portals(t, "portals", required=any(isinstance(x, dict) and "portals" not in x for x in raw),
                       port=NBD_PORT)
    tls: NbdTlsSpec | None = None
    if t.has("tls"):
        tt = _Table(t.get("tls", dict), "nbd.tls", what='a table, e.g. tls = { cert = "server-cert.pem", key = '
                                                         '"server-key.pem" }')
        cert = tt.get("cert", str, required=True, hint='add cert = "server-cert.pem" (the server\'s PEM certificate)')
        key = tt.get("key", str, required=True, hint='add key = "server-key.pem" (its PEM private key)')
        ca = tt.get("ca", str, None)
        verify_client = tt.get("verify_client", bool, False)
        if verify_client and ca is None:
            raise ConfigError(f"{tt.key('ca')}: missing; verify_client = true needs the CA that signs client "
                              'certificates, e.g. ca = "ca-cert.pem"')
        tt.done(("cert", "key", "ca", "verify_client"))
        tls = NbdTlsSpec(_resolve(cert, base_dir), _resolve(key, base_dir),
                         _resolve(ca, base_dir) if ca is not None else None, verify_client)
    t.done(("portals", "exports", "tls"))
    out: list[NbdExportSpec] = []
    for i, re_ in enumerate(raw):
        et = _Table(re_, f"nbd.exports[{i}]", what="an [[nbd.exports]] table")
        name = et.check("name", check_nbd_export_name, et.get("name", str, required=True,
                                                               hint='add name = "disk0" (what clients ask for)'))
        if name in seen:
            raise ConfigError(f"{et.key('name')}: an NBD export named {_fmt(name)} is already defined; give each "
                              "export its own name")
        seen.add(name)
        volume = _volume_ref(et, "volume", volumes, known)
        own = _portals(et, "portals", required=False, port=NBD_PORT) or portals
        read_only = et.get("read_only", bool, False)
        description = et.get("description", str, "")
        if len(description.encode()) > 4096 or not description.isprintable():
            raise ConfigError(f"{et.key('description')}: use up to 4096 bytes of printable text")
        open_ = et.get("allow_unauthenticated", bool, False)
        mode = et.get("tls", str, "require" if tls is not None else "off")
        if mode not in NBD_TLS_MODES:
            raise ConfigError(f"{et.key('tls')}: {_fmt(mode)} is not a TLS mode; use one of: {', '.join(NBD_TLS_MODES)}")
        if mode != "off" and tls is None:
            raise ConfigError(f'{et.key("tls")}: "{mode}" needs the server\'s TLS credentials; add [nbd] tls = '
                              '{ cert = "server-cert.pem", key = "server-key.pem" } or set tls = "off"')
        et.done(("name", "volume", "portals", "read_only", "description", "allow_unauthenticated", "tls"))
        out.append(NbdExportSpec(name, volume, own, read_only, description, tls=mode, allow_unauthenticated=open_))
    return tuple(out), tls


def _check_portal_clashes(cfg: NodeConfig) -> None:
    """Two protocols cannot listen on one address: the second server would fail to bind at start."""
    seen: dict[Portal, tuple[str, str]] = {}  # portal -> (protocol, key path)
    uses: list[tuple[str, str, Portal]] = []
    for i, tgt in enumerate(cfg.targets):
        uses += [("iSCSI", f"iscsi.targets[{i}].portals", p) for p in tgt.portals]
    if cfg.nvme is not None:
        uses += [("NVMe/TCP", "nvme.portals", p) for p in cfg.nvme.portals]
        for i, sub in enumerate(cfg.nvme.subsystems):
            uses += [("NVMe/TCP", f"nvme.subsystems[{i}].portals", p) for p in sub.portals]
    for i, e in enumerate(cfg.nbd_exports):
        uses += [("NBD", f"nbd.exports[{i}].portals", p) for p in e.portals]
    wildcard = ("0.0.0.0", "::")
    for proto, key, p in uses:
        for q, (other, where) in seen.items():
            same = q == p or (q.port == p.port and (q.host in wildcard or p.host in wildcard))
            if same and other != proto:
                raise ConfigError(f"{key}: {p} is already an {other} portal ({where}); give {proto} another port "
                                  f"(NVMe/TCP uses {NVME_PORT}, NBD {NBD_PORT}, iSCSI 3260)")
        seen.setdefault(p, (proto, key))


def preflight(cfg: NodeConfig, *, data_dir: Path | None = None) -> None:
    """Checks that depend on this machine rather than the text: can the devices be opened as declared, and is
    each existing file safe to serve (what FileDevice and RamDevice check again on the opened fd).
    `data_dir`: the data dir serve will make, which may not exist yet."""
    made = effective_data_dir(cfg.node, data_dir)
    for i, d in enumerate(cfg.devices):
        if d.type == "file" and d.path is not None:
            if d.size is None and not d.path.exists():
                raise ConfigError(f"devices[{i}].size: {d.path} does not exist; add a size to create it, "
                                  'e.g. size = "10GiB"')
            if not d.path.exists() and not d.path.parent.is_dir() and d.path.parent != made:
                raise ConfigError(f"devices[{i}].path: the directory {d.path.parent} does not exist; create it")
            _check_file(f"devices[{i}].path", d.path, cfg.node.trust_foreign_files)
        if d.type == "ram" and d.backing is not None:
            if not d.backing.parent.is_dir() and d.backing.parent != made:
                raise ConfigError(f"devices[{i}].backing: the directory {d.backing.parent} does not exist; "
                                  "create it")
            _check_file(f"devices[{i}].backing", d.backing, cfg.node.trust_foreign_files, block=False)
    if cfg.nbd_tls is not None:
        from openvsan.frontend.nbd import TlsCredentialError, tls_context  # the server's own loader, imported late
        t = cfg.nbd_tls
        try:
            tls_context(t.cert, t.key, t.ca, t.verify_client)
        except TlsCredentialError as e:
            raise ConfigError(f"nbd.tls.{e.which}: {e}") from None


def exposed_secrets(cfg: NodeConfig) -> str | None:
    """The warning for a config file that holds secrets (CHAP, DH-HMAC-CHAP) and that group or others may read;
    None when it holds none or only its owner may read it. (A TLS key is named by its path, not held.)"""
    holds = (any(t.chap is not None or t.mutual_chap is not None for t in cfg.targets)
             or any(sub.hosts for sub in cfg.subsystems))
    if not holds or cfg.source is None:
        return None
    try:
        mode = cfg.source.stat().st_mode
    except OSError:
        return None
    if not mode & 0o044:
        return None
    return f"{cfg.source} is readable by others and holds secrets; chmod 600 {cfg.source}"


def _check_file(key: str, path: Path, trust: bool, *, block: bool = True) -> None:
    """A device file already there that FileDevice or RamDevice would refuse at open (block/file.py
    check_backing): refused here, before anything starts, in the same words."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return   # made at start, 0600, with O_EXCL
    except OSError as e:
        raise ConfigError(f"{key}: cannot look at {path}: {e.strerror}") from None
    try:
        check_backing(st, str(path), trust_foreign=trust, allow_block=block)
    except UnsafeFile as e:
        raise ConfigError(f"{key}: {e.filename} {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
