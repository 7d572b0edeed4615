"""One NVMe/TCP queue of the host: an asyncio.Protocol over one TCP connection (NVMe/TCP 1.0 §3.3).

ICReq/ICResp first, then command capsules out and responses, C2HData and R2Ts in. The codecs are sans-IO
(protocol/nvme_tcp/host_pdus.py, protocol/nvme/host_commands.py); this class pumps and keeps command state.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from openvsan.initiator.iscsi_conn import ConnectionLost
from openvsan.initiator.watchdog import CommandWatchdog
from openvsan.netio import WriteBatcher
from openvsan.protocol.nvme import host_commands as C
from openvsan.protocol.nvme_tcp import host_pdus as H
from openvsan.protocol.nvme_tcp.framing import RESP_PLAIN, Pdu
from openvsan.protocol.nvme_tcp.pdu import F_LAST_PDU, F_SUCCESS, PduType

log = logging.getLogger("openvsan.initiator.nvme")
Buf = bytes | bytearray | memoryview
_DATA_HEADER = struct.Struct("<HHII")     # C2HData/R2T after the common header: CCCID, TTAG, offset, length
_LAST_SUCCESS = F_LAST_PDU | F_SUCCESS
_C2H_DATA = int(PduType.C2H_DATA)
# a C2HData's common header and data header in one unpack (§3.6.2.9): flags, PDO, PLEN, CCCID, offset, length
_C2H_HEADER = struct.Struct("<xBxBIHxxII")
_CAPSULE_RESP = int(PduType.CAPSULE_RESP)


@dataclass(slots=True)
class Result:
    cqe: H.Cqe
    data: Buf = b""

    @property
    def status(self) -> int:
        return self.cqe.status & 0x7FFF


Answer = Callable[["Result | None", "BaseException | None"], None]


class _Cmd:
    """A command sent and not answered: its outcome goes to its future, or to `then` (submit_then)."""

    __slots__ = ("buf", "cid", "data", "future", "read_len", "received", "sent", "then")

    def __init__(self, cid: int, read_len: int, data: memoryview | None, future: asyncio.Future[Result] | None,
                 then: Answer | None, now: float) -> None:
        self.sent = now
        self.cid = cid
        self.read_len = read_len
        self.buf: bytearray | None = None   # made at the first C2HData that does not carry the whole read
        self.data = data
        self.future = future
        self.then = then
        self.received = 0

    def answer(self, result: Result | None, exc: BaseException | None = None) -> None:
        """Its outcome, once (later ones are ignored): a result, or the exception it failed with."""
        then = self.then
        if then is not None:
            self.then = None
            then(result, exc)
            return
        fut = self.future
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]


class NvmeQueue(asyncio.Protocol):
    def __init__(self, name: str, qid: int, command_timeout: float = 30.0) -> None:
        self.name = name
        self.qid = qid
        self.loop = asyncio.get_running_loop()
        # a command unanswered this long drops the queue; the initiator reconnects and sends it again
        self.watchdog = CommandWatchdog(name, command_timeout, lambda: (c.sent for c in self.cmds.values()),
                                        self.abort)
        self.transport: asyncio.Transport | None = None
        self.reader = H.HostPduReader()
        self.alive = False
        self.hdgst = self.ddgst = False
        self.cpda = 0
        self.maxh2cdata = 4096
        self.cmds: dict[int, _Cmd] = {}
        self.lost: asyncio.Future[None] = self.loop.create_future()
        self.on_lost: Callable[[NvmeQueue], None] | None = None
        self._cid = 0
        self._icresp: asyncio.Future[H.IcResp] | None = None
        self._batch = WriteBatcher()
        # the completion a C2HData with SUCCESS stands for (§3.6.2.9): status 0; one for every such command
        self._ok = H.Cqe(0, 0, 0, qid, 0, 0)
        self._done = Result(self._ok)   # the answer of every success with no data (not changed by its callers)

    # ---------------------------------------------------------------------------------- transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._batch.transport = self.transport
        self.alive = True
        self.watchdog.start()

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        self.watchdog.stop()
        self._batch.transport = None
        err = ConnectionLost(f"{self.name}: connection lost" + (f": {exc}" if exc else ""))
        for c in self.cmds.values():
            if c.then is not None:    # after this returns (and the association is known dead), as a future's are
                self.loop.call_soon(c.answer, None, err)
            else:
                c.answer(None, err)
        self.cmds.clear()
        if self._icresp is not None and not self._icresp.done():
            self._icresp.set_exception(err)
        if not self.lost.done():
            self.lost.set_result(None)
        if self.on_lost is not None:
            self.on_lost(self)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _send(self, parts: Sequence[Buf]) -> None:
        # everything made in one event-loop turn leaves in one writelines, as the target does
        self._batch.send(parts)

    # --------------------------------------------------------------------------------- handshake
    async def initialize(self, *, hdgst: bool, ddgst: bool) -> H.IcResp:
        """§3.6.2.2-3: ICReq out, ICResp in; digests apply to every PDU after these two."""
        self._icresp = self.loop.create_future()
        self._send([H.icreq(hdgst=hdgst, ddgst=ddgst)])
        ic = await self._icresp
        if ic.pfv != 0:
            raise ConnectionLost(f"{self.name}: controller speaks PDU format version {ic.pfv}")
        if ic.hdgst != hdgst or ic.ddgst != ddgst:
            raise ConnectionLost(f"{self.name}: controller answered digests header={ic.hdgst} data={ic.ddgst}")
        self.hdgst, self.ddgst = ic.hdgst, ic.ddgst
        self.reader.hdgst, self.reader.ddgst = ic.hdgst, ic.ddgst
        self.cpda = ic.cpda
        self.maxh2cdata = max(4096, ic.maxh2cdata)
        return ic

    # ------------------------------------------------------------------------------------ receive
    def data_received(self, data: bytes) -> None:
        rest: bytes | memoryview = data
        if not (self.hdgst or self.ddgst or self.reader.buffered):
            rest = self._read_lane(data)
            if not len(rest):
                return
        try:
            pdus = self.reader.receive_data(rest)
        except H.HostFatalError as e:
            log.warning("%s: %s; dropping the connection", self.name, e)
            self.abort()
            return
        for pdu in pdus:
            if not pdu.data_ok:
                log.warning("%s: data digest error; dropping the connection", self.name)
                self.abort()
                return
            t = pdu.type
            if t == PduType.CAPSULE_RESP:
                self._response(pdu)
            elif t == PduType.C2H_DATA:
                self._c2h_data(pdu)
            elif t == PduType.R2T:
                self._r2t(pdu)
            elif t == PduType.IC_RESP:
                if self._icresp is not None and not self._icresp.done():
                    self._icresp.set_result(H.IcResp.parse(pdu))
            elif t == PduType.C2H_TERM_REQ:
                fes = int.from_bytes(pdu.header[8:10], "little")
                log.warning("%s: controller ended the connection (C2HTermReq, FES %#x)", self.name, fes)
                self.abort()
                return

    def _read_lane(self, data: bytes) -> bytes | memoryview:
        """The lane for what a controller sends most, at the front of a receive, without digests: a
        CapsuleResp (§3.6.2.6), and, to a host that turned SQ flow control off, a whole read in one C2HData
        with LAST_PDU and SUCCESS (§3.6.2.9), whose data is the result (a view of the receive, as in
        _c2h_data). Returns what is left for the PDU reader: from the first PDU that is anything else, is
        cut by the end of the receive, or is a C2HData that is not exactly the whole read of a command
        waiting for one (_c2h_data judges those)."""
        n = len(data)
        pos = 0
        cmds = self.cmds
        view: memoryview | None = None
        completed = self._completed
        while n - pos >= 24 and data[pos + 2] == 24:
            t = data[pos]
            if t == _CAPSULE_RESP:
                t, flags, _, pdo, plen, dw0, dw1, sqhd, sqid, cid, sf = RESP_PLAIN.unpack_from(data, pos)
                if flags or pdo or plen != 24:
                    break
                completed(dw0, dw1, sqhd, sqid, cid, sf)
                pos += 24
                continue
            if t != _C2H_DATA:
                break
            flags, pdo, plen, cccid, offset, length = _C2H_HEADER.unpack_from(data, pos)
            end = pos + plen
            if flags != _LAST_SUCCESS or end > n or pdo < 24 or pdo > plen:
                break
            c = cmds.get(cccid)
            if c is None or offset or length != plen - pdo or length != c.read_len or c.buf is not None:
                break
            del cmds[cccid]
            if view is None:
                view = memoryview(data)
            c.answer(Result(self._ok, view[pos + pdo:end]))
            pos = end
        return data if not pos else (view[pos:] if view is not None else data[pos:])

    def _response(self, pdu: Pdu) -> None:  # §3.6.2.6
        self._completed(*RESP_PLAIN.unpack_from(pdu.header)[5:])   # the CQE after the common header

    def _completed(self, dw0: int, dw1: int, sqhd: int, sqid: int, cid: int, sf: int) -> None:
        """A CQE in: its command's result (a success with nothing in DW0/DW1 shares one Cqe)."""
        c = self.cmds.pop(cid, None)
        if c is None:
            return
        if dw0 or dw1 or sf >> 1:
            c.answer(Result(H.Cqe(dw0, dw1, sqhd, sqid, cid, sf >> 1), c.buf if c.buf is not None else b""))
        elif c.buf is None and c.then is not None:
            then, c.then = c.then, None
            then(self._done, None)      # answer()'s first case, the fast path's every success
        else:
            c.answer(self._done if c.buf is None else Result(self._ok, c.buf))

    def _c2h_data(self, pdu: Pdu) -> None:  # §3.6.2.9
        cccid, _, offset, length = _DATA_HEADER.unpack_from(pdu.header, 8)
        c = self.cmds.get(cccid)
        data = pdu.data
        n = len(data)
        if c is None or not c.read_len or offset + n > c.read_len or n != length:
            log.warning("%s: C2HData for an unknown command or past its buffer; dropping the connection", self.name)
            self.abort()
            return
        # §3.6.2.9: SUCCESS means no CapsuleResp follows; the command completed without error
        success = pdu.flags & _LAST_SUCCESS == _LAST_SUCCESS
        if success and offset == 0 and n == c.read_len and c.buf is None:
            # the whole read in one PDU: its data is the result, no copy (a view of the received bytes)
            del self.cmds[cccid]
            c.answer(Result(self._ok, data))
            return
        if c.buf is None:
            c.buf = bytearray(c.read_len)
        c.buf[offset:offset + n] = data
        c.received += n
        if success:
            del self.cmds[cccid]
            c.answer(Result(self._ok, c.buf))

    def _r2t(self, pdu: Pdu) -> None:  # §3.6.2.10 → H2CData §3.6.2.8
        h = H.DataHeader.parse(pdu)
        c = self.cmds.get(h.cccid)
        if c is None or c.data is None or h.offset + h.length > len(c.data) or h.length == 0:
            log.warning("%s: R2T for an unknown command or past its data; dropping the connection", self.name)
            self.abort()
            return
        out: list[Buf] = []
        off, end = h.offset, h.offset + h.length
        while off < end:
            n = min(self.maxh2cdata, end - off)
            out += H.h2c_data(c.cid, h.ttag, off, c.data[off:off + n], last=off + n >= end, hdgst=self.hdgst,
                              ddgst=self.ddgst, cpda=self.cpda)
            off += n
        self._send(out)

    # ------------------------------------------------------------------------------------ submit
    def _next_cid(self) -> int:
        cid = (self._cid + 1) & 0xFFFF
        if cid in self.cmds:   # a command that long outstanding: look further
            for _ in range(65535):
                cid = (cid + 1) & 0xFFFF
                if cid not in self.cmds:
                    break
            else:
                raise ConnectionLost(f"{self.name}: no free command id")
        self._cid = cid
        return cid

    def submit(self, build: Callable[[int], bytes], *, data: Buf | None = None, read_len: int = 0,
               in_capsule: bool = False) -> asyncio.Future[Result]:
        """Send one command capsule; `build(cid)` makes its SQE. Data goes in the capsule or waits for R2T."""
        fut: asyncio.Future[Result] = self.loop.create_future()
        self._enqueue(build, memoryview(data).cast("B") if data is not None else None, read_len, in_capsule, fut,
                      None)
        return fut

    def submit_then(self, build: Callable[[int], bytes], data: memoryview | None, in_capsule: bool,
                    then: Answer) -> None:
        """submit() for a caller with no coroutine (a write_soon, a read_soon), its data a memoryview of bytes
        (format "B"): `then(result, None)` once answered, or `then(None, exc)` once it failed (the connection
        lost), called from the receive that ends it."""
        self._enqueue(build, data, 0, in_capsule, None, then)

    def read_then(self, nsid: int, lba: int, blocks: int, n: int, then: Answer) -> None:
        """submit_then of a Read of `blocks` (`n` bytes) at `lba` (read_soon): with no header digest its capsule is
        H.read_capsule's one pack, else capsule_cmd's (the general encoder)."""
        if self.hdgst:
            self._enqueue(lambda cid: C.read(cid, nsid, lba, blocks, n), None, n, False, None, then)
            return
        if not self.alive:
            raise ConnectionLost(f"{self.name}: not connected")
        cid = self._next_cid()
        self.cmds[cid] = _Cmd(cid, n, None, None, then, self.loop.time())
        self._batch.send((H.read_capsule(cid, nsid, lba, blocks, n),))

    def write_then(self, nsid: int, lba: int, blocks: int, mv: memoryview, fua: bool, then: Answer) -> None:
        """submit_then of a Write with its data (a memoryview of bytes) in the capsule: with no digest and no CPDA
        padding its header is H.write_capsule's one pack, else capsule_cmd's (the general encoder)."""
        if self.hdgst or self.ddgst or self.cpda:
            self._enqueue(lambda cid: C.write(cid, nsid, lba, blocks, len(mv), fua=fua, in_capsule=True), mv, 0, True,
                          None, then)
            return
        if not self.alive:
            raise ConnectionLost(f"{self.name}: not connected")
        cid = self._next_cid()
        self.cmds[cid] = _Cmd(cid, 0, None, None, then, self.loop.time())
        self._batch.send((H.write_capsule(cid, nsid, lba, blocks, len(mv), fua), mv))

    def _enqueue(self, build: Callable[[int], bytes], mv: memoryview | None, read_len: int, in_capsule: bool,
                 fut: asyncio.Future[Result] | None, then: Answer | None) -> None:
        if not self.alive:
            raise ConnectionLost(f"{self.name}: not connected")
        cid = self._next_cid()
        self.cmds[cid] = _Cmd(cid, read_len, None if in_capsule else mv, fut, then, self.loop.time())
        payload: Buf = mv if (in_capsule and mv is not None) else b""
        self._send(H.capsule_cmd(build(cid), payload, hdgst=self.hdgst, ddgst=self.ddgst, cpda=self.cpda))

    def forget(self, fut: asyncio.Future[Result]) -> None:
        for cid, c in list(self.cmds.items()):
            if c.future is fut:
                del self.cmds[cid]
