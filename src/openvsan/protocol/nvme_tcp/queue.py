"""One NVMe/TCP connection = one NVMe queue: connection set-up and data transfer (NVMe/TCP 1.0 §3.3, §3.6).

Sans-IO, in the h11 manner: `receive_data(bytes)` returns events; the `respond`/`read_data`/`request_data`
methods return the buffers to send. NVMe command semantics live in protocol/nvme; this machine knows
only PDUs, R2T bookkeeping and the negotiated parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from openvsan.protocol.nvme_tcp.framing import FatalError, Pdu, PduReader, c2h_data, capsule_resp_of, digest_bytes
from openvsan.protocol.nvme_tcp.pdu import (
    DATA_HDR,
    DGST_DATA,
    DGST_HEADER,
    F_LAST_PDU,
    IC_REQ,
    Fes,
    PduType,
    ic_resp,
    r2t_header,
    term_req,
)

ADMIN_IN_CAPSULE = 8192      # NVMe-oF 1.1 §2.4.1 / NVMe/TCP: the admin queue takes 8 KiB in capsules
C2H_CHUNK = 131072           # read data per C2HData PDU: large enough that headers cost nothing


class State(Enum):
    AWAIT_ICREQ = "await-icreq"
    READY = "ready"
    CLOSED = "closed"


@dataclass(slots=True)
class CapsuleCommand:
    """A command capsule (§3.6.2.5): the 64-byte SQE and its in-capsule data (maybe empty)."""
    sqe: memoryview
    data: memoryview
    data_ok: bool                 # False: in-capsule data failed its digest


@dataclass(slots=True)
class DataReceived:
    """All the data an R2T asked for has arrived (§3.6.2.8)."""
    cccid: int
    data: bytes | bytearray | memoryview
    data_ok: bool


@dataclass(slots=True)
class Established:
    """ICReq accepted, ICResp to send (§3.6.2.2-3)."""
    response: bytes


@dataclass(slots=True)
class Terminated:
    """A fatal transport error: send `response` (a C2HTermReq, or nothing) and close (§3.6.2.4)."""
    response: bytes
    reason: str
    by_host: bool = False


Event = CapsuleCommand | DataReceived | Established | Terminated


@dataclass(slots=True)
class _Transfer:
    cccid: int
    ttag: int
    length: int
    received: int = 0
    parts: list[memoryview] = field(default_factory=list)
    ok: bool = True


class TcpQueue:
    """The transport side of one queue: what the controller offers and what the host negotiated."""

    def __init__(self, *, in_capsule: int = 8192, maxh2cdata: int = 131072, hdgst_allowed: bool = True,
                 ddgst_allowed: bool = True) -> None:
        self.state = State.AWAIT_ICREQ
        self.in_capsule = in_capsule
        self.maxh2cdata = maxh2cdata
        self.hdgst_allowed = hdgst_allowed
        self.ddgst_allowed = ddgst_allowed
        self.reader = PduReader(max_capsule_data=max(in_capsule, ADMIN_IN_CAPSULE), max_h2c_data=maxh2cdata,
                                ic_req_only=True)
        self.hdgst = False
        self.ddgst = False
        self.hpda = 0
        self.maxr2t = 1               # R2Ts the host takes outstanding per command (ICReq MAXR2T + 1)
        self._transfers: dict[int, _Transfer] = {}   # by TTAG
        self._by_cccid: dict[int, int] = {}
        self._next_ttag = 0

    # --- moving to another worker (node/workers.py move) ---------------------------------------------------
    def moving_state(self) -> dict[str, int | bool]:
        """What ICReq negotiated, for the worker that takes this queue over (no R2T may be outstanding)."""
        if self.state is not State.READY or self._transfers:
            raise RuntimeError("only an established queue with no R2T outstanding moves")
        return {"hdgst": self.hdgst, "ddgst": self.ddgst, "hpda": self.hpda, "maxr2t": self.maxr2t,
                "next_ttag": self._next_ttag}

    def resume(self, state: dict[str, int | bool]) -> None:
        """Established as moving_state() described: no ICReq is expected."""
        self.hdgst, self.ddgst = bool(state["hdgst"]), bool(state["ddgst"])
        self.hpda, self.maxr2t = int(state["hpda"]), int(state["maxr2t"])
        self._next_ttag = int(state["next_ttag"])
        self.reader.hdgst, self.reader.ddgst = self.hdgst, self.ddgst
        self.reader.ic_req_only = False
        self.state = State.READY

    # --- receiving ------------------------------------------------------------------------------------
    def receive_data(self, data: bytes | memoryview) -> list[Event]:
        if self.state is State.CLOSED:
            return []
        events: list[Event] = []
        try:
            pdus = self.reader.receive_data(data)
            while pdus:
                for pdu in pdus:
                    ev = self._pdu(pdu)
                    if ev is not None:
                        events.append(ev)
                        if isinstance(ev, Terminated):
                            return events
                # the reader pauses after ICReq so that the negotiated digests frame what follows
                pdus = self.reader.receive_data(b"") if pdus[-1].type == PduType.IC_REQ else []
        except FatalError as e:
            events.append(self.fatal(e))
        return events

    def fatal(self, e: FatalError) -> Terminated:
        self.state = State.CLOSED
        return Terminated(term_req(e.fes, e.fei, e.header), str(e))

    def _pdu(self, pdu: Pdu) -> Event | None:
        t = pdu.type
        if self.state is State.AWAIT_ICREQ:
            if t != PduType.IC_REQ:
                if t == PduType.H2C_TERM_REQ:
                    return self._host_term(pdu)
                raise FatalError(Fes.PDU_SEQUENCE_ERROR, 0, pdu.header, f"PDU type {t:#x} before ICReq")
            return self._ic_req(pdu)
        if t == PduType.CAPSULE_CMD:
            return CapsuleCommand(pdu.header[8:72], pdu.data, pdu.data_ok)
        if t == PduType.H2C_DATA:
            return self._h2c_data(pdu)
        if t == PduType.H2C_TERM_REQ:
            return self._host_term(pdu)
        raise FatalError(Fes.PDU_SEQUENCE_ERROR, 0, pdu.header, "a second ICReq")  # only ICReq is left

    def _host_term(self, pdu: Pdu) -> Terminated:
        # §3.6.2.4: the host has given up; the controller answers nothing and closes
        self.state = State.CLOSED
        fes = int.from_bytes(pdu.header[8:10], "little")
        return Terminated(b"", f"host sent H2CTermReq FES {fes:#x}", by_host=True)

    def _ic_req(self, pdu: Pdu) -> Established:
        # NVMe/TCP 1.0 §3.6.2.2 ICReq
        pfv, hpda, dgst, maxr2t = IC_REQ.unpack_from(pdu.header, 8)
        if pfv != 0:
            raise FatalError(Fes.UNSUPPORTED_PARAMETER, 8, pdu.header, f"PFV {pfv}")
        if hpda > 31:
            raise FatalError(Fes.UNSUPPORTED_PARAMETER, 10, pdu.header, f"HPDA {hpda}")
        self.hpda = hpda
        self.maxr2t = maxr2t + 1
        self.hdgst = bool(dgst & DGST_HEADER) and self.hdgst_allowed
        self.ddgst = bool(dgst & DGST_DATA) and self.ddgst_allowed
        self.reader.hdgst, self.reader.ddgst = self.hdgst, self.ddgst
        self.state = State.READY
        # §3.6.2.3: CPDA 0 (no alignment asked of the host's data), digests as granted
        return Established(ic_resp(0, self.hdgst, self.ddgst, self.maxh2cdata))

    def _h2c_data(self, pdu: Pdu) -> DataReceived | None:
        # NVMe/TCP 1.0 §3.6.2.8 H2CData: data for an R2T we sent, in order, within its range
        _, flags, _, _, _, cccid, ttag, datao, datal, = DATA_HDR.unpack_from(pdu.header)
        tr = self._transfers.get(ttag)
        if tr is None:
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 10, pdu.header, f"H2CData for unknown TTAG {ttag}")
        if tr.cccid != cccid:
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 8, pdu.header, f"H2CData CCCID {cccid} != {tr.cccid}")
        if datal != len(pdu.data):
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 16, pdu.header, f"DATAL {datal} != {len(pdu.data)}")
        if datal > self.maxh2cdata:
            raise FatalError(Fes.DATA_TRANSFER_LIMIT_EXCEEDED, 0, pdu.header, f"DATAL {datal} > MAXH2CDATA")
        if datao + datal > tr.length:
            raise FatalError(Fes.DATA_TRANSFER_OUT_OF_RANGE, 0, pdu.header, "H2CData past the R2T")
        if datao != tr.received:
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 12, pdu.header, f"DATAO {datao}, expected {tr.received}")
        if not datal:
            raise FatalError(Fes.INVALID_PDU_HEADER_FIELD, 16, pdu.header, "empty H2CData")
        tr.parts.append(pdu.data)
        tr.received += datal
        tr.ok = tr.ok and pdu.data_ok
        last = tr.received == tr.length
        if bool(flags & F_LAST_PDU) != last:
            raise FatalError(Fes.PDU_SEQUENCE_ERROR, 0, pdu.header, "LAST_PDU flag disagrees with the R2T length")
        if not last:
            return None
        del self._transfers[ttag]
        self._by_cccid.pop(cccid, None)
        data = tr.parts[0] if len(tr.parts) == 1 else b"".join(tr.parts)
        return DataReceived(cccid, data, tr.ok)

    # --- sending --------------------------------------------------------------------------------------
    def request_data(self, cccid: int, length: int) -> bytes:
        """§3.6.2.10: one R2T for all the command's data (the host splits it by MAXH2CDATA)."""
        ttag = self._next_ttag
        while ttag in self._transfers or ttag == 0xFFFF:
            ttag = (ttag + 1) & 0xFFFF
        self._next_ttag = (ttag + 1) & 0xFFFF
        self._transfers[ttag] = _Transfer(cccid, ttag, length)
        self._by_cccid[cccid] = ttag
        hdr = r2t_header(cccid, ttag, 0, length, self.hdgst)
        return hdr + digest_bytes(hdr) if self.hdgst else hdr

    def awaiting_data(self, cccid: int) -> bool:
        return cccid in self._by_cccid

    def cancel(self, cccid: int) -> None:
        ttag = self._by_cccid.pop(cccid, None)
        if ttag is not None:
            self._transfers.pop(ttag, None)

    def respond(self, cid: int, status: int, dw0: int, dw1: int, sqhd: int, sqid: int) -> bytes:
        """§3.6.2.6 CapsuleResp for a completion (the fields of status.cqe)."""
        return capsule_resp_of(cid, status, dw0, dw1, sqhd, sqid, self.hdgst)

    def read_data(self, out: list[bytes | memoryview], cccid: int, data: bytes | bytearray | memoryview, *,
                  success: bool) -> None:
        """§3.6.2.9: the command's data in C2HData PDUs; `success` sets SUCCESS on the last (§3.6.2.9:
        then no CapsuleResp follows)."""
        view = memoryview(data)
        n = len(view)
        off = 0
        while True:
            size = min(C2H_CHUNK, n - off)
            last = off + size >= n
            c2h_data(out, cccid, off, view[off:off + size], last=last, success=success and last,
                     hdgst=self.hdgst, ddgst=self.ddgst, hpda=self.hpda)
            off += size
            if last:
                return

