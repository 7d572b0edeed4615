"""`vsan initiator attach`: a remote volume as a regular file, through FUSE (pyfuse3, libfuse 3).

The mount point is a file, not a directory: the file system's root inode *is* the volume, so
`losetup -f --show FILE`, `mkfs.ext4` and `mount` work on machines without iSCSI or NVMe/TCP kernel
modules. fsync on the file (the loop driver sends one for every flush or FUA from the file system above)
becomes `flush()` on the device: SYNCHRONIZE CACHE or NVMe Flush.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import stat
import time
from typing import Any

from openvsan.block.device import BlockDevice
from openvsan.block.errors import BlockError, NoSpace, OutOfRange, ReadOnly

log = logging.getLogger("openvsan.initiator.fuse")

FUSE_PACKAGES = "pip install pyfuse3 (builds against Debian libfuse3-dev and pkg-config; runs with fuse3)"


def _pyfuse3() -> Any:
    try:
        import pyfuse3
        import pyfuse3.asyncio
    except ImportError as e:
        raise RuntimeError(f"FUSE support is missing ({e}): {FUSE_PACKAGES}") from e
    pyfuse3.asyncio.enable()
    return pyfuse3


def _errno(e: BlockError) -> int:
    if isinstance(e, OutOfRange):
        return errno.EINVAL
    if isinstance(e, ReadOnly):
        return errno.EROFS
    if isinstance(e, NoSpace):
        return errno.ENOSPC
    return errno.EIO


def make_operations(dev: BlockDevice, *, read_only: bool = False) -> Any:
    """A pyfuse3.Operations whose root inode is `dev` as one regular file."""
    fuse = _pyfuse3()
    root = fuse.ROOT_INODE
    bs = dev.block_size
    size = dev.num_blocks * bs
    now = time.time_ns()

    class BlockFile(fuse.Operations):  # type: ignore[misc,name-defined]
        supports_dot_lookup = False
        enable_writeback_cache = False
        enable_acl = False

        def __init__(self) -> None:
            super().__init__()
            self.rmw = asyncio.Lock()  # read-modify-write of partial blocks, one at a time

        async def getattr(self, inode: int, ctx: Any = None) -> Any:
            if inode != root:
                raise fuse.FUSEError(errno.ENOENT)
            e = fuse.EntryAttributes()
            e.st_ino = root
            e.st_mode = stat.S_IFREG | (0o400 if read_only else 0o600)
            e.st_nlink = 1
            e.st_uid, e.st_gid = os.getuid(), os.getgid()
            e.st_size = size
            e.st_blksize = max(bs, 4096)
            e.st_blocks = size // 512
            e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = now
            e.attr_timeout = e.entry_timeout = 3600.0  # nobody else changes the size under us
            return e

        async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
            if fields.update_size and attr.st_size != size:
                raise fuse.FUSEError(errno.EPERM)  # a volume does not grow or shrink by truncate
            return await self.getattr(inode)

        async def open(self, inode: int, flags: int, ctx: Any) -> Any:
            if inode != root:
                raise fuse.FUSEError(errno.ENOENT)
            if read_only and flags & (os.O_WRONLY | os.O_RDWR):
                raise fuse.FUSEError(errno.EROFS)
            return fuse.FileInfo(fh=root, keep_cache=True)

        async def read(self, fh: int, off: int, length: int) -> bytes:
            end = min(size, off + length)
            if off >= end:
                return b""
            first, last = off // bs, (end + bs - 1) // bs
            try:
                data = await dev.read(first, last - first)
            except BlockError as e:
                log.warning("read at %d (+%d): %s", off, length, e)
                raise fuse.FUSEError(_errno(e)) from e
            skip = off - first * bs
            return bytes(memoryview(data)[skip:skip + end - off])

        async def write(self, fh: int, off: int, buf: bytes) -> int:
            if read_only:
                raise fuse.FUSEError(errno.EROFS)
            if off + len(buf) > size:
                raise fuse.FUSEError(errno.ENOSPC)
            if not buf:
                return 0
            try:
                if off % bs == 0 and len(buf) % bs == 0:
                    await dev.write(off // bs, buf)
                else:
                    async with self.rmw:
                        first, last = off // bs, (off + len(buf) + bs - 1) // bs
                        blocks = bytearray(await dev.read(first, last - first))
                        skip = off - first * bs
                        blocks[skip:skip + len(buf)] = buf
                        await dev.write(first, blocks)
            except BlockError as e:
                log.warning("write at %d (+%d): %s", off, len(buf), e)
                raise fuse.FUSEError(_errno(e)) from e
            return len(buf)

        async def fsync(self, fh: int, datasync: bool) -> None:
            try:
                await dev.flush()
            except BlockError as e:
                raise fuse.FUSEError(_errno(e)) from e

        async def flush(self, fh: int) -> None:
            # close(2): make what this opener wrote durable, as a close of a block device does
            await self.fsync(fh, True)

        async def release(self, fh: int) -> None:
            return None

        async def statfs(self, ctx: Any) -> Any:
            s = fuse.StatvfsData()
            s.f_bsize = s.f_frsize = bs
            s.f_blocks = dev.num_blocks
            s.f_files = 1
            s.f_namemax = 255
            return s

    return BlockFile()


async def attach(dev: BlockDevice, path: str, *, read_only: bool = False, allow_other: bool = False,
                 ready: Any = None) -> None:
    """Serve `dev` as the file `path` until SIGINT/SIGTERM or `fusermount3 -u PATH`; then flush."""
    fuse = _pyfuse3()
    if not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # the mount point: an empty file
    elif not os.path.isfile(path):
        raise RuntimeError(f"{path}: not a regular file (attach mounts the volume over a file)")
    ops = make_operations(dev, read_only=read_only)
    options = {"fsname=openvsan", "subtype=openvsan", "default_permissions"}
    if allow_other:
        options.add("allow_other")
    if read_only:
        options.add("ro")
    fuse.init(ops, path, options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, fuse.terminate)
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        # pyfuse3's asyncio shim (pyfuse3/asyncio.py wait_readable) registers `future.set_result` as the FUSE
        # fd's reader and removes it only in a done-callback, a turn later: a worker's future that ended first
        # (cancelled as the session closes) then meets its own reader. Nothing is lost; not ours to report
        handle = ctx.get("handle")
        if (isinstance(ctx.get("exception"), asyncio.InvalidStateError)
                and "Future.set_result" in repr(handle)):
            log.debug("pyfuse3: a reader fired for a finished future (ignored)")
            return
        if previous is not None:
            previous(lp, ctx)
        else:
            lp.default_exception_handler(ctx)

    loop.set_exception_handler(handler)
    try:
        if ready is not None:
            ready()
        await fuse.main(min_tasks=4, max_tasks=64)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        fuse.close(unmount=True)
        await dev.flush()
