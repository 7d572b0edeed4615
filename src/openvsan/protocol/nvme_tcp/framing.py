"""Byte stream <-> NVMe/TCP PDUs (NVMe/TCP 1.0 §3.6.1 framing, §3.6.2 PDU layouts, §3.5.3 digests)."""

from __future__ import annotations

import struct

from crc32c import crc32c

from openvsan.protocol.nvme.status import CQE_LAYOUT, cqe
from openvsan.protocol.nvme_tcp.pdu import (
    CH,
    CH_LEN,
    DATA_HDR,
    DIGEST_LEN,
    F_DDGST,
    F_HDGST,
    F_LAST_PDU,
    F_SUCCESS,
    HLEN,
    HOST_TO_CONTROLLER,
    RESP_CH,
    TERM_REQ_MAX_PLEN,
    Fes,
    PduType,
)
from openvsan.protocol.recvbuf import RecvBuffer

_ZEROS = bytes(128)
DIGESTED = frozenset({PduType.CAPSULE_CMD, PduType.CAPSULE_RESP, PduType.H2C_DATA, PduType.C2H_DATA,
                      PduType.R2T})


class FatalError(Exception):
    """A fatal transport error: the controller answers with C2HTermReq and closes (§3.6.2.4, §3.5.4)."""

    def __init__(self, fes: int, fei: int, header: bytes | memoryview, why: str) -> None:
        super().__init__(why)
        self.fes = fes
        self.fei = fei
        self.header = bytes(header)


def digest(*parts: bytes | bytearray | memoryview) -> int:
    """CRC32C (§3.5.3: the same digest as iSCSI); sent little-endian."""
    crc = 0
    for p in parts:
        crc = crc32c(p, crc)
    return crc


def digest_bytes(*parts: bytes | bytearray | memoryview) -> bytes:
    return digest(*parts).to_bytes(4, "little")


class Pdu:
    """One received PDU; header and data are views into the received bytes (no copy)."""

    __slots__ = ("data", "data_ok", "flags", "header", "hlen", "pdo", "plen", "type")

    def __init__(self, ptype: int, flags: int, hlen: int, pdo: int, plen: int, header: memoryview,
                 data: memoryview, data_ok: bool) -> None:
        self.type = ptype
        self.flags = flags
        self.hlen = hlen
        self.pdo = pdo
        self.plen = plen
        self.header = header      # HLEN bytes, the common header included
        self.data = data          # PDU DATA, without padding or digest
        self.data_ok = data_ok    # False: the data digest did not match (§3.5.3: not fatal)


class PduReader:
    """Feeds on received bytes, returns whole PDUs; raises FatalError on what §3.6.1/§3.6.2 forbid.

    Lengths are judged from the 8-byte common header before the rest is buffered, so a PLEN of 4 GiB
    costs nothing. Chunks are joined once per batch: a PDU that arrives whole costs no copy. While
    `ic_req_only` (a queue not yet initialized) any type but ICReq and H2CTermReq is refused from its
    header too, so what a peer that has not sent ICReq can make us hold is one 128-byte ICReq.
    """

    def __init__(self, *, max_capsule_data: int = 8192, max_h2c_data: int = 131072,
                 ic_req_only: bool = False) -> None:
        self.hdgst = False
        self.ddgst = False
        self.max_capsule_data = max_capsule_data
        self.max_h2c_data = max_h2c_data
        self.ic_req_only = ic_req_only
        self._buf = RecvBuffer()

    def _check_ch(self, ch: memoryview) -> int:
        """Validate a common header (§3.6.1); returns PLEN."""
        ptype, flags, hlen, pdo, plen = CH.unpack_from(ch)
        if ptype not in HOST_TO_CONTROLLER:
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 0, ch, f"PDU type {ptype:#x} not host-to-controller")
        if self.ic_req_only and ptype != PduType.IC_REQ and ptype != PduType.H2C_TERM_REQ:
            # §3.3: the connection starts with ICReq/ICResp; nothing else is read, or held, before it
            raise FatalError(Fes.PDU_SEQUENCE_ERROR, 0, ch, f"PDU type {ptype:#x} before ICReq")
        if hlen != HLEN[ptype]:   # an int finds the IntEnum key; no PduType(...) call per PDU
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 2, ch, f"HLEN {hlen} for PDU type {ptype:#x}")
        digested = ptype in DIGESTED
        hd = DIGEST_LEN if digested and self.hdgst else 0
        if digested and bool(flags & F_HDGST) != self.hdgst:
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 1, ch, "HDGSTF differs from the negotiated digest")
        if flags & F_DDGST and not (digested and self.ddgst):
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 1, ch, "DDGSTF without a negotiated data digest")
        if plen < hlen + hd:
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 4, ch, f"PLEN {plen} shorter than the header")
        if ptype == PduType.IC_REQ:
            if plen != 128:
                raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 4, ch, f"ICReq PLEN {plen}")
        elif ptype == PduType.H2C_TERM_REQ:
            if plen > TERM_REQ_MAX_PLEN:
                raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 4, ch, f"H2CTermReq PLEN {plen}")
        else:
            limit = self.max_capsule_data if ptype == PduType.CAPSULE_CMD else self.max_h2c_data
            if plen > hlen + hd + 256 + limit + DIGEST_LEN:
                raise FatalError(Fes.DATA_TRANSFER_LIMIT_EXCEEDED, 0, ch, f"PLEN {plen} beyond {limit} bytes of data")
            if plen > hlen + hd:
                dd = DIGEST_LEN if self.ddgst else 0
                if self.ddgst and not flags & F_DDGST:
                    raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 1, ch, "data without the negotiated data digest")
                if pdo < hlen + hd or pdo > plen - dd:
                    raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 3, ch, f"PDO {pdo} outside the PDU")
                if plen - dd - pdo > limit:
                    raise FatalError(Fes.DATA_TRANSFER_LIMIT_EXCEEDED, 0, ch, f"{plen - dd - pdo} bytes of data")
        return int(plen)

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished PDU held from earlier reads."""
        return self._buf.size

    def take_buffered(self) -> bytes:
        """The bytes of the unfinished PDU held from earlier reads, as received; none are held afterwards."""
        return self._buf.take()

    def receive_data(self, data: bytes | memoryview) -> list[Pdu]:
        """Whole PDUs in `data` and what was buffered before. Parsing stops after an ICReq: the digests it
        negotiates apply to the bytes behind it, so call again (with b"") once it is handled."""
        buf = self._buf
        buf.append(data)
        out: list[Pdu] = []
        while True:
            ch = buf.peek(CH_LEN)
            if ch is None:
                break
            plen = self._check_ch(ch)
            p = buf.peek(plen)
            if p is None:
                break
            out.append(self._parse(p))
            buf.consume(plen)
            if p[0] == PduType.IC_REQ:
                self.ic_req_only = False
                break
        buf.compact()   # what is left waits for the next receive: it must not pin this one
        return out

    def _parse(self, p: memoryview) -> Pdu:
        ptype, flags, hlen, pdo, plen = CH.unpack_from(p)
        digested = ptype in DIGESTED
        hd = DIGEST_LEN if digested and self.hdgst else 0
        if hd:
            got = int.from_bytes(p[hlen:hlen + 4], "little")
            if digest(p[:hlen]) != got:
                raise FatalError(Fes.HEADER_DIGEST_ERROR, got, p[:hlen], "header digest error")
        data_ok = True
        if plen > hlen + hd and digested:
            dd = DIGEST_LEN if self.ddgst else 0
            data = p[pdo:plen - dd]
            if dd:
                data_ok = digest(data) == int.from_bytes(p[plen - 4:plen], "little")
        elif ptype == PduType.H2C_TERM_REQ:
            data = p[hlen:plen]
        else:
            data = p[plen:plen]
        return Pdu(ptype, flags, hlen, pdo, plen, p[:hlen], data, data_ok)


# --- sending (controller to host) ---------------------------------------------------------------------
def capsule_resp(cqe: bytes, hdgst: bool) -> bytes:
    """§3.6.2.6 CapsuleResp: common header + 16-byte CQE (+ header digest)."""
    if hdgst:
        hdr = RESP_CH.pack(PduType.CAPSULE_RESP, F_HDGST, 24, 0, 28) + cqe
        return hdr + digest_bytes(hdr)
    return RESP_CH.pack(PduType.CAPSULE_RESP, 0, 24, 0, 24) + cqe


_CAPSULE_RESP = int(PduType.CAPSULE_RESP)
# a CapsuleResp without a header digest, RESP_CH and the CQE in one: the target packs it, the host's lane
# (initiator/nvme_conn.py) and its PDU reader's answers unpack it
RESP_PLAIN = struct.Struct("<BBBBI" + CQE_LAYOUT)


def capsule_resp_of(cid: int, status: int, dw0: int, dw1: int, sqhd: int, sqid: int, hdgst: bool) -> bytes:
    """The CapsuleResp for a completion given by its fields (status.cqe's): what the target sends for every
    command, on its normal and its fast path. Without a header digest, one pack."""
    if hdgst:
        return capsule_resp(cqe(cid, status, dw0, dw1, sqhd, sqid), True)
    return RESP_PLAIN.pack(_CAPSULE_RESP, 0, 24, 0, 24, dw0 & 0xFFFFFFFF, dw1 & 0xFFFFFFFF, sqhd, sqid, cid,
                            (status << 1) & 0xFFFF)


def c2h_data(out: list[bytes | memoryview], cccid: int, offset: int, data: bytes | memoryview, *, last: bool,
             success: bool, hdgst: bool, ddgst: bool, hpda: int) -> None:
    """§3.6.2.9 C2HData: header, header digest, pad to the host's alignment (HPDA), data, data digest."""
    n = len(data)
    hd = DIGEST_LEN if hdgst else 0
    align = (hpda + 1) * 4
    pdo = -(-(24 + hd) // align) * align
    dd = DIGEST_LEN if ddgst else 0
    flags = (F_HDGST if hdgst else 0) | (F_DDGST if ddgst else 0)
    if last:
        flags |= F_LAST_PDU | (F_SUCCESS if success else 0)
    hdr = DATA_HDR.pack(PduType.C2H_DATA, flags, 24, pdo, pdo + n + dd, cccid, 0, offset, n)
    out.append(hdr)
    if hd:
        out.append(digest_bytes(hdr))
    pad = pdo - 24 - hd
    if pad:
        out.append(_ZEROS[:pad])
    out.append(data)
    if dd:
        out.append(digest_bytes(data))
