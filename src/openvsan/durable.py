"""Files replaced crash-safely: the new content written whole to a new file, synced, renamed over the old
one, and the directory synced, so that after a crash the path holds either the old content or the new, never
a torn mix (what the persistent-reservation state, secrets.json and a replica's fence floor rely on).
Blocking: call it off the event loop."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def sync_dir(path: Path) -> None:
    """Make a rename or a new name in `path` durable (POSIX: fsync of the directory)."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def replace_file(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Put `data` at `path` as one crash-safe step. The new file is made with `mode` (never through a link:
    O_EXCL | O_NOFOLLOW) under a name of this process and thread, so concurrent writers do not collide."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    sync_dir(path.parent)
