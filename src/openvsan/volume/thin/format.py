"""The on-disk format of a volume group (a device or pool carved into many volumes; DESIGN.md: every on-disk
structure has a magic, a version and a checksum, and is updated crash-safely).

```
byte 0             superblock, copy 0 (4 KiB)       written once, at format
byte 4096          superblock, copy 1 (4 KiB)
byte 8192          checkpoint slot 0                 the whole mapping state, written in turn to
8192 + S           checkpoint slot 1                 slot seq % 2 (the torn one leaves the other)
8192 + 2S          journal (J bytes, 4 KiB blocks)   records since the newest checkpoint
data_offset        data clusters (cluster-aligned)
```

Physical clusters are numbered from 1: cluster p lies at data_offset + (p - 1) * cluster_size, and 0 in a
mapping means unmapped (so a mapping in memory starts as zeros, pages the kernel lends until written).

A checkpoint holds every volume (id, name, flags, size, origin, creation time) and its mapping as runs
(virtual cluster, physical cluster, length). It names `journal_base`: the journal block at position i after
it must carry sequence number journal_base + i, so a block left by an older checkpoint or by a commit that
was never acknowledged can never be taken for a newer one (each open that replayed anything checkpoints
anew, so a torn tail is never continued).

Journal blocks hold whole records; a commit writes new blocks only (a committed block is never rewritten, so
a torn write cannot take back what was acknowledged). Records are logical (map, unmap, create, snapshot...)
and are replayed in order over the checkpoint. All integers little-endian; checksums are CRC32C.
"""

from __future__ import annotations

import enum
import struct
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any, TypeAlias

import crc32c
import numpy as np

SUPER_MAGIC = b"OVSNVGRP"
CHECKPOINT_MAGIC = b"OVSNVGCK"
JOURNAL_MAGIC = 0x4C4E524A   # "JRNL"
VERSION = 2   # 2: physical clusters numbered from 1 (0 in a mapping: unmapped)
META_BLOCK = 4096            # superblock copies, slot and journal block unit
SUPER_COPIES = 2
MAX_NAME = 64                # bytes of UTF-8 in a volume or snapshot name

# ---- superblock

_SUPER = struct.Struct("<8sII16sIIQQQQQQQ64s")   # + I crc


@dataclass(frozen=True)
class Superblock:
    uuid: uuidlib.UUID
    block_size: int          # the device's logical block
    cluster_size: int        # bytes
    slot_size: int           # bytes of one checkpoint slot
    journal_offset: int      # bytes
    journal_size: int        # bytes
    data_offset: int         # bytes, a multiple of cluster_size
    clusters: int            # data clusters
    created: int             # unix seconds
    name: str = ""

    @property
    def slot_offsets(self) -> tuple[int, int]:
        base = SUPER_COPIES * META_BLOCK
        return base, base + self.slot_size

    def encode(self) -> bytes:
        name = self.name.encode()[:64]
        body = _SUPER.pack(SUPER_MAGIC, VERSION, _SUPER.size + 4, self.uuid.bytes, self.block_size,
                           self.cluster_size, self.slot_size, self.journal_offset, self.journal_size,
                           self.data_offset, self.clusters, self.created, 0, name)
        body += struct.pack("<I", crc32c.crc32c(body))
        return body.ljust(META_BLOCK, b"\0")

    @classmethod
    def decode(cls, raw: bytes | bytearray | memoryview) -> Superblock | None:
        """The superblock in raw, or None when raw holds none (or a damaged one)."""
        raw = bytes(raw[:_SUPER.size + 4])
        if len(raw) < _SUPER.size + 4 or raw[:8] != SUPER_MAGIC:
            return None
        if struct.unpack_from("<I", raw, _SUPER.size)[0] != crc32c.crc32c(raw[:_SUPER.size]):
            return None
        (_, version, _, uid, bs, cs, slot, joff, jsize, doff, clusters, created, _,
         name) = _SUPER.unpack_from(raw)
        if version != VERSION:
            raise FormatError(f"volume group format version {version}; this openvsan reads version {VERSION}")
        return cls(uuidlib.UUID(bytes=uid), bs, cs, slot, joff, jsize, doff, clusters, created,
                   name.rstrip(b"\0").decode(errors="replace"))


class FormatError(Exception):
    """The device holds a volume group this code cannot read (a newer version, impossible geometry)."""


def is_blank(raw: bytes | bytearray | memoryview) -> bool:
    return not any(raw)


# ---- checkpoint

_CK_HEAD = struct.Struct("<8sIIQQQIII")   # magic, version, head crc, seq, journal_base, body len, body crc,
#                                          next volume id, volume count
_VOL = struct.Struct("<IIQIQH")          # id, flags, blocks, origin, created (unix ns), name length


class Flag(enum.IntFlag):
    THIN = 1          # clusters allocated on first write (else all at creation)
    SNAPSHOT = 2      # read-only point-in-time copy of its origin
    READ_ONLY = 4


@dataclass
class VolumeRecord:
    """A volume's metadata besides its mapping (the state a checkpoint carries for it)."""
    id: int
    name: str
    flags: Flag
    blocks: int
    origin: int       # the volume a snapshot was taken of, or the snapshot a clone was made from; 0: none
    created: int      # unix ns


def runs_of(vcs: np.ndarray, ps: np.ndarray) -> np.ndarray:
    """(virtual, physical, length) runs of a mapping given as its mapped entries: virtual clusters in
    ascending order and the physical cluster of each (state.entries gives them)."""
    if not len(vcs):
        return np.zeros((0, 3), dtype="<u4")
    breaks = np.flatnonzero((np.diff(vcs) != 1) | (np.diff(ps) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(vcs)]))
    out = np.empty((len(starts), 3), dtype="<u4")
    out[:, 0] = vcs[starts]
    out[:, 1] = ps[starts]
    out[:, 2] = ends - starts
    return out


def count_runs(vcs: np.ndarray, ps: np.ndarray) -> int:
    if not len(vcs):
        return 0
    return 1 + int(np.count_nonzero((np.diff(vcs) != 1) | (np.diff(ps) != 1)))


RUN_BYTES = 12
VOLUME_BYTES = _VOL.size + MAX_NAME + 4   # a volume's entry at most, without its runs


def encode_checkpoint(seq: int, journal_base: int, next_id: int,
                      volumes: list[tuple[VolumeRecord, np.ndarray, np.ndarray]]) -> bytes:
    """`volumes`: each volume's record and its mapped entries (virtual clusters ascending, physical ones)."""
    parts = []
    for rec, vcs, ps in volumes:
        name = rec.name.encode()
        runs = runs_of(vcs, ps)
        parts.append(_VOL.pack(rec.id, int(rec.flags), rec.blocks, rec.origin, rec.created, len(name)))
        parts.append(name)
        parts.append(struct.pack("<I", len(runs)))
        parts.append(runs.tobytes())
    body = b"".join(parts)
    head = _CK_HEAD.pack(CHECKPOINT_MAGIC, VERSION, 0, seq, journal_base, len(body), crc32c.crc32c(body),
                         next_id, len(volumes))
    crc = crc32c.crc32c(head[:12] + head[16:])
    head = head[:12] + struct.pack("<I", crc) + head[16:]
    return head + body


@dataclass
class Checkpoint:
    seq: int
    journal_base: int
    next_id: int
    volumes: list[tuple[VolumeRecord, np.ndarray]]   # mapping as runs (virtual, physical, length)


def checkpoint_head(raw: bytes | bytearray | memoryview) -> tuple[int, int, int] | None:
    """(seq, body length, body crc) of a valid checkpoint head, else None."""
    raw = bytes(raw[:_CK_HEAD.size])
    if len(raw) < _CK_HEAD.size or raw[:8] != CHECKPOINT_MAGIC:
        return None
    if struct.unpack_from("<I", raw, 12)[0] != crc32c.crc32c(raw[:12] + raw[16:]):
        return None
    _, version, _, seq, _, length, body_crc, _, _ = _CK_HEAD.unpack(raw)
    if version != VERSION:
        raise FormatError(f"volume group checkpoint version {version}; this openvsan reads version {VERSION}")
    return seq, length, body_crc


def decode_checkpoint(raw: bytes | bytearray | memoryview) -> Checkpoint | None:
    """The checkpoint in raw (head and body), or None when it is torn or damaged."""
    head = checkpoint_head(raw)
    if head is None:
        return None
    _, length, body_crc = head
    body = bytes(raw[_CK_HEAD.size:_CK_HEAD.size + length])
    if len(body) != length or crc32c.crc32c(body) != body_crc:
        return None
    _, _, _, seq, journal_base, _, _, next_id, count = _CK_HEAD.unpack_from(bytes(raw[:_CK_HEAD.size]))
    vols: list[tuple[VolumeRecord, np.ndarray]] = []
    at = 0
    for _ in range(count):
        vid, flags, blocks, origin, created, nlen = _VOL.unpack_from(body, at)
        at += _VOL.size
        name = body[at:at + nlen].decode()
        at += nlen
        (nruns,) = struct.unpack_from("<I", body, at)
        at += 4
        runs = np.frombuffer(body, dtype="<u4", count=nruns * 3, offset=at).reshape(nruns, 3)
        at += nruns * RUN_BYTES
        vols.append((VolumeRecord(vid, name, Flag(flags), blocks, origin, created), runs))
    return Checkpoint(seq, journal_base, next_id, vols)


CHECKPOINT_HEAD = _CK_HEAD.size

# ---- journal

_JB_HEAD = struct.Struct("<IIQII")   # magic, version, seq, payload length, crc (of the block with crc = 0)


class Op(enum.IntEnum):
    MAP = 1        # vol, virtual, physical, length: virtual..+length -> physical..+length
    UNMAP = 2      # vol, virtual, length
    CREATE = 3     # vol, flags, blocks, origin, created, name; copy: the origin's mapping is copied
    DELETE = 4     # vol
    RESIZE = 5     # vol, blocks
    ROLLBACK = 6   # vol, snapshot: the volume's mapping and size become the snapshot's
    RENAME = 7     # vol, name


_MAP = struct.Struct("<BIIII")
_UNMAP = struct.Struct("<BIII")
_CREATE = struct.Struct("<BIIQIQBH")   # op, id, flags, blocks, origin, created, copy, name length
_DELETE = struct.Struct("<BI")
_RESIZE = struct.Struct("<BIQ")
_ROLLBACK = struct.Struct("<BII")
_RENAME = struct.Struct("<BIH")

# A logical record: (Op, its fields...), the fields in the order the Op's comment above gives (CREATE: vol,
# flags, blocks, origin, created, copy, name).
Record: TypeAlias = tuple[Any, ...]


def encode_record(rec: Record) -> bytes:
    op: Op = rec[0]
    if op == Op.MAP:
        return _MAP.pack(op, *rec[1:])
    if op == Op.UNMAP:
        return _UNMAP.pack(op, *rec[1:])
    if op == Op.CREATE:
        vid, flags, blocks, origin, created, copy, name = rec[1:]
        raw = str(name).encode()
        return _CREATE.pack(op, vid, int(flags), blocks, origin, created, int(copy), len(raw)) + raw
    if op == Op.DELETE:
        return _DELETE.pack(op, rec[1])
    if op == Op.RESIZE:
        return _RESIZE.pack(op, *rec[1:])
    if op == Op.ROLLBACK:
        return _ROLLBACK.pack(op, *rec[1:])
    if op == Op.RENAME:
        raw = str(rec[2]).encode()
        return _RENAME.pack(op, rec[1], len(raw)) + raw
    raise ValueError(f"unknown journal op {op}")


def decode_records(payload: bytes) -> list[Record]:
    out: list[Record] = []
    at = 0
    while at < len(payload):
        op = payload[at]
        if op == Op.MAP:
            out.append((Op.MAP, *_MAP.unpack_from(payload, at)[1:]))
            at += _MAP.size
        elif op == Op.UNMAP:
            out.append((Op.UNMAP, *_UNMAP.unpack_from(payload, at)[1:]))
            at += _UNMAP.size
        elif op == Op.CREATE:
            _, vid, flags, blocks, origin, created, copy, nlen = _CREATE.unpack_from(payload, at)
            at += _CREATE.size
            name = payload[at:at + nlen].decode()
            at += nlen
            out.append((Op.CREATE, vid, Flag(flags), blocks, origin, created, bool(copy), name))
        elif op == Op.DELETE:
            out.append((Op.DELETE, *_DELETE.unpack_from(payload, at)[1:]))
            at += _DELETE.size
        elif op == Op.RESIZE:
            out.append((Op.RESIZE, *_RESIZE.unpack_from(payload, at)[1:]))
            at += _RESIZE.size
        elif op == Op.ROLLBACK:
            out.append((Op.ROLLBACK, *_ROLLBACK.unpack_from(payload, at)[1:]))
            at += _ROLLBACK.size
        elif op == Op.RENAME:
            _, vid, nlen = _RENAME.unpack_from(payload, at)
            at += _RENAME.size
            out.append((Op.RENAME, vid, payload[at:at + nlen].decode()))
            at += nlen
        else:
            raise FormatError(f"journal record with unknown op {op}")
    return out


JOURNAL_PAYLOAD = META_BLOCK - _JB_HEAD.size


def journal_blocks(records: list[bytes], seq: int) -> list[bytes]:
    """Encoded records packed into whole journal blocks, numbered from seq."""
    blocks: list[bytes] = []
    cur: list[bytes] = []
    used = 0
    for raw in records:
        if used + len(raw) > JOURNAL_PAYLOAD:
            blocks.append(_seal(b"".join(cur), seq + len(blocks)))
            cur, used = [], 0
        cur.append(raw)
        used += len(raw)
    if cur:
        blocks.append(_seal(b"".join(cur), seq + len(blocks)))
    return blocks


def _seal(payload: bytes, seq: int) -> bytes:
    head = _JB_HEAD.pack(JOURNAL_MAGIC, VERSION, seq, len(payload), 0)
    block = (head + payload).ljust(META_BLOCK, b"\0")
    crc = crc32c.crc32c(block)
    return block[:_JB_HEAD.size - 4] + struct.pack("<I", crc) + block[_JB_HEAD.size:]


def open_journal_block(raw: bytes | bytearray | memoryview, seq: int) -> list[Record] | None:
    """The records of a valid journal block carrying sequence number seq, else None (end of the journal);
    FormatError for a valid block of another version."""
    raw = bytes(raw[:META_BLOCK])
    if len(raw) < META_BLOCK:
        return None
    magic, version, bseq, length, crc = _JB_HEAD.unpack_from(raw)
    if magic != JOURNAL_MAGIC or bseq != seq or length > JOURNAL_PAYLOAD:
        return None
    if crc32c.crc32c(raw[:_JB_HEAD.size - 4] + b"\0\0\0\0" + raw[_JB_HEAD.size:]) != crc:
        return None
    if version != VERSION:
        raise FormatError(f"volume group journal version {version}; this openvsan reads version {VERSION}")
    return decode_records(raw[_JB_HEAD.size:_JB_HEAD.size + length])
