"""What the node hands the target servers: one object per iSCSI target, NVMe subsystem or NBD export."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openvsan.protocol.nvme.auth import HostPolicy
    from openvsan.protocol.scsi.target import ScsiTarget
    from openvsan.volume import Volume


@dataclass(frozen=True)
class ChapCredential:
    user: str
    secret: str


@dataclass
class IscsiTargetConfig:
    iqn: str
    scsi: ScsiTarget                     # the LUNs behind this target
    portals: list[tuple[str, int]]       # where it is reachable (host, port); the server listens on the union
    advertised_portals: list[tuple[str, int]] = field(default_factory=list)  # SendTargets; default: portals
    allowed_initiators: list[str] | None = None   # None: any initiator name may log in
    chap: ChapCredential | None = None            # the initiator must prove this secret (CHAP)
    mutual_chap: ChapCredential | None = None     # the target proves this one back (mutual CHAP)
    alias: str | None = None
    portal_group_tag: int = 1
    elsewhere: int | None = None         # served by that worker process of this node (frontend/handoff.py)


@dataclass
class NvmeNamespaceConfig:
    nsid: int                            # 1-based namespace ID
    volume: Volume                       # behind it; NGUID/EUI64/UUID derive from its uuid
    read_only: bool = False


@dataclass
class NvmeSubsystemConfig:
    nqn: str
    namespaces: list[NvmeNamespaceConfig]
    portals: list[tuple[str, int]]       # NVMe/TCP ports (host, port) the subsystem is reachable on
    advertised_portals: list[tuple[str, int]] = field(default_factory=list)  # discovery log; default: portals
    allowed_hosts: list[str] | None = None    # host NQNs allowed to connect; None: any host
    serial: str = ""                     # controller serial number (Identify Controller SN)
    model: str = "openvsan"
    # host NQN -> its DH-HMAC-CHAP secrets and the hashes / DH groups it may use: it must authenticate
    dhchap_hosts: dict[str, HostPolicy] = field(default_factory=dict)
    elsewhere: int | None = None         # served by that worker process of this node (frontend/handoff.py)


@dataclass
class NbdExportConfig:
    name: str                            # export name clients ask for (NBD_OPT_GO / INFO)
    volume: Volume | None                # None where another worker serves it (`elsewhere`)
    portals: list[tuple[str, int]]       # where it is served (default port 10809)
    read_only: bool = False
    description: str = ""
    tls: str = "off"                     # off | optional | require: NBD_OPT_STARTTLS (the server's ssl context)
    elsewhere: int | None = None         # served by that worker process of this node (frontend/handoff.py)
    geometry: tuple[int, int] | None = None   # elsewhere: (blocks, block size) once the supervisor told them
