"""Completion status codes (NVMe Base 2.0 §4.6.1.2) and the one place block errors become NVMe status."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from openvsan.block.errors import (
    BlockError,
    Busy,
    DeviceFailed,
    Locked,
    MediumError,
    NoSpace,
    OutOfRange,
    ReadOnly,
)

# Status Code Type (§4.6.1.2 Figure 98)
SCT_GENERIC = 0
SCT_COMMAND = 1
SCT_MEDIA = 2
SCT_PATH = 3
DNR = 0x4000          # Do Not Retry, bit 14 of the 15-bit status field


def sf(sct: int, sc: int, dnr: bool = True) -> int:
    """The status field (Status Field of CQE DW3 without the phase tag): SC, SCT, DNR."""
    return (sct << 8) | sc | (DNR if dnr else 0)


SUCCESS = 0
# Generic command status (§4.6.1.2.1 Figure 99; NVM Command Set 1.0 Figure 7)
INVALID_OPCODE = sf(0, 0x01)
INVALID_FIELD = sf(0, 0x02)
CID_CONFLICT = sf(0, 0x03)
DATA_TRANSFER_ERROR = sf(0, 0x04, dnr=False)
INTERNAL_ERROR = sf(0, 0x06, dnr=False)
ABORT_REQUESTED = sf(0, 0x07, dnr=False)
INVALID_NAMESPACE = sf(0, 0x0B)
COMMAND_SEQUENCE_ERROR = sf(0, 0x0C)
SGL_DESCRIPTOR_INVALID = sf(0, 0x0D)
DATA_SGL_LENGTH_INVALID = sf(0, 0x0F)
SGL_TYPE_INVALID = sf(0, 0x11)
SGL_OFFSET_INVALID = sf(0, 0x16)
HOST_ID_INCONSISTENT = sf(0, 0x18)
KEEP_ALIVE_INVALID = sf(0, 0x1A)
NS_WRITE_PROTECTED = sf(0, 0x20)
TRANSIENT_TRANSPORT_ERROR = sf(0, 0x22, dnr=False)
LBA_OUT_OF_RANGE = sf(0, 0x80)
CAPACITY_EXCEEDED = sf(0, 0x81)
NS_NOT_READY = sf(0, 0x82, dnr=False)
RESERVATION_CONFLICT = sf(0, 0x83)
# Command specific (§4.6.1.2.2 Figure 100; NVMe-oF 1.1 §2.4.2 Figure 7 for Connect)
ASYNC_EVENT_LIMIT_EXCEEDED = sf(1, 0x05)
INVALID_LOG_PAGE = sf(1, 0x09)
FEATURE_NOT_SAVEABLE = sf(1, 0x0D)
FEATURE_NOT_CHANGEABLE = sf(1, 0x0E)
CONNECT_INCOMPATIBLE_FORMAT = sf(1, 0x80)
CONNECT_CONTROLLER_BUSY = sf(1, 0x81)
CONNECT_INVALID_PARAMETERS = sf(1, 0x82)
CONNECT_INVALID_HOST = sf(1, 0x84)
# Media and data integrity errors (§4.6.1.2.3 Figure 101)
WRITE_FAULT = sf(2, 0x80, dnr=False)
UNRECOVERED_READ_ERROR = sf(2, 0x81, dnr=False)
COMPARE_FAILURE = sf(2, 0x85)
# Path related (§4.6.1.2.4 Figure 102): ANA states. None with DNR, persistent loss included: it is this
# path that lost the namespace, and DNR would say any controller of the subsystem fails it too (§4.6.1.2),
# so a multipath host (Linux: nvme_decide_disposition) would fail the I/O instead of trying another path
ANA_PERSISTENT_LOSS = sf(3, 0x01, dnr=False)
ANA_INACCESSIBLE = sf(3, 0x02, dnr=False)
ANA_TRANSITION = sf(3, 0x03, dnr=False)

# §4.6.1 Figure 92: DW0, DW1, SQHD, SQID, CID, status field (the phase tag in bit 0)
CQE_LAYOUT = "IIHHHH"
_CQE = struct.Struct("<" + CQE_LAYOUT)


def cqe(cid: int, status: int, dw0: int = 0, dw1: int = 0, sqhd: int = 0, sqid: int = 0) -> bytes:
    """A 16-byte completion queue entry (§4.6.1 Figure 92); the phase tag is unused over fabrics."""
    return _CQE.pack(dw0 & 0xFFFFFFFF, dw1 & 0xFFFFFFFF, sqhd, sqid, cid, (status << 1) & 0xFFFF)


def block_error_status(exc: BaseException, *, write: bool) -> int:
    """Block-layer errors as NVMe status: the one mapping for the whole NVMe target."""
    if isinstance(exc, OutOfRange):
        return LBA_OUT_OF_RANGE
    if isinstance(exc, MediumError):
        return WRITE_FAULT if (write or exc.write) else UNRECOVERED_READ_ERROR
    if isinstance(exc, ReadOnly):
        return NS_WRITE_PROTECTED
    if isinstance(exc, NoSpace):
        return CAPACITY_EXCEEDED
    if isinstance(exc, (Busy, Locked)):
        return NS_NOT_READY          # retryable: the host tries again later (a locked volume: once unlocked)
    if isinstance(exc, DeviceFailed):
        return INTERNAL_ERROR
    if isinstance(exc, BlockError):
        return INTERNAL_ERROR
    return INTERNAL_ERROR


@dataclass(slots=True)
class Completion:
    """What a command handler returns: status, result dwords, and data for the host (C2H) if any."""
    status: int = SUCCESS
    dw0: int = 0
    dw1: int = 0
    data: bytes | bytearray | memoryview | None = None


OK = Completion()


def fail(status: int, dw0: int = 0) -> Completion:
    return Completion(status, dw0)
