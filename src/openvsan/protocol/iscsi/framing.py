"""Turning a byte stream into PDUs and PDUs into buffers to send (RFC 7143 §11.2, digests §13.1)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from crc32c import crc32c

from openvsan.protocol.iscsi.pdu import BHS_LEN, Pdu, data_segment_length, pad4, total_ahs_length
from openvsan.protocol.recvbuf import RecvBuffer

# The largest data segment we ever read before deciding what to do with it: the format allows 2^24-1.
HARD_MAX_DSL = (1 << 24) - 1
_PADS = (b"", b"\0\0\0", b"\0\0", b"\0")
_U32 = struct.Struct(">I")


class FramingError(Exception):
    """The stream cannot be parsed further (a header digest error, a length past any limit): at
    ErrorRecoveryLevel 0 the connection must be dropped (RFC 7143 §7.1.1, §7.8)."""


def digest(*parts: bytes | memoryview) -> bytes:
    """CRC32C as iSCSI sends it: the 32-bit value least significant byte first (RFC 7143 §13.1, B.4)."""
    crc = 0
    for p in parts:
        crc = crc32c(p, crc)
    return crc.to_bytes(4, "little")


class PduReader:
    """Feeds on received bytes, yields whole PDUs.

    A PDU that arrives inside one read costs no copy (its views point into the received bytes); one that
    straddles reads is joined once, copying only its own bytes (netio.RecvBuffer).
    """

    def __init__(self) -> None:
        self.header_digest = False
        self.data_digest = False
        self.max_dsl = HARD_MAX_DSL
        self._buf = RecvBuffer()

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished PDU held from earlier reads."""
        return self._buf.size

    def receive_data(self, data: bytes | memoryview) -> list[Pdu]:
        buf = self._buf
        out: list[Pdu] = []
        if not buf.size and not self.header_digest and not self.data_digest:
            # nothing held from before: the whole PDUs at the front are views of `data` itself, with no trip
            # through the buffer; only an unfinished one at the end is kept
            pos = self._whole_pdus(data, out)
            if pos == len(data):
                return out
            data = memoryview(data)[pos:] if pos else data
        buf.append(data)
        hd = 4 if self.header_digest else 0
        while True:
            bhs = buf.peek(BHS_LEN)
            if bhs is None:
                break
            ahs_len = total_ahs_length(bhs)
            dsl = data_segment_length(bhs)
            if dsl > HARD_MAX_DSL:
                raise FramingError(f"data segment length {dsl} too large")
            dd = 4 if (self.data_digest and dsl) else 0
            hlen = BHS_LEN + ahs_len
            total = hlen + hd + dsl + pad4(dsl) + dd
            view = buf.peek(total)
            if view is None:
                break
            if hd and digest(view[:hlen]) != view[hlen:hlen + 4]:
                raise FramingError("header digest error")
            dstart = hlen + hd
            pdu = Pdu(view[:BHS_LEN], view[BHS_LEN:hlen], view[dstart:dstart + dsl])
            if dd:
                padded = dsl + pad4(dsl)
                pdu.digest_ok = digest(view[dstart:dstart + padded]) == view[dstart + padded:dstart + padded + 4]
            out.append(pdu)
            buf.consume(total)
        return out

    @staticmethod
    def _whole_pdus(data: bytes | memoryview, out: list[Pdu]) -> int:
        """Append the whole PDUs at the front of `data` (no digests) to `out`; returns where they end."""
        view = memoryview(data)
        n = len(view)
        pos = 0
        while n - pos >= BHS_LEN:
            word = _U32.unpack_from(view, pos + 4)[0]      # TotalAHSLength (4-byte words), DataSegmentLength
            dsl = word & 0xFFFFFF
            dstart = pos + BHS_LEN + (word >> 24) * 4
            end = dstart + dsl + (-dsl & 3)
            if end > n:
                break
            out.append(Pdu(view[pos:pos + BHS_LEN], view[pos + BHS_LEN:dstart], view[dstart:dstart + dsl]))
            pos = end
        return pos


def frame(bhs: bytes, data: Sequence[bytes | memoryview] | bytes | memoryview = b"", *,
          header_digest: bool = False, data_digest: bool = False) -> list[bytes | memoryview]:
    """The buffers of one PDU, ready for transport.writelines (no copy of the payload)."""
    parts: list[bytes | memoryview] = [bhs]
    if header_digest:
        parts.append(digest(bhs))
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = [data] if len(data) else []
    n = sum(len(d) for d in data)
    if n:
        parts.extend(data)
        pad = _PADS[n & 3]
        if pad:
            parts.append(pad)
        if data_digest:
            parts.append(digest(*data, pad))
    return parts
