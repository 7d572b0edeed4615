"""TARGET strings: an initiator URL (iscsi://, nvme+tcp://, nbd://) or a local file or block device."""

from __future__ import annotations

import os
from typing import Any

from openvsan.block.device import BlockDevice

SCHEMES = ("iscsi://", "nvme+tcp://", "nvme-tcp://", "nbd://")


def is_url(target: str) -> bool:
    return target.lower().startswith(SCHEMES)


def redact(target: str) -> str:
    """The target as it may be printed and stored: no CHAP secret."""
    if len(target.split()) > 1:   # the paths of one volume (initiator/multipath.py)
        return " ".join(redact(t) for t in target.split())
    if target.lower().startswith(("iscsi://", "nvme")):
        from openvsan.initiator.url import parse_url
        return parse_url(target).redacted()
    return target


async def open_target(target: str, *, qd: int = 32, size: int | None = None, **options: Any) -> BlockDevice:
    """Open TARGET with room for `qd` requests in flight on its connection(s)."""
    if is_url(target):
        from openvsan.initiator import open_url
        low = target.lower()
        if low.startswith("iscsi://"):
            options.setdefault("queue_depth", max(qd, 32))
        elif low.startswith("nvme"):
            options.setdefault("queue_depth", min(max(qd + 1, 64), 1023))
        return await open_url(target, **options)
    from openvsan.block.file import FileDevice
    exists = os.path.exists(target)
    return FileDevice(target, size=None if exists else size, name="bench",
                      io_threads=max(4, min(qd, 64)))
