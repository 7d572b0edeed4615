"""Userspace initiators: a remote iSCSI LUN or NVMe/TCP namespace as a `BlockDevice`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openvsan.block.device import BlockDevice
from openvsan.initiator.url import UrlError, parse_url


async def open_url(url: str | Sequence[str], **options: Any) -> BlockDevice:
    """iscsi://, nvme+tcp:// (initiator/url.py) or nbd:// (initiator/nbd.py) → an open BlockDevice. Several
    URLs of one volume (a list, or one string with them apart by spaces) → a MultipathDevice
    (initiator/multipath.py) over them."""
    if not isinstance(url, str) or len(url.split()) > 1:
        from openvsan.initiator.multipath import open_paths, split_urls
        urls = split_urls(url)
        if len(urls) > 1:
            return await open_paths(urls, **options)
        if not urls:
            raise UrlError("no URL given")
        url = urls[0]
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
