"""The member header: what each member of a pool carries at its start so the pool can be reassembled.

Every member reserves a header area of `data_offset` blocks (1 MiB by default) before its data:

```
byte 0        superblock copy 0 (a 4 KiB slot)
byte 4096     superblock copy 1 (a 4 KiB slot)
byte 8192     write-intent bitmap (bitmap.py), 1 bit per region, up to the data offset
data_offset   member data (chunk rows, layout.py)
```

A superblock is written to slot `event % 2`, so the update that tears leaves the previous copy (one event
older) intact; a reader takes the valid copy with the higher event. Each copy carries a CRC32C over itself.

Besides the member's own identity and state, every superblock holds the role table: for each member slot its
UUID, state and rebuild checkpoint, as the writer knew them. At assembly the superblock with the highest event
is the truth, and its role table says which members may be trusted (the MD v1 superblock's `dev_roles` idea).

Fields are little-endian, at fixed offsets:

```
0    8s  magic "OVSNPOOL"        64   I   member index (0xFFFFFFFF: a spare)
8    I   version (1)             68   I   flags (bit 0: clean shutdown)
12   I   length (CRC offset)     72   Q   event counter
16   16s pool UUID               80   Q   data offset (blocks)
32   16s member UUID             88   Q   data size (blocks per member)
48   I   level                   96   Q   bitmap region (chunk rows per bit)
52   I   chunk size (bytes)      104  I   own state      108 I reserved
56   I   block size              112  Q   own rebuild checkpoint (member data LBA)
60   I   member count            120  Q   creation time (unix seconds)
128  64s name (UTF-8, NUL padded)
192  role table: member count x (16s UUID, I state, I reserved, Q checkpoint)
192 + 32 x count: I CRC32C of bytes [0, length)
```
"""

from __future__ import annotations

import enum
import struct
import uuid as uuidlib
from dataclasses import dataclass, field, replace

import crc32c

from openvsan.block.device import BlockDevice

MAGIC = b"OVSNPOOL"
VERSION = 1
SLOT_SIZE = 4096
SLOTS = 2
BITMAP_OFFSET = SLOTS * SLOT_SIZE  # bytes from the member's start
DEFAULT_DATA_OFFSET = 1 << 20  # bytes
SPARE_INDEX = 0xFFFFFFFF
MAX_MEMBERS = 64
FLAG_CLEAN = 1

_HEAD = struct.Struct("<8sII16s16sIIIIIIQQQQIIQQ64s")
_ROLE = struct.Struct("<16sIIQ")
_CRC = struct.Struct("<I")
assert _HEAD.size == 192 and _ROLE.size == 32
assert _HEAD.size + MAX_MEMBERS * _ROLE.size + _CRC.size <= SLOT_SIZE


class MemberState(enum.IntEnum):
    ACTIVE = 1  # in sync: every row may be read
    FAILED = 2  # gone, pulled, or returned errors: nothing on it is trusted
    SPARE = 3  # waiting to take over a failed member
    REBUILDING = 4  # rows below the checkpoint are in sync, rows at or above it are not (yet)
    MISSING = 5  # a slot with no device (replaced or never found); never stored as a member's own state


@dataclass(frozen=True)
class Role:
    """One slot of the role table: who holds member slot i, and how far it can be trusted."""

    uuid: uuidlib.UUID
    state: MemberState
    checkpoint: int = 0  # member data LBA; meaningful when REBUILDING


@dataclass(frozen=True)
class Superblock:
    pool_uuid: uuidlib.UUID
    member_uuid: uuidlib.UUID
    level: int
    chunk_size: int  # bytes
    block_size: int
    member_count: int
    member_index: int  # SPARE_INDEX for a spare
    event: int
    data_offset: int  # blocks
    data_size: int  # blocks per member
    bitmap_region: int  # chunk rows per bitmap bit
    state: MemberState
    checkpoint: int = 0
    clean: bool = False
    created: int = 0
    name: str = ""
    roles: tuple[Role, ...] = field(default_factory=tuple)

    @property
    def is_spare(self) -> bool:
        return self.member_index == SPARE_INDEX

    def pack(self) -> bytes:
        if len(self.roles) not in (0, self.member_count) or self.member_count > MAX_MEMBERS:
            raise ValueError(f"role table of {len(self.roles)} for {self.member_count} members (max {MAX_MEMBERS})")
        name = self.name.encode()
        if len(name) > 64:
            raise ValueError(f"pool name {self.name!r} is longer than 64 bytes")
        length = _HEAD.size + len(self.roles) * _ROLE.size
        head = _HEAD.pack(
            MAGIC, VERSION, length, self.pool_uuid.bytes, self.member_uuid.bytes, self.level, self.chunk_size,
            self.block_size, self.member_count, self.member_index, FLAG_CLEAN if self.clean else 0, self.event,
            self.data_offset, self.data_size, self.bitmap_region, int(self.state), 0, self.checkpoint,
            self.created, name,
        )
        roles = b"".join(_ROLE.pack(r.uuid.bytes, int(r.state), 0, r.checkpoint) for r in self.roles)
        body = head + roles
        return body + _CRC.pack(crc32c.crc32c(body))

    @classmethod
    def unpack(cls, raw: bytes) -> Superblock | None:
        """The superblock in one slot, or None when the slot holds none (wrong magic, torn, bad CRC)."""
        if len(raw) < _HEAD.size + _CRC.size or raw[:8] != MAGIC:
            return None
        (_, version, length, pool_uuid, member_uuid, level, chunk_size, block_size, count, index, flags, event,
         data_offset, data_size, bitmap_region, state, _, checkpoint, created, name) = _HEAD.unpack_from(raw)
        if version != VERSION or not _HEAD.size <= length <= SLOT_SIZE - _CRC.size or len(raw) < length + 4:
            return None
        if (length - _HEAD.size) % _ROLE.size or _CRC.unpack_from(raw, length)[0] != crc32c.crc32c(raw[:length]):
            return None
        try:
            roles = tuple(
                Role(uuidlib.UUID(bytes=u), MemberState(s), cp)
                for u, s, _, cp in _ROLE.iter_unpack(raw[_HEAD.size:length])
            )
            own = MemberState(state)
        except ValueError:
            return None
        return cls(
            pool_uuid=uuidlib.UUID(bytes=pool_uuid), member_uuid=uuidlib.UUID(bytes=member_uuid), level=level,
            chunk_size=chunk_size, block_size=block_size, member_count=count, member_index=index, event=event,
            data_offset=data_offset, data_size=data_size, bitmap_region=bitmap_region, state=own,
            checkpoint=checkpoint, clean=bool(flags & FLAG_CLEAN), created=created,
            name=name.rstrip(b"\0").decode(errors="replace"), roles=roles,
        )

    def evolve(self, **changes: object) -> Superblock:
        return replace(self, **changes)  # type: ignore[arg-type]


def _slot_blocks(dev: BlockDevice) -> int:
    return SLOT_SIZE // dev.block_size


async def read_superblock(dev: BlockDevice) -> Superblock | None:
    """The newest valid copy on `dev`, or None when it carries no pool superblock (or is too small to)."""
    if dev.num_blocks * dev.block_size < BITMAP_OFFSET:
        return None
    raw = bytes(await dev.read(0, SLOTS * _slot_blocks(dev)))
    copies = [Superblock.unpack(raw[i * SLOT_SIZE:(i + 1) * SLOT_SIZE]) for i in range(SLOTS)]
    valid = [sb for sb in copies if sb is not None]
    return max(valid, key=lambda sb: sb.event) if valid else None


async def write_superblock(dev: BlockDevice, sb: Superblock) -> None:
    """Write `sb` into slot event % 2, durably: the other slot keeps the previous event."""
    raw = sb.pack()
    slot = sb.event % SLOTS
    await dev.write(slot * _slot_blocks(dev), raw + bytes(SLOT_SIZE - len(raw)), fua=True)


async def erase_superblock(dev: BlockDevice) -> None:
    """Remove both copies (a member leaving a destroyed pool)."""
    await dev.write_zeroes(0, SLOTS * _slot_blocks(dev))
    await dev.flush()
