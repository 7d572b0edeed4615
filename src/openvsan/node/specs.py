"""The node's desired state as typed specs, declared once: pydantic v2 dataclasses that the TOML config
(node/config.py), the control socket (node/live.py edits the same document), the store (node/store.py) and the
REST API to come validate their input with, and that the node (node/node.py) runs from.

Each field's type and the checks that need only its own table are here, with the one-line message users
read (`<what is wrong>; <how to mend>`; node/config.py puts the key path in front). Scalars are strict: a TOML
string is never read as a number, nor true as 1. Unknown keys are refused. Checks that look across tables
(a LUN naming an unknown volume, a device in two pools, two protocols on one port) stay in node/config.py.
Each field's default is the product's default; docs/security.md and README.md explain the ones of the [node]
limits. A spec built in code (`DeviceSpec("ram0", "ram", 1 << 30)`) passes the same checks.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    Strict,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from openvsan.node.values import (
    Portal,
    check_chap_secret,
    check_iscsi_name,
    check_nbd_export_name,
    check_nqn,
    check_object_name,
    format_size,
    parse_portal,
    parse_size,
)

DEFAULT_CHUNK = 64 * 1024
DEFAULT_POLL_US = 50
DEFAULT_POLL_MAX_US = 500   # the longest a polling window grows to, learned from the gaps between commands
# Limits on peers (docs/security.md): connections in all, connections that have not logged in (all sources,
# and from one source address), and failed authentications before a lockout
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_UNAUTHENTICATED = 512
DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE = 32
DEFAULT_AUTH_DELAY_MAX = 8.0          # seconds: the cap of the doubling delay after failed authentications
DEFAULT_AUTH_LOCKOUT_FAILURES = 10    # failures in a row from one (initiator, address) before a lockout; 0: never
DEFAULT_AUTH_LOCKOUT_SECONDS = 300
MAX_AUTH_DELAY = 60.0   # seconds: beyond it a held login runs into the initiator's own login timeout
MAX_MAX_CONNECTIONS = 1 << 20   # Linux's default fs.nr_open: no process can hold more descriptors
MAX_POLL_US = 10_000
DHCHAP_HASHES = ("sha256", "sha384", "sha512")
DHCHAP_DHGROUPS = ("null", "ffdhe2048", "ffdhe3072", "ffdhe4096", "ffdhe6144", "ffdhe8192")
DEVICE_TYPES = ("ram", "file", "null")
# the keys each device type takes
DEVICE_KEYS = {
    "ram": ("name", "type", "size", "block_size", "backing"),
    "file": ("name", "type", "size", "block_size", "path", "direct"),
    "null": ("name", "type", "size", "block_size"),
}
# the pool levels a config names, and the fewest members each needs (RAID 10: mirrored pairs, so also even)
POOL_LEVELS = {"raid0": 1, "raid1": 2, "raid10": 4, "raid5": 3, "raid6": 4}
MAX_CHUNK = 16 << 20
BLOCK_SIZES = (512, 4096)
MAX_LUN = 16383  # SAM-5 flat/peripheral addressing as Linux and Windows use it: 14 bits
MAX_NSID = 0xFFFFFFFE
MAX_REPLICAS = 3
DEFAULT_LEASE_TTL = 5          # seconds: a primary's etcd lease (failover takes about this long)
DEFAULT_SUSPEND_SECONDS = 30   # seconds I/O is held, not failed, while the cluster store has no quorum
DEFAULT_REPLICATION_PORT = 4430  # NVMe Base 2.0 §3.2.1.2: 0 and FFFFFFFFh are not valid namespace IDs
ISCSI_PORT, NVME_PORT, NBD_PORT = 3260, 4420, 10809  # IANA: iSCSI; NVMe/TCP I/O controllers; NBD
NBD_TLS_MODES = ("off", "optional", "require")
DATA_DIR_REF = "${data_dir}"   # a device path or backing starting with this lies in the node's data dir

T = TypeVar("T")


class SpecError(ValueError):
    """A check's one line (what is wrong; how to mend it). `at`: the key path, below the value checked, that
    the line is about: ("size",) when a device's check of its size and block size fails on the size."""

    def __init__(self, message: str, *at: str | int, subject: bool = False) -> None:
        super().__init__(message)
        self.at = at
        self.subject = subject   # the line starts with a key below `at` as its subject: "qos.bps_limit is -1; ..."


class Hint:
    """Annotated metadata: how to mend the key when it is missing (node/config.py prints it)."""

    def __init__(self, text: str) -> None:
        self.text = text


class Table:
    """Annotated metadata on a spec class's field holding tables: what one such table is called in errors."""

    def __init__(self, what: str) -> None:
        self.what = what


def fmt(v: object) -> str:
    """A value as an error line shows it: a string quoted as TOML writes it (a newline as \\n: one line)."""
    return json.dumps(v, ensure_ascii=False) if isinstance(v, str) else repr(v)


def _names(kinds: tuple[type, ...]) -> str:
    words = {str: "a string", int: "an integer", bool: "true or false", list: "a list", dict: "a table"}
    return " or ".join(words.get(k, k.__name__) for k in kinds)


def expect(value: object, *kinds: type) -> None:
    """Refuse a value of another type than `kinds`, as a strict field would (a bool is not a number here)."""
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise SpecError(f"expected {_names(kinds)}, found {fmt(value)}")


def _workers(v: object) -> object:
    """[node] workers: "auto" or 1..MAX_WORKERS."""
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(f'expected "auto" or an integer, found {fmt(v)}')
    if not 1 <= v <= MAX_WORKERS:
        raise SpecError(f'{v} is out of range; use "auto" (one per core) or 1 to {MAX_WORKERS} worker processes')
    return v


def _check(fn: Callable[[Any], T]) -> AfterValidator:
    return AfterValidator(fn)


def _secret(fn: Callable[[Any], T]) -> AfterValidator:
    """A secret's check; outside a config document a secret may be "": one the spec does not carry (the
    state a store migrates, whose secrets stay in secrets.json)."""
    def check(v: Any, info: ValidationInfo) -> Any:
        return v if v == "" and not (info.context or {}).get("document") else fn(v)
    return AfterValidator(check)


def _in_range(lo: float, hi: float, mend: str) -> AfterValidator:
    """`<v> is out of range; <mend>` outside lo..hi (mend says the range and what its ends mean)."""
    def check(v: float) -> float:
        if not lo <= v <= hi:
            raise SpecError(f"{v} is out of range; {mend}")
        return v
    return AfterValidator(check)


def one_of(choices: tuple[str, ...], what: str) -> AfterValidator:
    """A string out of `choices`: `"x" is not <what>; use one of: ...` otherwise."""
    def check(v: str) -> str:
        if v not in choices:
            raise SpecError(f"{fmt(v)} is not {what}; use one of: {', '.join(choices)}")
        return v
    return AfterValidator(check)


def _block_size(v: int) -> int:
    if v not in BLOCK_SIZES:
        raise SpecError(f"{v} is not supported; use 512 or 4096")
    return v


def _printable(limit: int) -> AfterValidator:
    def check(v: str) -> str:
        if len(v.encode()) > limit or not v.isprintable():
            raise SpecError(f"use up to {limit} bytes of printable text")
        return v
    return AfterValidator(check)


def _size(v: object) -> object:
    if isinstance(v, int | str) and not isinstance(v, bool):
        return parse_size(v)
    expect(v, int, str)
    return v


def _rate(v: object) -> object:
    # "200MiB/s" reads as well as "200MiB": the unit is per second either way
    return _size(v.removesuffix("/s") if isinstance(v, str) else v)


def _portal(v: object) -> Portal:
    return v if isinstance(v, Portal) else parse_portal(v)


def _unique(values: tuple[T, ...], show: Callable[[T], str] = fmt) -> tuple[T, ...]:
    for i, v in enumerate(values):
        if v in values[:i]:
            raise SpecError(f"{show(v)} is listed twice; remove one", i)
    return values


Str = Annotated[str, Strict()]
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Number = Annotated[float, Strict()]       # an integer or a float, not a bool
Name = Annotated[str, Strict(), _check(check_object_name)]
BlockSize = Annotated[int, Strict(), AfterValidator(_block_size)]
Size = Annotated[int, BeforeValidator(_size)]
# a size that may be 0 (none), written 0 or "0" too
SizeOrZero = Annotated[int, BeforeValidator(lambda v: 0 if v in (0, "0") and v is not False else _size(v))]
# written "host:port" (and so in JSON and the REST API's schema), a Portal once read
PortalT = Annotated[Portal, BeforeValidator(_portal), PlainSerializer(str, return_type=str),
                    WithJsonSchema({"type": "string", "examples": ["127.0.0.1:3260", "[::1]:3260"]})]
Portals = Annotated[tuple[PortalT, ...], AfterValidator(lambda v: _unique(v, str))]
IscsiName = Annotated[str, Strict(), _check(check_iscsi_name)]
SubsystemNqn = Annotated[str, Strict(), _check(check_nqn)]
HostNqn = Annotated[str, Strict(), _check(lambda v: check_nqn(v, subsystem=False))]
# the schemas are built at first use: a CLI call that parses no config (`vsan volume list`) does not pay for them
SPEC = ConfigDict(extra="forbid", arbitrary_types_allowed=True, defer_build=True)


# [node]'s caps on connections, whole first: (key, default, what it counts)
MAX_WORKERS = 256
_CAPS = (("max_connections", DEFAULT_MAX_CONNECTIONS, "connections of all protocols together"),
         ("max_unauthenticated", DEFAULT_MAX_UNAUTHENTICATED, "connections that have not logged in"),
         ("max_unauthenticated_per_source", DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE,
          "connections not logged in from one address"))


def _host_name() -> str:
    return socket.gethostname().split(".")[0]


def _path(v: object, info: ValidationInfo, *, data_dir: bool = False) -> object:
    """A path as written: relative to the config file's directory (context base_dir); with data_dir, one that
    starts with ${data_dir} lies in the node's data dir (context data_dir)."""
    if v is None or isinstance(v, Path):
        return v
    if not isinstance(v, str):
        raise SpecError(f"expected a string, found {fmt(v)}")
    ctx = info.context or {}
    if data_dir and DATA_DIR_REF in v:
        rest = v[len(DATA_DIR_REF):]
        if not v.startswith(DATA_DIR_REF):
            raise SpecError(f'{DATA_DIR_REF} may only start a path, e.g. "{DATA_DIR_REF}/disk0.img"')
        if not rest.startswith("/") or not rest.strip("/"):
            raise SpecError(f'name a file in the data dir, e.g. "{DATA_DIR_REF}/disk0.img"')
        data_dir_of = ctx.get("data_dir")   # a callable: the data dir is found only when a path names it
        if data_dir_of is None:
            raise SpecError(f"{DATA_DIR_REF}: no data dir to put it in; give the path itself")
        return Path(data_dir_of()) / rest.lstrip("/")
    path = Path(v).expanduser()
    base = ctx.get("base_dir")
    return path if path.is_absolute() or base is None else Path(base) / path


@dataclass(frozen=True, config=SPEC)
class NodeSettings:
    """[node]. `name`: "" only in a node not yet given one (an empty store)."""

    name: Str = field(default_factory=_host_name)
    data_dir: Path | None = None
    # adaptive busy-poll window after each command (frontend/busypoll.py); 0: off
    poll_us: Annotated[Int, _in_range(0, MAX_POLL_US, f"use 0 (no polling) to {MAX_POLL_US} microseconds "
                                                     f"(default {DEFAULT_POLL_US})")] = DEFAULT_POLL_US
    # ... and the longest it may grow to, covering the gaps of a steady stream of commands (busypoll.py); at
    # most poll_us: windows of poll_us only
    poll_max_us: Annotated[Int, _in_range(0, MAX_POLL_US, f"use 0 (windows of poll_us only) to {MAX_POLL_US} "
                                                          f"microseconds (default {DEFAULT_POLL_MAX_US})")] = \
        DEFAULT_POLL_MAX_US
    max_connections: Int = DEFAULT_MAX_CONNECTIONS            # every protocol's connections together
    max_unauthenticated: Int = DEFAULT_MAX_UNAUTHENTICATED    # connections that have not logged in, all sources
    max_unauthenticated_per_source: Int = DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE   # ... from one address
    trust_foreign_files: Bool = False   # open device/member files another user owns or others may write
    auth_delay_max: Annotated[Number, _in_range(0, MAX_AUTH_DELAY, f"use 0 (no delay) to {MAX_AUTH_DELAY:g} seconds "
                                                f"(default {DEFAULT_AUTH_DELAY_MAX:g})")] = DEFAULT_AUTH_DELAY_MAX
    auth_lockout_failures: Annotated[Int, _in_range(0, 1_000_000, "use 0 (never lock out) or the failures in a "
                                                    "row that lock a peer out (default "
                                                    f"{DEFAULT_AUTH_LOCKOUT_FAILURES})")] = DEFAULT_AUTH_LOCKOUT_FAILURES
    auth_lockout_seconds: Annotated[Int, _in_range(1, 86_400, "use 1 to 86400 seconds (default "
                                                   f"{DEFAULT_AUTH_LOCKOUT_SECONDS}; auth_lockout_failures = 0 turns "
                                                   "lockouts off)")] = DEFAULT_AUTH_LOCKOUT_SECONDS
    # worker processes (node/workers.py): "auto" is one per core the node may use (worker_cpus, else every
    # core the process may run on: one core gives one process); 1: the whole node in one process
    workers: Annotated[Literal["auto"] | Int, BeforeValidator(_workers)] = "auto"
    # the cores they are pinned to, worker i on the i-th (round robin); (): every core the node may use
    worker_cpus: tuple[Annotated[Int, _in_range(0, 4095, "use a cpu number from 0 to 4095")], ...] = ()
    # seconds between automatic rebalances of volumes over the workers by load (node/workers.py); 0: only
    # `vsan workers balance` moves them
    worker_balance_interval: Annotated[Number, _in_range(0, 86_400, "use 0 (off) or 10 to 86400 seconds")] = 0

    @field_validator("name")
    @classmethod
    def _name(cls, v: str, info: ValidationInfo) -> str:
        return v if v == "" and not (info.context or {}).get("document") else check_object_name(v)

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir(cls, v: object, info: ValidationInfo) -> object:
        return _path(v, info)

    @field_validator("worker_balance_interval")
    @classmethod
    def _balance_interval(cls, v: float) -> float:
        if 0 < v < 10:
            raise ValueError("use 0 (off) or 10 to 86400 seconds: a volume that moves pauses its I/O a moment")
        return v

    @model_validator(mode="before")
    @classmethod
    def _cap_defaults(cls, data: Any) -> Any:
        """A cap left out is its default, or the cap above it when that is lower (max_connections = 100 alone
        makes max_unauthenticated 100)."""
        if not isinstance(data, dict):
            return data
        top = MAX_MAX_CONNECTIONS
        out = dict(data)
        for key, default, _ in _CAPS:
            value = out.setdefault(key, min(default, top))
            top = value if isinstance(value, int) and not isinstance(value, bool) else top
        return out

    @model_validator(mode="after")
    def _caps(self) -> NodeSettings:
        """Each cap within 1 and the one before it: a cap on a part cannot be above the cap on the whole."""
        top, before = MAX_MAX_CONNECTIONS, ""
        for key, default, what in _CAPS:
            value = getattr(self, key)
            if not 1 <= value <= top:
                above = f" (it cannot be above {before} = {top})" if before else ""
                raise SpecError(f"{value} is out of range{above}; use 1 to {top} {what} (default {default})", key)
            before, top = key, value
        return self


DEFAULT_CLUSTER = 64 << 10


def _cluster(v: int) -> int:
    """The cluster of a volume group (volume/thin): the unit thin volumes are allocated and snapshots copied in."""
    if v & (v - 1) or not 4096 <= v <= 4 << 20:
        raise SpecError(f'{v} bytes; use a power of two from 4KiB to 4MiB, e.g. cluster = "64KiB"')
    return v


_TYPE_HINT = Hint(f'add type = "ram" (one of: {", ".join(DEVICE_TYPES)})')
_LEVEL_HINT = Hint(f'add level = "raid5" (one of: {", ".join(POOL_LEVELS)})')


@dataclass(frozen=True, config=SPEC)
class DeviceSpec:
    name: Annotated[Name, Hint('give the device a name, e.g. name = "ram0"')]
    type: Annotated[Str, _TYPE_HINT]   # ram | file | null
    size: Size | None = None        # bytes; None only for a file device that takes the file's size
    block_size: BlockSize = 512
    backing: Path | None = None     # ram: a file (in /dev/shm) that keeps the contents across restarts
    path: Path | None = None        # file: the file or block device
    direct: Bool = False            # file: O_DIRECT
    # a volume group carved from it (volumes with a size): its cluster and fill level for the soft threshold
    cluster: Annotated[Size, AfterValidator(_cluster)] = DEFAULT_CLUSTER
    soft_threshold: Annotated[Int, _in_range(1, 100, "use 1 to 100 (% of the group in use; default 80)")] = 80

    @model_validator(mode="before")
    @classmethod
    def _keys_of_type(cls, data: Any) -> Any:
        """A key of another device type is named as such (`path` on a ram device), not as unknown."""
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] in DEVICE_KEYS:
            kind = data["type"]
            for key in data:
                if key not in DEVICE_KEYS[kind] and any(key in keys for keys in DEVICE_KEYS.values()):
                    owner = " or ".join(fmt(k) for k, keys in DEVICE_KEYS.items() if key in keys)
                    raise SpecError(f"not a key of a {kind} device (it belongs to type = {owner}); remove it", key)
        return data

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v not in DEVICE_TYPES:
            raise SpecError(f"unknown device type {fmt(v)}; use one of: {', '.join(DEVICE_TYPES)}")
        return v

    @field_validator("backing", "path", mode="before")
    @classmethod
    def _file(cls, v: object, info: ValidationInfo) -> object:
        return _path(v, info, data_dir=True)

    @model_validator(mode="after")
    def _whole(self) -> DeviceSpec:
        if self.size is not None and self.size % self.block_size:
            raise SpecError(f"{self.size} bytes is not a whole number of {self.block_size}-byte blocks; use "
                            f"{self.size - self.size % self.block_size or self.block_size}", "size")
        if self.size is None and self.type != "file":
            raise SpecError(f'missing; a {self.type} device needs a size, e.g. size = "1GiB"', "size")
        if self.type == "file" and self.path is None:
            raise SpecError('missing; add path = "${data_dir}/disk0.img" (a file or block device)', "path")
        return self


@dataclass(frozen=True, config=SPEC)
class PoolSpec:
    """A RAID pool over devices (openvsan.pool); serve creates it on blank members, else assembles it."""

    name: Annotated[Name, Hint('give the pool a name, e.g. name = "pool0"')]
    level: Annotated[Str, _LEVEL_HINT]
    members: Annotated[tuple[Str, ...], Hint('list its devices, e.g. members = ["d0", "d1", "d2"]')]  # slot order
    spares: tuple[Str, ...] = ()
    chunk: Size = DEFAULT_CHUNK      # bytes
    rebuild_rate: Annotated[int, BeforeValidator(_rate)] | None = None  # bytes/s of member data; None: no cap
    cluster: Annotated[Size, AfterValidator(_cluster)] = DEFAULT_CLUSTER   # as a device's
    soft_threshold: Annotated[Int, _in_range(1, 100, "use 1 to 100 (% of the group in use; default 80)")] = 80

    @field_validator("level", mode="after")
    @classmethod
    def _level(cls, v: str) -> str:
        if v.lower() not in POOL_LEVELS:
            raise SpecError(f"unknown level {fmt(v.lower())}; use one of: {', '.join(POOL_LEVELS)}")
        return v.lower()

    @field_validator("members", "spares", mode="before")
    @classmethod
    def _devices(cls, v: object) -> object:
        if isinstance(v, list | tuple):
            for i, d in enumerate(v):
                if not isinstance(d, str):
                    raise SpecError(f"expected a device name, found {fmt(d)}", i)
                if d in v[:i]:
                    raise SpecError(f"device {fmt(d)} is listed twice in this pool; list it once", i)
        return v

    @field_validator("chunk")
    @classmethod
    def _chunk(cls, v: int) -> int:
        if v & (v - 1) or not 4096 <= v <= MAX_CHUNK:
            raise SpecError(f'{v} bytes; use a power of two from 4KiB to 16MiB, e.g. chunk = "64KiB"')
        return v

    @model_validator(mode="after")
    def _shape(self) -> PoolSpec:
        n = len(self.members)
        need = POOL_LEVELS[self.level]
        if n < need:
            raise SpecError(f"{self.level} needs at least {need} members, {n} given; add {need - n} more", "members")
        if self.level == "raid10" and n % 2:
            raise SpecError(f"raid10 needs an even number of members (mirrored pairs), {n} given; add or remove one",
                            "members")
        if self.spares and self.level == "raid0":
            raise SpecError("raid0 has no redundancy to rebuild a spare from; remove spares or use a redundant level",
                            "spares")
        return self


def _qos(v: object) -> object:
    """qos = { read_iops_limit = 1000, bps_limit = "100MB", ... } (volume/qos.py QosLimits, Ceph librbd's
    knobs): the knobs set, validated; bytes/s knobs take sizes ("100MB", "1GiB"); 0 means no limit."""
    from openvsan.volume.qos import QosError, QosLimits

    if not isinstance(v, dict):
        raise SpecError(f"expected a table, found {fmt(v)}")
    values: dict[str, Any] = {}
    for key, value in v.items():
        if isinstance(value, str) and "_bps_" in f"_{key}" and not key.endswith("_seconds"):
            try:
                value = parse_size(value)
            except ValueError as e:
                raise SpecError(str(e), key) from None
        values[key] = value
    try:
        limits = QosLimits.from_dict(values)
    except QosError as e:
        raise SpecError(str(e).removeprefix("qos: "), subject=True) from None
    return dict(limits.to_dict()) if not limits.unlimited else {}


def _compression(v: str | None) -> str | None:
    if v is None:
        return None
    from openvsan.volume.compress import parse_compression

    try:
        parse_compression(v)
    except ValueError as e:
        raise SpecError(str(e).removeprefix(f"compression {v!r}: ")) from None
    return v


@dataclass(frozen=True, config=SPEC)
class EncryptionSpec:
    """A volume's `encryption = { key_file = ... }`: its data in a LUKS2 container on its device (volume/crypt.py),
    which `cryptsetup open` reads too. The key file's bytes are the passphrase (as cryptsetup --key-file); only
    its path is kept in the desired state."""

    key_file: Path | None = None     # its bytes unlock the volume (as cryptsetup --key-file), or:
    # a key service hook: this command (argv) prints the passphrase on stdout (as-is, newline included), or:
    key_command: tuple[Str, ...] | None = None
    # the volume starts locked (served, every command answered "not ready") until `vsan volume unlock` gives
    # its passphrase (typed at a prompt, or --key-file); nothing holds the key on disk
    prompt: Bool = False
    format: Annotated[Str, one_of(("luks2",), "a format")] = "luks2"
    cipher: Annotated[Str, one_of(("aes-xts-plain64",), "a cipher")] = "aes-xts-plain64"
    # at format only (a container that exists keeps its own):
    key_size: Int = 512               # bits: 256 (AES-128-XTS) or 512 (AES-256-XTS)
    sector_size: Int | None = None    # 512 or 4096 (the volume's block size); None: 4096, as cryptsetup
    kdf: Annotated[Str, one_of(("argon2id", "argon2i", "pbkdf2"), "a KDF")] = "argon2id"
    kdf_time: Annotated[Int, _in_range(1, 100, "use 1 to 100 passes")] = 4
    kdf_memory_kib: Annotated[Int, _in_range(8, 4 << 20, "use 8 KiB to 4 GiB, in KiB")] = 262144
    kdf_iterations: Annotated[Int, _in_range(1000, 100_000_000, "use 1000 or more")] = 600_000
    allow_discards: Bool = False     # pass unmaps down (shows which blocks are in use, as dm-crypt warns)

    @field_validator("key_file", mode="before")
    @classmethod
    def _file(cls, v: object, info: ValidationInfo) -> object:
        return None if v is None else _path(v, info)

    @model_validator(mode="after")
    def _one_key(self) -> EncryptionSpec:
        if (self.key_file is not None) + (self.key_command is not None) + self.prompt != 1:
            raise SpecError('give key_file = "/etc/openvsan/VOLUME.key" (its bytes unlock the volume), key_command '
                            '= ["/usr/local/bin/get-key", "VOLUME"] (it prints the passphrase) or prompt = true '
                            "(`vsan volume unlock` gives it), one of the three", "key_file")
        if self.key_command is not None and not self.key_command:
            raise SpecError('key_command: give the command and its arguments, e.g. ["/usr/local/bin/get-key", "v1"]',
                            "key_command")
        return self

    @field_validator("key_size")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in (256, 512):
            raise SpecError(f"{v} bits: use 256 (AES-128 in XTS) or 512 (AES-256 in XTS)")
        return v

    @field_validator("sector_size")
    @classmethod
    def _sector(cls, v: int | None) -> int | None:
        if v not in (None, 512, 4096):
            raise SpecError(f"sector size {v}: use 512 or 4096 (the volume's block size)")
        return v

    def layer(self) -> dict[str, Any]:
        key: dict[str, Any] = ({"key_file": str(self.key_file)} if self.key_file is not None else
                               {"key_command": list(self.key_command)} if self.key_command is not None else
                               {"prompt": True})
        out: dict[str, Any] = {"type": "crypt", "format": self.format, "cipher": self.cipher,
                               **key, "key_size": self.key_size, "kdf": self.kdf,
                               "kdf_time": self.kdf_time, "kdf_memory_kib": self.kdf_memory_kib,
                               "kdf_iterations": self.kdf_iterations, "allow_discards": self.allow_discards}
        if self.sector_size is not None:
            out["sector_size"] = self.sector_size
        return out


@dataclass(frozen=True, config=SPEC)
class VolumeSpec:
    name: Annotated[Name, Hint('give the volume a name, e.g. name = "disk0"')]
    # None: the volume lives on `pool`
    device: Str | None = None
    read_only: Bool = False
    pool: Str | None = None
    # QoS limits (volume/qos.py QosLimits knobs that are set: read_iops_limit, bps_burst, ...); empty: none,
    # and then no QoS layer at all in its stack
    qos: Annotated[dict[str, int | float], BeforeValidator(_qos)] = field(default_factory=dict, hash=False)
    # replication (replication/, issue 12): the copies kept, one per node; `nodes` names them, this node among
    # them. 1: a volume of this node alone
    replicas: Annotated[Int, _in_range(1, MAX_REPLICAS, f"use 1 (not replicated), 2 or {MAX_REPLICAS}")] = 1
    nodes: Annotated[tuple[Name, ...], AfterValidator(_unique)] = ()
    # carved from its device or pool (volume/thin, with other volumes there): its size, thin (clusters on
    # first write) or thick (all at creation); None: the volume is the whole device or pool
    size: Size | None = None
    thin: Bool = True
    snapshot: Bool = False          # a snapshot of the device's or pool's group, served read-only by its name
    # encrypted at rest in a LUKS2 container on its device or pool (volume/crypt.py); None: not encrypted
    encryption: Annotated[EncryptionSpec | None, Table('a table, e.g. encryption = { key_file = "v.key" }')] = None
    # compressed in 64 KiB chunks (volume/compress.py): "lz4", "zstd" or "zstd:LEVEL"; a thin volume carved from
    # a device or pool whose group has small clusters (cluster_size = "4KiB") keeps only what the chunks need
    compression: Annotated[Str | None, AfterValidator(_compression)] = None
    # the compressed unit: 16, 32, 64 (None: the default) or 128 KiB; smaller costs less per small random
    # write and read (a whole chunk is read, decompressed and compressed again), larger compresses better.
    # Fixed once the volume holds data
    compression_chunk: Size | None = None
    # within a chunk, each frame of this size is compressed on its own: 0 (None: the default, the chunk is one
    # stream), 4, 8, 16 or 32 KiB; a small read decodes only its frames and a small write encodes only the
    # frames it changes, at a few per cent of the ratio and some large-I/O speed. Changeable: each version
    # written says how it is framed
    compression_frame: SizeOrZero | None = None
    # small writes (whole 4 KiB units) kept in memory until a flush or the cleaner writes them back, so that a
    # chunk written several times in between is compressed once: its most bytes, 0 for none (None: the default,
    # 32 MiB). Volatile, as any write not yet flushed: a flush or a FUA write makes it durable. Changeable
    compression_cache: SizeOrZero | None = None

    @model_validator(mode="after")
    def _compressed(self) -> VolumeSpec:
        if self.compression is None:
            for knob in ("compression_chunk", "compression_frame", "compression_cache"):
                if getattr(self, knob) is not None:
                    raise SpecError(f'{knob} is for a compressed volume; add compression = "lz4" or remove it', knob)
            return self
        from openvsan.volume.compress import CHUNKS

        chunk = self.chunk_bytes
        if chunk not in CHUNKS:
            raise SpecError(f"{format_size(chunk)}: use one of {', '.join(format_size(c) for c in CHUNKS)}",
                            "compression_chunk")
        if self.compression_frame is not None:
            from openvsan.volume.compress import check_frame

            why = check_frame(self.compression_frame, chunk)
            if why:
                raise SpecError(why, "compression_frame")
        if not self.snapshot and (self.size is None or not self.thin):
            raise SpecError('compression is for a thin volume carved from its device or pool: give it a size, e.g. '
                            'size = "10GiB"', "compression")
        if self.size is not None and self.size % chunk:
            raise SpecError(f"a compressed volume's size is a multiple of its {chunk >> 10} KiB chunks, e.g. "
                            f"{format_size(-(-self.size // chunk) * chunk)}", "size")
        if self.encryption is not None and not self.encryption.allow_discards:
            raise SpecError("compression under encryption gives space back through unmaps: add allow_discards = true "
                            "to its encryption table", "encryption")
        return self

    @property
    def carved_size(self) -> int | None:
        """The size of its volume in the group: a compressed volume's thin volume holds two slots per chunk
        (volume/compress.py; only what is written takes clusters), and an encrypted one's LUKS2 header too."""
        if self.size is None or self.compression is None:
            return self.size
        from openvsan.volume.compress import backing_size
        from openvsan.volume.luks2 import DATA_OFFSET

        return backing_size(self.size, self.chunk_bytes) + (DATA_OFFSET if self.encryption is not None else 0)

    @property
    def chunk_bytes(self) -> int:
        """A compressed volume's chunk size in bytes (the default when compression_chunk is not given)."""
        from openvsan.volume.compress import DEFAULT_CHUNK

        return self.compression_chunk or DEFAULT_CHUNK

    @model_validator(mode="after")
    def _carved(self) -> VolumeSpec:
        if self.snapshot and self.size is not None:
            raise SpecError("a snapshot keeps the size it was taken with; remove size", "size")
        if not self.thin and self.size is None and not self.snapshot:
            raise SpecError('thin = false is for a volume carved from its device or pool; give it a size, e.g. '
                            'size = "10GiB"', "thin")
        if self.snapshot and self.replicated:
            raise SpecError("a snapshot is served from one node's volume group; serve it with replicas = 1",
                            "replicas")
        if self.encryption is not None and self.encryption.prompt and self.replicated:
            raise SpecError("a replicated volume's nodes unlock it when they start, with nobody there: give its "
                            "encryption a key_file or key_command (prompt = true is for a volume of one node)",
                            "encryption")
        return self

    @property
    def carved(self) -> bool:
        """One of many volumes of its device's or pool's volume group (volume/thin)."""
        return self.size is not None or self.snapshot

    @model_validator(mode="after")
    def _replica_nodes(self) -> VolumeSpec:
        if self.replicas == 1 and self.nodes:
            raise SpecError(f"names nodes {', '.join(self.nodes)} but the volume has replicas = 1; set replicas = "
                            f"{max(len(self.nodes), 2)} or remove nodes", "nodes")
        if self.replicas > 1 and len(self.nodes) != self.replicas:
            raise SpecError(f"replicas = {self.replicas} needs that many node names, e.g. nodes = "
                            f"{json.dumps([f'node{i + 1}' for i in range(self.replicas)])}", "nodes")
        return self

    @property
    def replicated(self) -> bool:
        return self.replicas > 1

    @model_validator(mode="after")
    def _one_home(self) -> VolumeSpec:
        if self.device is not None and self.pool is not None:
            raise SpecError(f"names both device {fmt(self.device)} and pool {fmt(self.pool)}; a volume lives on one "
                            "of them: remove one")
        if self.device is None and self.pool is None:
            raise SpecError('missing; name the device it lives on, e.g. device = "ram0" (or a pool: pool = "pool0")',
                            "device")
        return self

    @property
    def layers(self) -> list[dict[str, Any]]:
        """The layer configs of its stack, bottom first (volume/registry.py builds them over the device)."""
        crypt = [self.encryption.layer()] if self.encryption is not None else []
        # above the encryption: what it compresses is the plain data (ciphertext does not compress)
        squeeze = [{"type": "compress", "algorithm": self.compression,
                    **({"chunk_size": self.compression_chunk} if self.compression_chunk is not None else {}),
                    **({"frame_size": self.compression_frame} if self.compression_frame is not None else {}),
                    **({"cache_size": self.compression_cache} if self.compression_cache is not None else {})}
                   ] if self.compression is not None else []
        return crypt + squeeze + ([{"type": "qos", **self.qos}] if self.qos else [])


@dataclass(frozen=True, config=SPEC)
class ChapSpec:
    user: Annotated[Str, Hint('add user = "name"')]
    secret: Annotated[Str, Hint('add secret = "12 to 16 bytes"'), _secret(check_chap_secret)]

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not v or not v.isprintable():
            raise SpecError("the user name must be printable and not empty")
        return v


@dataclass(frozen=True, config=SPEC)
class LunSpec:
    lun: Annotated[Int, Hint("add lun = 0"), _in_range(0, MAX_LUN, f"use 0 to {MAX_LUN}")]
    volume: Annotated[Str, Hint('add volume = "disk0"')]


def _exported(items: tuple[Any, ...], number: str, what: str, owner: str) -> tuple[Any, ...]:
    """A target's LUNs or a subsystem's namespaces: each number once, each volume once, sorted by number;
    at least one."""
    numbers: set[int] = set()
    volumes: set[str] = set()
    for i, x in enumerate(items):
        n = getattr(x, number)
        if n in numbers:
            raise SpecError(f"{what} {n} is already used in this {owner}; pick another number", i, number)
        if x.volume in volumes:
            raise SpecError(f"volume {fmt(x.volume)} is already a {what} of this {owner}; "
                            "export it once", i, "volume")
        numbers.add(n)
        volumes.add(x.volume)
    return tuple(sorted(items, key=lambda x: getattr(x, number)))


@dataclass(frozen=True, config=SPEC)
class TargetSpec:
    iqn: Annotated[IscsiName, Hint('add iqn = "iqn.2026-11.org.example:disk0"')]
    luns: Annotated[tuple[LunSpec, ...], Table('a table { lun = 0, volume = "disk0" }')]
    portals: Portals        # in a config: the [iscsi] portals unless its own
    advertised_portals: Portals = ()
    allowed_initiators: tuple[IscsiName, ...] | None = None  # None: any initiator
    chap: Annotated[ChapSpec | None, Table('a table { user = "...", secret = "..." }')] = None
    mutual_chap: Annotated[ChapSpec | None, Table('a table { user = "...", secret = "..." }')] = None
    alias: Annotated[Str, _printable(255)] | None = None
    portal_group_tag: Annotated[Int, _in_range(1, 65535, "use 1 to 65535")] = 1
    allow_unauthenticated: Bool = False   # served open although another export of one of its volumes is not

    @field_validator("luns")
    @classmethod
    def _luns(cls, v: tuple[LunSpec, ...]) -> tuple[LunSpec, ...]:
        if not v:
            raise SpecError('missing or empty; add luns = [{ lun = 0, volume = "disk0" }]')
        return _exported(v, "lun", "LUN", "target")

    @field_validator("allowed_initiators")
    @classmethod
    def _initiators(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return v if v is None else _unique(v)

    @model_validator(mode="after")
    def _chaps(self) -> TargetSpec:
        if self.mutual_chap and not self.chap:
            raise SpecError('needs chap too (the initiator authenticates first); add chap = { user = "...", '
                            'secret = "..." }', "mutual_chap")
        if self.mutual_chap and self.chap and self.chap.secret and self.mutual_chap.secret == self.chap.secret:
            # RFC 7143 §12.1.3: a secret is never used in both directions
            raise SpecError("must differ from chap.secret (RFC 7143 §12.1.3)", "mutual_chap", "secret")
        return self


@dataclass(frozen=True, config=SPEC)
class NamespaceSpec:
    nsid: Annotated[Int, Hint("add nsid = 1 (namespace IDs start at 1)"),
                    _in_range(1, MAX_NSID, f"use 1 to {MAX_NSID} (NVMe Base 2.0 §3.2.1.2)")]
    volume: Annotated[Str, Hint('add volume = "disk0"')]


def _dhchap_secret(v: str) -> str:
    from openvsan.protocol.nvme.auth import parse_secret  # NVMe Base 2.0 §8.13.5.7: the DHHC-1 form

    parse_secret(v)      # its SecretError (a ValueError) says what is wrong, never the secret
    return v.strip()


def _dhchap_value(v: object) -> object:
    if not isinstance(v, str):
        raise SpecError('expected a string "DHHC-1:00:<base64>:" as `nvme gen-dhchap-key` prints it')
    return v


DhchapSecret = Annotated[str, BeforeValidator(_dhchap_value), _secret(_dhchap_secret)]


@dataclass(frozen=True, config=SPEC)
class HostAuthSpec:
    """A host's DH-HMAC-CHAP secrets (NVMe Base 2.0 §8.13), in the DHHC-1 form `nvme gen-dhchap-key` writes."""

    nqn: Annotated[HostNqn, Hint('add nqn = "<the host NQN>" (nvme show-hostnqn)')]
    # the host proves it knows this
    dhchap_secret: Annotated[DhchapSecret, Hint('add dhchap_secret = "DHHC-1:00:...:" (make one with nvme '
                                                'gen-dhchap-key)')]
    dhchap_ctrl_secret: DhchapSecret | None = None  # bidirectional: the controller proves this back

    @model_validator(mode="after")
    def _own_key(self) -> HostAuthSpec:
        from openvsan.protocol.nvme.auth import parse_secret

        if self.dhchap_ctrl_secret and self.dhchap_secret and (
                parse_secret(self.dhchap_ctrl_secret).key == parse_secret(self.dhchap_secret).key):
            raise SpecError("the same key as dhchap_secret; give the controller a secret of its own (nvme "
                            "gen-dhchap-key)", "dhchap_ctrl_secret")
        return self


def _choices(known: tuple[str, ...], what: str) -> BeforeValidator:
    """A list of names out of `known`, each once, not empty; the order is the preference."""
    def check(v: object) -> object:
        if not isinstance(v, list | tuple):
            return v
        for j, x in enumerate(v):
            if not isinstance(x, str) or x not in known:
                raise SpecError(f"{fmt(x)} is not one of the {what}: {', '.join(known)}", j)
            if x in v[:j]:
                raise SpecError(f"{fmt(x)} is listed twice; remove one", j)
        if not v:
            raise SpecError(f"empty; list one or more of {', '.join(known)} (or leave it out for all)")
        return v
    return BeforeValidator(check)


def _ascii(most: int, what: str, *, least: int = 0) -> AfterValidator:
    def check(v: str) -> str:
        if not least <= len(v) <= most or not v.isascii() or not v.isprintable():
            span = f"up to {most}" if not least else f"{least} to {most}"
            raise SpecError(f"use {span} printable ASCII characters ({what})")
        return v
    return AfterValidator(check)


@dataclass(frozen=True, config=SPEC)
class SubsystemSpec:
    nqn: Annotated[SubsystemNqn, Hint('add nqn = "nqn.2026-11.org.example:disk0"')]
    namespaces: Annotated[tuple[NamespaceSpec, ...], Table('a table { nsid = 1, volume = "disk0" }')]
    portals: Portals        # in a config: the [nvme] portals unless its own
    advertised_portals: Portals = ()
    allowed_hosts: tuple[HostNqn, ...] | None = None  # None: any host NQN
    # "": derived from the NQN (stable across restarts); NVMe Base 2.0 Figure 275 (Identify Controller SN, MN)
    serial: Annotated[Str, _ascii(20, "Identify Controller SN")] = ""
    model: Annotated[Str, _ascii(40, "Identify Controller MN", least=1)] = "openvsan"
    # hosts that authenticate with DH-HMAC-CHAP
    hosts: Annotated[tuple[HostAuthSpec, ...], Table('a table { nqn = "nqn.2014-08.org.nvmexpress:uuid:...", '
                                                     'dhchap_secret = "DHHC-1:00:...:" }')] = ()
    dhchap_hashes: Annotated[tuple[Str, ...], _choices(DHCHAP_HASHES, "hash functions")] = DHCHAP_HASHES
    dhchap_dhgroups: Annotated[tuple[Str, ...], _choices(DHCHAP_DHGROUPS, "DH groups")] = DHCHAP_DHGROUPS
    allow_unauthenticated: Bool = False

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, v: tuple[NamespaceSpec, ...]) -> tuple[NamespaceSpec, ...]:
        if not v:
            raise SpecError('missing or empty; add namespaces = [{ nsid = 1, volume = "disk0" }]')
        return _exported(v, "nsid", "namespace", "subsystem")

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return v if v is None else _unique(v)

    @field_validator("hosts")
    @classmethod
    def _auth_hosts(cls, v: tuple[HostAuthSpec, ...]) -> tuple[HostAuthSpec, ...]:
        for i, h in enumerate(v):
            if any(x.nqn == h.nqn for x in v[:i]):
                raise SpecError(f"host {fmt(h.nqn)} is listed twice in this subsystem; remove one", i, "nqn")
        return v


def _inherit(data: Any, items: str, keys: tuple[str, ...], *, port: int, required: str) -> Any:
    """A section's portals are the default of each of its tables (`items`) that names none. `required`:
    "always", "some" (when some table names none) or "never"."""
    if not isinstance(data, dict):
        return data
    tables = data.get(items, [])
    tables = tables if isinstance(tables, list) else []
    lacking = any(isinstance(x, dict) and "portals" not in x for x in tables)
    if "portals" not in data and (required == "always" or (required == "some" and lacking)):
        raise SpecError(f'missing; add portals = ["127.0.0.1:{port}"]', "portals")
    if data.get("portals") == [] and required != "never" and (required == "always" or lacking):
        raise SpecError(f'empty; list at least one, e.g. ["127.0.0.1:{port}"]', "portals")
    if not any(k in data for k in keys):
        return data
    own = [{**{k: data[k] for k in keys if k in data and k not in x}, **x} if isinstance(x, dict) else x
           for x in tables]
    return {**data, items: own}


@dataclass(frozen=True, config=SPEC)
class NvmeSpec:
    """The [nvme] section: its portals serve the discovery subsystem and are the subsystems' default."""

    portals: Portals = ()
    subsystems: Annotated[tuple[SubsystemSpec, ...], Table("an [[nvme.subsystems]] table")] = ()

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        subsystems = data.get("subsystems") if isinstance(data, dict) else None
        return _inherit(data, "subsystems", ("portals",), port=NVME_PORT,
                        required="some" if subsystems else "always")

    @field_validator("subsystems")
    @classmethod
    def _unique_nqns(cls, v: tuple[SubsystemSpec, ...]) -> tuple[SubsystemSpec, ...]:
        for i, s in enumerate(v):
            if any(x.nqn == s.nqn for x in v[:i]):
                raise SpecError(f"subsystem {fmt(s.nqn)} is already defined; give each subsystem its own nqn", i, "nqn")
        return v


@dataclass(frozen=True, config=SPEC)
class NbdExportSpec:
    name: Annotated[Str, Hint('add name = "disk0" (what clients ask for)'), _check(check_nbd_export_name)]
    volume: Annotated[Str, Hint('add volume = "disk0"')]
    portals: Portals        # in a config: the [nbd] portals unless its own
    read_only: Bool = False
    description: Annotated[Str, _printable(4096)] = ""
    # off | optional | require (NBD_OPT_STARTTLS); needs [nbd] tls; in a config "require" when [nbd] has tls
    tls: Annotated[Str, one_of(NBD_TLS_MODES, "a TLS mode")] = "off"
    allow_unauthenticated: Bool = False


@dataclass(frozen=True, config=SPEC)
class NbdTlsSpec:
    """[nbd] tls: the server's X.509 credentials; with verify_client, a client certificate signed by `ca`
    is required (that, not the name a client asks for, is what authenticates an NBD client)."""

    cert: Annotated[Path, Hint('add cert = "server-cert.pem" (the server\'s PEM certificate)')]
    key: Annotated[Path, Hint('add key = "server-key.pem" (its PEM private key)')]
    ca: Path | None = None
    verify_client: Bool = False

    @field_validator("cert", "key", "ca", mode="before")
    @classmethod
    def _file(cls, v: object, info: ValidationInfo) -> object:
        return _path(v, info)

    @model_validator(mode="after")
    def _needs_ca(self) -> NbdTlsSpec:
        if self.verify_client and self.ca is None:
            raise SpecError('missing; verify_client = true needs the CA that signs client certificates, e.g. ca = '
                            '"ca-cert.pem"', "ca")
        return self


def _endpoint(v: object) -> object:
    if isinstance(v, str):
        rest = v.removeprefix("http://")
        if not rest or "/" in rest or ":" not in rest:
            raise SpecError(f"{fmt(v)}: an etcd client URL is host:port (or http://host:port), e.g. "
                            '"10.0.0.1:2379"')
    return v


@dataclass(frozen=True, config=SPEC)
class ClusterSpec:
    """[cluster]: this node is a member of a cluster whose shared state (replica sets, leases, members) lives
    in etcd. The node's own name is [node] name."""

    id: Annotated[Str, Hint('add id = "cluster1" (what `vsan cluster init --id` was given)'),
                  _check(check_object_name)]
    etcd: Annotated[tuple[Annotated[Str, AfterValidator(_endpoint)], ...],
                    Hint('add etcd = ["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"] (every member, the '
                         "witness too)")]
    # where peers reach this node's replicas (NVMe/TCP, our replication path); never the initiators
    replication: Annotated[PortalT, Hint(f'add replication = "10.0.1.1:{DEFAULT_REPLICATION_PORT}" (an address '
                                         "the other nodes reach)")]
    management: Str | None = None       # the REST API's address, published for `vsan cluster status`
    lease_ttl: Annotated[Int, _in_range(2, 60, f"use 2 to 60 seconds (default {DEFAULT_LEASE_TTL})")] = \
        DEFAULT_LEASE_TTL
    suspend_seconds: Annotated[Number, _in_range(0, 3600, "use 0 (fail at once) to 3600 seconds (default "
                                                 f"{DEFAULT_SUSPEND_SECONDS})")] = DEFAULT_SUSPEND_SECONDS

    @field_validator("etcd")
    @classmethod
    def _some(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise SpecError('list at least one etcd member, e.g. etcd = ["10.0.0.1:2379"]')
        return _unique(v)


@dataclass(frozen=True, config=SPEC)
class NodeConfig:
    node: NodeSettings
    devices: tuple[DeviceSpec, ...] = ()
    volumes: tuple[VolumeSpec, ...] = ()
    targets: tuple[TargetSpec, ...] = ()
    source: Path | None = field(default=None, compare=False)
    nvme: NvmeSpec | None = None                  # None: no [nvme] section, no NVMe/TCP server
    nbd_exports: tuple[NbdExportSpec, ...] = ()
    pools: tuple[PoolSpec, ...] = ()
    nbd_tls: NbdTlsSpec | None = None
    cluster: ClusterSpec | None = None            # None: a node of its own (no replicated volumes)
    api: ApiSpec | None = None                    # None: the default API, on 127.0.0.1:8080 if it is free

    @property
    def subsystems(self) -> tuple[SubsystemSpec, ...]:
        return self.nvme.subsystems if self.nvme is not None else ()

    def exports_anything(self) -> bool:
        return bool(self.targets or self.subsystems or self.nbd_exports)

    def device(self, name: str) -> DeviceSpec:
        return next(d for d in self.devices if d.name == name)

    def volume(self, name: str) -> VolumeSpec:
        return next(v for v in self.volumes if v.name == name)

    def pool(self, name: str) -> PoolSpec:
        return next(p for p in self.pools if p.name == name)

    def device_user(self, name: str) -> str | None:
        """Who uses device `name`: 'volume X', 'pool X' (a member or spare), or None."""
        for v in self.volumes:
            if v.device == name:
                return f"volume {v.name}"
        for p in self.pools:
            if name in p.members or name in p.spares:
                return f"pool {p.name}"
        return None


# ---- the config document: the sections of the TOML file (and of the REST API's node document)


@dataclass(frozen=True, config=SPEC)
class IscsiSection:
    """[iscsi]: its portals (and advertised portals) are each target's unless it names its own."""

    portals: Portals = ()
    advertised_portals: Portals = ()
    targets: Annotated[tuple[TargetSpec, ...], Table("an [[iscsi.targets]] table")] = ()

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        return _inherit(data, "targets", ("portals", "advertised_portals"), port=ISCSI_PORT, required="some")

    @field_validator("targets")
    @classmethod
    def _unique_iqns(cls, v: tuple[TargetSpec, ...]) -> tuple[TargetSpec, ...]:
        for i, t in enumerate(v):
            if any(x.iqn == t.iqn for x in v[:i]):
                raise SpecError(f"target {fmt(t.iqn)} is already defined; give each target its own iqn", i, "iqn")
        return v


@dataclass(frozen=True, config=SPEC)
class NbdSection:
    """[nbd]: its portals are each export's unless it names its own; with tls, exports require TLS unless
    they say otherwise."""

    portals: Portals = ()
    exports: Annotated[tuple[NbdExportSpec, ...], Table("an [[nbd.exports]] table")] = ()
    tls: Annotated[NbdTlsSpec | None, Table('a table, e.g. tls = { cert = "server-cert.pem", key = '
                                            '"server-key.pem" }')] = None

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        data = _inherit(data, "exports", ("portals",), port=NBD_PORT, required="some")
        if isinstance(data, dict) and isinstance(data.get("exports"), list):
            mode = "require" if "tls" in data else "off"
            data = {**data, "exports": [{"tls": mode, **x} if isinstance(x, dict) else x for x in data["exports"]]}
        return data

    @model_validator(mode="after")
    def _credentials(self) -> NbdSection:
        names: set[str] = set()
        for i, e in enumerate(self.exports):
            if e.name in names:
                raise SpecError(f"an NBD export named {fmt(e.name)} is already defined; give each export its own name",
                                "exports", i, "name")
            names.add(e.name)
            if e.tls != "off" and self.tls is None:
                raise SpecError(f'"{e.tls}" needs the server\'s TLS credentials; add [nbd] tls = {{ cert = '
                                '"server-cert.pem", key = "server-key.pem" } or set tls = "off"', "exports", i, "tls")
        return self


DEFAULT_API_PORTAL = "127.0.0.1:8080"


@dataclass(frozen=True, config=SPEC)
class ApiTlsSpec:
    """[api] tls: the REST API and console over HTTPS with this certificate and key (PEM files)."""

    cert: Annotated[Path, Hint('add cert = "api-cert.pem" (the server\'s PEM certificate)')]
    key: Annotated[Path, Hint('add key = "api-key.pem" (its PEM private key)')]

    @field_validator("cert", "key", mode="before")
    @classmethod
    def _file(cls, v: object, info: ValidationInfo) -> object:
        return _path(v, info)


@dataclass(frozen=True, config=SPEC)
class ApiSpec:
    """[api]: the REST API, the web console and /metrics (api/), served by `vsan serve` beside the control
    socket. Without the table the node serves them on 127.0.0.1:8080 when that address is free (a second
    node on one host goes on without); with it, on `listen` or not at all (enabled = false), and an address
    that cannot be bound stops the start."""

    listen: PortalT = field(default_factory=lambda: parse_portal(DEFAULT_API_PORTAL))
    enabled: Bool = True
    tls: Annotated[ApiTlsSpec | None, Table('a table, e.g. tls = { cert = "api-cert.pem", key = "api-key.pem" }')] \
        = None


@dataclass(frozen=True, config=SPEC)
class ConfigDocument:
    """The whole TOML document as written; node/config.py checks it across tables and makes the NodeConfig."""

    node: NodeSettings = field(default_factory=NodeSettings)
    devices: Annotated[tuple[DeviceSpec, ...], Table("a [[devices]] table"), Hint("add [[devices]] tables")] = ()
    pools: Annotated[tuple[PoolSpec, ...], Table("a [[pools]] table"), Hint("add [[pools]] tables")] = ()
    volumes: Annotated[tuple[VolumeSpec, ...], Table("a [[volumes]] table"), Hint("add [[volumes]] tables")] = ()
    iscsi: IscsiSection | None = None
    nvme: NvmeSpec | None = None
    nbd: NbdSection | None = None
    cluster: Annotated[ClusterSpec | None, Table('a [cluster] table')] = None
    api: Annotated[ApiSpec | None, Table('an [api] table')] = None
