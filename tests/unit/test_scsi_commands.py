"""SPC-4/SBC-4 command handling, driven through ScsiTarget.execute with CDB bytes over a RamDevice."""

from __future__ import annotations

import asyncio
import struct
import uuid
from typing import Any

import pytest

from openvsan.block.errors import Busy, MediumError, NoSpace
from openvsan.block.ram import RamDevice
from openvsan.protocol.scsi import (
    BUSY,
    CHECK_CONDITION,
    CONDITION_MET,
    GOOD,
    Lun,
    Nexus,
    ScsiResult,
    ScsiTarget,
    parse_sense,
)
from openvsan.volume import Volume

BLOCKS = 4096
IQN = "iqn.2026-11.org.openvsan:test"
NX = Nexus("iqn.2026-11.org.openvsan.test:init1", 0x23D000000001, IQN)


class Harness:
    def __init__(self, **lun_kw: Any) -> None:
        self.dev = lun_kw.pop("device", None) or RamDevice(BLOCKS)
        self.lun = Lun(Volume(self.dev, name="disk0", uuid=uuid.UUID(int=0x1234), serial="SER0"), **lun_kw)
        self.target = ScsiTarget(IQN, {0: self.lun})

    def run(self, cdb: bytes | list[int], data: bytes = b"", nexus: Nexus = NX, lun: int = 0) -> ScsiResult:
        cdb = bytes(cdb)
        return asyncio.run(self.target.execute(lun, cdb, memoryview(data), nexus))

    def ok(self, cdb: bytes | list[int], data: bytes = b"", nexus: Nexus = NX) -> bytes:
        r = self.run(cdb, data, nexus)
        assert r.status == GOOD, parse_sense(r.sense) if r.sense else r.status
        return bytes(r.data)

    def sense(self, cdb: bytes | list[int], data: bytes = b"", nexus: Nexus = NX) -> tuple[int, int]:
        r = self.run(cdb, data, nexus)
        assert r.status == CHECK_CONDITION, r.status
        assert r.sense[0] & 0x7F == 0x70 and len(r.sense) >= 18
        return parse_sense(r.sense)


def rw10(op: int, lba: int, n: int, flags: int = 0) -> bytes:
    return struct.pack(">BBIBHB", op, flags, lba, 0, n, 0)


def rw16(op: int, lba: int, n: int, flags: int = 0) -> bytes:
    return struct.pack(">BBQIBB", op, flags, lba, n, 0, 0)


ILLEGAL, INVALID_FIELD, LBA_OOR, INVALID_OP = 5, 0x2400, 0x2100, 0x2000


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_inquiry_standard_and_vpd(h: Harness) -> None:
    std = h.ok([0x12, 0, 0, 0, 255, 0])
    assert std[0] == 0 and std[2] == 6 and std[3] & 0x0F == 2 and std[4] == len(std) - 5
    assert std[8:16] == b"OPENVSAN"
    assert 0x04C0 in struct.unpack_from(">8H", std, 58)
    pages = h.ok([0x12, 1, 0, 0, 255, 0])
    assert list(pages[4:]) == [0, 0x80, 0x83, 0xB0, 0xB1, 0xB2]
    assert h.ok([0x12, 1, 0x80, 0, 255, 0])[4:] == b"SER0"
    ids = h.ok([0x12, 1, 0x83, 0, 255, 0])
    assert ids[4] & 0x0F == 1 and ids[5] == 0x03 and ids[8] >> 4 == 6   # binary NAA-6 for the LU first
    assert h.ok([0x12, 1, 0x83, 0, 255, 0]) == ids                         # stable
    bl = h.ok([0x12, 1, 0xB0, 0, 255, 0])
    assert len(bl) == 64 and bl[3] == 0x3C and bl[5] == 255
    assert h.ok([0x12, 1, 0xB1, 0, 255, 0])[5] == 1
    assert h.ok([0x12, 1, 0xB2, 0, 255, 0])[5] & 0xE0 == 0xE0
    assert h.ok([0x12, 0, 0, 0, 7, 0]) == std[:7]           # ALLOCATION LENGTH truncates
    assert h.sense([0x12, 0, 0x80, 0, 255, 0]) == (ILLEGAL, INVALID_FIELD)   # page without EVPD
    assert h.sense([0x12, 1, 0x42, 0, 255, 0]) == (ILLEGAL, INVALID_FIELD)


def test_invalid_field_points_at_the_bit(h: Harness) -> None:
    r = h.run([0x28, 0x20, 0, 0, 0, 0, 0, 0, 1, 0])   # RDPROTECT without protection information
    assert parse_sense(r.sense) == (ILLEGAL, INVALID_FIELD)
    assert r.sense[15] == 0x80 | 0x40 | 0x08 | 5 and r.sense[16:18] == b"\x00\x01"


def test_unknown_opcode_and_absent_lun(h: Harness) -> None:
    assert h.sense([0xC0, 0, 0, 0, 0, 0]) == (ILLEGAL, INVALID_OP)
    absent = asyncio.run(h.target.execute(5, bytes([0x12, 0, 0, 0, 96, 0]), memoryview(b""), NX))
    assert absent.status == GOOD and absent.data[0] == 0x7F
    r = asyncio.run(h.target.execute(5, bytes([0, 0, 0, 0, 0, 0]), memoryview(b""), NX))
    assert parse_sense(r.sense) == (ILLEGAL, 0x2500)
    r = asyncio.run(h.target.execute(5, bytes([3, 0, 0, 0, 18, 0]), memoryview(b""), NX))
    assert r.status == GOOD and parse_sense(bytes(r.data)) == (ILLEGAL, 0x2500)
    assert h.target.data_out_length(5, rw10(0x2A, 0, 1)) == 0


def test_report_luns() -> None:
    luns = {n: Lun(Volume(RamDevice(64), name=f"d{n}", uuid=uuid.uuid4(), serial=str(n))) for n in (0, 3, 300)}
    t = ScsiTarget(IQN, luns)
    r = asyncio.run(t.execute(7, bytes([0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]), memoryview(b""), NX))
    assert r.status == GOOD
    assert struct.unpack_from(">I", r.data)[0] == 24
    assert bytes(r.data[8:]) == bytes(8) + b"\x00\x03" + bytes(6) + b"\x41\x2c" + bytes(6)


def test_read_capacity(h: Harness) -> None:
    assert h.ok([0x25] + [0] * 9) == struct.pack(">II", BLOCKS - 1, 512)
    rc16 = h.ok([0x9E, 0x10] + [0] * 8 + [0, 0, 0, 32, 0, 0])
    lba, bs, _, exp, flags = struct.unpack_from(">QIBBH", rc16)
    assert (lba, bs, exp) == (BLOCKS - 1, 512, 3) and flags & 0xC000 == 0xC000
    assert len(h.ok([0x9E, 0x10] + [0] * 8 + [0, 0, 0, 5, 0, 0])) == 5


def test_read_write_roundtrip_and_limits(h: Harness) -> None:
    data = bytes(range(256)) * 8
    h.ok(rw10(0x2A, 10, 4, 0x08), data)
    assert h.ok(rw10(0x28, 10, 4, 0x18)) == data
    assert h.ok(rw16(0x88, 10, 4)) == data
    assert h.ok(struct.pack(">BBIIBB", 0xA8, 0, 10, 4, 0, 0)) == data
    assert h.ok([0x08, 0, 0, 10, 4, 0]) == data
    assert h.ok(rw10(0x28, 0, 0)) == b""
    assert h.sense(rw10(0x28, BLOCKS - 1, 2)) == (ILLEGAL, LBA_OOR)
    assert h.sense(rw10(0x28, BLOCKS + 1, 0)) == (ILLEGAL, LBA_OOR)
    assert h.sense(rw16(0x88, 2**64 - 1, 1)) == (ILLEGAL, LBA_OOR)
    assert h.sense(rw10(0x2A, 0, 2), b"x" * 512) == (ILLEGAL, INVALID_FIELD)   # short Data-Out
    assert h.target.data_out_length(0, [0x0A, 0, 0, 0, 0, 0]) == 256 * 512     # WRITE(6) 0 = 256
    assert h.target.data_out_length(0, rw16(0x8A, 0, 3)) == 3 * 512


def test_fua_reaches_the_device(h: Harness) -> None:
    seen: list[bool] = []
    orig = h.dev.write

    async def write(lba: int, data: Any, *, fua: bool = False) -> None:
        seen.append(fua)
        await orig(lba, data, fua=fua)
    h.dev.write = write  # type: ignore[method-assign]
    h.ok([0x15, 0x10, 0, 0, 24, 0], bytes(4) + bytes((0x08, 18)) + bytes(18))   # WCE off
    h.ok(rw10(0x2A, 0, 1), bytes(512))
    h.ok([0x15, 0x10, 0, 0, 24, 0], bytes(4) + bytes((0x08, 18, 0x04)) + bytes(17))   # WCE on
    h.ok(rw10(0x2A, 0, 1), bytes(512))
    h.ok(rw10(0x2A, 0, 1, 0x08), bytes(512))
    assert seen == [True, False, True]


def test_read_only_lun() -> None:
    h = Harness(read_only=True)
    assert h.sense(rw10(0x2A, 0, 1), bytes(512)) == (7, 0x2700)
    assert h.sense([0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0], bytes(24)) == (7, 0x2700)
    assert h.ok([0x1A, 0, 0x3F, 0, 255, 0])[2] & 0x80   # WP in the mode parameter header


def test_verify(h: Harness) -> None:
    data = b"v" * 1024
    h.ok(rw10(0x2A, 0, 2), data)
    h.ok(rw10(0x2F, 0, 2, 0x00))                        # BYTCHK 0: medium only
    h.ok(rw10(0x2F, 0, 2, 0x02), data)
    bad = bytearray(data)
    bad[700] ^= 1
    r = h.run(rw10(0x2F, 0, 2, 0x02), bytes(bad))
    assert parse_sense(r.sense) == (0x0E, 0x1D00) and r.sense[0] & 0x80 and r.sense[3:7] == struct.pack(">I", 700)
    h.ok(rw10(0x2F, 0, 2, 0x06), b"v" * 512)            # BYTCHK 11b: one block against each
    assert h.sense(rw10(0x2F, 0, 2, 0x04)) == (ILLEGAL, INVALID_FIELD)
    h.ok(rw16(0x8E, 4, 1, 0x02), b"w" * 512)            # WRITE AND VERIFY(16)
    assert h.ok(rw10(0x28, 4, 1)) == b"w" * 512


def test_compare_and_write(h: Harness) -> None:
    h.ok(rw10(0x2A, 8, 1), b"a" * 512)
    caw = struct.pack(">BBQ3xBBB", 0x89, 0, 8, 1, 0, 0)
    assert h.target.data_out_length(0, caw) == 1024
    h.ok(caw, b"a" * 512 + b"b" * 512)
    assert h.ok(rw10(0x28, 8, 1)) == b"b" * 512
    r = h.run(caw, b"a" * 100 + b"b" * 412 + b"c" * 512)
    assert parse_sense(r.sense) == (0x0E, 0x1D00) and struct.unpack_from(">I", r.sense, 3)[0] == 0
    assert h.ok(rw10(0x28, 8, 1)) == b"b" * 512
    assert h.sense(struct.pack(">BBQ3xBBB", 0x89, 0, 8, 0, 0, 0) [:13] + b"\xff\x00\x00") == (ILLEGAL, INVALID_FIELD)
    h.ok(struct.pack(">BBQ3xBBB", 0x89, 0, 8, 0, 0, 0))   # zero blocks: nothing to do


def test_orwrite(h: Harness) -> None:
    h.ok(rw10(0x2A, 0, 1), b"\x0f" * 512)
    h.ok(rw16(0x8B, 0, 1), b"\xf0" * 512)
    assert h.ok(rw10(0x28, 0, 1)) == b"\xff" * 512


def test_write_same_and_unmap(h: Harness) -> None:
    h.ok(rw10(0x41, 100, 50), b"\x5a" * 512)
    assert h.ok(rw10(0x28, 100, 50)) == b"\x5a" * 512 * 50
    h.ok(rw10(0x41, 100, 50, 0x08), bytes(512))          # UNMAP bit
    assert h.ok(rw10(0x28, 100, 50)) == bytes(512 * 50)
    h.ok(rw10(0x2A, 200, 2), b"x" * 1024)
    h.ok(rw16(0x93, 200, 2, 0x09))                         # NDOB: zeros, no Data-Out
    assert h.target.data_out_length(0, rw16(0x93, 200, 2, 0x09)) == 0
    assert h.ok(rw10(0x28, 200, 2)) == bytes(1024)
    h.ok(rw10(0x41, BLOCKS - 3, 0), b"e" * 512)            # 0 blocks: to the end (WSNZ clear)
    assert h.ok(rw10(0x28, BLOCKS - 3, 3)) == b"e" * 1536
    assert h.sense(rw10(0x41, 0, 1, 0x10), b"e" * 512) == (ILLEGAL, INVALID_FIELD)   # ANCHOR
    h.ok(rw10(0x2A, 300, 4), b"u" * 2048)
    params = struct.pack(">HH4x", 22, 16) + struct.pack(">QI4x", 300, 4)
    h.ok([0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0], params)
    assert h.ok(rw10(0x28, 300, 4)) == bytes(2048)
    beyond = struct.pack(">HH4x", 22, 16) + struct.pack(">QI4x", BLOCKS - 1, 2)
    assert h.sense([0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0], beyond) == (ILLEGAL, LBA_OOR)
    assert h.sense([0x42, 0, 0, 0, 0, 0, 0, 0, 4, 0], params[:4]) == (ILLEGAL, 0x1A00)
    h.ok([0x42, 0, 0, 0, 0, 0, 0, 0, 0, 0])


def test_get_lba_status(h: Harness) -> None:
    h.ok(rw10(0x2A, 16, 8), b"m" * 4096)
    out = h.ok(struct.pack(">BBQIBB", 0x9E, 0x12, 0, 1024, 0, 0))
    descs = [struct.unpack_from(">QIB", out, 8 + 16 * i) for i in range((len(out) - 8) // 16)]
    assert descs[:3] == [(0, 16, 1), (16, 8, 0), (24, BLOCKS - 24, 1)]
    assert h.sense(struct.pack(">BBQIBB", 0x9E, 0x12, BLOCKS, 24, 0, 0)) == (ILLEGAL, LBA_OOR)


def test_sync_cache_prefetch_defects(h: Harness) -> None:
    h.ok(rw10(0x35, 0, 0))
    h.ok(rw16(0x91, 0, 8))
    assert h.run(rw10(0x34, 0, 8)).status == CONDITION_MET
    assert h.sense(rw16(0x90, BLOCKS, 1)) == (ILLEGAL, LBA_OOR)
    assert h.ok([0x37, 0, 0x08, 0, 0, 0, 0, 0, 4, 0]) == bytes((0, 0x08, 0, 0))
    h.ok([0x00] * 6)


def test_mode_sense_select(h: Harness) -> None:
    ms = h.ok([0x1A, 0, 0x3F, 0, 255, 0])
    assert ms[0] == len(ms) - 1 and ms[3] == 8
    assert struct.unpack_from(">II", ms, 4) == (BLOCKS, 512)
    assert ms[12] == 0x08 and ms[14] & 0x04                  # caching page first, WCE set
    ms10 = h.ok([0x5A, 0x18, 0x0A, 0, 0, 0, 0, 0, 255, 0])  # LLBAA, DBD: control page only
    assert struct.unpack_from(">H", ms10)[0] == len(ms10) - 2 and ms10[8] == 0x0A
    ch = h.ok([0x1A, 0x08, 0x48, 0, 255, 0])                 # changeable caching page
    assert ch[4:7] == bytes((0x08, 18, 0x04))
    assert h.sense([0x1A, 0, 0xC8, 0, 255, 0]) == (ILLEGAL, 0x3900)   # saved values
    assert h.sense([0x1A, 0, 0x05, 0, 255, 0]) == (ILLEGAL, INVALID_FIELD)
    # a non-changeable bit in MODE SELECT: INVALID FIELD IN PARAMETER LIST
    bad = bytes(4) + bytes((0x08, 18, 0x05)) + bytes(17)
    assert h.sense([0x15, 0x10, 0, 0, 24, 0], bad) == (ILLEGAL, 0x2600)


def test_software_write_protect(h: Harness) -> None:
    page = bytearray(bytes((0x0A, 10, 0, 0x10, 0x08, 0x40, 0, 0, 0xFF, 0xFF, 0, 0)))
    h.ok([0x15, 0x10, 0, 0, 16, 0], bytes(4) + bytes(page))
    assert h.sense(rw10(0x2A, 0, 1), bytes(512))[0] == 7
    page[4] = 0
    h.ok([0x15, 0x10, 0, 0, 16, 0], bytes(4) + bytes(page))
    h.ok(rw10(0x2A, 0, 1), bytes(512))


def test_report_supported_opcodes(h: Harness) -> None:
    out = h.ok([0xA3, 0x0C, 0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0])
    n = struct.unpack_from(">I", out)[0] // 8
    found = {(out[4 + 8 * i], struct.unpack_from(">H", out, 6 + 8 * i)[0]) for i in range(n)}
    assert (0x28, 0) in found and (0x9E, 0x10) in found and (0x5F, 7) in found
    one = h.ok([0xA3, 0x0C, 0x81, 0x28, 0, 0, 0, 0, 1, 0, 0, 0])
    assert one[1] & 0x07 == 3 and one[4:14] == bytes((0x28, 0x18, 255, 255, 255, 255, 0x1F, 255, 255, 0))
    assert one[14:16] == b"\x00\x0a"
    assert h.sense([0xA3, 0x0C, 0x01, 0x9E, 0, 0x10, 0, 0, 1, 0, 0, 0]) == (ILLEGAL, INVALID_FIELD)
    assert h.ok([0xA3, 0x0C, 0x02, 0x9E, 0, 0x10, 0, 0, 1, 0, 0, 0])[1] & 7 == 3
    assert h.ok([0xA3, 0x0C, 0x01, 0xC5, 0, 0, 0, 0, 1, 0, 0, 0])[1] & 7 == 1
    timeouts = h.ok([0xA3, 0x0C, 0x80, 0, 0, 0, 0, 0, 0x40, 0, 0, 0])
    assert timeouts[4 + 5] & 0x02 and struct.unpack_from(">H", timeouts, 12)[0] == 0x0A
    assert h.ok([0xA3, 0x0D, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0])[0] & 0x80


def test_block_errors_map_to_sense(h: Harness) -> None:
    async def failing_read(lba: int, blocks: int) -> bytes:
        raise MediumError("bad", lba=lba + 1)

    async def full(lba: int, data: Any, *, fua: bool = False) -> None:
        raise NoSpace("full")
    h.dev.read = failing_read  # type: ignore[method-assign]
    h.dev.write = full  # type: ignore[method-assign]
    r = h.run(rw10(0x28, 40, 1))
    assert parse_sense(r.sense) == (3, 0x1100) and struct.unpack_from(">I", r.sense, 3)[0] == 41
    assert h.sense(rw10(0x2A, 0, 1), bytes(512)) == (7, 0x2707)

    async def busy(lba: int, blocks: int) -> bytes:
        raise Busy()
    h.dev.read = busy  # type: ignore[method-assign]
    assert h.run(rw10(0x28, 0, 1)).status == BUSY


def test_sanitize() -> None:
    h = Harness(device=RamDevice(64))
    h.ok(rw10(0x2A, 0, 1), b"s" * 512)
    h.ok([0x48, 0x02, 0, 0, 0, 0, 0, 0, 0, 0])
    assert h.ok(rw10(0x28, 0, 1)) == bytes(512)
    pattern = bytes((0x01, 0, 0, 4)) + b"abcd"
    h.ok([0x48, 0x01, 0, 0, 0, 0, 0, 0, 8, 0], pattern)
    assert h.ok(rw10(0x28, 63, 1)) == b"abcd" * 128


def _xcopy_params(h: Harness, blocks: int, src: int, dst: int, list_id: int = 1) -> bytes:
    ids = h.ok([0x12, 1, 0x83, 0, 255, 0])
    naa = ids[4:8 + ids[7]]                                   # the first designator: NAA-6 for the LU
    target = bytes((0xE4, 0, 0, 0)) + naa + bytes(20 - len(naa)) + bytes(4) + b"\x00\x00\x02\x00"
    segment = struct.pack(">BBHHHxxHQQ", 0x02, 0, 0x18, 0, 0, blocks, src, dst)
    return struct.pack(">BBHxxxxII", list_id, 0, len(target), len(segment), 0) + target + segment


def test_extended_copy(h: Harness) -> None:
    h.ok(rw10(0x2A, 0, 4), b"C" * 2048)
    params = _xcopy_params(h, 4, 0, 100)
    cdb = struct.pack(">BB8xIBB", 0x83, 0, len(params), 0, 0)
    assert h.target.data_out_length(0, cdb) == len(params)
    h.ok(cdb, params)
    assert h.ok(rw10(0x28, 100, 4)) == b"C" * 2048
    status = h.ok(struct.pack(">BBB7xIBB", 0x84, 0, 1, 64, 0, 0))
    assert status[4] == 0x01 and struct.unpack_from(">H", status, 5)[0] == 1
    assert h.sense(struct.pack(">BBB7xIBB", 0x84, 0, 9, 64, 0, 0)) == (ILLEGAL, INVALID_FIELD)
    ops = h.ok(struct.pack(">BB8xIBB", 0x84, 3, 64, 0, 0))
    assert struct.unpack_from(">HH", ops, 8) == (2, 16)
    beyond = _xcopy_params(h, 4, 0, BLOCKS - 1)
    assert h.sense(struct.pack(">BB8xIBB", 0x83, 0, len(beyond), 0, 0), beyond)[0] == 0x0A   # COPY ABORTED
    short = params[:40]
    assert h.sense(struct.pack(">BB8xIBB", 0x83, 0, len(short), 0, 0), short) == (ILLEGAL, 0x1A00)


def test_removable_medium() -> None:
    h = Harness(removable=True)
    assert h.ok([0x12, 0, 0, 0, 36, 0])[1] & 0x80
    h.ok([0x1E, 0, 0, 0, 1, 0])                                             # PREVENT
    assert h.sense([0x1B, 0, 0, 0, 0x02, 0]) == (ILLEGAL, 0x5302)
    h.ok([0x1E, 0, 0, 0, 0, 0])
    h.ok([0x1B, 0, 0, 0, 0x02, 0])                                          # eject
    assert h.sense([0, 0, 0, 0, 0, 0]) == (2, 0x3A00)
    assert h.sense(rw10(0x28, 0, 1)) == (2, 0x3A00)
    h.ok([0x1B, 0, 0, 0, 0x03, 0])                                          # load
    h.ok([0, 0, 0, 0, 0, 0])


def test_exact_data_out_for_caw_and_write_same(h: Harness) -> None:
    caw = struct.pack(">BBQ3xBBB", 0x89, 0, 8, 1, 0, 0)
    r = asyncio.run(h.target.execute(0, caw, memoryview(bytes(1024)), NX, expected_length=2048))
    assert parse_sense(r.sense) == (ILLEGAL, INVALID_FIELD)
    ws = rw10(0x41, 0, 1)
    r = asyncio.run(h.target.execute(0, ws, memoryview(bytes(512)), NX, expected_length=1024))
    assert parse_sense(r.sense) == (ILLEGAL, INVALID_FIELD)
    r = asyncio.run(h.target.execute(0, ws, memoryview(bytes(512)), NX, expected_length=512))
    assert r.status == GOOD
