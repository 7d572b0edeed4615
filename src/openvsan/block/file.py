"""FileDevice: a regular file (sparse) or a block device, with blocking I/O kept off the event loop."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import mmap
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import Buffer
from openvsan.block.errors import DeviceFailed, MediumError, NoSpace

T = TypeVar("T")

# linux/falloc.h
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

# Largest chunk of zeroes written at once when hole punching is not available.
_ZERO_CHUNK = 1 << 20
# Largest read_now: beyond it the thread pool's hop is small beside the copy, and a big fresh buffer faults
NOWAIT_MAX = 128 * 1024
# File systems whose reads and writes never wait for a disk (their fsync does nothing either)
MEMORY_FS = frozenset({"tmpfs", "ramfs"})


def fs_type(st_dev: int) -> str | None:
    """The file system type of the mount with this device number (from /proc/self/mountinfo), or None."""
    want = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 7 and parts[2] == want and "-" in parts[6:]:
                    return parts[parts.index("-", 6) + 1]
    except OSError:
        pass
    return None


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    # os.posix_fallocate cannot punch holes (mode is always 0), so call fallocate(2) from libc directly.
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load_fallocate()


TRUST_MEND = "or set [node] trust_foreign_files = true"


class UnsafeFile(PermissionError):
    """A backing file someone else could read or change behind our back (a symlink, another owner, a mode
    that lets others write): refused unless the node trusts foreign files. str() names the file and the mend."""


SYMLINK = "is a symbolic link; name the file it points to, not the link"


def check_backing(st: os.stat_result, name: str, *, trust_foreign: bool = False, allow_block: bool = True) -> None:
    """Judge a backing file by its stat: a symlink, a file that is neither regular nor (with allow_block) a
    block device, or (unless trust_foreign) a regular file another user owns or others may write is refused,
    with UnsafeFile or ValueError naming it and the mend. open_backing applies it to the opened fd; the
    config's preflight to an lstat, so `vsan config check` says the same before anything starts."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFile(errno.ELOOP, SYMLINK, name)
    if stat.S_ISBLK(st.st_mode) and allow_block:
        return   # a disk is root:disk 0660 as a rule: no owner check, only no symlink
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{name} is neither a regular file nor a block device" if allow_block
                         else f"{name} is not a regular file")
    if trust_foreign:
        return
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafeFile(errno.EPERM, f"is owned by uid {st.st_uid}, not by the serving user (uid {euid}); "
                         f"chown {euid} {name} if it is ours, {TRUST_MEND}", name)
    if st.st_mode & 0o022:
        raise UnsafeFile(errno.EPERM, f"is writable by group or others (mode {st.st_mode & 0o7777:04o}); "
                         f"chmod go-w {name}, {TRUST_MEND}", name)


def open_backing(path: str | os.PathLike[str], flags: int, *, create: bool = False, trust_foreign: bool = False,
                 allow_block: bool = True) -> tuple[int, bool]:
    """Open a device's backing file as safely as the path allows; returns (fd, created).

    O_NOFOLLOW: a symlink planted at the path is refused (ELOOP), not followed. A new file is made with
    O_CREAT|O_EXCL and mode 0600, so nobody can slip a file in between a check and the open. An existing
    regular file must be owned by the serving user (euid) and writable by nobody else, judged on the fstat of
    the opened fd, not on a stat of the name; a block device (root:disk 0660 is normal) is exempt from that.
    """
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    name = os.fspath(path)
    created = False
    try:
        if create:
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
            except FileExistsError:
                fd = os.open(name, flags)  # there already (or a dangling symlink: ELOOP below)
        else:
            fd = os.open(name, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(errno.ELOOP, SYMLINK, name) from None
        raise
    try:
        # a file we have just made is ours and 0600: only its kind needs judging
        check_backing(os.fstat(fd), name, trust_foreign=trust_foreign or created, allow_block=allow_block)
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def _aligned(size: int) -> mmap.mmap:
    # An anonymous mapping is page aligned, which satisfies every O_DIRECT alignment rule.
    return mmap.mmap(-1, max(size, 1))


class FileDevice:
    """A block device stored in a file or a host block device.

    `size` creates a missing file (sparse) or grows a shorter one; without it the size is the file's or
    the block device's own. `direct=True` opens with O_DIRECT and goes through page-aligned buffers.
    """

    def __init__(self, path: str | os.PathLike[str], *, size: int | None = None, block_size: int = 512,
                 direct: bool = False, name: str = "file", io_threads: int = 4, trust_foreign: bool = False) -> None:
        if block_size not in (512, 4096):
            raise ValueError(f"block_size must be 512 or 4096, not {block_size}")
        if size is not None and (size <= 0 or size % block_size):
            raise ValueError(f"size {size} must be a positive multiple of the block size {block_size}")
        self.name = name
        self.path = Path(path)
        self.block_size = block_size
        self.direct = direct
        flags = os.O_RDWR
        if direct:
            flags |= os.O_DIRECT
        try:
            # no size: never create it (a file that is gone is a missing device, not a new blank one)
            self._fd, _ = open_backing(self.path, flags, create=size is not None, trust_foreign=trust_foreign)
        except FileNotFoundError:
            if size is None:
                raise FileNotFoundError(errno.ENOENT, "no such file, and no size given to create it",
                                        str(path)) from None
            raise
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                raise OSError(e.errno, "this file system does not support O_DIRECT (direct = true)",
                              str(path)) from None
            raise
        try:
            st = os.fstat(self._fd)
            self.is_block_device = stat.S_ISBLK(st.st_mode)
            if self.is_block_device:
                actual = os.lseek(self._fd, 0, os.SEEK_END)
                if size is not None and size > actual:
                    raise ValueError(f"{path} holds {actual} bytes, fewer than the size {size} asked for")
                size = size if size is not None else actual - actual % block_size
            elif stat.S_ISREG(st.st_mode):
                if size is None:
                    size = st.st_size - st.st_size % block_size
                elif st.st_size < size:
                    os.ftruncate(self._fd, size)  # sparse: no blocks allocated until written
            else:
                raise ValueError(f"{path} is neither a regular file nor a block device")
            if size <= 0:
                raise ValueError(f"{path} is smaller than one {block_size}-byte block")
            self.num_blocks = size // block_size
            if direct:
                self._probe_direct()
        except BaseException:
            os.close(self._fd)
            raise
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"file-{name}")
        # RWF_DSYNC makes one pwritev durable on its own (Linux 4.7+); fall back to pwrite + fdatasync.
        self._rwf_dsync = getattr(os, "RWF_DSYNC", 0) if hasattr(os, "pwritev") else 0
        # RWF_NOWAIT reads (Linux 4.14+) for read_now; not with O_DIRECT, where a read always goes to the disk
        self._nowait = 0 if direct else getattr(os, "RWF_NOWAIT", 0)
        # a file in memory (tmpfs, /dev/shm) is read and written at once, in the event loop's turn
        self.memory_backed = (not direct and not self.is_block_device
                              and fs_type(os.fstat(self._fd).st_dev) in MEMORY_FS)
        self._closed = False
        # a regular file on a disk holds written data in the page cache until a sync: a volatile cache
        self.capabilities = Capabilities(
            sync_read=self.memory_backed or bool(self._nowait), sync_write=self.memory_backed,
            volatile_cache=not self.memory_backed, resizable=not self.is_block_device)

    def _probe_direct(self) -> None:
        # O_DIRECT needs the I/O size to be a multiple of the medium's logical block; find out now, not on
        # the first initiator read.
        buf = _aligned(self.block_size)
        try:
            os.preadv(self._fd, [buf], 0)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise ValueError(f"{self.path}: O_DIRECT refuses {self.block_size}-byte blocks here; "
                                 "use block_size = 4096 or direct = false") from None
            raise
        finally:
            buf.close()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise DeviceFailed(f"{self.name}: device is closed")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        except OSError as e:
            raise self._map_error(e) from e

    def _map_error(self, e: OSError) -> Exception:
        if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
            return NoSpace(f"{self.name}: {e.strerror}")
        if e.errno == errno.EIO:
            return MediumError(f"{self.name}: {e.strerror}")
        if e.errno in (errno.ENODEV, errno.ENXIO, errno.EBADF):
            return DeviceFailed(f"{self.name}: {e.strerror}")
        return e

    # --- the fast path (block/device.py SyncRead) ------------------------------------------------

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        """The blocks, when the page cache holds them all: preadv2(RWF_NOWAIT) never waits for the disk and
        says EAGAIN instead. None (declined): read() takes the thread pool. The caller checked the range."""
        n = blocks * self.block_size
        if n > NOWAIT_MAX or self._closed:
            return None
        if self.memory_backed:
            data = os.pread(self._fd, n, lba * self.block_size)
            return data if len(data) == n else None
        if not self._nowait:
            return None
        buf = bytearray(n)
        try:
            got = os.preadv(self._fd, [buf], lba * self.block_size, self._nowait)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = 0   # this file system (or kernel) has no RWF_NOWAIT reads: stop asking
            return None            # every other error is the async path's to report
        return buf if got == n else None

    def write_now(self, lba: int, data: Buffer) -> bool:
        """A write to a file in memory, done at once (as durable as any: tmpfs has nothing to sync); False for
        a file on a disk, where durability needs a sync and a buffered write may block: write() does it."""
        if not self.memory_backed or self._closed:
            return False
        try:
            n = os.pwrite(self._fd, data, lba * self.block_size)
        except OSError:
            return False  # ENOSPC and the like: the async path writes again and reports it
        return n == len(data)

    # --- blocking halves, run in the pool -------------------------------------------------------

    def _pread(self, offset: int, length: int) -> Buffer:
        if self.direct:
            buf = _aligned(length)
            view = memoryview(buf)[:length]
            done = 0
            while done < length:
                n = os.preadv(self._fd, [view[done:]], offset + done)
                if n == 0:
                    raise MediumError(f"{self.name}: short read at byte {offset + done}")
                done += n
            return view  # zero copy; the mapping lives as long as the view does
        data = os.pread(self._fd, length, offset)
        if len(data) == length:
            return data
        parts = [data]
        done = len(data)
        while done < length:
            chunk = os.pread(self._fd, length - done, offset + done)
            if not chunk:
                # a regular file shorter than the device (truncated behind our back) reads as zeroes
                parts.append(bytes(length - done))
                break
            parts.append(chunk)
            done += len(chunk)
        return b"".join(parts)

    def _pwrite(self, offset: int, data: Buffer, fua: bool) -> None:
        view = memoryview(data).cast("B")
        if self.direct:
            buf = _aligned(len(view))
            buf[:len(view)] = view
            view = memoryview(buf)[:len(view)]
        flags = self._rwf_dsync if fua else 0
        done = 0
        total = len(view)
        while done < total:
            if flags:
                try:
                    n = os.pwritev(self._fd, [view[done:]], offset + done, flags)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    self._rwf_dsync = flags = 0
                    continue
            else:
                n = os.pwrite(self._fd, view[done:], offset + done)
            done += n
        if fua and not flags:
            os.fdatasync(self._fd)

    def _zero(self, offset: int, length: int) -> None:
        if _fallocate is not None:
            if _fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise OSError(err, os.strerror(err))
        chunk = _aligned(min(length, _ZERO_CHUNK)) if self.direct else bytes(min(length, _ZERO_CHUNK))
        zero = memoryview(chunk)
        done = 0
        while done < length:
            n = os.pwrite(self._fd, zero[:min(len(zero), length - done)], offset + done)
            done += n

    # --- BlockDevice ----------------------------------------------------------------------------

    async def read(self, lba: int, blocks: int) -> Buffer:
        if blocks == 0:
            return b""
        bs = self.block_size
        return await self._run(self._pread, lba * bs, blocks * bs)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        bs = self.block_size
        n = memoryview(data).nbytes
        if n == 0:
            if fua:
                await self.flush()
            return
        await self._run(self._pwrite, lba * bs, data, fua)

    async def flush(self) -> None:
        await self._run(os.fdatasync, self._fd)

    async def unmap(self, lba: int, blocks: int) -> None:
        # Punching a hole both frees the space and reads back as zeroes, so unmap and write_zeroes agree
        # (the SCSI layer may report LBPRZ).
        await self.write_zeroes(lba, blocks)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        if blocks:
            bs = self.block_size
            await self._run(self._zero, lba * bs, blocks * bs)

    async def resize(self, num_blocks: int) -> None:
        """A regular file grows sparse (or is cut short); a block device keeps the size it has."""
        if self.is_block_device:
            raise ValueError(f"{self.path} is a block device: its size is the disk's")
        await self._run(os.ftruncate, self._fd, num_blocks * self.block_size)
        self.num_blocks = num_blocks

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # let reads and writes already in the pool finish before their fd goes away
        await asyncio.to_thread(self._pool.shutdown, True)
        os.close(self._fd)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> FileDevice:
        return cls(cfg["path"], size=cfg.get("size"), block_size=cfg.get("block_size", 512),
                   direct=cfg.get("direct", False), name=cfg.get("name", "file"))

    def to_config(self) -> dict[str, Any]:
        return {"type": "file", "name": self.name, "path": str(self.path),
                "size": self.num_blocks * self.block_size, "block_size": self.block_size,
                "direct": self.direct}
