"""Userspace initiators: a remote iSCSI LUN or NVMe/TCP namespace as a `BlockDevice`."""

from __future__ import annotations

from typing import Any

from openvsan.block.device import BlockDevice
from openvsan.initiator.url import UrlError, parse_url


async def open_url(url: str, **options: Any) -> BlockDevice:
    """iscsi://, nvme+tcp:// (initiator/url.py) or nbd:// (initiator/nbd.py) → an open BlockDevice."""
    if url.lower().startswith("nbd://"):
        from openvsan.initiator.nbd import NbdInitiator
        return await NbdInitiator.open_url(url, **options)
    u = parse_url(url)
    if u.iscsi:
        from openvsan.initiator.iscsi import IscsiInitiator

        return await IscsiInitiator.open_url(url, **options)
    try:
        from openvsan.initiator.nvme_tcp import NvmeTcpInitiator  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        raise UrlError(f"{u.redacted()}: NVMe/TCP initiator not available: {e}") from e
    dev: BlockDevice = await NvmeTcpInitiator.open_url(url, **options)
    return dev


__all__ = ["UrlError", "open_url", "parse_url"]
