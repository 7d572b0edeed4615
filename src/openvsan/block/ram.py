"""RamDevice: blocks in memory, optionally in a file under /dev/shm so they outlive the process."""

from __future__ import annotations

import mmap
import os
from typing import Any

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import Buffer
from openvsan.block.file import open_backing

LEND_AT = 64 * 1024   # read_now lends a view of the memory from this size up
PAGE = mmap.PAGESIZE
_PAGE_SHIFT = PAGE.bit_length() - 1
_ZEROS = memoryview(b"")


def _zeros(n: int) -> memoryview:
    """n zero bytes to send, from one buffer shared by every RAM disk (untouched pages: no memory)."""
    global _ZEROS
    if len(_ZEROS) < n:
        _ZEROS = memoryview(bytes(max(n, 1 << 20)))
    return _ZEROS[:n]


class RamDevice:
    def __init__(self, num_blocks: int, block_size: int = 512, *, backing: str | None = None,
                 name: str = "ram", trust_foreign: bool = False, memfd: int | None = None) -> None:
        """`memfd`: a memory file made by someone else (a worker's supervisor, node/workers.py), used through
        a duplicate of the descriptor, so the blocks outlive this process while its maker keeps it."""
        if block_size not in (512, 4096):
            raise ValueError(f"block_size must be 512 or 4096, not {block_size}")
        self.name = name
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backing = backing
        size = num_blocks * block_size
        if backing:
            # the same rules as a file device's file: no symlink, ours alone, made 0600 (block/file.py)
            self._fd, _ = open_backing(backing, os.O_RDWR, create=True, trust_foreign=trust_foreign,
                                       allow_block=False)
            try:
                if os.fstat(self._fd).st_size != size:
                    os.ftruncate(self._fd, size)
            except BaseException:
                os.close(self._fd)
                raise
        elif memfd is not None:
            self._fd = os.dup(memfd)
            if os.fstat(self._fd).st_size != size:
                os.ftruncate(self._fd, size)
        else:
            # a sparse memory file: blocks cost nothing until written, and read back as zeros
            self._fd = os.memfd_create(f"openvsan-{name}", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, size)
        self._mem: mmap.mmap = mmap.mmap(self._fd, size)
        self._view = memoryview(self._mem)
        # One byte per page of the memory file: 1 where the page holds memory (written through the mapping,
        # or found holding data at open); reads of such pages copy from the mapping, the others use pread
        # (see read). A hint for cost only: a wrong 0 costs a pread, a wrong 1 a zeroed page.
        self._held = bytearray(-(-size // PAGE))
        if backing or memfd is not None:
            self._find_held(size)
        self.capabilities = Capabilities(sync_read=True, sync_write=True, resizable=True, write_window=True)

    def _find_held(self, size: int) -> None:
        """Mark the pages a memory file made elsewhere (a backing file, a supervisor's memfd) holds."""
        pos = 0
        while pos < size:
            try:
                data = os.lseek(self._fd, pos, os.SEEK_DATA)
            except OSError:
                return   # ENXIO: no data from here to the end
            hole = os.lseek(self._fd, data, os.SEEK_HOLE)
            first, end = data >> _PAGE_SHIFT, -(-min(hole, size) // PAGE)
            self._held[first:end] = b"\x01" * (end - first)
            pos = hole

    def _wrote(self, start: int, n: int) -> None:
        first, last = start >> _PAGE_SHIFT, (start + n - 1) >> _PAGE_SHIFT
        held = self._held
        if first == last:
            held[first] = 1
        else:
            held[first:last + 1] = b"\x01" * (last + 1 - first)

    # A page never written is read with pread, not through the mapping: reading it through a shared mapping
    # faults in a fresh zeroed page (memory the disk then holds for nothing), pread copies zeros and
    # allocates nothing. A page that holds memory is copied from the mapping: no system call (pread of 4 KiB
    # costs about four times the copy). Writes go through the mapping.
    def _copy(self, start: int, n: int) -> bytes:
        first, last = start >> _PAGE_SHIFT, (start + n - 1) >> _PAGE_SHIFT
        held = self._held
        if held[first] if first == last else held.find(0, first, last + 1) < 0:
            return self._mem[start:start + n]
        return os.pread(self._fd, n, start)

    async def read(self, lba: int, blocks: int) -> Buffer:
        bs = self.block_size
        return self._copy(lba * bs, blocks * bs)

    # The synchronous fast path (block/device.py, SyncRead and SyncWrite): the caller has checked the range.
    def read_now(self, lba: int, blocks: int) -> Buffer:
        bs = self.block_size
        start, n = lba * bs, blocks * bs
        if n < LEND_AT:
            return self._copy(start, n)
        # Large reads are lent, not copied: a fresh 1 MiB bytes object costs more in page faults (malloc
        # maps and unmaps it) than the send itself. A range never written is lent from a zero buffer.
        try:
            data_at = os.lseek(self._fd, start, os.SEEK_DATA)
        except OSError:
            data_at = start + n     # ENXIO: no data from here to the end
        if data_at >= start + n:
            return _zeros(n)
        return self._view[start:start + n]

    def _put(self, lba: int, data: Buffer) -> bool:
        start = lba * self.block_size
        n = len(data)
        self._view[start:start + n] = data
        first = start >> _PAGE_SHIFT
        if first == (start + n - 1) >> _PAGE_SHIFT:
            self._held[first] = 1       # _wrote's common case, here: every replicated 4 KiB write comes by
        else:
            self._wrote(start, n)
        return True

    write_now = _put   # the fast path is the write itself, one call (write() calls _put: a subclass's write_now
    #                    that declines, as tests' fakes do, must not stop it)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        self._put(lba, data)

    def write_window(self, lba: int, blocks: int) -> memoryview:
        """The mapping itself, for a write's data to be received into (block/device.py WriteWindow). Its
        pages are marked as holding data now: a hint for reads only, right once the data is there."""
        bs = self.block_size
        start, n = lba * bs, blocks * bs
        self._wrote(start, n)
        return self._view[start:start + n]

    async def flush(self) -> None:
        # RAM (or tmpfs) is as durable as it gets: the promise is "survives the process", which it does.
        return None

    async def unmap(self, lba: int, blocks: int) -> None:
        await self.write_zeroes(lba, blocks)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        bs = self.block_size
        start, end = lba * bs, (lba + blocks) * bs
        page = mmap.PAGESIZE
        a, b = -(-start // page) * page, end // page * page
        if b - a >= page * 16:
            # Give whole pages back (they read back as zero). MADV_REMOVE, not MADV_DONTNEED: the mapping
            # is shared (anonymous or /dev/shm), and DONTNEED would keep its contents.
            try:
                self._mem.madvise(mmap.MADV_REMOVE, a, b - a)
            except OSError:
                pass  # a backing file system without hole punching: zero the bytes instead
            else:
                self._held[a >> _PAGE_SHIFT:b >> _PAGE_SHIFT] = bytes((b - a) >> _PAGE_SHIFT)
                self._view[start:a] = bytes(a - start)
                self._view[b:end] = bytes(end - b)
                if a > start:
                    self._wrote(start, a - start)
                if end > b:
                    self._wrote(b, end - b)
                return
        self._view[start:end] = bytes(end - start)
        if end > start:
            self._wrote(start, end - start)

    async def resize(self, num_blocks: int) -> None:
        """Grow or shrink the memory file and map it anew. A view still lent from the old mapping keeps it
        alive until its send is done; both map the same pages."""
        size = num_blocks * self.block_size
        os.ftruncate(self._fd, size)
        old_mem, old_view = self._mem, self._view
        self._mem = mmap.mmap(self._fd, size)
        self._view = memoryview(self._mem)
        pages = -(-size // PAGE)
        del self._held[pages:]
        self._held += bytes(pages - len(self._held))
        self.num_blocks = num_blocks
        old_view.release()
        try:
            old_mem.close()
        except BufferError:
            pass  # lent: it goes when the last view does

    async def close(self) -> None:
        self._view.release()
        try:
            self._mem.close()
        except BufferError:
            pass  # a view lent by read_now is still being sent: the mapping goes when the last one does
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RamDevice:
        bs = cfg.get("block_size", 512)
        return cls(cfg["size"] // bs, bs, backing=cfg.get("backing"), name=cfg.get("name", "ram"))

    def to_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"type": "ram", "name": self.name, "size": self.num_blocks * self.block_size,
                               "block_size": self.block_size}
        if self.backing:
            cfg["backing"] = self.backing
        return cfg
