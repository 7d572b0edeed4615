"""Block commands (SBC-4 5): reads, writes, verify, caches, provisioning, atomic read-modify-write."""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from openvsan.protocol.scsi.cdb import (
    lba_len6,
    lba_len10,
    lba_len12,
    lba_len16,
    lba_len_atomic16,
    lba_len_caw,
    u16,
    u32,
    u64,
)
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.sense import (
    ASC_MISCOMPARE_DURING_VERIFY,
    CONDITION_MET,
    GOOD,
    ILLEGAL_REQUEST,
    MISCOMPARE,
    ScsiError,
    ScsiResult,
    invalid_field,
    lba_out_of_range,
    write_protected,
)

if TYPE_CHECKING:
    from openvsan.protocol.scsi.lun import Lun

Handler = Callable[["Lun", bytes, memoryview, Nexus], Awaitable[ScsiResult]]

_GOOD = ScsiResult(GOOD)
_FUA = 0x08
_CHUNK = 8 << 20   # largest buffer built at once by WRITE SAME and the like


def _check_range(lun: Lun, lba: int, n: int) -> None:
    # SBC-4 4.5: also for zero blocks, an LBA past the capacity is out of range
    if lba + n > lun.volume.num_blocks:
        raise lba_out_of_range()


def _check_transfer(lun: Lun, n: int, field: int) -> None:
    if n > lun.limits.max_transfer:
        raise invalid_field(field)


def admit_rw(lun: Lun, lba: int, n: int, lenfield: int, *, write: bool = False) -> ScsiError | None:
    """What refuses a READ or WRITE of n blocks at lba (its TRANSFER LENGTH in CDB byte lenfield) once
    Lun.admit() let it through, or None: write protection (DATA PROTECT), the LBA range (SBC-4 4.5: also for
    zero blocks), the transfer length (Block Limits VPD). Pure, for the normal path and the fast path."""
    if write and lun.write_protected:
        return write_protected()
    if lba + n > lun.volume.num_blocks:
        return lba_out_of_range()
    if n > lun.limits.max_transfer:
        return invalid_field(lenfield)
    return None


def _data(lun: Lun, data: memoryview, nbytes: int) -> memoryview:
    """The first nbytes of Data-Out; less than the CDB asked for is refused rather than half-written."""
    if len(data) < nbytes:
        raise invalid_field(0)
    return data[:nbytes] if len(data) > nbytes else data


def first_difference(a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview) -> int:
    """Offset of the first byte where a and b differ (they must differ), by bisection: C-speed compares."""
    lo, hi = 0, min(len(a), len(b))
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if a[lo:mid] != b[lo:mid]:
            hi = mid
        else:
            lo = mid
    for i in range(lo, hi):
        if a[i] != b[i]:
            return i
    return hi


def _miscompare(offset: int) -> ScsiError:
    # SBC-4 5.3 / 5.33: MISCOMPARE, MISCOMPARE DURING VERIFY OPERATION, INFORMATION = byte offset
    return ScsiError(MISCOMPARE, ASC_MISCOMPARE_DURING_VERIFY, info=offset)


# ---- READ (SBC-4 5.14-5.17)

async def _read(lun: Lun, lba: int, n: int, lenfield: int) -> ScsiResult:
    refused = admit_rw(lun, lba, n, lenfield)
    if refused is not None:
        raise refused
    if not n:
        return _GOOD
    return ScsiResult(GOOD, await lun.volume.read(lba, n))


async def read6(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len6(cdb)
    return await _read(lun, lba, n, 4)


async def read10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len10(cdb)
    return await _read(lun, lba, n, 7)


async def read12(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len12(cdb)
    return await _read(lun, lba, n, 6)


async def read16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len16(cdb)
    return await _read(lun, lba, n, 10)


# ---- WRITE (SBC-4 5.40-5.43)

async def _write(lun: Lun, lba: int, n: int, data: memoryview, fua: bool, lenfield: int) -> ScsiResult:
    refused = admit_rw(lun, lba, n, lenfield, write=True)
    if refused is not None:
        raise refused
    if not n:
        return _GOOD
    payload = _data(lun, data, n * lun.block_size)
    token = await lun.locks.acquire(lba, lba + n)
    try:
        lun.all_deallocated = False
        await lun.volume.write(lba, payload, fua=fua or not lun.mode.wce)
    finally:
        lun.locks.release(token)
    return _GOOD


async def write6(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len6(cdb)
    return await _write(lun, lba, n, data, False, 4)


async def write10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len10(cdb)
    return await _write(lun, lba, n, data, bool(cdb[1] & _FUA), 7)


async def write12(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len12(cdb)
    return await _write(lun, lba, n, data, bool(cdb[1] & _FUA), 6)


async def write16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len16(cdb)
    return await _write(lun, lba, n, data, bool(cdb[1] & _FUA), 10)


async def write_atomic16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """WRITE ATOMIC(16) (SBC-4 5.48): all or nothing, so it excludes overlapping writes like CAW does."""
    lba, n = lba_len_atomic16(cdb)
    boundary = u16(cdb, 10)
    if lun.write_protected:
        raise write_protected()
    _check_range(lun, lba, n)
    if boundary:
        raise invalid_field(10)
    if n > lun.limits.max_atomic:
        raise invalid_field(12)
    if not n:
        return _GOOD
    payload = _data(lun, data, n * lun.block_size)
    token = await lun.locks.acquire(lba, lba + n, exclusive=True)
    try:
        lun.all_deallocated = False
        await lun.volume.write(lba, payload, fua=bool(cdb[1] & _FUA) or not lun.mode.wce)
    finally:
        lun.locks.release(token)
    return _GOOD


# ---- VERIFY and WRITE AND VERIFY (SBC-4 5.33-5.35, 5.44-5.46)

async def _verify(lun: Lun, lba: int, n: int, cdb: bytes, data: memoryview, lenfield: int) -> ScsiResult:
    bytchk = (cdb[1] >> 1) & 0x03
    if bytchk == 2:
        raise invalid_field(1, 2)
    _check_range(lun, lba, n)
    if not n:
        return _GOOD
    _check_transfer(lun, n, lenfield)
    bs = lun.block_size
    medium = await lun.volume.read(lba, n)
    if bytchk == 0:  # medium verification only: the read above succeeded
        return _GOOD
    if bytchk == 1:
        expected = _data(lun, data, n * bs)
        if medium != expected:
            raise _miscompare(first_difference(medium, expected))
        return _GOOD
    block = bytes(_data(lun, data, bs))   # BYTCHK 11b: one block, compared with each block of the range
    mv = memoryview(medium)
    for i in range(n):
        if mv[i * bs:(i + 1) * bs] != block:
            return _miscompare(i * bs + first_difference(mv[i * bs:(i + 1) * bs], block)).result()
    return _GOOD


async def verify10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len10(cdb)
    return await _verify(lun, lba, n, cdb, data, 7)


async def verify12(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len12(cdb)
    return await _verify(lun, lba, n, cdb, data, 6)


async def verify16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len16(cdb)
    return await _verify(lun, lba, n, cdb, data, 10)


async def _write_verify(lun: Lun, lba: int, n: int, cdb: bytes, data: memoryview, lenfield: int) -> ScsiResult:
    if (cdb[1] >> 1) & 0x03 >= 2:   # BYTCHK 10b and 11b are reserved for WRITE AND VERIFY
        raise invalid_field(1, 2)
    # the write goes to the medium itself (FUA), so reading it back would add nothing
    return await _write(lun, lba, n, data, True, lenfield)


async def write_verify10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len10(cdb)
    return await _write_verify(lun, lba, n, cdb, data, 7)


async def write_verify12(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len12(cdb)
    return await _write_verify(lun, lba, n, cdb, data, 6)


async def write_verify16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len16(cdb)
    return await _write_verify(lun, lba, n, cdb, data, 10)


# ---- COMPARE AND WRITE (SBC-4 5.3) and ORWRITE (SBC-4 5.11): atomic read-modify-write

async def compare_and_write(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len_caw(cdb)
    if lun.write_protected:
        raise write_protected()
    if n > lun.limits.max_compare_write:
        raise invalid_field(13)
    _check_range(lun, lba, n)
    size = n * lun.block_size
    if len(data) != 2 * size:
        # more or less Data-Out than the CDB says: where compare data ends and write data begins is
        # anybody's guess, so nothing is compared or written
        raise invalid_field(13)
    if not n:
        return _GOOD
    verify, write = data[:size], data[size:]
    token = await lun.locks.acquire(lba, lba + n, exclusive=True)
    try:
        current = await lun.volume.read(lba, n)
        if current != verify:
            raise _miscompare(first_difference(current, verify))
        lun.all_deallocated = False
        await lun.volume.write(lba, write, fua=bool(cdb[1] & _FUA) or not lun.mode.wce)
    finally:
        lun.locks.release(token)
    return _GOOD


async def orwrite16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len16(cdb)
    if lun.write_protected:
        raise write_protected()
    _check_range(lun, lba, n)
    if not n:
        return _GOOD
    _check_transfer(lun, n, 10)
    size = n * lun.block_size
    mask = _data(lun, data, size)
    token = await lun.locks.acquire(lba, lba + n, exclusive=True)
    try:
        current = await lun.volume.read(lba, n)
        merged = (int.from_bytes(current, "big") | int.from_bytes(mask, "big")).to_bytes(size, "big")
        lun.all_deallocated = False
        await lun.volume.write(lba, merged, fua=bool(cdb[1] & _FUA) or not lun.mode.wce)
    finally:
        lun.locks.release(token)
    return _GOOD


# ---- caches: SYNCHRONIZE CACHE (SBC-4 5.24, 5.25), PRE-FETCH (SBC-4 5.12, 5.13)

async def _sync(lun: Lun, lba: int, n: int) -> ScsiResult:
    _check_range(lun, lba, n)
    await lun.volume.flush()
    return _GOOD


async def sync_cache10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len10(cdb)
    return await _sync(lun, lba, n)


async def sync_cache16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len16(cdb)
    return await _sync(lun, lba, n)


def _prefetch(lun: Lun, lba: int, n: int) -> ScsiResult:
    _check_range(lun, lba, n)
    # the blocks are in memory already or as near as this LU can bring them: CONDITION MET when the range
    # fits what we call the cache (MAXIMUM PREFETCH LENGTH), GOOD otherwise
    if n and n <= lun.limits.max_prefetch:
        return ScsiResult(CONDITION_MET)
    return _GOOD


async def prefetch10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len10(cdb)
    return _prefetch(lun, lba, n)


async def prefetch16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len16(cdb)
    return _prefetch(lun, lba, n)


# ---- capacity and provisioning status

async def read_capacity10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """READ CAPACITY(10) (SBC-4 5.20): FFFFFFFFh when the last LBA does not fit in 32 bits."""
    if not cdb[8] & 0x01 and u32(cdb, 2):   # an LBA without PMI
        raise invalid_field(2)
    last = lun.num_blocks - 1
    return ScsiResult(GOOD, struct.pack(">II", min(last, 0xFFFFFFFF), lun.block_size))


async def read_capacity16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """READ CAPACITY(16) (SBC-4 5.21): LBPME set (every stack here deallocates or zeroes on UNMAP, as VPD
    B2h's LBPU/LBPWS say, thin provisioned or not), LBPRZ as B2h has it, LOGICAL BLOCKS PER PHYSICAL BLOCK."""
    if not cdb[14] & 0x01 and u64(cdb, 2):
        raise invalid_field(2)
    alloc = u32(cdb, 10)
    flags = 0x8000 | (0x4000 if lun.lbprz else 0)
    out = struct.pack(">QIBBH", lun.num_blocks - 1, lun.block_size, 0, lun.lbppb_exponent, flags) + bytes(16)
    return ScsiResult(GOOD, out[:alloc])


async def read_defect_data10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """READ DEFECT DATA(10) (SBC-4 5.18): no defects, in whatever list format was asked for."""
    out = bytes((0, cdb[2] & 0x1F, 0, 0))
    return ScsiResult(GOOD, out[:u16(cdb, 7)])


async def read_defect_data12(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """READ DEFECT DATA(12) (SBC-4 5.19)."""
    out = bytes((0, cdb[1] & 0x1F, 0, 0, 0, 0, 0, 0))
    return ScsiResult(GOOD, out[:u32(cdb, 6)])


# ---- Data-Out lengths (what the transport must collect before execute)

def _blocks(decode: Callable[[bytes], tuple[int, int]]) -> Callable[[bytes, int], int]:
    def length(cdb: bytes, bs: int) -> int:
        return decode(cdb)[1] * bs
    return length


def _verify_out(decode: Callable[[bytes], tuple[int, int]]) -> Callable[[bytes, int], int]:
    def length(cdb: bytes, bs: int) -> int:
        bytchk = (cdb[1] >> 1) & 0x03
        n = decode(cdb)[1]
        return n * bs if bytchk == 1 else (bs if bytchk == 3 and n else 0)
    return length


DATA_OUT: dict[int, Callable[[bytes, int], int]] = {
    0x0A: _blocks(lba_len6), 0x2A: _blocks(lba_len10), 0xAA: _blocks(lba_len12), 0x8A: _blocks(lba_len16),
    0x2E: _blocks(lba_len10), 0xAE: _blocks(lba_len12), 0x8E: _blocks(lba_len16),
    0x2F: _verify_out(lba_len10), 0xAF: _verify_out(lba_len12), 0x8F: _verify_out(lba_len16),
    0x8B: _blocks(lba_len16), 0x9C: _blocks(lba_len_atomic16),
    0x89: lambda cdb, bs: 2 * cdb[13] * bs,
}

HANDLERS: dict[tuple[int, int | None], Handler] = {
    (0x08, None): read6, (0x28, None): read10, (0xA8, None): read12, (0x88, None): read16,
    (0x0A, None): write6, (0x2A, None): write10, (0xAA, None): write12, (0x8A, None): write16,
    (0x9C, None): write_atomic16,
    (0x2F, None): verify10, (0xAF, None): verify12, (0x8F, None): verify16,
    (0x2E, None): write_verify10, (0xAE, None): write_verify12, (0x8E, None): write_verify16,
    (0x89, None): compare_and_write, (0x8B, None): orwrite16,
    (0x35, None): sync_cache10, (0x91, None): sync_cache16,
    (0x34, None): prefetch10, (0x90, None): prefetch16,
    (0x25, None): read_capacity10, (0x9E, 0x10): read_capacity16,
    (0x37, None): read_defect_data10, (0xB7, None): read_defect_data12,
}

__all__ = ["DATA_OUT", "HANDLERS", "ILLEGAL_REQUEST", "admit_rw", "first_difference"]
