"""EXTENDED COPY (LID1) and RECEIVE COPY RESULTS (SPC-4 6.4, 6.22): block-to-block copies between logical
units of this target, named by their NAA/T10 designators (identification target descriptors, E4h)."""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from openvsan.protocol.scsi import inquiry as inq
from openvsan.protocol.scsi.cdb import u32
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.sense import (
    ASC_COPY_TARGET_DEVICE_NOT_REACHABLE,
    ASC_NO_ADDITIONAL,
    ASC_TOO_MANY_SEGMENT_DESCRIPTORS,
    ASC_TOO_MANY_TARGET_DESCRIPTORS,
    ASC_UNSUPPORTED_SEGMENT_DESCRIPTOR_TYPE,
    ASC_UNSUPPORTED_TARGET_DESCRIPTOR_TYPE,
    COPY_ABORTED,
    GOOD,
    ILLEGAL_REQUEST,
    ScsiError,
    ScsiResult,
    invalid_field,
    invalid_param,
    param_list_length_error,
    write_protected,
)

if TYPE_CHECKING:
    from openvsan.protocol.scsi.lun import Lun

Handler = Callable[["Lun", bytes, memoryview, Nexus], Awaitable[ScsiResult]]

MAX_TARGET_DESCRIPTORS = 2
MAX_SEGMENT_DESCRIPTORS = 16
MAX_DESCRIPTOR_LIST = 1024
IDENTIFICATION_TARGET = 0xE4
BLOCK_TO_BLOCK = 0x02
_CHUNK = 4 << 20

# what the copy of one list id left behind for RECEIVE COPY RESULTS: (status, segments, blocks)
CopyResult = tuple[int, int, int]


def _aborted(asc: int = ASC_COPY_TARGET_DEVICE_NOT_REACHABLE) -> ScsiError:
    return ScsiError(COPY_ABORTED, asc)


def _designator_of(desc: bytes) -> bytes:
    # SPC-4 6.4.6.2: bytes 4-23 of an identification target descriptor hold one designation descriptor
    length = desc[7]
    return bytes((desc[4] & 0x0F, desc[5] & 0x3F)) + desc[8:8 + min(length, 16)]


def _lun_designators(lun: Lun) -> list[bytes]:
    naa = inq.naa6(lun.uuid)
    t10 = inq.VENDOR.ljust(8) + lun.uuid.hex.encode()
    return [bytes((0x1, 0x03)) + naa, bytes((0x2, 0x01)) + t10[:16]]


def _find_lun(lun: Lun, designator: bytes) -> Lun | None:
    peers = list(lun.peers()) if lun.peers is not None else [lun]
    for candidate in peers:
        if designator in _lun_designators(candidate):
            return candidate
    return None


async def extended_copy(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """EXTENDED COPY(LID1) (SPC-4 6.4): everything is checked before the first block moves."""
    plen = u32(cdb, 10)
    if plen == 0:
        return ScsiResult(GOOD)
    if plen < 16 or len(data) < plen:
        raise param_list_length_error()
    params = bytes(data[:plen])
    list_id, usage = params[0], (params[1] >> 3) & 0x03
    tdl, sdl, inline = struct.unpack_from(">H4xII", params, 2)
    if params[1] & 0x20:   # STR: the sequential striped bit belongs to stream devices
        raise invalid_param(1, 5)
    if usage == 1:
        raise invalid_param(1, 4)
    if 16 + tdl + sdl + inline > plen:
        raise param_list_length_error()
    if tdl + sdl > MAX_DESCRIPTOR_LIST:
        raise param_list_length_error()
    if inline:
        raise invalid_param(12)
    if tdl % 32:
        raise invalid_param(2)
    if tdl // 32 > MAX_TARGET_DESCRIPTORS:
        raise ScsiError(ILLEGAL_REQUEST, ASC_TOO_MANY_TARGET_DESCRIPTORS)
    targets: list[Lun | None] = []
    for off in range(16, 16 + tdl, 32):
        desc = params[off:off + 32]
        if desc[0] != IDENTIFICATION_TARGET:
            raise ScsiError(ILLEGAL_REQUEST, ASC_UNSUPPORTED_TARGET_DESCRIPTOR_TYPE, field=off, in_cdb=False)
        if desc[1] & 0x1F != 0:   # only block devices
            raise invalid_param(off + 1)
        target = _find_lun(lun, _designator_of(desc))
        if target is not None and (desc[29] << 16 | desc[30] << 8 | desc[31]) != target.block_size:
            raise invalid_param(off + 29)
        targets.append(target)
    segments: list[tuple[Lun, int, Lun, int, int]] = []
    off = 16 + tdl
    end = off + sdl
    while off < end:
        if end - off < 4:
            raise param_list_length_error()
        kind, dlen = params[off], struct.unpack_from(">H", params, off + 2)[0] + 4
        if kind != BLOCK_TO_BLOCK:
            raise ScsiError(ILLEGAL_REQUEST, ASC_UNSUPPORTED_SEGMENT_DESCRIPTOR_TYPE, field=off, in_cdb=False)
        if len(segments) >= MAX_SEGMENT_DESCRIPTORS:
            raise ScsiError(ILLEGAL_REQUEST, ASC_TOO_MANY_SEGMENT_DESCRIPTORS)
        if dlen != 0x1C or off + dlen > end:
            raise param_list_length_error()
        src_i, dst_i, nblocks, src_lba, dst_lba = struct.unpack_from(">HHxxHQQ", params, off + 4)
        dc = params[off + 1] & 0x02
        if src_i >= len(targets) or dst_i >= len(targets):
            raise _aborted()
        src, dst = targets[src_i], targets[dst_i]
        if src is None or dst is None:
            raise _aborted()
        if dc:   # NUMBER OF BLOCKS counts destination blocks
            nblocks = nblocks * dst.block_size // src.block_size
        if src_lba + nblocks > src.num_blocks or \
                dst_lba + nblocks * src.block_size // dst.block_size > dst.num_blocks:
            raise _aborted(ASC_NO_ADDITIONAL)
        if dst.write_protected:
            raise write_protected()
        segments.append((src, src_lba, dst, dst_lba, nblocks))
        off += dlen
    copied = 0
    for n, (src, src_lba, dst, dst_lba, nblocks) in enumerate(segments):
        per = max(1, _CHUNK // src.block_size)
        done = 0
        while done < nblocks:
            k = min(per, nblocks - done)
            chunk = await src.volume.read(src_lba + done, k)
            d_lba = dst_lba + done * src.block_size // dst.block_size
            d_n = k * src.block_size // dst.block_size
            token = await dst.locks.acquire(d_lba, d_lba + d_n)
            try:
                dst.all_deallocated = False
                await dst.volume.write(d_lba, chunk, fua=not dst.mode.wce)
            finally:
                dst.locks.release(token)
            done += k
            copied += k
        if usage == 0:
            lun.copy_results[(nexus, list_id)] = (0x00, n + 1, copied)
    if usage == 0:
        lun.copy_results[(nexus, list_id)] = (0x01, len(segments), copied)
    return ScsiResult(GOOD)


async def copy_status(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """RECEIVE COPY RESULTS, COPY STATUS (SPC-4 6.22.3)."""
    result = lun.copy_results.get((nexus, cdb[2]))
    if result is None:
        raise invalid_field(2)
    status, segments, blocks = result
    # transfer count in logical blocks of the copy manager's LU (units F1h: 512... use bytes to be plain)
    out = struct.pack(">IBHBI", 8, status, segments, 0, min(blocks * lun.block_size, 0xFFFFFFFF))
    return ScsiResult(GOOD, out[:u32(cdb, 10)])


async def operating_parameters(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """RECEIVE COPY RESULTS, OPERATING PARAMETERS (SPC-4 6.22.4)."""
    types = bytes((BLOCK_TO_BLOCK, IDENTIFICATION_TARGET))
    body = struct.pack(">B3xHHIIIIIxxHBBBB3xB", 0x01, MAX_TARGET_DESCRIPTORS, MAX_SEGMENT_DESCRIPTORS,
                       MAX_DESCRIPTOR_LIST, 0xFFFF * lun.block_size, 0, 0, 0, 1, 1, 0, 0, 0,
                       len(types)) + types
    out = struct.pack(">I", len(body)) + body
    return ScsiResult(GOOD, out[:u32(cdb, 10)])


HANDLERS: dict[tuple[int, int | None], Handler] = {
    (0x83, 0x00): extended_copy,
    (0x84, 0x00): copy_status,
    (0x84, 0x03): operating_parameters,
}
DATA_OUT: dict[int, Callable[[bytes, int], int]] = {
    0x83: lambda cdb, bs: u32(cdb, 10),
}
