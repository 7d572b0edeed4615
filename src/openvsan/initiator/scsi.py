"""The SCSI commands an initiator sends, the data it reads back, and sense → typed block errors.

Sans-IO: CDBs in, parsed structures out. The transport (iSCSI) moves them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from openvsan.block.errors import BlockError, Busy, DeviceFailed, MediumError, NoSpace, OutOfRange, ReadOnly
from openvsan.protocol.scsi import sense as S

# SPC-4 / SBC-4 operation codes used here
TEST_UNIT_READY = 0x00
INQUIRY = 0x12
SYNCHRONIZE_CACHE_10 = 0x35
UNMAP = 0x42
READ_16 = 0x88
WRITE_16 = 0x8A
SYNCHRONIZE_CACHE_16 = 0x91
WRITE_SAME_16 = 0x93
SERVICE_ACTION_IN_16 = 0x9E
SA_READ_CAPACITY_16 = 0x10
REPORT_LUNS = 0xA0
MAINTENANCE_IN = 0xA3
SA_REPORT_TARGET_PORT_GROUPS = 0x0A


class ScsiCommandError(BlockError):
    """A command ended with a status the block layer has no better name for."""

    def __init__(self, message: str, status: int = S.CHECK_CONDITION, key: int = 0, asc: int = 0) -> None:
        super().__init__(message)
        self.status, self.key, self.asc = status, key, asc


class PathNotAccessible(Busy):
    """NOT READY, LOGICAL UNIT NOT ACCESSIBLE (SPC-4 5.15.2.4/5: the target port is in standby, unavailable or
    transitioning): this path serves no I/O now, another path to the LU may. `asc` says which."""

    def __init__(self, message: str, asc: int) -> None:
        super().__init__(message)
        self.asc = asc


# --- CDBs --------------------------------------------------------------------------------------------

def inquiry(page: int | None = None, alloc: int = 255) -> bytes:
    """SPC-4 6.6: standard data, or the VPD page `page` (EVPD=1)."""
    return struct.pack(">BBBHB", INQUIRY, 1 if page is not None else 0, page or 0, alloc, 0)


def read_capacity_16(alloc: int = 32) -> bytes:
    """SBC-4 5.16."""
    return struct.pack(">BBQIBB", SERVICE_ACTION_IN_16, SA_READ_CAPACITY_16, 0, alloc, 0, 0)


_CDB16 = struct.Struct(">BBQIBB")   # READ(16), WRITE(16), SYNCHRONIZE CACHE(16): opcode, flags, LBA, count, group, control


def read_16(lba: int, blocks: int) -> bytes:
    """SBC-4 5.13."""
    return _CDB16.pack(READ_16, 0, lba, blocks, 0, 0)


def write_16(lba: int, blocks: int, *, fua: bool = False) -> bytes:
    """SBC-4 5.40: FUA is bit 3 of byte 1."""
    return _CDB16.pack(WRITE_16, 0x08 if fua else 0, lba, blocks, 0, 0)


def synchronize_cache_16(lba: int = 0, blocks: int = 0) -> bytes:
    """SBC-4 5.25: 0 blocks = to the end of the medium."""
    return _CDB16.pack(SYNCHRONIZE_CACHE_16, 0, lba, blocks, 0, 0)


def write_same_16(lba: int, blocks: int, *, unmap: bool) -> bytes:
    """SBC-4 5.44: UNMAP (bit 3 of byte 1) lets the target deallocate instead of writing zeroes."""
    return struct.pack(">BBQIBB", WRITE_SAME_16, 0x08 if unmap else 0, lba, blocks, 0, 0)


def unmap(ranges: list[tuple[int, int]]) -> tuple[bytes, bytes]:
    """SBC-4 5.30: the CDB and its parameter list (8-byte header, 16-byte block descriptors)."""
    desc = b"".join(struct.pack(">QI4x", lba, n) for lba, n in ranges)
    param = struct.pack(">HH4x", 6 + len(desc), len(desc)) + desc
    return struct.pack(">BB4xBHB", UNMAP, 0, 0, len(param), 0), param


def test_unit_ready() -> bytes:
    return bytes(6)


def report_luns(alloc: int = 4096) -> bytes:
    """SPC-4 6.33."""
    return struct.pack(">BB4xIBB", REPORT_LUNS, 0, alloc, 0, 0)


def report_target_port_groups(alloc: int = 1024) -> bytes:
    """SPC-4 6.36: PARAMETER DATA FORMAT 000b (length-only header)."""
    return struct.pack(">BBxxxxIxx", MAINTENANCE_IN, SA_REPORT_TARGET_PORT_GROUPS, alloc)


# --- data in -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inquiry:
    peripheral_type: int
    vendor: str
    product: str
    revision: str
    tpgs: int = 0   # TARGET PORT GROUP SUPPORT: 0 no ALUA, 1 implicit, 2 explicit, 3 both

    @classmethod
    def parse(cls, data: bytes) -> Inquiry:
        """SPC-4 6.6.2 standard INQUIRY data; TPGS is bits 5-4 of byte 5."""
        if len(data) < 36:
            raise ScsiCommandError(f"INQUIRY data too short ({len(data)} bytes)")
        vendor, product, revision = (data[a:b].decode("ascii", "replace").strip()
                                     for a, b in ((8, 16), (16, 32), (32, 36)))
        return cls(data[0] & 0x1F, vendor, product, revision, (data[5] >> 4) & 0x3)


@dataclass(frozen=True)
class Capacity:
    num_blocks: int
    block_size: int
    lbpme: bool    # logical block provisioning management enabled: UNMAP may work
    lbprz: bool    # unmapped blocks read as zeroes

    @classmethod
    def parse(cls, data: bytes) -> Capacity:
        """SBC-4 5.16.2: RETURNED LOGICAL BLOCK ADDRESS is the last LBA."""
        if len(data) < 32:
            raise ScsiCommandError(f"READ CAPACITY(16) data too short ({len(data)} bytes)")
        last, bs = struct.unpack_from(">QI", data)
        return cls(last + 1, bs, bool(data[14] & 0x80), bool(data[14] & 0x40))


@dataclass(frozen=True)
class BlockLimits:
    """VPD page B0h, SBC-4 6.6.4. Zero means 'no limit reported'."""

    max_transfer: int = 0
    max_unmap_lbas: int = 0
    max_unmap_descriptors: int = 0
    max_write_same: int = 0

    @classmethod
    def parse(cls, data: bytes) -> BlockLimits:
        if len(data) < 16 or data[1] != 0xB0:
            return cls()
        max_xfer = struct.unpack_from(">I", data, 8)[0]
        mu = struct.unpack_from(">II", data, 20) if len(data) >= 28 else (0, 0)
        mws = struct.unpack_from(">Q", data, 36)[0] if len(data) >= 44 else 0
        return cls(max_xfer, mu[0], mu[1], mws)


@dataclass(frozen=True)
class Provisioning:
    """VPD page B2h, SBC-4 6.6.6."""

    lbpu: bool = False     # UNMAP supported
    lbpws: bool = False    # WRITE SAME(16) with UNMAP supported

    @classmethod
    def parse(cls, data: bytes) -> Provisioning:
        if len(data) < 6 or data[1] != 0xB2:
            return cls()
        return cls(bool(data[5] & 0x80), bool(data[5] & 0x40))


def vpd_pages(data: bytes) -> set[int]:
    """VPD page 00h, SPC-4 7.8.16: the pages the LU supports."""
    if len(data) < 4 or data[1] != 0:
        return set()
    n = struct.unpack_from(">H", data, 2)[0]
    return set(data[4:4 + n])


def designators(data: bytes) -> list[tuple[int, bytes]]:
    """VPD page 83h, SPC-4 7.8.6: (designator type, identifier) pairs."""
    out: list[tuple[int, bytes]] = []
    if len(data) < 4 or data[1] != 0x83:
        return out
    end = min(len(data), 4 + struct.unpack_from(">H", data, 2)[0])
    pos = 4
    while pos + 4 <= end:
        n = data[pos + 3]
        out.append((data[pos + 1] & 0x0F, bytes(data[pos + 4:pos + 4 + n])))
        pos += 4 + n
    return out


@dataclass(frozen=True)
class DeviceIdentification:
    """What VPD page 83h (SPC-4 7.8.6) says of the LU and of the target port the command came in on."""

    naa: bytes = b""                 # the LU's NAA designator (association 00b, type 3): same LU, same bytes
    relative_port: int | None = None  # relative target port identifier (association 01b, type 4, 7.8.6.4)
    port_group: int | None = None     # target port group (association 01b, type 5, 7.8.6.5)

    @classmethod
    def parse(cls, data: bytes) -> DeviceIdentification:
        if len(data) < 4 or data[1] != 0x83:
            return cls()
        naa, rel, grp = b"", None, None
        end = min(len(data), 4 + struct.unpack_from(">H", data, 2)[0])
        pos = 4
        while pos + 4 <= end:
            assoc, dtype, n = (data[pos + 1] >> 4) & 0x3, data[pos + 1] & 0x0F, data[pos + 3]
            ident = bytes(data[pos + 4:pos + 4 + n])
            if assoc == 0 and dtype == 0x3 and not naa:
                naa = ident
            elif assoc == 1 and dtype in (0x4, 0x5) and len(ident) >= 4:
                value = struct.unpack_from(">H", ident, 2)[0]
                rel, grp = (value, grp) if dtype == 0x4 else (rel, value)
            pos += 4 + n
        return cls(naa, rel, grp)


@dataclass(frozen=True)
class PortGroup:
    """One target port group descriptor of REPORT TARGET PORT GROUPS (SPC-4 6.36)."""

    id: int
    # ASYMMETRIC ACCESS STATE: 0 active/optimized, 1 active/non-optimized, 2 standby, 3 unavailable,
    # Eh offline, Fh transitioning
    state: int
    preferred: bool
    ports: tuple[int, ...]


def port_groups(data: bytes) -> list[PortGroup]:
    """REPORT TARGET PORT GROUPS parameter data (SPC-4 6.36), header format 000b or 001b."""
    if len(data) < 4:
        return []
    end = min(len(data), 4 + struct.unpack_from(">I", data, 0)[0])
    pos = 8 if len(data) >= 8 and (data[4] >> 4) & 0x7 == 1 else 4   # extended header: 4 more bytes
    out: list[PortGroup] = []
    while pos + 8 <= end:
        first, gid, count = data[pos], struct.unpack_from(">H", data, pos + 2)[0], data[pos + 7]
        ports = tuple(struct.unpack_from(">H", data, pos + 8 + 4 * i + 2)[0] for i in range(count)
                      if pos + 8 + 4 * i + 4 <= end)
        out.append(PortGroup(gid, first & 0x0F, bool(first & 0x80), ports))
        pos += 8 + 4 * count
    return out


# --- status → errors ---------------------------------------------------------------------------------

def sense_key_asc(sense: bytes) -> tuple[int, int, int | None]:
    """(key, ASC<<8|ASCQ, INFORMATION or None) of fixed (70h/71h) or descriptor (72h/73h) format sense."""
    if len(sense) < 3:
        return 0, 0, None
    code = sense[0] & 0x7F
    if code in (0x72, 0x73):  # SPC-4 4.5.2
        key, asc = sense[1] & 0x0F, (sense[2] << 8) | (sense[3] if len(sense) > 3 else 0)
        info = None
        pos = 8
        while pos + 2 <= len(sense):
            dtype, dlen = sense[pos], sense[pos + 1]
            if dtype == 0 and dlen >= 10 and pos + 12 <= len(sense):
                info = struct.unpack_from(">Q", sense, pos + 4)[0]
            pos += 2 + dlen
        return key, asc, info
    key = sense[2] & 0x0F
    asc = (sense[12] << 8) | sense[13] if len(sense) >= 14 else 0
    info = struct.unpack_from(">I", sense, 3)[0] if sense[0] & 0x80 and len(sense) >= 7 else None
    return key, asc, info


def status_error(status: int, sense: bytes, *, write: bool, what: str) -> BlockError:
    """The typed block error for a status other than GOOD (the reverse of protocol/scsi/sense.py's mapping)."""
    if status in (S.BUSY, S.TASK_SET_FULL):
        return Busy(f"{what}: target busy (status {status:#04x})")
    if status == S.RESERVATION_CONFLICT:
        return ScsiCommandError(f"{what}: reservation conflict", status)
    if status != S.CHECK_CONDITION:
        return ScsiCommandError(f"{what}: status {status:#04x}", status)
    key, asc, info = sense_key_asc(sense)
    text = f"{what}: sense {key:x}/{asc >> 8:02x}/{asc & 0xFF:02x}"
    if key == S.ILLEGAL_REQUEST and asc == S.ASC_LBA_OUT_OF_RANGE:
        return OutOfRange(text)
    if key == S.MEDIUM_ERROR:
        return MediumError(text, info, write=write or asc == S.ASC_WRITE_ERROR)
    if key == S.DATA_PROTECT:
        if asc == S.ASC_SPACE_ALLOCATION_FAILED_WRITE_PROTECT:
            return NoSpace(text)
        return ReadOnly(text)
    if key == S.HARDWARE_ERROR or (key == S.NOT_READY and asc == S.ASC_MEDIUM_NOT_PRESENT):
        return DeviceFailed(text)
    if key == S.NOT_READY and asc in (S.ASC_LU_NOT_ACCESSIBLE_TRANSITION, S.ASC_LU_NOT_ACCESSIBLE_STANDBY,
                                      S.ASC_LU_NOT_ACCESSIBLE_UNAVAILABLE):
        return PathNotAccessible(text, asc)
    if key == S.NOT_READY:
        return Busy(text)
    return ScsiCommandError(text, status, key, asc)


def retryable(status: int, sense: bytes) -> bool:
    """Conditions a command is simply sent again for: a unit attention (reset, capacity or parameter
    change: the target reports it once), an aborted command, a busy target."""
    if status in (S.BUSY, S.TASK_SET_FULL):
        return True
    if status != S.CHECK_CONDITION:
        return False
    key, _, _ = sense_key_asc(sense)
    return key in (S.UNIT_ATTENTION, S.ABORTED_COMMAND)
