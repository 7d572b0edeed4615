"""What a device can do, stated once in a frozen record (DESIGN.md: the volume stack), so frontends and layers
read it instead of probing with getattr / isinstance."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class Capabilities:
    sync_read: bool = False         # read_now may answer at once (block/device.py SyncRead)
    sync_write: bool = False        # write_now may write at once, durable on return (SyncWrite)
    unmap_reads_zero: bool = True   # an unmapped block reads back as zeros (SBC-4 LBPRZ, NVMe DLFEAT)
    write_zeroes: bool = True       # write_zeroes costs no data transfer (hole punch, RAM page drop)
    extents: bool = False           # lba_status(lba, blocks) tells mapped from unmapped (GET LBA STATUS)
    max_transfer: int = 16 << 20    # bytes in one read or write
    atomic_write: int = 0           # bytes written all or nothing; 0: one logical block
    volatile_cache: bool = False    # a write without FUA may be lost until flush() (SBC-4 WCE, NVMe VWC)
    resizable: bool = False         # resize(num_blocks) can grow (or shrink) the device while it serves
    write_window: bool = False      # write_window lends its own memory to receive a write into (WriteWindow)
    thin: bool = False              # space is allocated on first write (a thin volume): writes may fail NoSpace,
    #                                 allocated_blocks() says how much is allocated (SBC-4 LBPME, NVMe THINP)

    def but(self, **changes: Any) -> Capabilities:
        """The same capabilities with some changed: what a layer states over the device below it."""
        return replace(self, **changes)
