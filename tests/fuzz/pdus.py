"""Initiator-side PDUs for the fuzz tests, written independently of the target's own codec (RFC 7143 §11).

Every builder returns the whole PDU (48-byte BHS, data segment, padding), digests optional, so tests can
mutate exact wire bytes. Parsing of the target's answers is kept just as small: the fields a test checks.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

from crc32c import crc32c

BHS_LEN = 48
RESERVED_TAG = 0xFFFFFFFF
IMMEDIATE = 0x40

# Opcodes, RFC 7143 §11.2.1.2
NOP_OUT, SCSI_CMD, TMF_REQ, LOGIN_REQ, TEXT_REQ, DATA_OUT, LOGOUT_REQ, SNACK = 0x00, 0x01, 0x02, 0x03, 0x04, \
    0x05, 0x06, 0x10
NOP_IN, SCSI_RSP, TMF_RSP, LOGIN_RSP, TEXT_RSP, DATA_IN, LOGOUT_RSP, R2T, ASYNC, REJECT = 0x20, 0x21, 0x22, \
    0x23, 0x24, 0x25, 0x26, 0x31, 0x32, 0x3F

# Reject reasons, RFC 7143 §11.17.1
REJECT_DATA_DIGEST, REJECT_SNACK, REJECT_PROTOCOL, REJECT_NOT_SUPPORTED = 0x02, 0x03, 0x04, 0x05
REJECT_TASK_IN_PROGRESS, REJECT_INVALID_FIELD = 0x07, 0x09

ISID = bytes((0x80, 0x12, 0x34, 0x56, 0x00, 0x01))  # random-qualifier format (§11.12.5)


def crc(*parts: bytes) -> bytes:
    """iSCSI CRC32C digest: least significant byte first on the wire (RFC 7143 §13.1, Appendix B.4)."""
    c = 0
    for p in parts:
        c = crc32c(p, c)
    return c.to_bytes(4, "little")


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) & 3)


def assemble(bhs: bytes, data: bytes = b"", *, ahs: bytes = b"", hd: bool = False, dd: bool = False) -> bytes:
    """BHS (its length fields set here) + AHS + [header digest] + data + pad + [data digest] (§11.2)."""
    assert len(bhs) == BHS_LEN and len(ahs) % 4 == 0
    b = bytearray(bhs)
    b[4] = len(ahs) // 4
    b[5:8] = len(data).to_bytes(3, "big")
    header = bytes(b) + ahs
    out = header + (crc(header) if hd else b"")
    if data:
        padded = pad(data)
        out += padded + (crc(padded) if dd else b"")
    return out


def text(pairs: list[tuple[str, str]] | dict[str, str]) -> bytes:
    items = pairs.items() if isinstance(pairs, dict) else pairs
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in items)


# --- initiator PDUs ----------------------------------------------------------------------------------

def login_request(keys: bytes | list[tuple[str, str]] | dict[str, str], *, csg: int = 1, nsg: int = 3,
                  transit: bool = True, cont: bool = False, vmax: int = 0, vmin: int = 0, isid: bytes = ISID,
                  tsih: int = 0, itt: int = 1, cid: int = 0, cmdsn: int = 1, expstatsn: int = 0) -> bytes:
    """§11.12: always immediate; flags T C . . CSG NSG."""
    data = keys if isinstance(keys, bytes) else text(keys)
    flags = (0x80 if transit else 0) | (0x40 if cont else 0) | (csg << 2) | (nsg if transit else 0)
    bhs = struct.pack(">BBBBI6sHIH2xII16x", IMMEDIATE | LOGIN_REQ, flags, vmax, vmin, 0, isid, tsih, itt, cid,
                      cmdsn, expstatsn)
    return assemble(bhs, data)


def scsi_command(cdb: bytes, *, itt: int, cmdsn: int, expstatsn: int = 0, edtl: int = 0, read: bool = False,
                 write: bool = False, final: bool = True, lun: int = 0, data: bytes = b"", immediate: bool = False,
                 hd: bool = False, dd: bool = False) -> bytes:
    """§11.3: F R W, LUN, ITT, EDTL, CmdSN, ExpStatSN, a 16-byte CDB field."""
    flags = (0x80 if final else 0) | (0x40 if read else 0) | (0x20 if write else 0) | 0x01  # SIMPLE task
    bhs = struct.pack(">BBBBI8sIIII16s", (IMMEDIATE if immediate else 0) | SCSI_CMD, flags, 0, 0, 0, lun_bytes(lun),
                      itt, edtl, cmdsn, expstatsn, cdb.ljust(16, b"\0"))
    return assemble(bhs, data, hd=hd, dd=dd)


def data_out(data: bytes, *, itt: int, ttt: int = RESERVED_TAG, datasn: int = 0, offset: int = 0,
             final: bool = True, lun: int = 0, expstatsn: int = 0, hd: bool = False, dd: bool = False) -> bytes:
    """§11.7: Data-Out; TTT 0xffffffff for unsolicited data."""
    bhs = struct.pack(">BBBBI8sII4xI4xII4x", DATA_OUT, 0x80 if final else 0, 0, 0, 0, lun_bytes(lun), itt, ttt,
                      expstatsn, datasn, offset)
    return assemble(bhs, data, hd=hd, dd=dd)


def nop_out(*, itt: int, cmdsn: int, ttt: int = RESERVED_TAG, expstatsn: int = 0, data: bytes = b"",
            immediate: bool = True, hd: bool = False, dd: bool = False) -> bytes:
    """§11.18."""
    bhs = struct.pack(">BBBBI8sIIII16x", (IMMEDIATE if immediate else 0) | NOP_OUT, 0x80, 0, 0, 0, bytes(8), itt,
                      ttt, cmdsn, expstatsn)
    return assemble(bhs, data, hd=hd, dd=dd)


def text_request(keys: bytes | dict[str, str], *, itt: int, cmdsn: int, ttt: int = RESERVED_TAG,
                 expstatsn: int = 0, final: bool = True, cont: bool = False, immediate: bool = True) -> bytes:
    """§11.10."""
    data = keys if isinstance(keys, bytes) else text(keys)
    flags = (0x80 if final else 0) | (0x40 if cont else 0)
    bhs = struct.pack(">BBBBI8sIIII16x", (IMMEDIATE if immediate else 0) | TEXT_REQ, flags, 0, 0, 0, bytes(8), itt,
                      ttt, cmdsn, expstatsn)
    return assemble(bhs, data)


def logout_request(*, itt: int, cmdsn: int, reason: int = 0, cid: int = 0, expstatsn: int = 0,
                   immediate: bool = True, hd: bool = False) -> bytes:
    """§11.14."""
    bhs = struct.pack(">BBBBI8sIH2xII16x", (IMMEDIATE if immediate else 0) | LOGOUT_REQ, 0x80 | reason, 0, 0, 0,
                      bytes(8), itt, cid, cmdsn, expstatsn)
    return assemble(bhs, hd=hd)


def task_mgmt(function: int, *, itt: int, cmdsn: int, lun: int = 0, rtt: int = RESERVED_TAG, refcmdsn: int = 0,
              expstatsn: int = 0, immediate: bool = True) -> bytes:
    """§11.5."""
    bhs = struct.pack(">BBBBI8sIIIIII8x", (IMMEDIATE if immediate else 0) | TMF_REQ, 0x80 | function, 0, 0, 0,
                      lun_bytes(lun), itt, rtt, cmdsn, expstatsn, refcmdsn, 0)
    return assemble(bhs)


def snack(*, itt: int, snack_type: int = 0, begrun: int = 0, runlength: int = 0, expstatsn: int = 0) -> bytes:
    """§11.16."""
    bhs = struct.pack(">BBBBI8sII4xI8xII", SNACK, 0x80 | snack_type, 0, 0, 0, bytes(8), itt, RESERVED_TAG,
                      expstatsn, begrun, runlength)
    return assemble(bhs)


def lun_bytes(lun: int) -> bytes:
    """SAM-5 4.7: peripheral addressing below 256, flat above."""
    if lun < 256:
        return bytes((0, lun)) + bytes(6)
    return bytes((0x40 | (lun >> 8) & 0x3F, lun & 0xFF)) + bytes(6)


# --- CDBs ---------------------------------------------------------------------------------------------

def read10(lba: int, blocks: int) -> bytes:
    return struct.pack(">BBIBHB", 0x28, 0, lba, 0, blocks, 0)  # SBC-4 5.15


def write10(lba: int, blocks: int) -> bytes:
    return struct.pack(">BBIBHB", 0x2A, 0, lba, 0, blocks, 0)  # SBC-4 5.39


TEST_UNIT_READY = bytes(6)


# --- target PDUs: just the fields tests check ------------------------------------------------------------

@dataclass
class Reply:
    bhs: bytes
    data: bytes

    @property
    def opcode(self) -> int:
        return self.bhs[0] & 0x3F

    @property
    def flags(self) -> int:
        return self.bhs[1]

    @property
    def itt(self) -> int:
        return int.from_bytes(self.bhs[16:20], "big")

    @property
    def ttt(self) -> int:
        return int.from_bytes(self.bhs[20:24], "big")

    @property
    def statsn(self) -> int:
        return int.from_bytes(self.bhs[24:28], "big")

    @property
    def expcmdsn(self) -> int:
        return int.from_bytes(self.bhs[28:32], "big")

    @property
    def maxcmdsn(self) -> int:
        return int.from_bytes(self.bhs[32:36], "big")

    @property
    def login_status(self) -> tuple[int, int]:
        """§11.13.5: Status-Class, Status-Detail."""
        return self.bhs[36], self.bhs[37]

    @property
    def reject_reason(self) -> int:
        return self.bhs[2]  # §11.17

    @property
    def scsi_status(self) -> int:
        return self.bhs[3]  # §11.4.2 (and §11.7.4 for Data-In with S)

    def keys(self) -> dict[str, str]:
        out = {}
        for item in self.data.split(b"\0"):
            if item:
                k, _, v = item.decode().partition("=")
                out[k] = v
        return out


def split_replies(stream: bytes, *, hd: bool = False, dd: bool = False) -> tuple[list[Reply], bytes]:
    """Whole target PDUs at the front of stream, and what is left over."""
    out = []
    pos = 0
    while len(stream) - pos >= BHS_LEN:
        bhs = stream[pos:pos + BHS_LEN]
        ahs = bhs[4] * 4
        dsl = int.from_bytes(bhs[5:8], "big")
        total = BHS_LEN + ahs + (4 if hd else 0) + dsl + (-dsl & 3) + (4 if dd and dsl else 0)
        if len(stream) - pos < total:
            break
        start = pos + BHS_LEN + ahs + (4 if hd else 0)
        out.append(Reply(bytes(bhs), bytes(stream[start:start + dsl])))
        pos += total
    return out, stream[pos:]


# --- mutation -----------------------------------------------------------------------------------------

def mutate(pdu: bytes, rng: random.Random, *, keep_length: bool = False) -> bytes:
    """A few random edits of a valid PDU: bit flips, byte sets (weighted toward the BHS and its length
    fields), truncation, extension, splices. keep_length keeps the DataSegmentLength field intact, so a
    stream of mutated PDUs stays framed (the edits then exercise the parsers, not the framing)."""
    b = bytearray(pdu)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op <= 2 and b:  # flip a bit, most often in the header
            i = rng.randrange(min(len(b), BHS_LEN)) if rng.random() < 0.8 else rng.randrange(len(b))
            if keep_length and 4 <= i < 8:
                continue
            b[i] ^= 1 << rng.randrange(8)
        elif op == 3 and b:  # set a byte to an interesting value
            i = rng.randrange(min(len(b), BHS_LEN))
            if keep_length and 4 <= i < 8:
                continue
            b[i] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 4 and not keep_length:  # an interesting DataSegmentLength / TotalAHSLength
            if len(b) >= 8:
                b[5:8] = rng.choice((0, 1, 3, 48, 8192, 8193, 262144, 262145, (1 << 24) - 1,
                                     rng.randrange(1 << 24))).to_bytes(3, "big")
                if rng.random() < 0.3:
                    b[4] = rng.randrange(256)
        elif op == 5 and len(b) >= BHS_LEN and not keep_length:  # truncate or extend
            if rng.random() < 0.5:
                del b[rng.randrange(len(b)):]
            else:
                b += rng.randbytes(rng.randrange(64))
        elif op == 6 and len(b) >= 24:  # set a 32-bit field (ITT, TTT, sequence numbers, EDTL...)
            off = rng.choice((16, 20, 24, 28, 32, 36, 40, 44))
            b[off:off + 4] = rng.choice((0, 1, 0x7FFFFFFF, 0x80000000, RESERVED_TAG,
                                         rng.randrange(1 << 32))).to_bytes(4, "big")
        elif op == 7 and len(b) > BHS_LEN:  # scribble on the data segment
            i = rng.randrange(BHS_LEN, len(b))
            n = rng.randrange(1, 16)
            b[i:i + n] = rng.randbytes(min(n, len(b) - i))
    return bytes(b)
