"""The node's TOML config (examples/single-node.toml) read into typed, fully validated dataclasses.

A bad config raises ConfigError with one line: the key path, what is wrong, how to mend it, e.g.
`iscsi.targets[0].luns[1].volume: unknown volume "disk9"; define it under [[volumes]] or use one of: disk0`.
Validation is complete before anything is stored or started (STYLE.md §5).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from openvsan.block.file import UnsafeFile, check_backing
from openvsan.node.paths import default_data_dir, effective_data_dir
from openvsan.node.specs import (
    DEVICE_TYPES,
    NBD_PORT,
    NVME_PORT,
    ConfigDocument,
    DeviceSpec,
    Hint,
    NodeConfig,
    PoolSpec,
    SpecError,
    Table,
    VolumeSpec,
    fmt,
)
from openvsan.node.values import Portal

__all__ = ["DEVICE_TYPES", "ConfigError", "default_data_dir", "effective_data_dir", "exposed_secrets",
           "load_config", "one_line", "parse_config", "preflight"]


class ConfigError(ValueError):
    """A config that cannot be served; str() is one line naming the key."""


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


_DOCUMENT = TypeAdapter(ConfigDocument)


def parse_config(data: dict[str, Any], *, base_dir: Path | None = None, data_dir: Path | None = None) -> NodeConfig:
    """A config document (parsed TOML, or the document the control socket edits) as a NodeConfig: the specs'
    own checks (node/specs.py), then the checks across tables; the first failure raises ConfigError."""
    context: dict[str, Any] = {"document": True, "base_dir": base_dir}

    @functools.cache
    def data_dir_of() -> Path:
        """For a device path that starts with ${data_dir}: the data dir, which [node] may set ([node] read
        first, alone)."""
        node = data.get("node", {}) if isinstance(data, dict) else {}
        return effective_data_dir(_validate({"node": node}, context).node.data_dir, data_dir)

    context["data_dir"] = data_dir_of
    doc = _validate(data, context)
    _check_devices(doc.devices)
    _check_pools(doc.pools, doc.devices)
    _check_volumes(doc.volumes, doc.devices, doc.pools)
    known = {v.name for v in doc.volumes}
    names = [v.name for v in doc.volumes]
    for i, t in enumerate(doc.iscsi.targets if doc.iscsi else ()):
        for j, x in enumerate(t.luns):
            _volume_ref(f"iscsi.targets[{i}].luns[{_written(data, ('iscsi', 'targets', i, 'luns'), 'lun', x.lun, j)}]"
                        ".volume", x.volume, known, names)
    for i, s in enumerate(doc.nvme.subsystems if doc.nvme else ()):
        for j, n in enumerate(s.namespaces):
            at = _written(data, ("nvme", "subsystems", i, "namespaces"), "nsid", n.nsid, j)
            _volume_ref(f"nvme.subsystems[{i}].namespaces[{at}].volume", n.volume, known, names)
    for i, e in enumerate(doc.nbd.exports if doc.nbd else ()):
        _volume_ref(f"nbd.exports[{i}].volume", e.volume, known, names)
    cfg = NodeConfig(doc.node, doc.devices, doc.volumes, doc.iscsi.targets if doc.iscsi else (), nvme=doc.nvme,
                     nbd_exports=doc.nbd.exports if doc.nbd else (), pools=doc.pools,
                     nbd_tls=doc.nbd.tls if doc.nbd else None, cluster=doc.cluster, api=doc.api)
    _check_replicas(cfg)
    _check_portal_clashes(cfg)
    from openvsan.node.access import check_access_policy  # it reads these specs: imported late, no cycle
    check_access_policy(cfg)
    return cfg


def _written(data: Any, loc: tuple[str | int, ...], key: str, value: int, default: int) -> int:
    """Where a LUN or namespace is in the document as written (the spec sorts them by number)."""
    for seg in loc:
        try:
            data = data[seg]
        except (KeyError, IndexError, TypeError):
            return default
    return next((k for k, x in enumerate(data) if isinstance(x, dict) and x.get(key) == value), default)


def _validate(data: Any, context: dict[str, Any]) -> ConfigDocument:
    try:
        return _DOCUMENT.validate_python(data, context=context)
    except ValidationError as e:
        raise ConfigError(one_line(e)) from None


# ---- pydantic's errors as our one line: `<key path>: <what is wrong>; <how to mend>`

_TYPE_WORDS = {"int_type": "an integer", "string_type": "a string", "bool_type": "true or false",
               "float_type": "a number", "tuple_type": "a list", "list_type": "a list", "dict_type": "a table"}


def _key_path(loc: tuple[str | int, ...]) -> str:
    out = ""
    for seg in loc:
        out += f"[{seg}]" if isinstance(seg, int) else (f".{seg}" if out else str(seg))
    return out or "config"


def _unwrap(t: Any) -> tuple[Any, list[Any]]:
    """Annotated[X, m...] -> (X, [m...]); X | None -> X."""
    meta: list[Any] = []
    while True:
        if typing.get_origin(t) is typing.Annotated:
            meta += t.__metadata__
            t = t.__origin__
            continue
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) in (typing.Union, __import__("types").UnionType) and len(args) == 1:
            t = args[0]
            continue
        return t, meta


def _walk(root: Any, loc: tuple[str | int, ...]) -> tuple[Any, list[Any]]:
    """The spec class (or other type) declared at `loc` in `root`, with the metadata of the field that holds
    it (its Hint, its Table)."""
    t: Any = root
    meta: list[Any] = []
    for seg in loc:
        base, more = _unwrap(t)
        if isinstance(seg, int):
            t = (typing.get_args(base) or (Any,))[0]
            meta += more
            continue
        fields = getattr(base, "__pydantic_fields__", None)
        if fields is None or seg not in fields:
            return Any, []
        info = fields[seg]
        t, meta = info.annotation, list(info.metadata)
    base, more = _unwrap(t)
    return base, meta + more


def one_line(e: ValidationError, root: Any = ConfigDocument) -> str:
    """The first of pydantic's errors in validating a `root` (a missing key whose typo is also there: the
    typo) as our one line."""
    errs = e.errors(include_url=False)
    err = errs[0]
    if err["type"] == "missing":
        err = next((x for x in errs if x["type"] == "unexpected_keyword_argument" and x["loc"][:-1] == err["loc"][:-1]),
                   err)
    kind, loc = err["type"], tuple(err["loc"])
    if kind == "value_error" and isinstance(err["ctx"]["error"], SpecError):
        own: SpecError = err["ctx"]["error"]
        where = _key_path(loc + own.at)
        return f"{where}.{own}" if own.subject else f"{where}: {own}"
    if kind == "value_error":
        return f"{_key_path(loc)}: {err['ctx']['error']}"
    where = _key_path(loc)
    if kind == "missing":
        hint = next((m.text for m in _walk(root, loc)[1] if isinstance(m, Hint)), "add it")
        return f"{where}: missing; {hint}"
    if kind == "unexpected_keyword_argument":
        owner, _ = _walk(root, loc[:-1])
        known = sorted(getattr(owner, "__pydantic_fields__", {}))
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        mend = f'did you mean "{close[0]}"?' if close else "remove it"
        return f"{where}: unknown key; {mend} (known keys: {', '.join(known)})"
    if kind in ("dataclass_type", "dataclass_exact_type"):
        what = next((m.what for m in _walk(root, loc)[1] if isinstance(m, Table)), "a table")
        return f"{where}: expected {what}, found {fmt(err['input'])}"
    if kind in _TYPE_WORDS:
        return f"{where}: expected {_TYPE_WORDS[kind]}, found {fmt(err['input'])}"
    return f"{where}: {err['msg']}"


# ---- the checks across tables


def _unique_names(items: Sequence[DeviceSpec | PoolSpec | VolumeSpec], section: str, what: str) -> None:
    seen: set[str] = set()
    for i, x in enumerate(items):
        if x.name in seen:
            raise ConfigError(f"{section}[{i}].name: a {what} named {fmt(x.name)} is already defined; give each "
                              f"{what} its own name")
        seen.add(x.name)


def _check_devices(devices: tuple[DeviceSpec, ...]) -> None:
    _unique_names(devices, "devices", "device")
    files: dict[Path, str] = {}
    for i, d in enumerate(devices):
        for key, p in (("backing", d.backing), ("path", d.path)):
            if p is not None:
                other = files.setdefault(p.resolve(), d.name)
                if other != d.name:
                    raise ConfigError(f"devices[{i}].{key}: {fmt(str(p))} is already used by device {fmt(other)}; "
                                      "give each device its own file")


def _check_pools(pools: tuple[PoolSpec, ...], devices: tuple[DeviceSpec, ...]) -> None:
    _unique_names(pools, "pools", "pool")
    by_name = {d.name: d for d in devices}
    owner: dict[str, str] = {}  # device -> the pool it is a member or spare of
    for i, p in enumerate(pools):
        slots = [(f"members[{j}]", d) for j, d in enumerate(p.members)] + \
                [(f"spares[{j}]", d) for j, d in enumerate(p.spares)]
        for slot, d in slots:
            k = f"pools[{i}].{slot}"
            if d not in by_name:
                known = f"use one of: {', '.join(by_name)}" if by_name else "none is defined"
                raise ConfigError(f"{k}: unknown device {fmt(d)}; define it under [[devices]] or {known}")
            if by_name[d].type == "null":
                raise ConfigError(f"{k}: device {fmt(d)} is a null device, which keeps nothing (not even the pool's "
                                  "superblock); use a file or ram device")
            if d in owner:
                where = "this pool" if owner[d] == p.name else f"pool {fmt(owner[d])}"
                raise ConfigError(f"{k}: device {fmt(d)} is already in {where}; a device belongs to one pool, once")
            owner[d] = p.name
        first = by_name[p.members[0]]
        for slot, d in slots:
            if by_name[d].block_size != first.block_size:
                raise ConfigError(f"pools[{i}].{slot}: device {fmt(d)} has {by_name[d].block_size}-byte blocks, "
                                  f"{fmt(first.name)} {first.block_size}; a pool's devices have one block size")
        if p.chunk % first.block_size:
            raise ConfigError(f"pools[{i}].chunk: {p.chunk} bytes; use a power of two from 4KiB to 16MiB, e.g. "
                              'chunk = "64KiB"')


def _check_volumes(volumes: tuple[VolumeSpec, ...], devices: tuple[DeviceSpec, ...],
                   pools: tuple[PoolSpec, ...]) -> None:
    _unique_names(volumes, "volumes", "volume")
    device_names = [d.name for d in devices]
    pool_names = [p.name for p in pools]
    known_devices, known_pools = set(device_names), set(pool_names)
    in_pool = {d: p.name for p in pools for d in (*p.members, *p.spares)}
    user: dict[tuple[str, str], str] = {}      # ("device" or "pool", name) -> the volume on it
    carved: dict[tuple[str, str], bool] = {}   # and whether its volumes are carved from it
    for i, v in enumerate(volumes):
        if v.pool is not None:
            if v.pool not in known_pools:
                known = f"use one of: {', '.join(pool_names)}" if pool_names else "none is defined"
                raise ConfigError(f"volumes[{i}].pool: unknown pool {fmt(v.pool)}; define it under [[pools]] or {known}")
            _one_user(user, carved, ("pool", v.pool), v, i)
            continue
        assert v.device is not None   # a VolumeSpec has one of them
        if v.device not in known_devices:
            known = f"use one of: {', '.join(device_names)}" if device_names else "none is defined"
            raise ConfigError(f"volumes[{i}].device: unknown device {fmt(v.device)}; define it under [[devices]] "
                              f"or {known}")
        if v.device in in_pool:
            raise ConfigError(f"volumes[{i}].device: device {fmt(v.device)} is in pool {fmt(in_pool[v.device])}; a "
                              f"volume on the pool names it: pool = {fmt(in_pool[v.device])}")
        _one_user(user, carved, ("device", v.device), v, i)


def _one_user(user: dict[tuple[str, str], str], carved: dict[tuple[str, str], bool], where: tuple[str, str],
              v: VolumeSpec, i: int) -> None:
    """A device or pool holds one whole volume, or any number of volumes carved from it (with a size), not both."""
    kind, name = where
    if where in user and not (carved[where] and v.carved):
        other = user[where]
        mend = (f"give each volume its own {kind}, or a size to both to carve them from it" if not carved[where]
                and not v.carved else f"{fmt(other) if not carved[where] else fmt(v.name)} has no size: give it one "
                f"(volumes carved from a {kind} all have one)")
        raise ConfigError(f"volumes[{i}].{kind}: {kind} {fmt(name)} is already used by volume {fmt(other)}; {mend}")
    user[where] = v.name
    carved[where] = v.carved


def _volume_ref(key: str, volume: str, known: set[str], names: list[str]) -> None:
    if volume not in known:
        choices = f"use one of: {', '.join(names)}" if names else "none is defined"
        raise ConfigError(f"{key}: unknown volume {fmt(volume)}; define it under [[volumes]] or {choices}")

def _check_replicas(cfg: NodeConfig) -> None:
    """A replicated volume lives on a cluster node, which holds one of its replicas."""
    for i, v in enumerate(cfg.volumes):
        if not v.replicated:
            continue
        if cfg.cluster is None:
            raise ConfigError(f"volumes[{i}].replicas: a replicated volume needs the node in a cluster; add a "
                              '[cluster] table (id, etcd, replication), or set replicas = 1')
        if cfg.node.name not in v.nodes:
            raise ConfigError(f"volumes[{i}].nodes: this node ({fmt(cfg.node.name)}) is not one of "
                              f"{', '.join(v.nodes)}; a node declares only the volumes it holds a replica of")


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
    if cfg.cluster is not None:
        uses.append(("replication", "cluster.replication", cfg.cluster.replication))
    if cfg.api is not None and cfg.api.enabled:
        uses.append(("REST API", "api.listen", cfg.api.listen))
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
    made = effective_data_dir(cfg.node.data_dir, data_dir)
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
