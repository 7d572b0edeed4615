"""iSCSI PDU wire format: the Basic Header Segment and the target's PDUs (RFC 7143 §11).

Decoding keeps the 48-byte BHS as a memoryview and reads fields on demand with struct; encoding builds a
48-byte header with one struct.pack_into per PDU type. Payloads are never copied here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

BHS_LEN = 48
RESERVED_TAG = 0xFFFFFFFF


class Op(IntEnum):
    """Opcodes, RFC 7143 §11.2.1.2."""

    NOP_OUT = 0x00
    SCSI_CMD = 0x01
    TASK_MGMT_REQ = 0x02
    LOGIN_REQ = 0x03
    TEXT_REQ = 0x04
    DATA_OUT = 0x05
    LOGOUT_REQ = 0x06
    SNACK = 0x10
    NOP_IN = 0x20
    SCSI_RSP = 0x21
    TASK_MGMT_RSP = 0x22
    LOGIN_RSP = 0x23
    TEXT_RSP = 0x24
    DATA_IN = 0x25
    LOGOUT_RSP = 0x26
    R2T = 0x31
    ASYNC_MSG = 0x32
    REJECT = 0x3F


INITIATOR_OPS = frozenset({Op.NOP_OUT, Op.SCSI_CMD, Op.TASK_MGMT_REQ, Op.LOGIN_REQ, Op.TEXT_REQ,
                           Op.DATA_OUT, Op.LOGOUT_REQ, Op.SNACK})


class RejectReason(IntEnum):
    """RFC 7143 §11.17.1."""

    DATA_DIGEST_ERROR = 0x02
    SNACK_REJECT = 0x03
    PROTOCOL_ERROR = 0x04
    COMMAND_NOT_SUPPORTED = 0x05
    IMMEDIATE_COMMAND_REJECT = 0x06
    TASK_IN_PROGRESS = 0x07
    INVALID_DATA_ACK = 0x08
    INVALID_PDU_FIELD = 0x09
    LONG_OP_REJECT = 0x0A
    WAITING_FOR_LOGOUT = 0x0C


class TmfFunction(IntEnum):
    """RFC 7143 §11.5.1."""

    ABORT_TASK = 1
    ABORT_TASK_SET = 2
    CLEAR_ACA = 3
    CLEAR_TASK_SET = 4
    LOGICAL_UNIT_RESET = 5
    TARGET_WARM_RESET = 6
    TARGET_COLD_RESET = 7
    TASK_REASSIGN = 8


class TmfResponse(IntEnum):
    """RFC 7143 §11.6.1."""

    COMPLETE = 0
    NO_TASK = 1
    NO_LUN = 2
    TASK_STILL_ALLEGIANT = 3
    REASSIGN_NOT_SUPPORTED = 4
    NOT_SUPPORTED = 5
    AUTH_FAILED = 6
    REJECTED = 255


# SCSI Command flags, RFC 7143 §11.3.1
F_FINAL = 0x80
F_READ = 0x40
F_WRITE = 0x20
# Data-In flags, RFC 7143 §11.7
F_ACK = 0x40
F_OVERFLOW = 0x04
F_UNDERFLOW = 0x02
F_STATUS = 0x01
# Login flags, RFC 7143 §11.12
F_TRANSIT = 0x80
F_CONTINUE = 0x40

_U32 = struct.Struct(">I")
_DSL = struct.Struct(">BBBBI")  # opcode, flags, b2, b3, (ahs<<24 | dsl)


@dataclass(slots=True)
class Pdu:
    """One received PDU: its BHS, additional header segments and data segment (padding removed)."""

    bhs: memoryview
    ahs: memoryview
    data: memoryview
    digest_ok: bool = True  # False when the data digest did not match (RFC 7143 §7.8)

    @property
    def opcode(self) -> int:
        return self.bhs[0] & 0x3F

    @property
    def immediate(self) -> bool:
        return bool(self.bhs[0] & 0x40)

    @property
    def flags(self) -> int:
        return self.bhs[1]

    @property
    def lun_raw(self) -> bytes:
        return bytes(self.bhs[8:16])

    @property
    def itt(self) -> int:
        return int(_U32.unpack_from(self.bhs, 16)[0])

    def u32(self, offset: int) -> int:
        return int(_U32.unpack_from(self.bhs, offset)[0])

    def u16(self, offset: int) -> int:
        return int.from_bytes(self.bhs[offset:offset + 2], "big")


def data_segment_length(bhs: bytes | memoryview) -> int:
    return int.from_bytes(bhs[5:8], "big")


def total_ahs_length(bhs: bytes | memoryview) -> int:
    return bhs[4] * 4


def pad4(n: int) -> int:
    return -n & 3


def decode_lun(raw: bytes) -> int:
    """SAM-5 4.7: the first level of a LUN, peripheral (00b) or flat (01b) addressing."""
    method = raw[0] >> 6
    if method == 0:
        return raw[1] if raw[0] == 0 else (raw[0] & 0x3F) << 8 | raw[1]
    if method == 1:
        return (raw[0] & 0x3F) << 8 | raw[1]
    return 0xFFFF_FFFF  # an addressing method we do not serve: no such LUN


def encode_lun(lun: int) -> bytes:
    if lun < 256:
        return bytes((0, lun, 0, 0, 0, 0, 0, 0))
    return bytes((0x40 | (lun >> 8), lun & 0xFF, 0, 0, 0, 0, 0, 0))


# --- target PDUs -------------------------------------------------------------------------------------
# Each builder returns the 48-byte BHS with the data segment length filled in; the connection appends
# digests and padding. Sequence numbers are passed in by the session, which owns them.

_SCSI_RSP = struct.Struct(">BBBBI8xIIIIIIII")  # §11.4
_DATA_IN = struct.Struct(">BBBBI8sIIIIIIII")   # §11.7.1
_R2T = struct.Struct(">BBBBI8sIIIIIIII")       # §11.8
_NOP_IN = struct.Struct(">BBBBI8sIIIII12x")   # §11.19
_TMF_RSP = struct.Struct(">BBBBI8xI4xIII12x")  # §11.6
_LOGIN_RSP = struct.Struct(">BBBBI6sHI4xIIIBB10x")  # §11.13
_TEXT_RSP = struct.Struct(">BBBBI8sIIIII12x")  # §11.11
_LOGOUT_RSP = struct.Struct(">BBBBI8xI4xIII4xHH4x")  # §11.15
_REJECT = struct.Struct(">BBBBI8xI4xIIII8x")   # §11.17
_ASYNC = struct.Struct(">BBBBI8sI4xIIIBBHHH4x")  # §11.9


def scsi_response(itt: int, status: int, statsn: int, expcmdsn: int, maxcmdsn: int, *, dsl: int = 0,
                  flags: int = 0, response: int = 0, expdatasn: int = 0, residual: int = 0,
                  bidi_residual: int = 0) -> bytes:
    return _SCSI_RSP.pack(Op.SCSI_RSP, 0x80 | flags, response, status, dsl, itt, 0, statsn, expcmdsn, maxcmdsn,
                          expdatasn, bidi_residual, residual)


def data_in(itt: int, datasn: int, offset: int, length: int, *, final: bool, expcmdsn: int, maxcmdsn: int,
            lun: bytes = bytes(8), status: int | None = None, statsn: int = 0, flags: int = 0,
            residual: int = 0) -> bytes:
    f = flags | (F_FINAL if final else 0)
    st = 0
    if status is not None:
        f |= F_STATUS | F_FINAL
        st = status
    else:
        statsn = 0
        f &= ~(F_OVERFLOW | F_UNDERFLOW)
        residual = 0
    return _DATA_IN.pack(Op.DATA_IN, f, 0, st, length, lun, itt, RESERVED_TAG, statsn, expcmdsn, maxcmdsn,
                         datasn, offset, residual)


def r2t(itt: int, ttt: int, lun: bytes, statsn: int, expcmdsn: int, maxcmdsn: int, r2tsn: int, offset: int,
        length: int) -> bytes:
    return _R2T.pack(Op.R2T, 0x80, 0, 0, 0, lun, itt, ttt, statsn, expcmdsn, maxcmdsn, r2tsn, offset, length)


def nop_in(itt: int, ttt: int, statsn: int, expcmdsn: int, maxcmdsn: int, *, lun: bytes = bytes(8),
           dsl: int = 0) -> bytes:
    return _NOP_IN.pack(Op.NOP_IN, 0x80, 0, 0, dsl, lun, itt, ttt, statsn, expcmdsn, maxcmdsn)


def tmf_response(itt: int, response: int, statsn: int, expcmdsn: int, maxcmdsn: int) -> bytes:
    return _TMF_RSP.pack(Op.TASK_MGMT_RSP, 0x80, response, 0, 0, itt, statsn, expcmdsn, maxcmdsn)


def login_response(flags: int, version_max: int, version_active: int, isid: bytes, tsih: int, itt: int,
                   statsn: int, expcmdsn: int, maxcmdsn: int, status_class: int, status_detail: int,
                   dsl: int) -> bytes:
    return _LOGIN_RSP.pack(Op.LOGIN_RSP, flags, version_max, version_active, dsl, isid, tsih, itt, statsn,
                           expcmdsn, maxcmdsn, status_class, status_detail)


def text_response(itt: int, ttt: int, statsn: int, expcmdsn: int, maxcmdsn: int, *, final: bool,
                  cont: bool, dsl: int, lun: bytes = bytes(8)) -> bytes:
    flags = (F_FINAL if final else 0) | (F_CONTINUE if cont else 0)
    return _TEXT_RSP.pack(Op.TEXT_RSP, flags, 0, 0, dsl, lun, itt, ttt, statsn, expcmdsn, maxcmdsn)


def logout_response(itt: int, response: int, statsn: int, expcmdsn: int, maxcmdsn: int, *,
                    time2wait: int = 0, time2retain: int = 0) -> bytes:
    return _LOGOUT_RSP.pack(Op.LOGOUT_RSP, 0x80, response, 0, 0, itt, statsn, expcmdsn, maxcmdsn, time2wait,
                            time2retain)


def reject(reason: int, statsn: int, expcmdsn: int, maxcmdsn: int, *, datasn: int = 0) -> bytes:
    """The data segment is the rejected PDU's header (§11.17): dsl is always 48."""
    return _REJECT.pack(Op.REJECT, 0x80, reason, 0, BHS_LEN, RESERVED_TAG, statsn, expcmdsn, maxcmdsn, datasn)


def async_message(event: int, statsn: int, expcmdsn: int, maxcmdsn: int, *, lun: bytes = bytes(8),
                  vcode: int = 0, p1: int = 0, p2: int = 0, p3: int = 0, dsl: int = 0) -> bytes:
    return _ASYNC.pack(Op.ASYNC_MSG, 0x80, 0, 0, dsl, lun, RESERVED_TAG, statsn, expcmdsn, maxcmdsn,
                       event, vcode, p1, p2, p3)
