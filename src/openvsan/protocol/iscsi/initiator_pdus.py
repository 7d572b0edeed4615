"""The initiator's side of the iSCSI wire format (RFC 7143 §11): requests it builds, responses it reads.

The target-side module `pdu.py` holds opcodes, flags and the received `Pdu`; this one adds the builders of
initiator PDUs and named views of the target's PDUs. Every target PDU but Login Response carries ExpCmdSN and
MaxCmdSN at bytes 28 and 32 (§11.3-§11.19), which is how the command window moves.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from openvsan.protocol.iscsi.pdu import (
    F_CONTINUE,
    F_FINAL,
    F_READ,
    F_STATUS,
    F_TRANSIT,
    F_WRITE,
    RESERVED_TAG,
    Op,
    Pdu,
)

ATTR_SIMPLE = 1  # §11.3.1.2 task attribute
F_BIDI_OVERFLOW = 0x10
F_BIDI_UNDERFLOW = 0x08
F_RSP_OVERFLOW = 0x04
F_RSP_UNDERFLOW = 0x02
LOGOUT_CLOSE_SESSION = 0  # §11.14.1 reason codes
LOGOUT_CLOSE_CONNECTION = 1

_SCSI_CMD = struct.Struct(">BBBBI8sIIII16s")      # §11.3
_DATA_OUT = struct.Struct(">BBBBI8sII4xI4xII4x")   # §11.7.1
_LOGIN_REQ = struct.Struct(">BBBBI6sHIHHII16x")    # §11.12
_TEXT_REQ = struct.Struct(">BBBBI8sIIII16x")       # §11.10
_NOP_OUT = struct.Struct(">BBBBI8sIIII16x")        # §11.18
_LOGOUT_REQ = struct.Struct(">BBBBI8xIHHII16x")    # §11.14
_TMF_REQ = struct.Struct(">BBBBI8sIIIIII8x")       # §11.5


def _dsl(n: int) -> int:
    if not 0 <= n < 1 << 24:
        raise ValueError(f"data segment length {n} out of range")
    return n


# --- requests ----------------------------------------------------------------------------------------

_SCSI_CMD_OP = int(Op.SCSI_CMD)


def scsi_command(itt: int, lun: bytes, cdb: bytes, edtl: int, cmdsn: int, expstatsn: int, *, read: bool = False,
                 write: bool = False, final: bool = True, immediate_len: int = 0, immediate: bool = False) -> bytes:
    """SCSI Command, §11.3. final=False when unsolicited Data-Out PDUs follow (§11.3.1.1); immediate_len is the
    data segment (immediate data, §10.7.1); CDBs longer than 16 bytes would need an AHS and are not made."""
    if len(cdb) > 16:
        raise ValueError("CDB longer than 16 bytes needs an extended CDB AHS")
    flags = (F_FINAL if final else 0) | (F_READ if read else 0) | (F_WRITE if write else 0) | ATTR_SIMPLE
    return _SCSI_CMD.pack(_SCSI_CMD_OP | (0x40 if immediate else 0), flags, 0, 0, _dsl(immediate_len), lun, itt,
                          edtl, cmdsn, expstatsn, cdb.ljust(16, b"\0"))


def data_out(itt: int, ttt: int, lun: bytes, expstatsn: int, datasn: int, offset: int, length: int, *,
             final: bool) -> bytes:
    """SCSI Data-Out, §11.7. ttt is the R2T's Target Transfer Tag, or 0xffffffff for unsolicited data."""
    return _DATA_OUT.pack(Op.DATA_OUT, F_FINAL if final else 0, 0, 0, _dsl(length), lun, itt, ttt, expstatsn,
                          datasn, offset)


def login_request(isid: bytes, tsih: int, itt: int, cid: int, cmdsn: int, expstatsn: int, *, csg: int, nsg: int,
                  transit: bool, cont: bool = False, dsl: int = 0) -> bytes:
    """Login Request, §11.12: always immediate; version-max and version-min are 0 (§11.12.4)."""
    flags = (F_TRANSIT if transit else 0) | (F_CONTINUE if cont else 0) | (csg << 2) | (nsg if transit else 0)
    return _LOGIN_REQ.pack(Op.LOGIN_REQ | 0x40, flags, 0, 0, _dsl(dsl), isid, tsih, itt, cid, 0, cmdsn, expstatsn)


def text_request(itt: int, ttt: int, cmdsn: int, expstatsn: int, *, final: bool = True, cont: bool = False,
                 dsl: int = 0, immediate: bool = True) -> bytes:
    """Text Request, §11.10. ttt is 0xffffffff, or the tag of a target's partial answer being continued."""
    flags = (F_FINAL if final else 0) | (F_CONTINUE if cont else 0)
    return _TEXT_REQ.pack(Op.TEXT_REQ | (0x40 if immediate else 0), flags, 0, 0, _dsl(dsl), bytes(8), itt, ttt,
                          cmdsn, expstatsn)


def nop_out(itt: int, ttt: int, cmdsn: int, expstatsn: int, *, lun: bytes = bytes(8), dsl: int = 0,
            immediate: bool = True) -> bytes:
    """NOP-Out, §11.18: a ping of ours (ITT set, TTT 0xffffffff) or the answer to a NOP-In (ITT 0xffffffff,
    the NOP-In's TTT and LUN, same data back, §11.18.1-3)."""
    return _NOP_OUT.pack(Op.NOP_OUT | (0x40 if immediate else 0), F_FINAL, 0, 0, _dsl(dsl), lun, itt, ttt, cmdsn,
                         expstatsn)


def logout_request(itt: int, cid: int, cmdsn: int, expstatsn: int, *, reason: int = LOGOUT_CLOSE_SESSION) -> bytes:
    """Logout Request, §11.14 (sent immediate so it does not wait behind queued commands)."""
    return _LOGOUT_REQ.pack(Op.LOGOUT_REQ | 0x40, F_FINAL | reason, 0, 0, 0, itt, cid, 0, cmdsn, expstatsn)


def tmf_request(itt: int, function: int, lun: bytes, cmdsn: int, expstatsn: int, *, rtt: int = RESERVED_TAG,
                refcmdsn: int = 0, expdatasn: int = 0) -> bytes:
    """Task Management Function Request, §11.5."""
    return _TMF_REQ.pack(Op.TASK_MGMT_REQ | 0x40, F_FINAL | function, 0, 0, 0, lun, itt, rtt, cmdsn, expstatsn,
                         refcmdsn, expdatasn)


# --- responses ---------------------------------------------------------------------------------------

def exp_max_cmdsn(pdu: Pdu) -> tuple[int, int]:
    """ExpCmdSN and MaxCmdSN, same place in every target PDU (§11.3-§11.19)."""
    return pdu.u32(28), pdu.u32(32)


@dataclass(frozen=True, slots=True)
class LoginResponse:
    """§11.13."""

    transit: bool
    cont: bool
    csg: int
    nsg: int
    version_active: int
    isid: bytes
    tsih: int
    itt: int
    statsn: int
    expcmdsn: int
    maxcmdsn: int
    status_class: int
    status_detail: int

    @classmethod
    def parse(cls, pdu: Pdu) -> LoginResponse:
        b, f = pdu.bhs, pdu.bhs[1]
        return cls(bool(f & F_TRANSIT), bool(f & F_CONTINUE), (f >> 2) & 3, f & 3, b[3], bytes(b[8:14]),
                   pdu.u16(14), pdu.itt, pdu.u32(24), pdu.u32(28), pdu.u32(32), b[36], b[37])


@dataclass(frozen=True, slots=True)
class TextResponse:
    """§11.11."""

    final: bool
    cont: bool
    itt: int
    ttt: int
    statsn: int

    @classmethod
    def parse(cls, pdu: Pdu) -> TextResponse:
        f = pdu.bhs[1]
        return cls(bool(f & F_FINAL), bool(f & F_CONTINUE), pdu.itt, pdu.u32(20), pdu.u32(24))


@dataclass(frozen=True, slots=True)
class ScsiResponse:
    """§11.4. The data segment holds SenseLength (2 bytes) and the sense data (§11.4.7)."""

    flags: int
    response: int
    status: int
    itt: int
    statsn: int
    expdatasn: int
    residual: int
    sense: bytes

    @classmethod
    def parse(cls, pdu: Pdu) -> ScsiResponse:
        b = pdu.bhs
        sense = b""
        if len(pdu.data) >= 2:
            n = int.from_bytes(pdu.data[:2], "big")
            sense = bytes(pdu.data[2:2 + n])
        return cls(b[1], b[2], b[3], pdu.itt, pdu.u32(24), pdu.u32(36), pdu.u32(44), sense)

    @property
    def underflow(self) -> bool:
        return bool(self.flags & F_RSP_UNDERFLOW)

    @property
    def overflow(self) -> bool:
        return bool(self.flags & F_RSP_OVERFLOW)


@dataclass(frozen=True, slots=True)
class DataIn:
    """§11.7 (Data-In); with the S bit it also carries status (phase collapse, §11.7.4)."""

    final: bool
    has_status: bool
    underflow: bool
    overflow: bool
    status: int
    itt: int
    ttt: int
    statsn: int
    datasn: int
    offset: int
    residual: int

    @classmethod
    def parse(cls, pdu: Pdu) -> DataIn:
        f = pdu.bhs[1]
        return cls(bool(f & F_FINAL), bool(f & F_STATUS), bool(f & F_RSP_UNDERFLOW), bool(f & F_RSP_OVERFLOW),
                   pdu.bhs[3], pdu.itt, pdu.u32(20), pdu.u32(24), pdu.u32(36), pdu.u32(40), pdu.u32(44))


@dataclass(frozen=True, slots=True)
class R2T:
    """§11.8."""

    itt: int
    ttt: int
    r2tsn: int
    offset: int
    length: int

    @classmethod
    def parse(cls, pdu: Pdu) -> R2T:
        return cls(pdu.itt, pdu.u32(20), pdu.u32(36), pdu.u32(40), pdu.u32(44))


@dataclass(frozen=True, slots=True)
class NopIn:
    """§11.19: ttt != 0xffffffff means the target pings us and wants a NOP-Out back."""

    itt: int
    ttt: int
    statsn: int
    lun: bytes

    @classmethod
    def parse(cls, pdu: Pdu) -> NopIn:
        return cls(pdu.itt, pdu.u32(20), pdu.u32(24), pdu.lun_raw)


@dataclass(frozen=True, slots=True)
class LogoutResponse:
    """§11.15."""

    response: int
    itt: int
    statsn: int
    time2wait: int
    time2retain: int

    @classmethod
    def parse(cls, pdu: Pdu) -> LogoutResponse:
        return cls(pdu.bhs[2], pdu.itt, pdu.u32(24), pdu.u16(40), pdu.u16(42))


@dataclass(frozen=True, slots=True)
class Reject:
    """§11.17: the data segment is the rejected PDU's header, whose ITT names the command that failed."""

    reason: int
    statsn: int
    rejected_itt: int | None

    @classmethod
    def parse(cls, pdu: Pdu) -> Reject:
        itt = int.from_bytes(pdu.data[16:20], "big") if len(pdu.data) >= 48 else None
        return cls(pdu.bhs[2], pdu.u32(24), itt)


@dataclass(frozen=True, slots=True)
class AsyncMessage:
    """§11.9."""

    event: int
    vcode: int
    statsn: int
    param1: int
    param2: int
    param3: int

    @classmethod
    def parse(cls, pdu: Pdu) -> AsyncMessage:
        return cls(pdu.bhs[36], pdu.bhs[37], pdu.u32(24), pdu.u16(38), pdu.u16(40), pdu.u16(42))


class AsyncEvent:
    """§11.9.1 AsyncEvent codes."""

    SCSI = 0
    LOGOUT_REQUESTED = 1
    DROPPING_CONNECTION = 2
    DROPPING_ALL_CONNECTIONS = 3
    RENEGOTIATE = 4
