"""INQUIRY data: the standard page and the vital product data pages (SPC-4 6.6, 7.8; SBC-4 6.6)."""

from __future__ import annotations

import struct
import uuid as uuidlib
from dataclasses import dataclass

VENDOR = b"OPENVSAN"
PRODUCT = b"VIRTUAL-DISK"
REVISION = b"0001"

# SPC-4 table 143 version descriptors: SAM-5, iSCSI, SPC-4, SBC-3 (libiscsi keys its SBC-3 tests on 0x04C0)
VERSION_DESCRIPTORS = (0x00A0, 0x0960, 0x0460, 0x04C0)

# The IEEE company id in NAA-6 designators, with the "locally administered" bit (0x02 in the first octet,
# as in a MAC address) set: no IEEE registration is claimed, and with the uuid bits below it is unique enough.
COMPANY_ID = 0x0A4F56  # "\x0aOV"

PERIPHERAL_DISK = 0x00
PERIPHERAL_ABSENT = 0x7F  # qualifier 3 (not capable of supporting a device here), type 0x1F (SPC-4 6.6.2)


@dataclass(frozen=True)
class BlockLimits:
    """VPD page B0 values in logical blocks (SBC-4 6.6.4)."""

    max_compare_write: int
    opt_granularity: int
    max_transfer: int
    opt_transfer: int
    max_prefetch: int
    max_unmap_lbas: int
    max_unmap_descriptors: int
    unmap_granularity: int
    max_write_same: int
    max_atomic: int
    atomic_alignment: int
    atomic_granularity: int


def standard_inquiry(peripheral: int, *, removable: bool, third_party_copy: bool, tpgs: int = 0) -> bytes:
    """Standard INQUIRY data, 74 bytes through the last version descriptor (SPC-4 6.6.2); tpgs: the TPGS
    field already in place (0x10: implicit asymmetric access only, SPC-4 5.15.2.1)."""
    data = bytearray(74)
    data[0] = peripheral
    data[1] = 0x80 if removable else 0
    data[2] = 0x06                    # VERSION: SPC-4
    data[3] = 0x12                    # HISUP, RESPONSE DATA FORMAT 2
    data[4] = len(data) - 5
    data[5] = (0x08 if third_party_copy else 0) | (tpgs & 0x30)   # 3PC: EXTENDED COPY supported; TPGS
    data[7] = 0x02                    # CMDQUE: full task management model
    data[8:16] = VENDOR.ljust(8)
    data[16:32] = PRODUCT.ljust(16)
    data[32:36] = REVISION
    for i, v in enumerate(VERSION_DESCRIPTORS):
        struct.pack_into(">H", data, 58 + 2 * i, v)
    return bytes(data)


def naa6(uuid: uuidlib.UUID) -> bytes:
    """NAA IEEE Registered Extended designator (SPC-4 7.8.6.6.5): 4-bit NAA 6, 24-bit company id and 100
    bits of the LU's uuid, so the id is stable for as long as the volume keeps its uuid."""
    value = (6 << 124) | (COMPANY_ID << 100) | (uuid.int & ((1 << 100) - 1))
    return value.to_bytes(16, "big")


def _designator(code_set: int, piv_assoc_type: int, value: bytes, protocol: int = 0) -> bytes:
    # SPC-4 7.8.6.1 designation descriptor header
    return bytes((protocol << 4 | code_set, piv_assoc_type, 0, len(value))) + value


def _scsi_name(name: str) -> bytes:
    # SCSI name string: UTF-8, null terminated, padded to a multiple of 4 (SPC-4 7.8.6.11)
    raw = name.encode() + b"\0"
    return raw + b"\0" * (-len(raw) % 4)


ISCSI_PROTOCOL = 0x5


def device_identification(uuid: uuidlib.UUID, lu_name: str, target_name: str, tpgt: int,
                          relative_port: int, port_group: int | None) -> bytes:
    """VPD page 83h (SPC-4 7.8.6): LU designators (NAA-6, T10 vendor id) and those of the target port the
    command came in on: its relative port id, its target port group (none when the port is in no group)."""
    descs = [
        _designator(0x1, 0x03, naa6(uuid)),                                  # binary, LU, NAA
        _designator(0x2, 0x01, VENDOR.ljust(8) + uuid.hex.encode()),         # ASCII, LU, T10 vendor id
        # target port: PIV set, protocol iSCSI; relative target port (4, SPC-4 7.8.6.4)
        _designator(0x1, 0x80 | 0x10 | 0x04, struct.pack(">HH", 0, relative_port), ISCSI_PROTOCOL),
    ]
    if port_group is not None:   # target port group (5, SPC-4 7.8.6.5): what RTPG reports the port in
        descs.append(_designator(0x1, 0x80 | 0x10 | 0x05, struct.pack(">HH", 0, port_group), ISCSI_PROTOCOL))
    descs += [
        # SCSI name strings of the target port ("iqn...,t,0x0001") and of the target device
        _designator(0x3, 0x80 | 0x10 | 0x08, _scsi_name(f"{target_name},t,0x{tpgt:04x}"), ISCSI_PROTOCOL),
        _designator(0x3, 0x80 | 0x20 | 0x08, _scsi_name(target_name), ISCSI_PROTOCOL),
    ]
    del lu_name  # a name is not an identifier: it may be reused by another volume
    body = b"".join(descs)
    return bytes((PERIPHERAL_DISK, 0x83)) + struct.pack(">H", len(body)) + body


def unit_serial(serial: str) -> bytes:
    """VPD page 80h (SPC-4 7.8.15)."""
    raw = serial.encode("ascii", "replace")[:252]
    return bytes((PERIPHERAL_DISK, 0x80, 0, len(raw))) + raw


def block_limits(bl: BlockLimits) -> bytes:
    """VPD page B0h (SBC-4 6.6.4); WSNZ clear: WRITE SAME with 0 blocks means "to the last LBA"."""
    page = bytearray(64)
    page[1] = 0xB0
    page[3] = 0x3C
    page[5] = bl.max_compare_write
    struct.pack_into(">HIII", page, 6, bl.opt_granularity, bl.max_transfer, bl.opt_transfer, bl.max_prefetch)
    struct.pack_into(">III", page, 20, bl.max_unmap_lbas, bl.max_unmap_descriptors, bl.unmap_granularity)
    struct.pack_into(">I", page, 32, 0x80000000)      # UGAVALID, UNMAP GRANULARITY ALIGNMENT 0
    struct.pack_into(">Q", page, 36, bl.max_write_same)
    struct.pack_into(">III", page, 44, bl.max_atomic, bl.atomic_alignment, bl.atomic_granularity)
    return bytes(page)


def block_device_characteristics() -> bytes:
    """VPD page B1h (SBC-4 6.6.2): MEDIUM ROTATION RATE 1 = non-rotating medium; WABEREQ and WACEREQ
    01b: after a SANITIZE block or cryptographic erase, reads succeed (and return zeros)."""
    page = bytearray(64)
    page[1] = 0xB1
    page[3] = 0x3C
    struct.pack_into(">H", page, 4, 1)
    page[7] = 0x50
    return bytes(page)


PROVISIONING_FULL = 0x00   # B2h PROVISIONING TYPE 000b: fully provisioned, or the type is not reported
PROVISIONING_THIN = 0x02   # 010b: thin provisioned (SBC-4 4.7.3.3): a write may fail for lack of space


def logical_block_provisioning(*, lbprz: bool, thin: bool, threshold_exponent: int = 0) -> bytes:
    """VPD page B2h (SBC-4 6.6.6): UNMAP, WRITE SAME(16)/(10) with UNMAP; PROVISIONING TYPE thin only for a
    volume that allocates on first write (capabilities.thin), else 000b. Every device here deallocates (or
    zeroes) on UNMAP, so LBPU/LBPWS/LBPWS10 stay set either way, and READ CAPACITY(16) keeps LBPME set for
    both (000b is also SBC-3's "provisioning type not reported"). THRESHOLD EXPONENT 0: no threshold
    descriptors (no logical block provisioning mode page); a soft threshold is still reported by unit
    attention (Lun.soft_threshold_reached)."""
    page = bytearray(8)
    page[1] = 0xB2
    page[3] = 4
    page[4] = threshold_exponent
    page[5] = 0x80 | 0x40 | 0x20 | (0x04 if lbprz else 0)   # LBPU, LBPWS, LBPWS10, LBPRZ=001b
    page[6] = PROVISIONING_THIN if thin else PROVISIONING_FULL
    return bytes(page)


SUPPORTED_VPD = (0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2)


def supported_vpd_pages() -> bytes:
    """VPD page 00h (SPC-4 7.8.14)."""
    return bytes((PERIPHERAL_DISK, 0x00, 0, len(SUPPORTED_VPD))) + bytes(SUPPORTED_VPD)
