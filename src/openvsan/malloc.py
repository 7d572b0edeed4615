"""glibc malloc settings for a data path of large buffers.

Every 1 MiB write that a target receives is joined into one fresh bytes object, and every 1 MiB read a host
gets is one too. glibc serves an allocation that large from its own mmap (its threshold starts at 128 KiB and
moves only as far as the largest block freed so far) and gives the pages back on free, or trims them from the
heap's top once more than twice that is free: either way the next buffer faults its 256 pages in again, each
zeroed by the kernel. Measured on this 2-core machine (our NVMe/TCP initiator and target in one process, 1 MiB
writes at QD 8 to a RAM device already written once): 1,340-1,510 µs of CPU a write with glibc's defaults,
610-1,140 µs with the settings below (docs/benchmarks.md, "Replication cost"; measured with the mmap
threshold at 4 MiB, which treats a 1 MiB buffer the same way as the 8 MiB it is now).

`keep_large_buffers()` raises the mmap threshold to `MMAP_THRESHOLD` (buffers up to that size come from the
heap and are used again) and the trim threshold to `TRIM_THRESHOLD` (at most that much free heap is kept
mapped). Called once at start by `vsan serve` and by `vsan bench`'s workers. It does nothing when the
environment sets glibc's own MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (the administrator's choice),
when OPENVSAN_MALLOC=default, or where the C library has no mallopt (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1          # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 8 << 20       # the largest I/O a frontend takes in one command is 8 MiB or less
TRIM_THRESHOLD = 64 << 20      # free heap kept mapped: a queue depth of 32 x 1 MiB twice over


def keep_large_buffers(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Apply the settings; True when they were applied."""
    if os.environ.get("OPENVSAN_MALLOC", "tuned") == "default":
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; setting either also turns glibc's dynamic mmap threshold off
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if ok:
        log.debug("malloc: buffers up to %d bytes from the heap, %d bytes of free heap kept", mmap_threshold,
                  trim_threshold)
    return ok
