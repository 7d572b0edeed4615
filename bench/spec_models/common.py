"""What the pydantic and the msgspec spec trees share: the one-line error (`<path>: <what is wrong>; <mend>`)
built from a located failure, the walk from a key path to the declared type and the input value there, and
the cross-object checks that no schema library does (a LUN naming an unknown volume, a device used twice).

Both libraries produce objects with the same attribute names, so `cross_check` reads either tree.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

Segment = str | int

_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
          tuple: "a list", dict: "a table"}


def fmt(v: object) -> str:
    """A value as the TOML file would write it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, dict):
        return "a table"
    if isinstance(v, list | tuple):
        return "a list"
    return repr(v)


def key_path(segments: Sequence[Segment]) -> str:
    out = ""
    for s in segments:
        out += f"[{s}]" if isinstance(s, int) else (f".{s}" if out else s)
    return out or "config"


def type_name(t: Any) -> str:
    return _NAMES.get(t, getattr(t, "__name__", str(t)))


@dataclass
class Located:
    """Where a failure is: the key path in the input, the input value there (or MISSING), the declared type
    there (Annotated kept), and the model class that holds the key (for its known keys)."""

    path: list[Segment]
    value: Any
    declared: Any
    owner: Any


MISSING = object()


def unwrap(t: Any) -> tuple[Any, list[Any]]:
    """Annotated[X, m...] -> (X, [m...]); Optional[X] -> X (the non-None member), metadata gathered."""
    meta: list[Any] = []
    while True:
        origin = typing.get_origin(t)
        if origin is typing.Annotated:
            meta += list(t.__metadata__)
            t = t.__origin__
        elif origin in (typing.Union, __import__("types").UnionType):
            args = [a for a in typing.get_args(t) if a is not type(None)]
            if len(args) != 1:
                return t, meta
            t = args[0]
        else:
            return t, meta


def locate(root: type, data: Any, segments: Sequence[Segment], *, fields_of: Callable[[type], dict[str, Any] | None],
           tag_of: Callable[[type], tuple[str, str] | None]) -> Located:
    """Walk the declared types and the input together along `segments`. A segment that names a union member's
    tag (pydantic puts it in its loc) is dropped from the path."""
    t: Any = root
    value: Any = data
    owner: Any = None
    path: list[Segment] = []
    for seg in segments:
        base, _ = unwrap(t)
        if isinstance(seg, int):
            args = typing.get_args(base)
            t = args[0] if args else Any
            value = value[seg] if isinstance(value, list | tuple) and seg < len(value) else MISSING
            path.append(seg)
            continue
        members = _members(base)
        if members:   # a tagged union: pydantic names the member by its tag in the loc; else the input's tag
            by_tag = {tg[1]: m for m in members if (tg := tag_of(m)) is not None}
            if seg in by_tag and seg not in (fields_of(by_tag[seg]) or {}):
                t = by_tag[seg]
                continue
            tag_key = next((tg[0] for m in members if (tg := tag_of(m)) is not None), "")
            picked = by_tag.get(value.get(tag_key)) if isinstance(value, dict) else None
            base = picked or members[0]
        fields = fields_of(base)
        if fields is None:
            break
        owner = base
        t = fields.get(seg, Any)
        value = value.get(seg, MISSING) if isinstance(value, dict) else MISSING
        path.append(seg)
    return Located(path, value, t, owner)


def _members(t: Any) -> list[Any]:
    if typing.get_origin(t) in (typing.Union, __import__("types").UnionType):
        return [a for a in typing.get_args(t) if isinstance(a, type)]
    return []


def bounds(meta: Sequence[Any]) -> tuple[Any, Any]:
    """The (lowest, highest) a number may be, out of pydantic's annotated_types or msgspec's Meta."""
    lo = hi = None
    for m in meta:
        for attr, side in (("ge", "lo"), ("gt", "lo"), ("le", "hi"), ("lt", "hi")):
            v = getattr(m, attr, None)
            if v is not None:
                if side == "lo":
                    lo = v
                else:
                    hi = v
        for sub in getattr(m, "metadata", ()):   # pydantic FieldInfo inside Annotated
            slo, shi = bounds([sub])
            lo, hi = slo if slo is not None else lo, shi if shi is not None else hi
    return lo, hi


def examples(meta: Sequence[Any]) -> list[Any]:
    for m in meta:
        ex = getattr(m, "examples", None)
        if ex:
            return list(ex)
    return []


def literal_values(t: Any) -> list[Any]:
    base, _ = unwrap(t)
    if typing.get_origin(base) is typing.Literal:
        return list(typing.get_args(base))
    return []


def toml_literal(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(toml_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_literal(x)}" for k, x in v.items()) + " }"
    return fmt(v)


def unknown_key(where: str, key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    mend = f'did you mean "{close[0]}"?' if close else "remove it"
    return f"{where}.{key}: unknown key; {mend} (known keys: {', '.join(sorted(known))})"


def foreign_key(where: str, key: str, owner: Any, tag_of: Callable[[type], tuple[str, str] | None],
                fields_of: Callable[[type], dict[str, Any] | None], members: Sequence[type]) -> str | None:
    """A key of another member of a tagged union (`path` on a ram device): say whose key it is."""
    tag = tag_of(owner) if owner is not None else None
    if tag is None:
        return None
    others = [t[1] for m in members if (t := tag_of(m)) and t != tag and key in (fields_of(m) or {})]
    if not others:
        return None
    return (f"{where}.{key}: not a key of a {tag[1]} device (it belongs to type = "
            f"{' or '.join(fmt(o) for o in others)}); remove it")


def missing_key(where: str, key: str, declared: Any) -> str:
    _, meta = unwrap(declared)
    ex = examples(meta)
    choices = literal_values(declared)
    if ex:
        mend = f"add {key} = {toml_literal(ex[0])}"
    elif choices:
        mend = f"add {key} = {toml_literal(choices[0])} (one of: {', '.join(map(str, choices))})"
    else:
        mend = "add it"
    return f"{where}.{key}: missing; {mend}"


def out_of_range(where: str, value: Any, declared: Any) -> str:
    _, meta = unwrap(declared)
    lo, hi = bounds(meta)
    use = f"use {lo} to {hi}" if lo is not None and hi is not None else (
        f"use {lo} or more" if lo is not None else f"use at most {hi}")
    return f"{where}: {fmt(value)} is out of range; {use}"


def bad_choice(where: str, value: Any, declared: Any) -> str:
    choices = literal_values(declared)
    kinds = {type(c) for c in choices}
    if choices and type(value) not in kinds:   # "512" for 512: the type is what is wrong
        return wrong_type(where, value, " or ".join(sorted(type_name(k) for k in kinds)))
    return f"{where}: {fmt(value)} is not one of: {', '.join(map(str, choices))}"


def wrong_type(where: str, value: Any, expected: str) -> str:
    return f"{where}: expected {expected}, found {fmt(value)}"


_KEY_FIRST = re.compile(r"^([a-z_][a-z0-9_]*): (.*)$", re.DOTALL)


def own_message(loc: Located, message: str, fields: dict[str, Any] | None) -> str:
    """A message from our own validator; one that starts with `<key>: ` names a key of the table it checked,
    and that key moves into the path (`volumes[1].qos.read_iops_burst: ...`)."""
    where = key_path(loc.path)
    m = _KEY_FIRST.match(message)
    if m and fields is not None and m.group(1) in fields:
        return f"{where}.{m.group(1)}: {m.group(2)}"
    return f"{where}: {message}"


# ---- cross-object checks: ours whichever library parses the fields


class CrossError(ValueError):
    pass


def _fields(obj: Any) -> Iterator[tuple[int, Any]]:
    return enumerate(obj or ())


def _ref(key: str, what: str, name: str, known: dict[str, Any], table: str) -> None:
    if name not in known:
        names = f"use one of: {', '.join(known)}" if known else "none is defined"
        raise CrossError(f'{key}: unknown {what} "{name}"; define it under [[{table}]] or {names}')


def cross_check(cfg: Any) -> None:
    """Names unique per kind; every reference names something defined; a device serves one volume or one pool;
    targets, subsystems and exports without portals of their own get the section's. The words of
    openvsan.node.config."""
    devices: dict[str, Any] = {}
    for i, d in _fields(cfg.devices):
        if d.name in devices:
            raise CrossError(f'devices[{i}].name: a device named "{d.name}" is already defined; give each device '
                             "its own name")
        devices[d.name] = d
    pools: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for i, p in _fields(cfg.pools):
        if p.name in pools:
            raise CrossError(f'pools[{i}].name: a pool named "{p.name}" is already defined; give each pool its '
                             "own name")
        pools[p.name] = p
        for key in ("members", "spares"):
            for j, m in enumerate(getattr(p, key)):
                _ref(f"pools[{i}].{key}[{j}]", "device", m, devices, "devices")
                if m in owner:
                    raise CrossError(f'pools[{i}].{key}[{j}]: device "{m}" is already in pool "{owner[m]}"; a '
                                     "device belongs to one pool, once")
                owner[m] = p.name
    volumes: dict[str, Any] = {}
    for i, v in _fields(cfg.volumes):
        if v.name in volumes:
            raise CrossError(f'volumes[{i}].name: a volume named "{v.name}" is already defined; give each volume '
                             "its own name")
        volumes[v.name] = v
        if v.device is not None:
            _ref(f"volumes[{i}].device", "device", v.device, devices, "devices")
            if v.device in owner:
                raise CrossError(f'volumes[{i}].device: device "{v.device}" is already used by {owner[v.device]}; '
                                 "give each volume its own device")
            owner[v.device] = f'volume "{v.name}"'
        else:
            _ref(f"volumes[{i}].pool", "pool", v.pool, pools, "pools")
    if cfg.iscsi is not None:
        iqns: set[str] = set()
        for i, t in _fields(cfg.iscsi.targets):
            if t.iqn in iqns:
                raise CrossError(f'iscsi.targets[{i}].iqn: target "{t.iqn}" is already defined; give each target '
                                 "its own iqn")
            iqns.add(t.iqn)
            if not t.portals and not cfg.iscsi.portals:
                raise CrossError('iscsi.portals: missing; add portals = ["127.0.0.1:3260"]')
            for j, lun in enumerate(t.luns):
                _ref(f"iscsi.targets[{i}].luns[{j}].volume", "volume", lun.volume, volumes, "volumes")
    if cfg.nvme is not None:
        for i, s in _fields(cfg.nvme.subsystems):
            if not s.portals and not cfg.nvme.portals:
                raise CrossError('nvme.portals: missing; add portals = ["127.0.0.1:4420"]')
            for j, ns in enumerate(s.namespaces):
                _ref(f"nvme.subsystems[{i}].namespaces[{j}].volume", "volume", ns.volume, volumes, "volumes")
    if cfg.nbd is not None:
        names: set[str] = set()
        for i, e in _fields(cfg.nbd.exports):
            if e.name in names:
                raise CrossError(f'nbd.exports[{i}].name: an NBD export named "{e.name}" is already defined; give '
                                 "each export its own name")
            names.add(e.name)
            if not e.portals and not cfg.nbd.portals:
                raise CrossError('nbd.portals: missing; add portals = ["127.0.0.1:10809"]')
            _ref(f"nbd.exports[{i}].volume", "volume", e.volume, volumes, "volumes")
            if e.tls not in (None, "off") and cfg.nbd.tls is None:
                raise CrossError(f'nbd.exports[{i}].tls: "{e.tls}" needs the server\'s TLS credentials; add [nbd] '
                                 'tls = { cert = "server-cert.pem", key = "server-key.pem" } or set tls = "off"')
