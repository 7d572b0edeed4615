"""The config's spec tree as msgspec Structs (msgspec.convert is strict: TOML's types as written; unknown keys
forbidden), with the field-level checks msgspec does natively (types, Meta ranges, Literal, tagged unions),
our value parsers as custom types decoded by `dec_hook`, checks within one table in __post_init__, and
`one_line()` that turns its ValidationError (a message string ending "- at `$.path`") into our one line.

msgspec has no per-field validator: a value that needs our parser (a size, a name, a portal) is declared as a
marker type that dec_hook turns into the value. Cross-object checks are common.cross_check, as for pydantic.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

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

from . import common

MAX_CONNS = 1 << 20


# marker types: dec_hook parses the TOML value into the real one (the int or str it returns is what the field holds)
class Size(int):
    pass


class Rate(float):
    """bytes/s: a size ("100MB", "200MiB/s") or a plain number >= 0 (0: no limit)."""


class Name(str):
    pass


class IscsiName(str):
    pass


class SubsystemNqn(str):
    pass


class HostNqn(str):
    pass


class ChapSecret(str):
    pass


class DhchapSecret(str):
    pass


class ExportName(str):
    pass


class PortalValue(str):
    """A portal "host:port", as written; `.portal` is the parsed openvsan.node.values.Portal. (dec_hook must
    return an instance of the declared type, and Portal, a dataclass, msgspec would read from a table.)"""

    portal: Portal

    @classmethod
    def parse(cls, v: object) -> PortalValue:
        p = parse_portal(v)
        out = cls(str(p))
        out.portal = p
        return out


def _rate(v: object) -> float:
    if isinstance(v, str):
        return float(parse_size(v.removesuffix("/s")))
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{common.fmt(v)} is not a rate; write bytes/s or a size such as \"100MB\"")  # noqa: TRY004
    if v < 0:
        raise ValueError(f"{v:g} is negative; a rate is 0 (no limit) or more")
    return float(v)


def _dhchap(v: object) -> str:
    from openvsan.protocol.nvme.auth import parse_secret

    if not isinstance(v, str):
        raise ValueError('expected a string "DHHC-1:00:<base64>:" as `nvme gen-dhchap-key` prints it')  # noqa: TRY004
    parse_secret(v)
    return v.strip()


_DECODERS: dict[type, Any] = {
    Size: parse_size, Rate: _rate, Name: check_object_name, IscsiName: check_iscsi_name, SubsystemNqn: check_nqn,
    HostNqn: lambda v: check_nqn(v, subsystem=False), ChapSecret: check_chap_secret, DhchapSecret: _dhchap,
    ExportName: check_nbd_export_name,
}


def dec_hook(t: type, obj: Any) -> Any:
    if t is PortalValue:
        return PortalValue.parse(obj)
    fn = _DECODERS.get(t)
    if fn is None:
        raise NotImplementedError(t)
    return t(fn(obj))   # msgspec checks that the value is an instance of the declared (marker) type


def _printable(key: str, v: str | None, limit: int) -> None:
    if v is not None and (len(v.encode()) > limit or not v.isprintable()):
        raise ValueError(f"{key}: use up to {limit} bytes of printable text")


def _unique_portals(key: str, portals: tuple[PortalValue, ...] | None) -> None:
    for i, p in enumerate(portals or ()):
        if p in portals[:i]:  # type: ignore[index]
            raise ValueError(f"{key}: {p} is listed twice (at [{i}]); remove one")


class Spec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


Portals = Annotated[tuple[PortalValue, ...], Meta(examples=[["127.0.0.1:3260"]])]


class NodeSettings(Spec):
    name: Annotated[Name, Meta(examples=["node1"])] | None = None
    data_dir: str | None = None
    poll_us: Annotated[int, Meta(ge=0, le=10_000)] = 50
    max_connections: Annotated[int, Meta(ge=1, le=MAX_CONNS)] = 4096
    max_unauthenticated: Annotated[int, Meta(ge=1, le=MAX_CONNS)] = 512
    max_unauthenticated_per_source: Annotated[int, Meta(ge=1, le=MAX_CONNS)] = 32
    trust_foreign_files: bool = False
    auth_delay_max: Annotated[float, Meta(ge=0, le=60)] = 8.0
    auth_lockout_failures: Annotated[int, Meta(ge=0, le=1_000_000)] = 10
    auth_lockout_seconds: Annotated[int, Meta(ge=1, le=86_400)] = 300

    def __post_init__(self) -> None:
        if self.max_unauthenticated > self.max_connections:
            raise ValueError(f"max_unauthenticated: {self.max_unauthenticated} is above max_connections = "
                             f"{self.max_connections}; lower it or raise max_connections")
        if self.max_unauthenticated_per_source > self.max_unauthenticated:
            raise ValueError(f"max_unauthenticated_per_source: {self.max_unauthenticated_per_source} is above "
                             f"max_unauthenticated = {self.max_unauthenticated}; lower it")


class _Device(Spec, tag_field="type", kw_only=True):
    name: Annotated[Name, Meta(examples=["ram0"])]
    block_size: Literal[512, 4096] = 512

    def __post_init__(self) -> None:
        size = getattr(self, "size", None)
        if size is not None and size % self.block_size:
            raise ValueError(f"size: {size} bytes is not a whole number of {self.block_size}-byte blocks; use "
                             f"{size - size % self.block_size or self.block_size}")


class RamDevice(_Device, tag="ram", kw_only=True):
    size: Annotated[Size, Meta(examples=["1GiB"])]
    backing: str | None = None


class FileDevice(_Device, tag="file", kw_only=True):
    path: Annotated[str, Meta(examples=["${data_dir}/disk0.img"])]
    size: Size | None = None
    direct: bool = False


class NullDevice(_Device, tag="null", kw_only=True):
    size: Annotated[Size, Meta(examples=["1GiB"])]


DeviceSpec = RamDevice | FileDevice | NullDevice


class PoolSpec(Spec):
    name: Annotated[Name, Meta(examples=["pool0"])]
    level: Literal["raid0", "raid1", "raid10", "raid5", "raid6"]
    members: Annotated[tuple[Name, ...], Meta(min_length=1, examples=[["d0", "d1", "d2"]])]
    spares: tuple[Name, ...] = ()
    chunk: Size = 64 * 1024  # type: ignore[assignment]  # a default is not decoded: a plain int, so the schema can show it
    rebuild_rate: Rate | None = None

    def __post_init__(self) -> None:
        need = {"raid0": 1, "raid1": 2, "raid10": 4, "raid5": 3, "raid6": 4}[self.level]
        if len(self.members) < need:
            raise ValueError(f"members: {self.level} needs at least {need} members, {len(self.members)} given; "
                             f"add {need - len(self.members)} more")
        if self.chunk & (self.chunk - 1) or not 4096 <= self.chunk <= 16 << 20:
            raise ValueError(f'chunk: {self.chunk} bytes; use a power of two from 4KiB to 16MiB, e.g. chunk = "64KiB"')


Iops = Annotated[float, Meta(ge=0)]
Seconds = Annotated[float, Meta(gt=0)]


class QosSpec(Spec):
    iops_limit: Iops = 0
    iops_burst: Iops = 0
    iops_burst_seconds: Seconds = 1
    read_iops_limit: Iops = 0
    read_iops_burst: Iops = 0
    read_iops_burst_seconds: Seconds = 1
    write_iops_limit: Iops = 0
    write_iops_burst: Iops = 0
    write_iops_burst_seconds: Seconds = 1
    bps_limit: Rate = 0  # type: ignore[assignment]
    bps_burst: Rate = 0  # type: ignore[assignment]
    bps_burst_seconds: Seconds = 1
    read_bps_limit: Rate = 0  # type: ignore[assignment]
    read_bps_burst: Rate = 0  # type: ignore[assignment]
    read_bps_burst_seconds: Seconds = 1
    write_bps_limit: Rate = 0  # type: ignore[assignment]
    write_bps_burst: Rate = 0  # type: ignore[assignment]
    write_bps_burst_seconds: Seconds = 1

    def __post_init__(self) -> None:
        for scope in ("", "read_", "write_"):
            for kind in ("iops", "bps"):
                lk, bk = f"{scope}{kind}_limit", f"{scope}{kind}_burst"
                limit, burst = getattr(self, lk), getattr(self, bk)
                if burst and not limit:
                    raise ValueError(f"{bk}: {burst:g} but {lk} is 0 (no limit); set {lk} to the sustained rate, "
                                     f"or remove {bk}")
                if burst and burst < limit:
                    raise ValueError(f"{bk}: {burst:g} is below {lk} {limit:g}; a burst is at least the limit "
                                     "(or 0 for none)")


class VolumeSpec(Spec):
    name: Annotated[Name, Meta(examples=["disk0"])]
    device: Name | None = None
    pool: Name | None = None
    read_only: bool = False
    qos: QosSpec | None = None

    def __post_init__(self) -> None:
        if self.device is not None and self.pool is not None:
            raise ValueError(f'names both device "{self.device}" and pool "{self.pool}"; a volume lives on one of '
                             "them: remove one")
        if self.device is None and self.pool is None:
            raise ValueError('device: missing; name the device it lives on, e.g. device = "ram0" (or a pool: '
                             'pool = "pool0")')


class ChapSpec(Spec):
    user: Annotated[str, Meta(min_length=1, examples=["alice"])]
    secret: Annotated[ChapSecret, Meta(examples=["12 to 16 bytes"])]

    def __post_init__(self) -> None:
        _printable("user", self.user, 255)


class LunSpec(Spec):
    lun: Annotated[int, Meta(ge=0, le=16383, examples=[0])]
    volume: Annotated[Name, Meta(examples=["disk0"])]


class TargetSpec(Spec):
    iqn: Annotated[IscsiName, Meta(examples=["iqn.2026-11.org.example:disk0"])]
    luns: Annotated[tuple[LunSpec, ...], Meta(min_length=1, examples=[[{"lun": 0, "volume": "disk0"}]])]
    portals: Portals | None = None
    advertised_portals: Portals | None = None
    allowed_initiators: tuple[IscsiName, ...] | None = None
    chap: ChapSpec | None = None
    mutual_chap: ChapSpec | None = None
    alias: str | None = None
    portal_group_tag: Annotated[int, Meta(ge=1, le=65535)] = 1
    allow_unauthenticated: bool = False

    def __post_init__(self) -> None:
        seen: dict[int, str] = {}
        for i, x in enumerate(self.luns):
            if x.lun in seen:
                raise ValueError(f"luns: LUN {x.lun} is used twice (at [{i}]); pick another number")
            if x.volume in seen.values():
                raise ValueError(f'luns: volume "{x.volume}" is already a LUN of this target (at [{i}]); export it once')
            seen[x.lun] = x.volume
        _unique_portals("portals", self.portals)
        _printable("alias", self.alias, 255)
        if self.mutual_chap is not None and self.chap is None:
            raise ValueError('mutual_chap: needs chap too (the initiator authenticates first); add chap = '
                             '{ user = "...", secret = "..." }')
        if self.mutual_chap and self.chap and self.mutual_chap.secret == self.chap.secret:
            raise ValueError("mutual_chap: its secret must differ from chap.secret (RFC 7143 §12.1.3)")


class IscsiSection(Spec):
    portals: Portals | None = None
    advertised_portals: Portals | None = None
    targets: tuple[TargetSpec, ...] = ()


class NamespaceSpec(Spec):
    nsid: Annotated[int, Meta(ge=1, le=0xFFFFFFFE, examples=[1])]
    volume: Annotated[Name, Meta(examples=["disk0"])]


class HostAuthSpec(Spec):
    nqn: Annotated[HostNqn, Meta(examples=["nqn.2014-08.org.nvmexpress:uuid:..."])]
    dhchap_secret: Annotated[DhchapSecret, Meta(examples=["DHHC-1:00:...:"])]
    dhchap_ctrl_secret: DhchapSecret | None = None


class SubsystemSpec(Spec):
    nqn: Annotated[SubsystemNqn, Meta(examples=["nqn.2026-11.org.example:disk0"])]
    namespaces: Annotated[tuple[NamespaceSpec, ...], Meta(min_length=1, examples=[[{"nsid": 1, "volume": "disk0"}]])]
    portals: Portals | None = None
    advertised_portals: Portals | None = None
    allowed_hosts: tuple[HostNqn, ...] | None = None
    serial: Annotated[str, Meta(max_length=20, pattern=r"^[ -~]*$")] = ""
    model: Annotated[str, Meta(min_length=1, max_length=40, pattern=r"^[ -~]*$")] = "openvsan"
    hosts: tuple[HostAuthSpec, ...] = ()
    dhchap_hashes: Annotated[tuple[Literal["sha256", "sha384", "sha512"], ...], Meta(min_length=1)] = (
        "sha256", "sha384", "sha512")
    dhchap_dhgroups: Annotated[tuple[Literal["null", "ffdhe2048", "ffdhe3072", "ffdhe4096", "ffdhe6144",
                                             "ffdhe8192"], ...], Meta(min_length=1)] = (
        "null", "ffdhe2048", "ffdhe3072", "ffdhe4096", "ffdhe6144", "ffdhe8192")
    allow_unauthenticated: bool = False


class NvmeSection(Spec):
    portals: Portals | None = None
    subsystems: tuple[SubsystemSpec, ...] = ()


class NbdTlsSpec(Spec):
    cert: Annotated[str, Meta(examples=["server-cert.pem"])]
    key: Annotated[str, Meta(examples=["server-key.pem"])]
    ca: str | None = None
    verify_client: bool = False

    def __post_init__(self) -> None:
        if self.verify_client and self.ca is None:
            raise ValueError('ca: missing; verify_client = true needs the CA that signs client certificates, e.g. '
                             'ca = "ca-cert.pem"')


class NbdExportSpec(Spec):
    name: Annotated[ExportName, Meta(examples=["disk0"])]
    volume: Annotated[Name, Meta(examples=["disk0"])]
    portals: Portals | None = None
    read_only: bool = False
    description: str = ""
    tls: Literal["off", "optional", "require"] | None = None   # None: "require" with [nbd] tls, else "off"
    allow_unauthenticated: bool = False

    def __post_init__(self) -> None:
        _printable("description", self.description, 4096)


class NbdSection(Spec):
    portals: Portals | None = None
    exports: tuple[NbdExportSpec, ...] = ()
    tls: NbdTlsSpec | None = None


class NodeConfig(Spec):
    node: NodeSettings = NodeSettings()
    devices: tuple[DeviceSpec, ...] = ()
    pools: tuple[PoolSpec, ...] = ()
    volumes: tuple[VolumeSpec, ...] = ()
    iscsi: IscsiSection | None = None
    nvme: NvmeSection | None = None
    nbd: NbdSection | None = None


class VolumeCreate(Spec):
    """The body of a control-socket `volume.create` request (node/live.py)."""

    name: Annotated[Name, Meta(examples=["live1"])]
    size: Size | None = None
    backing: Literal["ram", "file"] = "ram"
    device: Name | None = None
    pool: Name | None = None
    block_size: Literal[512, 4096] = 512
    read_only: bool = False
    dry_run: bool = False


def parse(data: Any) -> NodeConfig:
    return msgspec.convert(data, NodeConfig, dec_hook=dec_hook)


_VOLUME_CREATE_JSON = msgspec.json.Decoder(VolumeCreate, dec_hook=dec_hook)


def parse_volume_create_json(body: bytes) -> VolumeCreate:
    return _VOLUME_CREATE_JSON.decode(body)


# ---- our one-line errors


def _fields_of(cls: type) -> dict[str, Any] | None:
    if isinstance(cls, type) and issubclass(cls, Struct):
        import typing
        return typing.get_type_hints(cls, include_extras=True)
    return None


def _tag_of(cls: type) -> tuple[str, str] | None:
    cfg = getattr(cls, "__struct_config__", None)
    return (cfg.tag_field, cfg.tag) if cfg is not None and cfg.tag is not None else None


_AT = re.compile(r"^(.*) - at `\$(.*)`$", re.DOTALL)
_SEG = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_EXPECTED = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
             "array": "a list", "object": "a table", "int | null": "an integer", "str | null": "a string",
             "float | null": "a number", "object | null": "a table", "array | null": "a list"}


def one_line(e: msgspec.ValidationError, data: Any, root: type = NodeConfig) -> str:
    """msgspec's one error (a string) as our one line: the path is parsed out of "- at `$...`"."""
    m = _AT.match(str(e))
    text, where = (m.group(1), m.group(2)) if m else (str(e), "")
    loc: list[common.Segment] = [int(i) if i else n for n, i in _SEG.findall(where)]
    at = common.locate(root, data, loc, fields_of=_fields_of, tag_of=_tag_of)
    path = common.key_path(at.path)
    if (k := re.match(r"Object contains unknown field `(.*)`$", text)):
        owner = _struct_at(root, data, loc)
        foreign = common.foreign_key(path, k.group(1), owner, _tag_of, _fields_of, (RamDevice, FileDevice, NullDevice))
        if foreign:
            return foreign
        return common.unknown_key(path, k.group(1), [f for f in (_fields_of(owner) or {})] +
                                  ([_tag_of(owner)[0]] if _tag_of(owner) else []))  # type: ignore[index]
    if (k := re.match(r"Object missing required field `(.*)`$", text)):
        owner = _struct_at(root, data, loc)
        if k.group(1) == "type" and owner is None:
            return f'{path}.type: missing; add type = "ram" (one of: ram, file, null)'
        return common.missing_key(path, k.group(1), (_fields_of(owner) or {}).get(k.group(1)))
    if (k := re.match(r"Expected `([^`]*)`, got `[^`]*`$", text)):
        return common.wrong_type(path, at.value, _EXPECTED.get(k.group(1), k.group(1)))
    if re.match(r"Expected `(int|float)` (>=|<=|>|<) ", text):
        return common.out_of_range(path, at.value, at.declared)
    if text.startswith("Invalid enum value"):
        return common.bad_choice(path, at.value, at.declared)
    if text.startswith("Invalid value") and at.path and at.path[-1] == "type":
        return f"{path}: unknown device type {common.fmt(at.value)}; use one of: ram, file, null"
    if text.startswith("Expected `array` of length"):
        ex = common.examples(common.unwrap(at.declared)[1])
        return f"{path}: empty; " + (f"add {at.path[-1]} = {common.toml_literal(ex[0])}" if ex else "list at least one")
    if text.startswith("Expected `str`"):
        return f"{path}: {common.fmt(at.value)}: {text[0].lower()}{text[1:]}"
    # a ValueError out of dec_hook (our value parsers) or __post_init__ (checks within one table)
    return common.own_message(at, text, _fields_of(_struct_at(root, data, loc)))


def _struct_at(root: type, data: Any, loc: list[Any]) -> Any:
    at = common.locate(root, data, loc, fields_of=_fields_of, tag_of=_tag_of)
    base, _ = common.unwrap(at.declared)
    members = common._members(base)
    if members:
        tag = at.value.get("type") if isinstance(at.value, dict) else None
        return next((m for m in members if _tag_of(m) == ("type", tag)), None)
    return base if isinstance(base, type) and issubclass(base, Struct) else None
