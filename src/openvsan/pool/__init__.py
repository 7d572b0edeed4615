"""Storage pools: RAID levels over member block devices, and their parity kernels (pool/parity)."""

from openvsan.pool.layout import Level
from openvsan.pool.raid import MemberStatus, Pool, PoolError, PoolStatus
from openvsan.pool.scrub import ScrubReport

__all__ = ["Level", "MemberStatus", "Pool", "PoolError", "PoolStatus", "ScrubReport"]
