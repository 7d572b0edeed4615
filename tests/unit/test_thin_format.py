"""The volume group's on-disk format (volume/thin/format.py): superblock, checkpoint and journal blocks round
trip; a bad checksum, a wrong sequence number or a torn block is refused; a newer version is a FormatError."""

from __future__ import annotations

import struct
import uuid

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openvsan.volume.thin import format as fmt
from openvsan.volume.thin.format import Flag, FormatError, Op, Superblock, VolumeRecord


def superblock(name: str = "tank") -> Superblock:
    return Superblock(uuid.UUID(int=7), 512, 65536, 1 << 20, 8192 + (2 << 20), 1 << 20, 4 << 20, 1000,
                      1_700_000_000, name)


NEWER = fmt.VERSION + 1


# ---- superblock

def test_superblock_round_trips() -> None:
    sb = superblock("pool-é")
    raw = sb.encode()
    assert len(raw) == fmt.META_BLOCK
    assert Superblock.decode(raw) == sb
    assert sb.slot_offsets == (8192, 8192 + (1 << 20))


def test_superblock_with_a_flipped_bit_or_torn_is_refused() -> None:
    raw = bytearray(superblock().encode())
    raw[40] ^= 0x10
    assert Superblock.decode(raw) is None
    assert Superblock.decode(superblock().encode()[:50]) is None       # torn: the tail missing
    assert Superblock.decode(bytes(fmt.META_BLOCK)) is None            # blank
    assert fmt.is_blank(bytes(fmt.META_BLOCK)) and not fmt.is_blank(superblock().encode())


def test_superblock_of_a_newer_version_raises() -> None:
    b = bytearray(superblock().encode())
    size = struct.calcsize("<8sII16sIIQQQQQQQ64s")    # the checksum follows what it covers
    struct.pack_into("<I", b, 8, NEWER)
    struct.pack_into("<I", b, size, crc32c.crc32c(bytes(b[:size])))
    with pytest.raises(FormatError, match=f"version {NEWER}"):
        Superblock.decode(b)


# ---- checkpoint

def entries(mapping: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A mapping's mapped entries as encode_checkpoint takes them (0: unmapped)."""
    vcs = np.flatnonzero(mapping)
    return vcs, mapping[vcs].astype(np.int64)


def volumes() -> list[tuple[VolumeRecord, np.ndarray, np.ndarray]]:
    a = np.zeros(40, dtype=np.int32)
    a[0:5] = np.arange(100, 105)
    a[7] = 3
    a[8:12] = np.arange(20, 24)
    b = np.zeros(10, dtype=np.int32)
    return [(VolumeRecord(1, "a", Flag.THIN, 40 * 128, 0, 123), *entries(a)),
            (VolumeRecord(2, "snap-ü", Flag.THIN | Flag.SNAPSHOT | Flag.READ_ONLY, 40 * 128, 1, 456), *entries(a)),
            (VolumeRecord(3, "empty", Flag(0), 1280, 0, 789), *entries(b))]


def test_runs_of_a_mapping() -> None:
    m = np.array([0, 5, 6, 7, 9, 0, 10, 11, 3], dtype=np.int32)
    runs = fmt.runs_of(*entries(m))
    assert runs.tolist() == [[1, 5, 3], [4, 9, 1], [6, 10, 2], [8, 3, 1]]
    assert fmt.count_runs(*entries(m)) == 4
    assert fmt.count_runs(*entries(np.zeros(4, dtype=np.int32))) == 0
    assert fmt.runs_of(*entries(np.zeros(0, dtype=np.int32))).shape == (0, 3)


def test_checkpoint_round_trips() -> None:
    vols = volumes()
    raw = fmt.encode_checkpoint(9, 1234, 4, vols)
    assert fmt.checkpoint_head(raw) is not None
    ck = fmt.decode_checkpoint(raw)
    assert ck is not None
    assert (ck.seq, ck.journal_base, ck.next_id) == (9, 1234, 4)
    assert [rec for rec, _ in ck.volumes] == [rec for rec, _, _ in vols]
    for (_, runs), (_, vcs, ps) in zip(ck.volumes, vols, strict=True):
        assert runs.tolist() == fmt.runs_of(vcs, ps).tolist()


@pytest.mark.parametrize("at", [0, 13, 20, fmt.CHECKPOINT_HEAD + 3, -1])
def test_checkpoint_with_a_flipped_bit_is_refused(at: int) -> None:
    raw = bytearray(fmt.encode_checkpoint(9, 1234, 4, volumes()))
    raw[at] ^= 0x01
    assert fmt.decode_checkpoint(raw) is None


def test_torn_checkpoint_is_refused() -> None:
    raw = fmt.encode_checkpoint(9, 1234, 4, volumes())
    assert fmt.decode_checkpoint(raw[:len(raw) - 1]) is None
    # the head of a new checkpoint over the body of an older one
    old = fmt.encode_checkpoint(8, 1000, 4, volumes()[:2])
    mixed = raw[:fmt.CHECKPOINT_HEAD] + old[fmt.CHECKPOINT_HEAD:]
    assert fmt.decode_checkpoint(mixed.ljust(len(raw), b"\0")) is None


def test_checkpoint_of_a_newer_version_raises() -> None:
    b = bytearray(fmt.encode_checkpoint(9, 1234, 4, volumes()))
    head = fmt.CHECKPOINT_HEAD
    struct.pack_into("<I", b, 8, NEWER)
    # the head's checksum (bytes 12-16) covers the rest of the head
    struct.pack_into("<I", b, 12, crc32c.crc32c(bytes(b[:12] + b[16:head])))
    with pytest.raises(FormatError, match=f"checkpoint version {NEWER}"):
        fmt.decode_checkpoint(b)


# ---- journal

RECORDS: list[fmt.Record] = [
    (Op.MAP, 1, 17, 200, 3),
    (Op.UNMAP, 1, 4, 9),
    (Op.CREATE, 5, Flag.THIN | Flag.SNAPSHOT, 4096, 1, 1_700_000_000_000_000_000, True, "snap-1"),
    (Op.CREATE, 6, Flag(0), 8, 0, 1, False, "é"),
    (Op.DELETE, 5),
    (Op.RESIZE, 1, 1 << 40),
    (Op.ROLLBACK, 1, 6),
    (Op.RENAME, 6, "renamed"),
]


def test_every_record_round_trips() -> None:
    payload = b"".join(fmt.encode_record(r) for r in RECORDS)
    assert fmt.decode_records(payload) == RECORDS


def test_journal_blocks_round_trip_in_sequence() -> None:
    recs = [fmt.encode_record((Op.MAP, 1, i, 1000 + i, 1)) for i in range(600)]   # more than one block
    blocks = fmt.journal_blocks(recs, 77)
    assert len(blocks) > 1 and all(len(b) == fmt.META_BLOCK for b in blocks)
    got: list[fmt.Record] = []
    for i, block in enumerate(blocks):
        decoded = fmt.open_journal_block(block, 77 + i)
        assert decoded is not None
        got += decoded
    assert got == [(Op.MAP, 1, i, 1000 + i, 1) for i in range(600)]


def test_journal_block_of_another_sequence_number_is_refused() -> None:
    block = fmt.journal_blocks([fmt.encode_record(RECORDS[0])], 10)[0]
    assert fmt.open_journal_block(block, 10) == [RECORDS[0]]
    assert fmt.open_journal_block(block, 11) is None
    assert fmt.open_journal_block(block, 9) is None


@pytest.mark.parametrize("at", [0, 5, 9, 17, 30, fmt.META_BLOCK - 1])
def test_journal_block_with_a_flipped_bit_is_refused(at: int) -> None:
    block = bytearray(fmt.journal_blocks([fmt.encode_record(r) for r in RECORDS], 10)[0])
    block[at] ^= 0x80
    assert fmt.open_journal_block(block, 10) is None


def test_torn_journal_block_is_refused() -> None:
    new = fmt.journal_blocks([fmt.encode_record(r) for r in RECORDS], 10)[0]
    # a full block of an older epoch: its bytes differ from the new block's all the way through
    old = fmt.journal_blocks([fmt.encode_record((Op.MAP, 2, i, i, 1)) for i in range(240)], 10 + 64)[0]
    for cut in (512, 1024, 3584):   # the first sectors of the new block over the rest of the old one
        assert fmt.open_journal_block(new[:cut] + old[cut:], 10) is None
    assert fmt.open_journal_block(new[:100], 10) is None   # short
    assert fmt.open_journal_block(bytes(fmt.META_BLOCK), 0) is None


def test_journal_block_of_a_newer_version_raises() -> None:
    b = bytearray(fmt.journal_blocks([fmt.encode_record(RECORDS[0])], 10)[0])
    struct.pack_into("<I", b, 4, NEWER)
    struct.pack_into("<I", b, 20, 0)          # the checksum covers the block with itself as 0
    struct.pack_into("<I", b, 20, crc32c.crc32c(bytes(b)))
    with pytest.raises(FormatError, match=f"journal version {NEWER}"):
        fmt.open_journal_block(b, 10)


def test_unknown_op_is_refused() -> None:
    with pytest.raises(FormatError):
        fmt.decode_records(b"\x63" + bytes(16))
    with pytest.raises(ValueError):
        fmt.encode_record((99, 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just(Op.MAP), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
              st.integers(1, 2**32 - 1)),
    st.tuples(st.just(Op.UNMAP), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(1, 2**32 - 1)),
    st.tuples(st.just(Op.RENAME), st.integers(0, 2**32 - 1), st.text(min_size=1, max_size=16)),
    st.tuples(st.just(Op.RESIZE), st.integers(0, 2**32 - 1), st.integers(1, 2**63)),
), max_size=400), st.integers(0, 2**60))
def test_any_records_round_trip_through_blocks(recs: list[fmt.Record], seq: int) -> None:
    blocks = fmt.journal_blocks([fmt.encode_record(r) for r in recs], seq)
    got: list[fmt.Record] = []
    for i, block in enumerate(blocks):
        decoded = fmt.open_journal_block(block, seq + i)
        assert decoded is not None
        got += decoded
    assert got == recs
