"""The node's desired state as typed specs: frozen dataclasses that the TOML config (node/config.py parses and
validates them), the store (node/store.py) and the node (node/node.py) share. Each field's default is the
product's default; docs/security.md and README.md explain the ones of the [node] limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openvsan.node.values import Portal

DEFAULT_CHUNK = 64 * 1024
DEFAULT_POLL_US = 50
# Limits on peers (docs/security.md): connections in all, connections that have not logged in (all sources,
# and from one source address), and failed authentications before a lockout
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_UNAUTHENTICATED = 512
DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE = 32
DEFAULT_AUTH_DELAY_MAX = 8.0          # seconds: the cap of the doubling delay after failed authentications
DEFAULT_AUTH_LOCKOUT_FAILURES = 10    # failures in a row from one (initiator, address) before a lockout; 0: never
DEFAULT_AUTH_LOCKOUT_SECONDS = 300
DHCHAP_HASHES = ("sha256", "sha384", "sha512")
DHCHAP_DHGROUPS = ("null", "ffdhe2048", "ffdhe3072", "ffdhe4096", "ffdhe6144", "ffdhe8192")


@dataclass(frozen=True)
class NodeSettings:
    name: str
    data_dir: Path | None = None
    poll_us: int = DEFAULT_POLL_US  # adaptive busy-poll window after each command (frontend/busypoll.py); 0: off
    max_connections: int = DEFAULT_MAX_CONNECTIONS            # every protocol's connections together
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED    # connections that have not logged in, all sources
    max_unauthenticated_per_source: int = DEFAULT_MAX_UNAUTHENTICATED_PER_SOURCE   # ... from one address
    trust_foreign_files: bool = False   # open device/member files another user owns or others may write
    auth_delay_max: float = DEFAULT_AUTH_DELAY_MAX
    auth_lockout_failures: int = DEFAULT_AUTH_LOCKOUT_FAILURES
    auth_lockout_seconds: int = DEFAULT_AUTH_LOCKOUT_SECONDS


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    type: str                       # ram | file | null
    size: int | None                # bytes; None only for a file device that takes the file's size
    block_size: int = 512
    backing: Path | None = None     # ram: a file (in /dev/shm) that keeps the contents across restarts
    path: Path | None = None        # file: the file or block device
    direct: bool = False            # file: O_DIRECT


@dataclass(frozen=True)
class PoolSpec:
    """A RAID pool over devices (openvsan.pool); serve creates it on blank members, else assembles it."""

    name: str
    level: str                      # raid0 | raid1 | raid10 | raid5 | raid6
    members: tuple[str, ...]        # device names, slot order at creation
    spares: tuple[str, ...] = ()
    chunk: int = DEFAULT_CHUNK      # bytes
    rebuild_rate: int | None = None  # bytes/s of member data; None: as fast as the members go


@dataclass(frozen=True)
class VolumeSpec:
    name: str
    device: str | None              # None: the volume lives on `pool`
    read_only: bool = False
    pool: str | None = None
    # QoS limits (volume/qos.py QosLimits knobs that are set: read_iops_limit, bps_burst, ...); empty: none,
    # and then no QoS layer at all in its stack
    qos: dict[str, float] = field(default_factory=dict, hash=False)

    @property
    def layers(self) -> list[dict[str, Any]]:
        """The layer configs of its stack, bottom first (volume/registry.py builds them over the device)."""
        return [{"type": "qos", **self.qos}] if self.qos else []


@dataclass(frozen=True)
class ChapSpec:
    user: str
    secret: str


@dataclass(frozen=True)
class LunSpec:
    lun: int
    volume: str


@dataclass(frozen=True)
class TargetSpec:
    iqn: str
    luns: tuple[LunSpec, ...]
    portals: tuple[Portal, ...]
    advertised_portals: tuple[Portal, ...] = ()
    allowed_initiators: tuple[str, ...] | None = None  # None: any initiator
    chap: ChapSpec | None = None
    mutual_chap: ChapSpec | None = None
    alias: str | None = None
    portal_group_tag: int = 1
    allow_unauthenticated: bool = False   # served open although another export of one of its volumes is not


@dataclass(frozen=True)
class NamespaceSpec:
    nsid: int
    volume: str


@dataclass(frozen=True)
class HostAuthSpec:
    """A host's DH-HMAC-CHAP secrets (NVMe Base 2.0 §8.13), in the DHHC-1 form `nvme gen-dhchap-key` writes."""

    nqn: str
    dhchap_secret: str                    # the host proves it knows this
    dhchap_ctrl_secret: str | None = None  # bidirectional: the controller proves this back


@dataclass(frozen=True)
class SubsystemSpec:
    nqn: str
    namespaces: tuple[NamespaceSpec, ...]
    portals: tuple[Portal, ...]
    advertised_portals: tuple[Portal, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None  # None: any host NQN
    serial: str = ""                              # "": derived from the NQN (stable across restarts)
    model: str = "openvsan"
    hosts: tuple[HostAuthSpec, ...] = ()          # hosts that authenticate with DH-HMAC-CHAP
    dhchap_hashes: tuple[str, ...] = DHCHAP_HASHES
    dhchap_dhgroups: tuple[str, ...] = DHCHAP_DHGROUPS
    allow_unauthenticated: bool = False


@dataclass(frozen=True)
class NvmeSpec:
    """The [nvme] section: its portals serve the discovery subsystem and are the subsystems' default."""

    portals: tuple[Portal, ...] = ()
    subsystems: tuple[SubsystemSpec, ...] = ()


@dataclass(frozen=True)
class NbdExportSpec:
    name: str
    volume: str
    portals: tuple[Portal, ...]
    read_only: bool = False
    description: str = ""
    tls: str = "off"                     # off | optional | require (NBD_OPT_STARTTLS); needs [nbd] tls
    allow_unauthenticated: bool = False


@dataclass(frozen=True)
class NbdTlsSpec:
    """[nbd] tls: the server's X.509 credentials; with verify_client, a client certificate signed by `ca`
    is required (that, not the name a client asks for, is what authenticates an NBD client)."""

    cert: Path
    key: Path
    ca: Path | None = None
    verify_client: bool = False


@dataclass(frozen=True)
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
