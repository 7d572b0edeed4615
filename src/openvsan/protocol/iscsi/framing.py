"""Turning a byte stream into PDUs and PDUs into buffers to send (RFC 7143 §11.2, digests §13.1)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NoReturn

from crc32c import crc32c

from openvsan.protocol.iscsi.pdu import BHS_LEN, Op, Pdu, data_segment_length, pad4, total_ahs_length
from openvsan.protocol.recvbuf import RecvBuffer

# What the format itself allows: DataSegmentLength is 24 bits, TotalAHSLength 8 bits of 4-byte words (§11.2.1)
HARD_MAX_DSL = (1 << 24) - 1
HARD_MAX_AHS = 255 * 4
LOGIN_MAX_DSL = 8192   # §13.12: MaxRecvDataSegmentLength is 8192 until the login negotiates it (§6.1, §7.2)
_PADS = (b"", b"\0\0\0", b"\0\0", b"\0")
_U32 = struct.Struct(">I")

# Where a Data-Out's payload goes (PduReader.place): given the PDU's BHS and DataSegmentLength, the memory the
# payload belongs in (the command's buffer at the PDU's Buffer Offset), or None
Placer = Callable[[memoryview, int], memoryview | None]
_DATA_OUT = int(Op.DATA_OUT)


class FramingError(Exception):
    """The stream cannot be parsed further (a header digest error, a length past any limit): at
    ErrorRecoveryLevel 0 the connection must be dropped (RFC 7143 §7.1.1, §7.8)."""


class LengthError(FramingError):
    """A header declares more than the phase allows (a data segment beyond the MaxRecvDataSegmentLength in
    force, or an AHS where none may be): refused from the header alone, before any of its data is held.
    `bhs` is the offending Basic Header Segment, for the Login Response or Reject that answers it."""

    def __init__(self, bhs: bytes, why: str) -> None:
        super().__init__(why)
        self.bhs = bhs


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

    `max_dsl` and `max_ahs` are what the current phase allows (the target sets LOGIN_MAX_DSL and no AHS
    before login, then the MaxRecvDataSegmentLength it declared): a header declaring more raises LengthError
    as soon as the header is in, so what is held never exceeds one header plus one PDU of that size.

    `place` (a target sets it): a SCSI Data-Out PDU that straddles reads is not joined where `place` gives
    memory for its payload: the payload is copied from the reads straight there (one copy instead of the join
    and the copy into the command's buffer), and the PDU's `data` is that memory. What `place` sees must be
    current, every PDU before this one handed on: a PDU that straddles reads is always the first one a call
    completes (every whole PDU held from before was returned by an earlier call), and the reader checks that
    nothing is waiting ahead of it all the same. Never with data digests (the digest is checked over the
    received bytes).
    """

    def __init__(self) -> None:
        self.header_digest = False
        self.data_digest = False
        self.max_dsl = HARD_MAX_DSL
        self.max_ahs = HARD_MAX_AHS
        self.place: Placer | None = None
        self._buf = RecvBuffer()

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished PDU held from earlier reads."""
        return self._buf.size

    def take_buffered(self) -> bytes:
        """The bytes of the unfinished PDU held from earlier reads, as received; none are held afterwards."""
        return self._buf.take()

    def receive_data(self, data: bytes | memoryview) -> list[Pdu]:
        buf = self._buf
        out: list[Pdu] = []
        if not buf.size and not self.header_digest and not self.data_digest:
            # nothing held from before: the whole PDUs at the front are views of `data` itself, with no trip
            # through the buffer; only an unfinished one at the end is kept
            pos = self._whole_pdus(data, out, self.max_dsl, self.max_ahs)
            if pos == len(data):
                return out
            data = memoryview(data)[pos:] if pos else data
        buf.append(data)
        hd = 4 if self.header_digest else 0
        max_dsl, max_ahs = self.max_dsl, self.max_ahs
        while True:
            bhs = buf.peek(BHS_LEN)
            if bhs is None:
                break
            ahs_len = total_ahs_length(bhs)
            dsl = data_segment_length(bhs)
            hlen = BHS_LEN + ahs_len
            if hd:
                # §7.8: a header that fails its digest is not believed, lengths included
                head = buf.peek(hlen + hd)
                if head is None:
                    break
                if digest(head[:hlen]) != head[hlen:hlen + 4]:
                    raise FramingError("header digest error")
                bhs = head[:BHS_LEN]
            if dsl > max_dsl or ahs_len > max_ahs:
                self._refuse(bhs, ahs_len, dsl)
            dd = 4 if (self.data_digest and dsl) else 0
            total = hlen + hd + dsl + pad4(dsl) + dd
            dstart = hlen + hd
            if (self.place is not None and not out and not dd and bhs[0] & 0x3F == _DATA_OUT
                    and buf.size >= total and not buf.contiguous(total)):
                target = self.place(bhs, dsl)
                if target is not None:
                    held = buf.peek(hlen)
                    assert held is not None   # hlen < total <= size
                    head = memoryview(bytes(held))
                    buf.copy_into(dstart, target)
                    out.append(Pdu(head[:BHS_LEN], head[BHS_LEN:hlen], target))
                    buf.consume(total)
                    continue
            view = buf.peek(total)
            if view is None:
                break
            pdu = Pdu(view[:BHS_LEN], view[BHS_LEN:hlen], view[dstart:dstart + dsl])
            if dd:
                padded = dsl + pad4(dsl)
                pdu.digest_ok = digest(view[dstart:dstart + padded]) == view[dstart + padded:dstart + padded + 4]
            out.append(pdu)
            buf.consume(total)
        buf.compact()   # what is left waits for the next receive: it must not pin this one
        return out

    def _refuse(self, bhs: memoryview, ahs_len: int, dsl: int) -> NoReturn:
        """Drop everything held and raise LengthError: nothing of the refused PDU is kept."""
        header = bytes(bhs)
        self._buf = RecvBuffer()
        if ahs_len > self.max_ahs:
            raise LengthError(header, f"TotalAHSLength {ahs_len} beyond the {self.max_ahs} allowed now")
        raise LengthError(header, f"DataSegmentLength {dsl} beyond MaxRecvDataSegmentLength {self.max_dsl}")

    @staticmethod
    def _whole_pdus(data: bytes | memoryview, out: list[Pdu], max_dsl: int, max_ahs: int) -> int:
        """Append the whole PDUs at the front of `data` (no digests) to `out`; returns where they end (at the
        first one cut short or longer than the limits, which the general path then judges)."""
        view = memoryview(data)
        n = len(view)
        pos = 0
        while n - pos >= BHS_LEN:
            word = _U32.unpack_from(view, pos + 4)[0]      # TotalAHSLength (4-byte words), DataSegmentLength
            dsl = word & 0xFFFFFF
            ahs = (word >> 24) * 4
            dstart = pos + BHS_LEN + ahs
            end = dstart + dsl + (-dsl & 3)
            if end > n or dsl > max_dsl or ahs > max_ahs:
                break
            out.append(Pdu(view[pos:pos + BHS_LEN], view[pos + BHS_LEN:dstart], view[dstart:dstart + dsl]))
            pos = end
        return pos


def wire_bytes(pdu: Pdu, *, header_digest: bool = False, data_digest: bool = False) -> bytes:
    """A received PDU as it came on the wire (digests made again, so one whose data digest failed comes out
    with a good one: callers hand on only PDUs that passed)."""
    return b"".join(frame(bytes(pdu.bhs) + bytes(pdu.ahs), pdu.data, header_digest=header_digest,
                          data_digest=data_digest))


def frame(bhs: bytes, data: Sequence[bytes | memoryview] | bytes | memoryview = b"", *,
          header_digest: bool = False, data_digest: bool = False) -> list[bytes | memoryview]:
    """The buffers of one PDU, ready for transport.writelines (no copy of the payload)."""
    parts: list[bytes | memoryview] = [bhs]
    if header_digest:
        parts.append(digest(bhs))
    if isinstance(data, (bytes, bytearray, memoryview)):
        n = len(data)
        data = [data] if n else []
    else:
        n = sum(len(d) for d in data)
    if n:
        parts.extend(data)
        pad = _PADS[n & 3]
        if pad:
            parts.append(pad)
        if data_digest:
            parts.append(digest(*data, pad))
    return parts
