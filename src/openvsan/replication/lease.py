"""The primary's lease, kept alive, and the rule that makes it safe: a primary that cannot renew its lease
stops acknowledging writes before the lease can expire (DESIGN.md, "Replication and failover").

`LeaseKeeper.run()` renews every ttl/3 and, when the store does not answer, tries again every ttl/10. Each
successful renewal sent at time t makes the lease certainly ours until t + ttl (the store started its TTL
when it received the request, after t); `held` is true only until that minus a `margin` (a quarter of the
TTL by default, for the clocks of this node and the store to disagree in). The mirror layer asks `held`
before every acknowledgement; past it, this node is fenced as surely as by a new epoch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from openvsan.node.statestore import Lease, LeaseExpired, StoreError

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, lease: Lease, granted_at: float, *, margin: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """`granted_at`: the clock's time when the grant was asked for (before it, not after)."""
        if not 0 < margin < 1:
            raise ValueError(f"lease margin {margin}: a fraction of the TTL between 0 and 1")
        self.lease = lease
        self.margin = margin
        self.clock = clock
        self.sleep = sleep
        self.lost = False
        self.valid_until = granted_at + lease.ttl * (1 - margin)
        self.failures = 0          # renewals the store did not answer

    @property
    def held(self) -> bool:
        return not self.lost and self.clock() < self.valid_until

    async def run(self) -> None:
        """Renew until cancelled, or until the lease is gone (then `lost`, and it returns)."""
        ttl = self.lease.ttl
        while not self.lost:
            await self.sleep(ttl / 3 if not self.failures else ttl / 10)
            sent = self.clock()
            try:
                ttl = await self.lease.refresh()
            except LeaseExpired:
                self.lost = True
                log.warning("lease %x expired: this node is no longer primary", self.lease.id)
                return
            except StoreError as e:
                self.failures += 1
                if not self.held:
                    log.warning("lease %x: not renewed in time (%s); acknowledging nothing more", self.lease.id, e)
                continue
            self.failures = 0
            self.valid_until = max(self.valid_until, sent + ttl * (1 - self.margin))
