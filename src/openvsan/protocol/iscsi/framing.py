"""Turning a byte stream into PDUs and PDUs into buffers to send (RFC 7143 §11.2, digests §13.1)."""

from __future__ import annotations

from collections.abc import Sequence

from crc32c import crc32c

from openvsan.protocol.iscsi.pdu import BHS_LEN, Pdu, data_segment_length, pad4, total_ahs_length

# The largest data segment we ever read before deciding what to do with it: the format allows 2^24-1.
HARD_MAX_DSL = (1 << 24) - 1
_PADS = (b"", b"\0\0\0", b"\0\0", b"\0")


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

    Received chunks are kept as they came and joined once a whole PDU is there, so a large Data-Out costs
    one copy and a PDU that arrives whole costs none (its views point into the received bytes object).
    """

    def __init__(self) -> None:
        self.header_digest = False
        self.data_digest = False
        self.max_dsl = HARD_MAX_DSL
        self._chunks: list[bytes] = []
        self._have = 0
        self._need = BHS_LEN

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished PDU held from earlier reads."""
        return self._have

    def receive_data(self, data: bytes) -> list[Pdu]:
        if not data:
            return []
        self._chunks.append(data)
        self._have += len(data)
        if self._have < self._need:
            return []
        src = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        view = memoryview(src)
        out: list[Pdu] = []
        pos, end = 0, len(src)
        hd = 4 if self.header_digest else 0
        while end - pos >= BHS_LEN:
            bhs = view[pos:pos + BHS_LEN]
            ahs_len = total_ahs_length(bhs)
            dsl = data_segment_length(bhs)
            if dsl > HARD_MAX_DSL:
                raise FramingError(f"data segment length {dsl} too large")
            dd = 4 if (self.data_digest and dsl) else 0
            hlen = BHS_LEN + ahs_len
            total = hlen + hd + dsl + pad4(dsl) + dd
            if end - pos < total:
                self._need = total
                break
            if hd and digest(view[pos:pos + hlen]) != view[pos + hlen:pos + hlen + 4]:
                raise FramingError("header digest error")
            dstart = pos + hlen + hd
            pdu = Pdu(bhs, view[pos + BHS_LEN:pos + hlen], view[dstart:dstart + dsl])
            if dd:
                padded = dsl + pad4(dsl)
                pdu.digest_ok = digest(view[dstart:dstart + padded]) == view[dstart + padded:dstart + padded + 4]
            out.append(pdu)
            pos += total
        else:
            self._need = BHS_LEN
        rest = src[pos:] if pos < end else b""
        self._chunks = [rest] if rest else []
        self._have = len(rest)
        return out


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
