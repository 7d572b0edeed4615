"""Storage pools: RAID levels over member block devices, and their parity kernels (pool/parity)."""

from openvsan.pool.assembly import PoolError
from openvsan.pool.layout import Level
from openvsan.pool.raid import Pool
from openvsan.pool.scrub import ScrubReport
from openvsan.pool.status import MemberStatus, PoolStatus

__all__ = ["Level", "MemberStatus", "Pool", "PoolError", "PoolStatus", "ScrubReport"]
