"""CDB field decoding shared by the command handlers (SBC-4 4.2.2, SPC-4 4.2)."""

from __future__ import annotations

import struct
from collections.abc import Callable

_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_LBA32_LEN16 = struct.Struct(">IxH").unpack_from       # 10-byte CDB: bytes 2-5 LBA, 7-8 length
_LBA32_LEN32 = struct.Struct(">II").unpack_from        # 12-byte CDB: bytes 2-5 LBA, 6-9 length
_LBA64_LEN32 = struct.Struct(">QI").unpack_from        # 16-byte CDB: bytes 2-9 LBA, 10-13 length


def u16(b: bytes, off: int) -> int:
    return int(_U16(b, off)[0])


def u32(b: bytes, off: int) -> int:
    return int(_U32(b, off)[0])


def u64(b: bytes, off: int) -> int:
    return int(_U64(b, off)[0])


def lba_len6(cdb: bytes) -> tuple[int, int]:
    """READ(6)/WRITE(6): 21-bit LBA; a TRANSFER LENGTH of 0 means 256 blocks (SBC-4 5.14)."""
    lba = ((cdb[1] & 0x1F) << 16) | (cdb[2] << 8) | cdb[3]
    return lba, cdb[4] or 256


def lba_len10(cdb: bytes) -> tuple[int, int]:
    lba, n = _LBA32_LEN16(cdb, 2)
    return lba, n


def lba_len12(cdb: bytes) -> tuple[int, int]:
    lba, n = _LBA32_LEN32(cdb, 2)
    return lba, n


def lba_len16(cdb: bytes) -> tuple[int, int]:
    lba, n = _LBA64_LEN32(cdb, 2)
    return lba, n


def lba_len_atomic16(cdb: bytes) -> tuple[int, int]:
    """WRITE ATOMIC(16): bytes 10-11 ATOMIC BOUNDARY, 12-13 TRANSFER LENGTH (SBC-4 5.48)."""
    return u64(cdb, 2), u16(cdb, 12)


def lba_len_caw(cdb: bytes) -> tuple[int, int]:
    """COMPARE AND WRITE: byte 13 NUMBER OF LOGICAL BLOCKS (SBC-4 5.3)."""
    return u64(cdb, 2), cdb[13]


LbaLen = Callable[[bytes], tuple[int, int]]

# every CDB's length follows from its group code (SPC-4 4.2.5.1)
_GROUP_LEN = (6, 10, 10, 0, 16, 12, 0, 0)


def cdb_length(opcode: int) -> int:
    """Length of the CDB with this operation code; 0 for variable-length or vendor-specific groups."""
    if opcode == 0x7F:
        return 0
    return _GROUP_LEN[opcode >> 5]
