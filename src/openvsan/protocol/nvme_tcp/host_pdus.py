"""The host's side of NVMe/TCP (NVMe/TCP 1.0 §3.6): PDUs it sends and a reader for what controllers send.

`pdu.py` and `framing.py` hold the layouts and the controller's reader; this module adds the host's builders
(ICReq, CapsuleCmd, H2CData) and `HostPduReader`, which accepts only controller-to-host PDU types.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from openvsan.protocol.nvme.command import SQE
from openvsan.protocol.nvme.host_commands import read_fields, write_fields
from openvsan.protocol.nvme_tcp.framing import Pdu, digest, digest_bytes
from openvsan.protocol.nvme_tcp.pdu import (
    CH,
    CH_LEN,
    DATA_HDR,
    DGST_DATA,
    DGST_HEADER,
    DIGEST_LEN,
    F_DDGST,
    F_HDGST,
    F_LAST_PDU,
    HLEN,
    TERM_REQ,
    PduType,
)
from openvsan.protocol.recvbuf import RecvBuffer

CONTROLLER_TO_HOST = frozenset({PduType.IC_RESP, PduType.C2H_TERM_REQ, PduType.CAPSULE_RESP, PduType.C2H_DATA,
                                PduType.R2T})
_DIGESTED = frozenset({PduType.CAPSULE_RESP, PduType.C2H_DATA, PduType.R2T})
_IC_REQ = struct.Struct("<BBBBIHBBI112x")   # §3.6.2.2: CH, PFV, HPDA, DGST, MAXR2T
_IC_RESP = struct.Struct("<HBBI")           # §3.6.2.3 after the common header: PFV, CPDA, DGST, MAXH2CDATA
_CQE = struct.Struct("<IIHHHH")             # NVMe Base 2.0 §4.6.1 Figure 92
MAX_PLEN = (16 << 20) + 256                 # the most a C2HData PDU may carry before we call it garbage


class HostFatalError(Exception):
    """The controller sent something we cannot parse: end the connection (§3.5.4)."""


def icreq(*, hdgst: bool, ddgst: bool, hpda: int = 0, maxr2t: int = 0) -> bytes:
    """§3.6.2.2 ICReq: PFV 0; MAXR2T is 0-based (0 = one outstanding R2T per command)."""
    dgst = (DGST_HEADER if hdgst else 0) | (DGST_DATA if ddgst else 0)
    return _IC_REQ.pack(PduType.IC_REQ, 0, 128, 0, 128, 0, hpda, dgst, maxr2t)


@dataclass(frozen=True, slots=True)
class IcResp:
    pfv: int
    cpda: int
    hdgst: bool
    ddgst: bool
    maxh2cdata: int

    @classmethod
    def parse(cls, pdu: Pdu) -> IcResp:
        pfv, cpda, dgst, maxh2c = _IC_RESP.unpack_from(pdu.header, CH_LEN)
        return cls(pfv, cpda, bool(dgst & DGST_HEADER), bool(dgst & DGST_DATA), maxh2c)


def _pad_to(n: int, cpda: int) -> int:
    align = (cpda + 1) * 4
    return -(-n // align) * align


_BARE_CAPSULE_CH = CH.pack(PduType.CAPSULE_CMD, 0, 72, 0, 72)
_CAPSULE_CMD = int(PduType.CAPSULE_CMD)


# a CapsuleCmd's header (common header, then the SQE) in one pack: what capsule_cmd makes with no digest or padding
_CAPSULE_HEADER = struct.Struct(CH.format + SQE.format[1:])


def write_capsule(cid: int, nsid: int, lba: int, blocks: int, nbytes: int, fua: bool) -> bytes:
    """capsule_cmd's header for a Write with its `nbytes` of data in the capsule, no digest and no CPDA padding
    (PDO 72, the data right after the SQE: a replicated write's capsule), packed in one call; the data follows it
    as its own part. The unit tests hold it to capsule_cmd(write(...)) byte for byte."""
    return _CAPSULE_HEADER.pack(_CAPSULE_CMD, 0, 72, 72, 72 + nbytes,
                                *write_fields(cid, nsid, lba, blocks, nbytes, fua, True))


def read_capsule(cid: int, nsid: int, lba: int, blocks: int, nbytes: int) -> bytes:
    """capsule_cmd's bytes for a Read of `nbytes` with no digest (a capsule with nothing but its SQE: PDO 0),
    packed in one call: every read of our NVMe/TCP host. The unit tests hold it to capsule_cmd(read(...)) byte
    for byte."""
    return _CAPSULE_HEADER.pack(_CAPSULE_CMD, 0, 72, 0, 72, *read_fields(cid, nsid, lba, blocks, nbytes))


def capsule_cmd(sqe: bytes, data: bytes | bytearray | memoryview = b"", *, hdgst: bool, ddgst: bool,
                cpda: int = 0) -> list[bytes | memoryview]:
    """§3.6.2.5 CapsuleCmd: header (CH + 64-byte SQE), header digest, pad to CPDA, in-capsule data, digest."""
    n = len(data)
    if not hdgst:
        if not n:
            return [_BARE_CAPSULE_CH + sqe]   # the common header of every capsule with nothing but its SQE
        if not ddgst and not cpda:
            # the data right after the SQE (PDO 72, no padding, no digest): a replicated write's capsule
            return [CH.pack(_CAPSULE_CMD, 0, 72, 72, 72 + n) + sqe, memoryview(data)]
    hd = DIGEST_LEN if hdgst else 0
    dd = DIGEST_LEN if ddgst and n else 0
    pdo = _pad_to(72 + hd, cpda) if n else 0
    plen = (pdo + n + dd) if n else 72 + hd
    flags = (F_HDGST if hdgst else 0) | (F_DDGST if dd else 0)
    hdr = CH.pack(PduType.CAPSULE_CMD, flags, 72, pdo, plen) + sqe
    out: list[bytes | memoryview] = [hdr]
    if hd:
        out.append(digest_bytes(hdr))
    if n:
        data = memoryview(data)
        pad = pdo - 72 - hd
        if pad:
            out.append(bytes(pad))
        out.append(data)
        if dd:
            out.append(digest_bytes(data))
    return out


def h2c_data(cccid: int, ttag: int, offset: int, data: bytes | memoryview, *, last: bool, hdgst: bool,
             ddgst: bool, cpda: int = 0) -> list[bytes | memoryview]:
    """§3.6.2.8 H2CData: one PDU of the data an R2T asked for; LAST_PDU on the final one of that R2T."""
    hd = DIGEST_LEN if hdgst else 0
    dd = DIGEST_LEN if ddgst else 0
    n = len(data)
    pdo = _pad_to(24 + hd, cpda)
    flags = (F_HDGST if hdgst else 0) | (F_DDGST if ddgst else 0) | (F_LAST_PDU if last else 0)
    hdr = DATA_HDR.pack(PduType.H2C_DATA, flags, 24, pdo, pdo + n + dd, cccid, ttag, offset, n)
    out: list[bytes | memoryview] = [hdr]
    if hd:
        out.append(digest_bytes(hdr))
    pad = pdo - 24 - hd
    if pad:
        out.append(bytes(pad))
    out.append(data)
    if dd:
        out.append(digest_bytes(data))
    return out


def h2c_term_req(fes: int, fei: int = 0) -> bytes:
    """§3.6.2.4 H2CTermReq, no offending header attached."""
    return TERM_REQ.pack(PduType.H2C_TERM_REQ, 0, 24, 0, 24, fes, fei)


@dataclass(frozen=True, slots=True)
class Cqe:
    """A completion queue entry (Base 2.0 §4.6.1): status without the phase bit."""

    dw0: int
    dw1: int
    sqhd: int
    sqid: int
    cid: int
    status: int

    @classmethod
    def parse(cls, raw: bytes | memoryview) -> Cqe:
        dw0, dw1, sqhd, sqid, cid, sf = _CQE.unpack_from(raw)
        return cls(dw0, dw1, sqhd, sqid, cid, sf >> 1)


@dataclass(frozen=True, slots=True)
class DataHeader:
    """C2HData and R2T (§3.6.2.9, §3.6.2.10): command id, transfer tag, offset, length."""

    cccid: int
    ttag: int
    offset: int
    length: int

    @classmethod
    def parse(cls, pdu: Pdu) -> DataHeader:
        cccid, ttag, off, n = struct.unpack_from("<HHII", pdu.header, CH_LEN)
        return cls(cccid, ttag, off, n)


class HostPduReader:
    """Bytes from a controller → PDUs. Header digest errors and impossible lengths raise HostFatalError;
    a data digest error is reported on the PDU (data_ok False)."""

    def __init__(self) -> None:
        self.hdgst = False
        self.ddgst = False
        self._buf = RecvBuffer()

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished PDU held from earlier receives."""
        return self._buf.size

    def receive_data(self, data: bytes | memoryview) -> list[Pdu]:
        buf = self._buf
        buf.append(data)
        out: list[Pdu] = []
        while True:
            ch = buf.peek(CH_LEN)
            if ch is None:
                break
            ptype, flags, hlen, pdo, plen = CH.unpack_from(ch)
            if ptype not in CONTROLLER_TO_HOST or hlen != HLEN[ptype]:
                raise HostFatalError(f"PDU type {ptype:#x} with HLEN {hlen} from a controller")
            if plen < hlen or plen > MAX_PLEN:
                raise HostFatalError(f"PLEN {plen} for PDU type {ptype:#x}")
            p = buf.peek(plen)
            if p is None:
                break
            out.append(self._parse(p, ptype, flags, hlen, pdo, plen))
            buf.consume(plen)
        return out

    def _parse(self, p: memoryview, ptype: int, flags: int, hlen: int, pdo: int, plen: int) -> Pdu:
        digested = ptype in _DIGESTED
        hd = DIGEST_LEN if digested and self.hdgst else 0
        if hd and (plen < hlen + hd or digest(p[:hlen]) != int.from_bytes(p[hlen:hlen + 4], "little")):
            raise HostFatalError("header digest error")
        data_ok = True
        data = p[plen:plen]
        if ptype == PduType.C2H_DATA:
            dd = DIGEST_LEN if self.ddgst else 0
            if pdo < hlen + hd or pdo > plen - dd:
                raise HostFatalError(f"C2HData PDO {pdo} outside the PDU")
            data = p[pdo:plen - dd]
            if dd:
                data_ok = digest(data) == int.from_bytes(p[plen - 4:plen], "little")
        elif ptype == PduType.C2H_TERM_REQ:
            data = p[hlen:plen]
        return Pdu(ptype, flags, hlen, pdo, plen, p[:hlen], data, data_ok)
