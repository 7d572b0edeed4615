"""Per-command data transfer bookkeeping, free of I/O (RFC 7143 §4.2.2 (CmdSN), §10.7 (Data-Out), §10.8 (R2T),
§11.7 (Data-In)).

The server asks these objects what to send; they never send anything themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from openvsan.protocol.iscsi.keys import Params


def sn_lt(a: int, b: int) -> bool:
    """Serial number arithmetic, RFC 1982 with SERIAL_BITS = 32 (RFC 7143 §4.2.2.1)."""
    return a != b and ((a < b and b - a < 1 << 31) or (a > b and a - b > 1 << 31))


def sn_in_window(sn: int, exp: int, maxsn: int) -> bool:
    return not sn_lt(sn, exp) and not sn_lt(maxsn, sn)


@dataclass(slots=True)
class R2TState:
    ttt: int
    offset: int
    length: int
    r2tsn: int
    next_datasn: int = 0
    received: int = 0


class DataOutError(Exception):
    """A Data-Out that breaks the rules: (asc, ascq) for the sense the task ends with."""

    def __init__(self, asc: int, why: str) -> None:
        super().__init__(why)
        self.asc = asc


# SPC-4 sense codes for data phase errors (ABORTED COMMAND)
ASC_DATA_PHASE_ERROR = 0x4B00
ASC_INVALID_TTT = 0x4B01
ASC_TOO_MUCH_WRITE_DATA = 0x4B02
ASC_DATA_OFFSET_ERROR = 0x4B05
# RFC 7143 §11.4.7.2: the iSCSI conditions a write ends with (ABORTED COMMAND, WRITE ERROR)
ASC_UNEXPECTED_UNSOLICITED_DATA = 0x0C0C
ASC_INCORRECT_AMOUNT_OF_DATA = 0x0C0D


@dataclass(slots=True)
class WriteTransfer:
    """Collecting a command's Data-Out: immediate data, unsolicited Data-Out and solicited bursts (R2T)."""

    edtl: int
    want: int                       # bytes the command will use (≤ edtl)
    params: Params
    buffer: bytearray = field(default_factory=bytearray)
    unsolicited_expected: bool = False
    unsolicited_end: int = 0        # immediate + unsolicited data cover [0, unsolicited_end)
    unsolicited_datasn: int = 0
    unsolicited_received: int = 0   # immediate data and unsolicited Data-Out bytes so far
    next_r2t_offset: int = 0
    r2tsn: int = 0
    outstanding: dict[int, R2TState] = field(default_factory=dict)
    error: DataOutError | None = None

    @classmethod
    def start(cls, edtl: int, want: int, immediate: memoryview, final: bool, params: Params) -> WriteTransfer:
        t = cls(edtl, want, params, bytearray(edtl))
        n = len(immediate)
        if n:
            t.buffer[:n] = immediate
        t.unsolicited_received = n
        if not final and not params.initial_r2t:
            t.unsolicited_expected = True
            t.unsolicited_end = min(params.first_burst_length, edtl)
        else:
            t.unsolicited_end = n
        t.next_r2t_offset = t.unsolicited_end
        return t

    def r2ts(self, next_ttt: Iterator[int]) -> list[R2TState]:
        """The R2Ts to send now, within MaxOutstandingR2T and MaxBurstLength (§10.8)."""
        out = []
        while self.next_r2t_offset < self.want and len(self.outstanding) < self.params.max_outstanding_r2t:
            length = min(self.params.max_burst_length, self.want - self.next_r2t_offset)
            r = R2TState(next(next_ttt), self.next_r2t_offset, length, self.r2tsn)
            self.r2tsn += 1
            self.next_r2t_offset += length
            self.outstanding[r.ttt] = r
            out.append(r)
        return out

    def data_out(self, ttt: int, datasn: int, offset: int, data: memoryview, final: bool) -> None:
        """Place one Data-Out PDU (§11.7). Errors are remembered; the transfer still runs to its end. `data` may
        already lie in place, a view of this transfer's buffer at `offset` (placed(): the reader received it
        there): then it is not copied. Placed data that this finds wrong has landed in the buffer all the
        same; the error fails the command, so the buffer is never written anywhere.

        A sequence that ends (F bit) short of what it owed fails the command too (RFC 7143 §11.4.7.2, "incorrect
        amount of data": unsolicited data other than FirstBurstLength, or than the whole transfer when that is
        shorter, and an answer to an R2T other than its Desired Data Transfer Length), so the bytes the
        initiator never sent are never written over what the volume holds."""
        n = len(data)
        if ttt == 0xFFFFFFFF:
            if not self.unsolicited_expected:
                self._fail(DataOutError(ASC_UNEXPECTED_UNSOLICITED_DATA, "unsolicited Data-Out not expected"))
                return
            if datasn != self.unsolicited_datasn:
                self._fail(DataOutError(ASC_DATA_PHASE_ERROR, f"DataSN {datasn} != {self.unsolicited_datasn}"))
            self.unsolicited_datasn += 1
            at, self.unsolicited_received = self.unsolicited_received, self.unsolicited_received + n
            if offset + n > self.unsolicited_end:
                self._fail(DataOutError(ASC_TOO_MUCH_WRITE_DATA, "unsolicited data beyond FirstBurstLength"))
            elif offset != at and self.params.data_pdu_in_order:
                self._fail(DataOutError(ASC_DATA_OFFSET_ERROR, f"unsolicited Data-Out at {offset}, not at {at}"))
            elif self.error is None and data.obj is not self.buffer:
                self.buffer[offset:offset + n] = data
            if final:
                self.unsolicited_expected = False
                if self.unsolicited_received != self.unsolicited_end:
                    self._fail(DataOutError(ASC_INCORRECT_AMOUNT_OF_DATA, f"unsolicited data ended at "
                                            f"{self.unsolicited_received} bytes of {self.unsolicited_end}"))
            return
        r = self.outstanding.get(ttt)
        if r is None:
            self._fail(DataOutError(ASC_INVALID_TTT, f"unknown TTT 0x{ttt:08x}"))
            return
        if datasn != r.next_datasn:
            self._fail(DataOutError(ASC_DATA_PHASE_ERROR, f"DataSN {datasn} != {r.next_datasn}"))
        r.next_datasn += 1
        if offset < r.offset or offset + n > r.offset + r.length:
            self._fail(DataOutError(ASC_DATA_OFFSET_ERROR, "Data-Out outside its R2T"))
        elif offset != r.offset + r.received and self.params.data_pdu_in_order:
            # §13.18 DataPDUInOrder=Yes: a sequence's PDUs at continuously increasing offsets, no gap, no overlay
            self._fail(DataOutError(ASC_DATA_OFFSET_ERROR, f"Data-Out at {offset}, its sequence is at "
                                    f"{r.offset + r.received}"))
        elif self.error is None and data.obj is not self.buffer:
            self.buffer[offset:offset + n] = data
        r.received += n
        if final:
            del self.outstanding[ttt]
            if r.received != r.length:
                self._fail(DataOutError(ASC_INCORRECT_AMOUNT_OF_DATA, f"R2T 0x{ttt:08x} answered with "
                                        f"{r.received} bytes of {r.length}"))

    def placed(self, offset: int, n: int) -> memoryview | None:
        """Where a Data-Out's n bytes at `offset` go, for the reader to receive them straight there
        (framing.PduReader.place), or None: not while an error is recorded, nor beyond the buffer. data_out
        still judges the PDU as it judges any."""
        if self.error is not None or offset + n > len(self.buffer):
            return None
        return memoryview(self.buffer)[offset:offset + n]

    def _fail(self, e: DataOutError) -> None:
        if self.error is None:
            self.error = e

    @property
    def complete(self) -> bool:
        """Every sequence owed has ended: the command can run (or fail, with `error`). After an error no more
        R2Ts are sent (the frontend stops asking), so the transfer ends with the sequences already asked for."""
        if self.unsolicited_expected or self.outstanding:
            return False
        return self.error is not None or self.next_r2t_offset >= self.want


def data_in_segments(length: int, params: Params) -> list[tuple[int, int, bool]]:
    """(offset, size, final-of-sequence) for each Data-In PDU of a read of `length` bytes: each PDU within
    the initiator's MaxRecvDataSegmentLength, each sequence within MaxBurstLength (§11.7.4)."""
    mrdsl, burst = params.initiator_mrdsl, params.max_burst_length
    segs = []
    off = 0
    in_burst = 0
    while off < length:
        n = min(mrdsl, length - off, burst - in_burst)
        in_burst += n
        off += n
        end_of_seq = in_burst == burst or off == length
        segs.append((off - n, n, end_of_seq))
        if end_of_seq:
            in_burst = 0
    return segs
