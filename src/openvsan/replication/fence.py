"""A replica's fence: NVMe reservations (protocol/nvme/reservations.py) whose keys are epochs, and whose
epochs only go up.

The replica of a replicated volume is served to its primary as an NVMe namespace (the replication path is
our NVMe/TCP; Pacemaker's fence_scsi does the same with SCSI persistent reservations). The primary of epoch E
registers key E and holds a Write Exclusive reservation; a new primary of epoch E' > E registers E' and
preempts E, so the old primary's writes get Reservation Conflict from then on. Plain reservations would let
a stale primary (paused past its lease, then woken) register again and preempt back; this fence refuses any
key below its `floor`, the highest epoch that ever acquired it, and drops the registrants below it when the
floor rises. The floor is made durable (`persist`) before the acquisition that raised it succeeds, so a
replica that restarts still refuses the old epochs.

Refused attempts (a stale epoch's registration or acquisition, a write from a host that is not the current
epoch's registrant) are counted (`refused`) for the replica's stats.
"""

from __future__ import annotations

from collections.abc import Callable

from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.reservations import WRITE_EXCLUSIVE, Reservations


class EpochFence(Reservations):
    def __init__(self, floor: int = 0, persist: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.floor = floor
        self._persist = persist
        self.refused = 0      # registrations, acquisitions and writes of an epoch below the floor

    @property
    def gated(self) -> bool:
        return True                    # even with no registrant: a write needs the current epoch's key

    def _stale(self, key: int) -> bool:
        if key < self.floor:
            self.refused += 1
            return True
        return False

    def register(self, host: bytes, rrega: int, iekey: bool, cptpl: int, crkey: int, nrkey: int) -> int:
        if rrega in (0, 2) and self._stale(nrkey):
            return S.RESERVATION_CONFLICT
        return super().register(host, rrega, iekey, cptpl, crkey, nrkey)

    def acquire(self, host: bytes, racqa: int, rtype: int, iekey: bool, crkey: int, prkey: int) -> int:
        key = self.registrants.get(host)
        if key is not None and self._stale(key):
            return S.RESERVATION_CONFLICT
        if rtype != WRITE_EXCLUSIVE:
            return S.INVALID_FIELD      # the replication path holds Write Exclusive, nothing else
        status = super().acquire(host, racqa, rtype, iekey, crkey, prkey)
        if status == S.SUCCESS and key is not None and key > self.floor:
            self._raise_floor(key)
        return status

    def _raise_floor(self, key: int) -> None:
        if key <= self.floor:
            return
        if self._persist is not None:
            self._persist(key)            # durable before the new primary is told it holds the replica
        self.floor = key
        for h in [h for h, k in self.registrants.items() if k < key]:
            del self.registrants[h]
            self.generation += 1

    def take_local(self, host: bytes, epoch: int) -> bool:
        """The primary of `epoch` takes its own replica in-process, as a peer would over the wire (register
        `epoch`, then acquire or preempt the holder): False when a newer epoch holds it already."""
        if epoch < self.floor:
            self.refused += 1
            return False
        if (self.register(host, 0, False, 0, 0, epoch) != S.SUCCESS
                and self.register(host, 2, True, 0, 0, epoch) != S.SUCCESS):
            return False
        if self.holder == host and self.rtype:
            self._raise_floor(epoch)           # ours already (an earlier epoch of this node): now this one's
            return True
        holder = self.registrants.get(self.holder) if self.holder is not None else None
        if holder is None:
            status = self.acquire(host, 0, WRITE_EXCLUSIVE, False, epoch, 0)
        else:
            status = self.acquire(host, 1, WRITE_EXCLUSIVE, False, epoch, holder)
        return status == S.SUCCESS and self.floor == epoch

    def holds(self, host: bytes, epoch: int) -> bool:
        """Whether `host` holds the replica for `epoch` now (nobody newer took it)."""
        return self.floor == epoch and self.registrants.get(host) == epoch

    def allows(self, host: bytes, write: bool) -> bool:
        key = self.registrants.get(host)
        if write and (key is None or key < self.floor):
            self.refused += 1          # a preempted (stale) primary's, or a stranger's
            return False               # a replica takes writes from the holder of the current epoch only
        return super().allows(host, write)
