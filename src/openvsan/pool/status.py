"""What `Pool.status()` reports (the CLI's `vsan pool status` and the REST API show it as it is)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class MemberStatus:
    index: int
    name: str
    state: str  # active | failed | rebuilding | missing
    rebuild_progress: float | None = None  # percent, rebuilding only


@dataclass
class PoolStatus:
    name: str
    uuid: str
    level: int
    state: str  # optimal | degraded | rebuilding | failed
    size: int  # bytes
    block_size: int
    chunk_size: int
    members: list[MemberStatus]
    spares: list[str] = field(default_factory=list)
    rebuild_progress: float | None = None  # percent of the slowest rebuilding member
    resync_progress: float | None = None  # percent of the dirty regions resynced, None when none is pending
    dirty_regions: int = 0
    event: int = 0
    error: str | None = None  # why the background resync or rebuild stopped

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
