"""Submission queue entries (NVMe Base 2.0 §4.2) and the data transfer each one implies over NVMe/TCP."""

from __future__ import annotations

import struct
from enum import IntEnum

from openvsan.protocol.nvme import status as S

# §4.2 Figure 88 (common command format) with the SGL descriptor of §4.3.2 in DPTR:
# OPC, FUSE/PSDT, CID, NSID, CDW2-3, MPTR, SGL address u64, SGL length u32, 3 reserved, SGL identifier,
# CDW10..CDW15
SQE = struct.Struct("<BBHI16xQI3xBIIIIII")

SGL_DATA_BLOCK_OFFSET = 0x01     # §4.3.2 Figure 115: data block, subtype "offset": in-capsule data
SGL_TRANSPORT_DATA_BLOCK = 0x5A  # transport SGL data block, transport-specific: data by R2T/C2HData
NSID_ALL = 0xFFFFFFFF
FABRICS_OPCODE = 0x7F


class Direction(IntEnum):
    # §4.2 / §5 Figure 139: the low two opcode bits say which way the data goes
    NONE = 0
    HOST_TO_CONTROLLER = 1
    CONTROLLER_TO_HOST = 2
    BIDIRECTIONAL = 3


_DIRECTIONS = tuple(Direction)

class Sqe:
    """A decoded SQE; fields by their spec names."""

    __slots__ = (
        "cdw10",
        "cdw11",
        "cdw12",
        "cdw13",
        "cdw14",
        "cdw15",
        "cid",
        "flags",
        "nsid",
        "opcode",
        "raw",
        "sgl_addr",
        "sgl_id",
        "sgl_len",
    )

    def __init__(self, raw: bytes | memoryview) -> None:
        (self.opcode, self.flags, self.cid, self.nsid, self.sgl_addr, self.sgl_len, self.sgl_id,
         self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15) = SQE.unpack_from(raw)
        self.raw = raw

    @property
    def fctype(self) -> int:
        """Fabrics command type (NVMe-oF 1.1 §3.3 Figure 10): byte 4, where NSID sits in others."""
        return int(self.nsid) & 0xFF

    @property
    def direction(self) -> Direction:
        code = self.fctype if self.opcode == FABRICS_OPCODE else self.opcode
        return _DIRECTIONS[code & 3]   # indexing, not Direction(...): an enum call costs microseconds


def data_plan(sqe: Sqe, in_capsule: int, max_transfer: int) -> tuple[int, int, bool]:
    """What data moves for this command: (status, length, needs_r2t). NVMe/TCP 1.0 §3.3: in-capsule data
    is described by an offset data block descriptor, everything else by a transport data block one."""
    direction = sqe.direction   # compared with ints below, not Direction's members: every command asks
    n = sqe.sgl_len
    if direction == _NONE or n == 0:
        return _SUCCESS, 0, False
    if n > max_transfer:
        return S.DATA_SGL_LENGTH_INVALID, n, False
    sgl_id = sqe.sgl_id
    if sgl_id == SGL_DATA_BLOCK_OFFSET:
        if direction != _TO_CONTROLLER:
            return S.SGL_TYPE_INVALID, n, False
        if sqe.sgl_addr != 0:
            return S.SGL_OFFSET_INVALID, n, False   # ICDOFF is 0: data starts at the capsule's data
        if n != in_capsule:
            return S.DATA_SGL_LENGTH_INVALID, n, False
        return _SUCCESS, n, False
    if sgl_id == SGL_TRANSPORT_DATA_BLOCK:
        if in_capsule:
            return S.SGL_DESCRIPTOR_INVALID, n, False
        return _SUCCESS, n, direction == _TO_CONTROLLER
    return S.SGL_TYPE_INVALID, n, False


_NONE, _TO_CONTROLLER = int(Direction.NONE), int(Direction.HOST_TO_CONTROLLER)
_SUCCESS = int(S.SUCCESS)
