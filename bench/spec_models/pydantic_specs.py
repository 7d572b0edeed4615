"""The config's spec tree as pydantic v2 models (strict: TOML's types as written, no "5" -> 5, no true -> 1;
unknown keys forbidden), with the field-level checks pydantic does natively, and `one_line()` that turns its
ValidationError into our `<path>: <what is wrong>; <how to mend>`.

The tree follows the TOML document ([node], [[devices]], [iscsi] with its [[iscsi.targets]], ...). Checks within
one table are validators here; checks across tables are common.cross_check, ours either way.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    model_validator,
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

from . import common

MAX_CONNS = 1 << 20


def _size(v: object) -> int:
    return parse_size(v)


def _rate(v: object) -> object:
    """bytes/s: a size ("100MB", "200MiB/s") or a plain number (0: no limit)."""
    return parse_size(v.removesuffix("/s")) if isinstance(v, str) else v


def _host_nqn(v: str) -> str:
    return check_nqn(v, subsystem=False)


def _dhchap(v: str) -> str:
    from openvsan.protocol.nvme.auth import parse_secret

    parse_secret(v)
    return v.strip()


def _printable(limit: int, unit: str = "bytes") -> AfterValidator:
    def check(v: str) -> str:
        n = len(v.encode()) if unit == "bytes" else len(v)
        if n > limit or not v.isprintable():
            raise ValueError(f"use up to {limit} {unit} of printable text")
        return v
    return AfterValidator(check)


Size = Annotated[int, BeforeValidator(_size), WithJsonSchema({"type": ["string", "integer"],
                                                              "examples": ["1GiB", 1073741824]})]
Rate = Annotated[float, BeforeValidator(_rate), Field(ge=0)]
Name = Annotated[str, AfterValidator(check_object_name), Field(examples=["disk0"])]
IscsiName = Annotated[str, AfterValidator(check_iscsi_name), Field(examples=["iqn.2026-11.org.example:disk0"])]
SubsystemNqn = Annotated[str, AfterValidator(check_nqn), Field(examples=["nqn.2026-11.org.example:disk0"])]
HostNqn = Annotated[str, AfterValidator(_host_nqn), Field(examples=["nqn.2014-08.org.nvmexpress:uuid:..."])]
PortalT = Annotated[Portal, PlainValidator(parse_portal), PlainSerializer(str),
                    WithJsonSchema({"type": "string", "examples": ["127.0.0.1:3260"]})]
Portals = Annotated[list[PortalT], Field(examples=[["127.0.0.1:3260"]])]
Iops = Annotated[float, Field(ge=0)]
Seconds = Annotated[float, Field(gt=0)]


class Spec(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _unique_portals(key: str, portals: list[Portal] | None) -> None:
    for i, p in enumerate(portals or ()):
        if p in portals[:i]:  # type: ignore[index]
            raise ValueError(f"{key}: {p} is listed twice (at [{i}]); remove one")


class NodeSettings(Spec):
    name: Name | None = None
    data_dir: str | None = None
    poll_us: Annotated[int, Field(ge=0, le=10_000)] = 50
    max_connections: Annotated[int, Field(ge=1, le=MAX_CONNS)] = 4096
    max_unauthenticated: Annotated[int, Field(ge=1, le=MAX_CONNS)] = 512
    max_unauthenticated_per_source: Annotated[int, Field(ge=1, le=MAX_CONNS)] = 32
    trust_foreign_files: bool = False
    auth_delay_max: Annotated[float, Field(ge=0, le=60)] = 8.0
    auth_lockout_failures: Annotated[int, Field(ge=0, le=1_000_000)] = 10
    auth_lockout_seconds: Annotated[int, Field(ge=1, le=86_400)] = 300

    @model_validator(mode="after")
    def _caps(self) -> NodeSettings:
        if self.max_unauthenticated > self.max_connections:
            raise ValueError(f"max_unauthenticated: {self.max_unauthenticated} is above max_connections = "
                             f"{self.max_connections}; lower it or raise max_connections")
        if self.max_unauthenticated_per_source > self.max_unauthenticated:
            raise ValueError(f"max_unauthenticated_per_source: {self.max_unauthenticated_per_source} is above "
                             f"max_unauthenticated = {self.max_unauthenticated}; lower it")
        return self


class _Device(Spec):
    name: Name
    block_size: Literal[512, 4096] = 512

    @model_validator(mode="after")
    def _whole_blocks(self) -> _Device:
        size = getattr(self, "size", None)
        if size is not None and size % self.block_size:
            raise ValueError(f"size: {size} bytes is not a whole number of {self.block_size}-byte blocks; use "
                             f"{size - size % self.block_size or self.block_size}")
        return self


class RamDevice(_Device):
    type: Literal["ram"]
    size: Annotated[Size, Field(examples=["1GiB"])]
    backing: str | None = None


class FileDevice(_Device):
    type: Literal["file"]
    path: Annotated[str, Field(examples=["${data_dir}/disk0.img"])]
    size: Size | None = None
    direct: bool = False


class NullDevice(_Device):
    type: Literal["null"]
    size: Annotated[Size, Field(examples=["1GiB"])]


DeviceSpec = Annotated[RamDevice | FileDevice | NullDevice, Field(discriminator="type")]


class PoolSpec(Spec):
    name: Name
    level: Literal["raid0", "raid1", "raid10", "raid5", "raid6"]
    members: Annotated[list[Name], Field(min_length=1, examples=[["d0", "d1", "d2"]])]
    spares: list[Name] = []
    chunk: Size = 64 * 1024
    rebuild_rate: Annotated[int, BeforeValidator(_rate)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> PoolSpec:
        need = {"raid0": 1, "raid1": 2, "raid10": 4, "raid5": 3, "raid6": 4}[self.level]
        if len(self.members) < need:
            raise ValueError(f"members: {self.level} needs at least {need} members, {len(self.members)} given; "
                             f"add {need - len(self.members)} more")
        if self.chunk & (self.chunk - 1) or not 4096 <= self.chunk <= 16 << 20:
            raise ValueError(f'chunk: {self.chunk} bytes; use a power of two from 4KiB to 16MiB, e.g. chunk = "64KiB"')
        return self


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
    bps_limit: Rate = 0
    bps_burst: Rate = 0
    bps_burst_seconds: Seconds = 1
    read_bps_limit: Rate = 0
    read_bps_burst: Rate = 0
    read_bps_burst_seconds: Seconds = 1
    write_bps_limit: Rate = 0
    write_bps_burst: Rate = 0
    write_bps_burst_seconds: Seconds = 1

    @model_validator(mode="after")
    def _bursts(self) -> QosSpec:
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
        return self


class VolumeSpec(Spec):
    name: Name
    device: Name | None = None
    pool: Name | None = None
    read_only: bool = False
    qos: QosSpec | None = None

    @model_validator(mode="after")
    def _one_home(self) -> VolumeSpec:
        if self.device is not None and self.pool is not None:
            raise ValueError(f'names both device "{self.device}" and pool "{self.pool}"; a volume lives on one of '
                             "them: remove one")
        if self.device is None and self.pool is None:
            raise ValueError('device: missing; name the device it lives on, e.g. device = "ram0" (or a pool: '
                             'pool = "pool0")')
        return self


class ChapSpec(Spec):
    user: Annotated[str, Field(min_length=1, examples=["alice"]), _printable(255)]
    secret: Annotated[str, AfterValidator(check_chap_secret), Field(examples=["12 to 16 bytes"])]


class LunSpec(Spec):
    lun: Annotated[int, Field(ge=0, le=16383, examples=[0])]
    volume: Name


class TargetSpec(Spec):
    iqn: IscsiName
    luns: Annotated[list[LunSpec], Field(min_length=1, examples=[[{"lun": 0, "volume": "disk0"}]])]
    portals: Portals | None = None
    advertised_portals: Portals | None = None
    allowed_initiators: list[IscsiName] | None = None
    chap: ChapSpec | None = None
    mutual_chap: ChapSpec | None = None
    alias: Annotated[str, _printable(255)] | None = None
    portal_group_tag: Annotated[int, Field(ge=1, le=65535)] = 1
    allow_unauthenticated: bool = False

    @model_validator(mode="after")
    def _within(self) -> TargetSpec:
        seen: dict[int, str] = {}
        for i, x in enumerate(self.luns):
            if x.lun in seen:
                raise ValueError(f"luns: LUN {x.lun} is used twice (at [{i}]); pick another number")
            if x.volume in seen.values():
                raise ValueError(f'luns: volume "{x.volume}" is already a LUN of this target (at [{i}]); export it once')
            seen[x.lun] = x.volume
        _unique_portals("portals", self.portals)
        if self.mutual_chap is not None and self.chap is None:
            raise ValueError('mutual_chap: needs chap too (the initiator authenticates first); add chap = '
                             '{ user = "...", secret = "..." }')
        if self.mutual_chap and self.chap and self.mutual_chap.secret == self.chap.secret:
            raise ValueError("mutual_chap: its secret must differ from chap.secret (RFC 7143 §12.1.3)")
        return self


class IscsiSection(Spec):
    portals: Portals | None = None
    advertised_portals: Portals | None = None
    targets: list[TargetSpec] = []


class NamespaceSpec(Spec):
    nsid: Annotated[int, Field(ge=1, le=0xFFFFFFFE, examples=[1])]
    volume: Name


class HostAuthSpec(Spec):
    nqn: HostNqn
    dhchap_secret: Annotated[str, AfterValidator(_dhchap), Field(examples=["DHHC-1:00:...:"])]
    dhchap_ctrl_secret: Annotated[str, AfterValidator(_dhchap)] | None = None


class SubsystemSpec(Spec):
    nqn: SubsystemNqn
    namespaces: Annotated[list[NamespaceSpec], Field(min_length=1, examples=[[{"nsid": 1, "volume": "disk0"}]])]
    portals: Portals | None = None
    advertised_portals: Portals | None = None
    allowed_hosts: list[HostNqn] | None = None
    serial: Annotated[str, Field(max_length=20, pattern=r"^[ -~]*$")] = ""
    model: Annotated[str, Field(min_length=1, max_length=40, pattern=r"^[ -~]*$")] = "openvsan"
    hosts: list[HostAuthSpec] = []
    dhchap_hashes: Annotated[list[Literal["sha256", "sha384", "sha512"]], Field(min_length=1)] = [
        "sha256", "sha384", "sha512"]
    dhchap_dhgroups: Annotated[list[Literal["null", "ffdhe2048", "ffdhe3072", "ffdhe4096", "ffdhe6144",
                                            "ffdhe8192"]], Field(min_length=1)] = [
        "null", "ffdhe2048", "ffdhe3072", "ffdhe4096", "ffdhe6144", "ffdhe8192"]
    allow_unauthenticated: bool = False


class NvmeSection(Spec):
    portals: Portals | None = None
    subsystems: list[SubsystemSpec] = []


class NbdTlsSpec(Spec):
    cert: Annotated[str, Field(examples=["server-cert.pem"])]
    key: Annotated[str, Field(examples=["server-key.pem"])]
    ca: str | None = None
    verify_client: bool = False

    @model_validator(mode="after")
    def _ca(self) -> NbdTlsSpec:
        if self.verify_client and self.ca is None:
            raise ValueError('ca: missing; verify_client = true needs the CA that signs client certificates, e.g. '
                             'ca = "ca-cert.pem"')
        return self


class NbdExportSpec(Spec):
    name: Annotated[str, AfterValidator(check_nbd_export_name), Field(examples=["disk0"])]
    volume: Name
    portals: Portals | None = None
    read_only: bool = False
    description: Annotated[str, _printable(4096)] = ""
    tls: Literal["off", "optional", "require"] | None = None   # None: "require" with [nbd] tls, else "off"
    allow_unauthenticated: bool = False


class NbdSection(Spec):
    portals: Portals | None = None
    exports: list[NbdExportSpec] = []
    tls: NbdTlsSpec | None = None


class NodeConfig(Spec):
    node: NodeSettings = NodeSettings()
    devices: list[DeviceSpec] = []
    pools: list[PoolSpec] = []
    volumes: list[VolumeSpec] = []
    iscsi: IscsiSection | None = None
    nvme: NvmeSection | None = None
    nbd: NbdSection | None = None


class VolumeCreate(Spec):
    """The body of a control-socket `volume.create` request (node/live.py)."""

    name: Name
    size: Size | None = None
    backing: Literal["ram", "file"] = "ram"
    device: Name | None = None
    pool: Name | None = None
    block_size: Literal[512, 4096] = 512
    read_only: bool = False
    dry_run: bool = False


# ---- our one-line errors


def _fields_of(cls: type) -> dict[str, Any] | None:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        # the declared annotation, with the field's own constraints carried as Annotated metadata
        return {n: Annotated[f.annotation, f] for n, f in cls.model_fields.items()}
    return None


def _tag_of(cls: type) -> tuple[str, str] | None:
    f = getattr(cls, "model_fields", {}).get("type")
    if f is None:
        return None
    args = getattr(f.annotation, "__args__", ())
    return ("type", args[0]) if len(args) == 1 else None


_TYPES = {"int_type": "an integer", "float_type": "a number", "string_type": "a string", "bool_type": "true or false",
          "list_type": "a list", "model_type": "a table", "dict_type": "a table", "model_attributes_type": "a table",
          "int_from_float": "an integer"}


def one_line(e: ValidationError, data: Any, root: type[BaseModel] = NodeConfig) -> str:
    """The first of pydantic's errors (in document order) as our one line."""
    errs = e.errors(include_url=False)
    err = errs[0]
    if err["type"] == "missing":   # a typo of the missing key is the better report: `naem: did you mean "name"?`
        err = next((x for x in errs if x["type"] == "extra_forbidden" and x["loc"][:-1] == err["loc"][:-1]), err)
    kind, loc = err["type"], list(err["loc"])
    if kind == "extra_forbidden":
        at = common.locate(root, data, loc[:-1], fields_of=_fields_of, tag_of=_tag_of)
        target = common.locate(root, data, loc, fields_of=_fields_of, tag_of=_tag_of)
        foreign = common.foreign_key(common.key_path(at.path), str(loc[-1]), target.owner, _tag_of, _fields_of,
                                     (RamDevice, FileDevice, NullDevice))
        if foreign:
            return foreign
        return common.unknown_key(common.key_path(at.path), str(loc[-1]), list(_fields_of(target.owner) or {}))
    at = common.locate(root, data, loc, fields_of=_fields_of, tag_of=_tag_of)
    where = common.key_path(at.path)
    if kind == "missing":
        return common.missing_key(common.key_path(at.path[:-1]), str(at.path[-1]), at.declared)
    if kind in _TYPES:
        return common.wrong_type(where, at.value, _TYPES[kind])
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return common.out_of_range(where, at.value, at.declared)
    if kind in ("literal_error", "enum"):
        return common.bad_choice(where, at.value, at.declared)
    if kind == "union_tag_invalid":
        return (f"{where}.type: unknown device type {common.fmt(err['ctx']['tag'])}; use one of: "
                f"{err['ctx']['expected_tags'].replace(chr(39), '')}")
    if kind == "union_tag_not_found":
        return f'{where}.type: missing; add type = "ram" (one of: ram, file, null)'
    if kind == "too_short":
        ex = common.examples(common.unwrap(at.declared)[1])
        return f"{where}: empty; " + (f"add {at.path[-1]} = {common.toml_literal(ex[0])}" if ex else
                                      "list at least one")
    if kind in ("string_too_long", "string_pattern_mismatch", "string_too_short"):
        return f"{where}: {common.fmt(at.value)}: {err['msg'].lower()}"
    if kind == "value_error":
        return common.own_message(at, str(err["ctx"]["error"]), _fields_of(_model_at(root, data, loc)))
    return f"{where}: {err['msg']}"


def _model_at(root: type, data: Any, loc: list[Any]) -> Any:
    """The model class whose table sits at `loc` (a validator of a whole table failed there)."""
    at = common.locate(root, data, loc, fields_of=_fields_of, tag_of=_tag_of)
    base, _ = common.unwrap(at.declared)
    members = common._members(base)
    if members:
        tag = at.value.get("type") if isinstance(at.value, dict) else None
        return next((m for m in members if _tag_of(m) == ("type", tag)), members[0])
    args = getattr(base, "__args__", ())
    return base if isinstance(base, type) else (args[0] if args else None)


def parse(data: Any) -> NodeConfig:
    return NodeConfig.model_validate(data)
