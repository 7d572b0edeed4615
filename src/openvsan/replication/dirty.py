"""A primary's record of the regions an out-of-sync peer misses, on disk, so that a primary that restarts
resyncs that peer by its dirty regions rather than by a full copy.

One file per (volume, peer) in the primary's data dir, replaced crash-safely (openvsan/durable.py) whenever a
region is added, before the write that dirtied it is acknowledged. Its header, little-endian:

    magic "OVSDIRTY" | version u16 | reserved u16 | region size u32 | regions u64 | since epoch u64 |
    CRC32C of the bitmap u32 | bitmap (one bit a region, bit r%8 of byte r//8)

`since` is the epoch the record (replication/record.py) gives for the peer's falling out of sync: a file
whose `since` differs from the record's is not this outage's and is not trusted (the caller then copies
everything). Losing the file is never unsafe, only slower.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import crc32c

from openvsan.durable import replace_file

MAGIC = b"OVSDIRTY"
VERSION = 1
_HEADER = struct.Struct("<8sHHIQQI")


class DirtyFileError(ValueError):
    """A dirty-region file that cannot be trusted (torn, another format, another volume's shape)."""


def encode(regions: Iterable[int], count: int, region_size: int, since: int) -> bytes:
    bits = bytearray(-(-count // 8))
    for r in regions:
        if not 0 <= r < count:
            raise ValueError(f"region {r} is outside 0..{count - 1}")
        bits[r >> 3] |= 1 << (r & 7)
    return _HEADER.pack(MAGIC, VERSION, 0, region_size, count, since, crc32c.crc32c(bits)) + bytes(bits)


def decode(raw: bytes) -> tuple[set[int], int, int, int]:
    """(regions, count, region size, since) of a file's content."""
    if len(raw) < _HEADER.size:
        raise DirtyFileError(f"{len(raw)} bytes: shorter than the header")
    magic, version, _, region_size, count, since, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise DirtyFileError("not a dirty-region file (bad magic)")
    if version != VERSION:
        raise DirtyFileError(f"version {version}; this openvsan reads version {VERSION}")
    bits = raw[_HEADER.size:]
    if len(bits) != -(-count // 8):
        raise DirtyFileError(f"{len(bits)} bitmap bytes for {count} regions")
    if crc32c.crc32c(bits) != crc:
        raise DirtyFileError("bitmap checksum mismatch")
    regions = {i * 8 + b for i, byte in enumerate(bits) if byte for b in range(8) if byte >> b & 1}
    return regions, count, region_size, since


class DirtyFile:
    """The dirty regions of one peer of one volume, kept in `path`."""

    def __init__(self, path: Path, count: int, region_size: int) -> None:
        self.path = path
        self.count = count
        self.region_size = region_size

    def save(self, regions: Iterable[int], since: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        replace_file(self.path, encode(regions, self.count, self.region_size, since))

    def load(self, since: int) -> set[int] | None:
        """The regions saved for the outage that began at epoch `since`; None when there is no such file,
        or it is another outage's, another shape's, or torn (then the peer needs a full copy)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            regions, count, region_size, saved_since = decode(raw)
        except DirtyFileError:
            return None
        if (count, region_size, saved_since) != (self.count, self.region_size, since):
            return None
        return regions

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
