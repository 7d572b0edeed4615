"""Logical block provisioning (SBC-4 4.7): WRITE SAME, UNMAP, GET LBA STATUS, and SANITIZE."""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from openvsan.protocol.scsi.cdb import lba_len10, lba_len16, u16, u32, u64
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.sbc import _CHUNK, _GOOD, _check_range, _data
from openvsan.protocol.scsi.sense import (
    GOOD,
    ScsiResult,
    invalid_field,
    invalid_param,
    lba_out_of_range,
    param_list_length_error,
    write_protected,
)

if TYPE_CHECKING:
    from openvsan.protocol.scsi.lun import Lun

Handler = Callable[["Lun", bytes, memoryview, Nexus], Awaitable[ScsiResult]]


# ---- WRITE SAME (SBC-4 5.49, 5.50) and UNMAP (SBC-4 5.32)

async def _write_same(lun: Lun, cdb: bytes, lba: int, n: int, data: memoryview, *, ndob: bool,
                      nfield: int) -> ScsiResult:
    unmap = bool(cdb[1] & 0x08)
    if lun.write_protected:
        raise write_protected()
    if not n:
        # WSNZ clear: zero blocks means "to the last LBA", within MAXIMUM WRITE SAME LENGTH
        if lba > lun.num_blocks:
            raise lba_out_of_range()
        n = lun.num_blocks - lba
        if n > lun.limits.max_write_same:
            raise invalid_field(nfield)
    _check_range(lun, lba, n)
    if n > lun.limits.max_write_same:
        raise invalid_field(nfield)
    if not n:
        return _GOOD
    bs = lun.block_size
    block = bytes(bs) if ndob else bytes(_data(lun, data, bs))
    token = await lun.locks.acquire(lba, lba + n)
    try:
        await _fill(lun, lba, n, block, unmap=unmap)
    finally:
        lun.locks.release(token)
    return _GOOD


async def _fill(lun: Lun, lba: int, n: int, block: bytes, *, unmap: bool) -> None:
    """Write one block's content over a range: zeros become unmap/write_zeroes, the rest big chunks."""
    dev, bs = lun.volume, lun.block_size
    if block.count(0) == bs:
        if unmap and lun.lbprz:
            await dev.unmap(lba, n)
        else:
            await dev.write_zeroes(lba, n)
        if lba == 0 and n == lun.num_blocks:
            lun.all_deallocated = True
        return
    lun.all_deallocated = False
    per = max(1, min(n, _CHUNK // bs))
    buf = block * per
    done = 0
    while done < n:
        k = min(per, n - done)
        await dev.write(lba + done, buf if k == per else buf[:k * bs], fua=not lun.mode.wce)
        done += k


async def write_same10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len10(cdb)
    return await _write_same(lun, cdb, lba, n, data, ndob=False, nfield=7)


async def write_same16(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    lba, n = lba_len16(cdb)
    return await _write_same(lun, cdb, lba, n, data, ndob=bool(cdb[1] & 0x01), nfield=10)


async def unmap(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """UNMAP (SBC-4 5.32): every descriptor is checked before any block is touched."""
    if lun.write_protected:
        raise write_protected()
    plen = u16(cdb, 7)
    if plen == 0:
        return _GOOD
    if plen < 8:
        raise param_list_length_error()
    params = bytes(_data(lun, data, plen))
    bddl = u16(params, 2)
    if bddl % 16 and bddl > len(params) - 8:
        raise param_list_length_error()
    count = min(bddl, len(params) - 8) // 16
    if count > lun.limits.max_unmap_descriptors:
        raise invalid_param(2)
    ranges = []
    total = 0
    for i in range(count):
        off = 8 + 16 * i
        lba, n = struct.unpack_from(">QI", params, off)
        if lba + n > lun.num_blocks:
            raise lba_out_of_range()
        if n > lun.limits.max_unmap_lbas:
            raise invalid_param(off + 8)
        total += n
        if n:
            ranges.append((lba, n))
    if total > lun.limits.max_unmap_lbas:
        raise invalid_param(8)
    if ranges == [(0, lun.num_blocks)]:
        lun.all_deallocated = True
    for lba, n in ranges:
        token = await lun.locks.acquire(lba, lba + n)
        try:
            await lun.volume.unmap(lba, n)
        finally:
            lun.locks.release(token)
    return _GOOD


_SCAN_CHUNK = 8 << 20     # bytes read at a time by the GET LBA STATUS zero scan
_SCAN_LIMIT = 4 << 20     # and at most this much per command: a descriptor may end before the run does
_SUB = 64 << 10           # zero-filled sub-chunks are taken whole


async def get_lba_status(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """GET LBA STATUS (SBC-4 5.6). A stack with extents (capabilities.extents: a thin or thick logical
    volume) answers from its map (lba_status(lba, blocks) -> [(lba, blocks, status)], status 0 mapped,
    1 deallocated), one descriptor per extent from the starting LBA on; otherwise blocks that read as zero
    are reported deallocated, which LBPRZ makes indistinguishable from real deallocation. As many
    descriptors as ALLOCATION LENGTH has room for (at least one: the data is then cut short), none longer
    than its 32-bit NUMBER OF LOGICAL BLOCKS field."""
    lba, alloc = u64(cdb, 2), u32(cdb, 10)
    if lba >= lun.num_blocks:
        raise lba_out_of_range()
    max_desc = max(1, (alloc - 8) // 16)
    if lun.volume.capabilities.extents:
        extents = list(await lun.volume.lba_status(lba, lun.num_blocks - lba))  # type: ignore[call-overload]
    elif lun.lbprz and lun.all_deallocated:
        extents = [(lba, lun.num_blocks - lba, 1)]
    elif lun.lbprz:
        extents = await _zero_extents(lun, lba, max_desc)
    else:
        extents = [(lba, lun.num_blocks - lba, 0)]
    body = b"".join(struct.pack(">QIB3x", s, c, st) for s, c, st in _descriptors(extents, max_desc))
    out = struct.pack(">I4x", 4 + len(body)) + body
    return ScsiResult(GOOD, out[:alloc])


_MAX_DESCRIPTOR_BLOCKS = 0xFFFFFFFF   # NUMBER OF LOGICAL BLOCKS is 32 bits (SBC-4 5.6.3)


def _descriptors(extents: list[tuple[int, int, int]], max_desc: int) -> list[tuple[int, int, int]]:
    """At most max_desc (lba, blocks, status) descriptors, an extent too long for one split over several."""
    out: list[tuple[int, int, int]] = []
    for start, count, status in extents:
        while count > 0:
            if len(out) >= max_desc:
                return out
            n = min(count, _MAX_DESCRIPTOR_BLOCKS)
            out.append((start, n, status))
            start += n
            count -= n
    return out


async def _zero_extents(lun: Lun, lba: int, max_desc: int) -> list[tuple[int, int, int]]:
    """Runs of mapped (0) and deallocated (1) blocks from lba on, read in big chunks, until max_desc runs
    are complete or the scan limit is reached."""
    bs = lun.block_size
    end = min(lun.num_blocks, lba + _SCAN_LIMIT // bs)
    per_read = _SCAN_CHUNK // bs
    runs: list[list[int]] = []   # [start, count, state]

    def add(start: int, count: int, state: int) -> None:
        if runs and runs[-1][2] == state:
            runs[-1][1] += count
        else:
            runs.append([start, count, state])

    pos = lba
    while pos < end and len(runs) <= max_desc:
        k = min(per_read, end - pos)
        buf = bytes(await lun.volume.read(pos, k))
        for off in range(0, len(buf), _SUB):
            stop = min(len(buf), off + _SUB)
            if buf.count(0, off, stop) == stop - off:
                add(pos + off // bs, (stop - off) // bs, 1)
                continue
            for b in range(off, stop, bs):
                add(pos + b // bs, 1, 1 if buf.count(0, b, b + bs) == bs else 0)
        pos += k
    return [(s, c, st) for s, c, st in runs]


# ---- SANITIZE (SBC-4 5.23): a RAM or thin device erases by deallocating or overwriting

async def sanitize(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    sa = cdb[1] & 0x1F
    plen = u16(cdb, 7)
    if lun.write_protected:
        raise write_protected()
    if sa == 0x1F:   # EXIT FAILURE MODE: we never enter it
        if plen:
            raise invalid_field(7)
        return _GOOD
    if sa == 0x01:   # OVERWRITE: parameter list with the pattern (SBC-4 5.23.3)
        if plen < 5 or plen > lun.block_size + 4:
            raise invalid_field(7)
        params = bytes(_data(lun, data, plen))
        count = params[0] & 0x1F
        pattern_len = u16(params, 2)
        if not count:
            raise invalid_param(0)
        if pattern_len == 0 or pattern_len > lun.block_size or pattern_len + 4 != plen:
            raise invalid_param(2)
        pattern = params[4:4 + pattern_len]
        if params[0] & 0x80:  # INVERT between passes: the last pass decides what stays
            pattern = bytes(b ^ 0xFF for b in pattern) if count % 2 == 0 else pattern
        block = (pattern * (lun.block_size // pattern_len + 1))[:lun.block_size]
        token = await lun.locks.acquire(0, lun.num_blocks, exclusive=True)
        try:
            await _fill(lun, 0, lun.num_blocks, block, unmap=False)
            await lun.volume.flush()
        finally:
            lun.locks.release(token)
        return _GOOD
    if plen:
        raise invalid_field(7)
    # BLOCK ERASE and CRYPTOGRAPHIC ERASE: every block deallocated, reads return zeros
    token = await lun.locks.acquire(0, lun.num_blocks, exclusive=True)
    try:
        await lun.volume.unmap(0, lun.num_blocks)
        await lun.volume.flush()
        lun.all_deallocated = True
    finally:
        lun.locks.release(token)
    return _GOOD


def _write_same_out(cdb: bytes, bs: int) -> int:
    return 0 if cdb[0] == 0x93 and cdb[1] & 0x01 else bs


DATA_OUT: dict[int, Callable[[bytes, int], int]] = {
    0x41: _write_same_out, 0x93: _write_same_out,
    0x42: lambda cdb, bs: u16(cdb, 7),
    0x48: lambda cdb, bs: u16(cdb, 7),
}

HANDLERS: dict[tuple[int, int | None], Handler] = {
    (0x41, None): write_same10, (0x93, None): write_same16, (0x42, None): unmap,
    (0x9E, 0x12): get_lba_status,
    (0x48, 0x01): sanitize, (0x48, 0x02): sanitize, (0x48, 0x03): sanitize, (0x48, 0x1F): sanitize,
}
