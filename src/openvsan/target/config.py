"""What the node hands the target servers: one object per exported iSCSI target."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openvsan.protocol.scsi.target import ScsiTarget


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
