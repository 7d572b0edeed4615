"""One iSCSI connection of the initiator: an asyncio.Protocol that logs in, then carries SCSI commands.

We negotiate MaxConnections=1 and ErrorRecoveryLevel=0, so a session is exactly one connection and the
command window (CmdSN, ExpCmdSN, MaxCmdSN, RFC 7143 §4.2.2) lives here too. The PDU codecs and the login
state machine are sans-IO (protocol/iscsi/initiator_pdus.py, initiator_login.py); this class only pumps.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openvsan.initiator.watchdog import CommandWatchdog
from openvsan.netio import WriteBatcher
from openvsan.protocol.iscsi import initiator_pdus as Q
from openvsan.protocol.iscsi.framing import FramingError, PduReader, frame
from openvsan.protocol.iscsi.initiator_login import InitiatorLogin, LoginConfig, LoginError, SessionParams
from openvsan.protocol.iscsi.keys import encode_text, parse_text
from openvsan.protocol.iscsi.pdu import RESERVED_TAG, Op, Pdu
from openvsan.protocol.iscsi.sequencing import sn_lt

log = logging.getLogger("openvsan.initiator.iscsi")
M32 = 0xFFFFFFFF
# Data-In (§11.7.1): flags, status, ITT, StatSN, Buffer Offset, Residual Count, in one unpack
_DATA_IN = struct.Struct(">xBxB12xI4xI8x4xII")
_EXP_MAX = struct.Struct(">II")
_U32 = struct.Struct(">I")
_BHS = 48
_DATA_IN_OP = int(Op.DATA_IN)
_FINAL_STATUS = Q.F_FINAL | Q.F_STATUS   # a Data-In that ends its command with GOOD-or-not status, no residual
# a SCSI Response's flags, response, status, TotalAHSLength+DataSegmentLength, ITT and StatSN (§11.4)
_RESPONSE = struct.Struct(">xBBBI8xI4xI")
_RESPONSE_OP = int(Op.SCSI_RSP)
_FINAL = Q.F_FINAL      # a SCSI Response with no residual flag set
Buf = bytes | bytearray | memoryview


class ConnectionLost(Exception):
    """The connection went away (or was dropped by us) with the command outstanding: send it again."""


@dataclass(slots=True)
class Completion:   # not frozen: a frozen dataclass's __init__ goes through object.__setattr__ (one per command)
    status: int
    data: Buf = b""
    sense: bytes = b""


Answer = Callable[["Completion | None", "BaseException | None"], None]


class _Task:
    """A command sent and not answered: its outcome goes to its future, or to `then` (command_then)."""

    __slots__ = ("buf", "data", "future", "itt", "lun", "read_len", "received", "sent", "then")

    def __init__(self, lun: bytes, read_len: int, data: memoryview | None, future: asyncio.Future[Any] | None,
                 then: Answer | None, now: float) -> None:
        self.sent = now
        self.itt = 0
        self.lun = lun
        self.read_len = read_len
        self.data = data
        self.future = future
        self.then = then
        self.buf: bytearray | None = None   # made at the first Data-In that does not carry the whole read
        self.received = 0

    def answer(self, c: Completion) -> None:
        """Its outcome, once (later ones are ignored)."""
        then = self.then
        if then is not None:
            self.then = None
            then(c, None)
        elif self.future is not None and not self.future.done():
            self.future.set_result(c)

    def fail(self, e: BaseException) -> None:
        then = self.then
        if then is not None:
            self.then = None
            then(None, e)
        elif self.future is not None and not self.future.done():
            self.future.set_exception(e)


class IscsiConnection(asyncio.Protocol):
    def __init__(self, name: str = "", command_timeout: float = 30.0) -> None:
        self.name = name
        self.loop = asyncio.get_running_loop()
        # a command unanswered this long drops the connection; the session sends it again after login
        self.watchdog = CommandWatchdog(name, command_timeout, lambda: (t.sent for t in self.tasks.values()),
                                        self.abort)
        self.transport: asyncio.Transport | None = None
        self.reader = PduReader()
        self.params = SessionParams()
        self.tasks: dict[int, _Task] = {}
        self.alive = False
        self.lost: asyncio.Future[None] = self.loop.create_future()
        self.cmdsn = 1
        self.expstatsn = 0
        self.expcmdsn = 1
        self.maxcmdsn = 1
        self._itt = 0
        self._window = asyncio.Event()
        self._batch = WriteBatcher()
        self._paused: asyncio.Future[None] | None = None
        self._login: InitiatorLogin | None = None
        self._login_fut: asyncio.Future[None] | None = None
        self._text_fut: asyncio.Future[tuple[Q.TextResponse, bytes]] | None = None
        self._logout_fut: asyncio.Future[Q.LogoutResponse] | None = None
        self._pings: dict[int, asyncio.Future[None]] = {}
        self.on_async_logout: Any = None  # called when the target asks us to log out (§11.9.1)

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
        for t in self.tasks.values():
            if t.then is not None:
                # a callback learns it in a later turn, as a future's waiter would: the connection is known
                # dead by then when it sends the command again
                self.loop.call_soon(t.fail, err)
            else:
                t.fail(err)
        self.tasks.clear()
        for fut in (self._login_fut, self._text_fut, self._logout_fut, self._paused, *self._pings.values()):
            if fut is not None and not fut.done():
                fut.set_exception(err)
        self._pings.clear()
        self._window.set()
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        if self._paused is None:
            self._paused = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        self._paused = None

    @property
    def paused(self) -> bool:
        """The transport asked us to stop writing (its buffer is full): drain() before sending more."""
        return self._paused is not None

    async def drain(self) -> None:
        if self._paused is not None:
            await self._paused

    def abort(self) -> None:
        """Drop the TCP connection now (a command timed out, or a test cuts the line)."""
        if self.transport is not None:
            self.transport.abort()

    def _send(self, parts: Sequence[Buf]) -> None:
        # everything made in one event-loop turn leaves in one writelines, as the target does
        self._batch.send(parts)

    def _frame(self, bhs: bytes, data: Sequence[Buf] | Buf = b"") -> list[Buf]:
        return frame(bhs, data, header_digest=self.params.header_digest,  # type: ignore[arg-type]
                     data_digest=self.params.data_digest)

    def _next_itt(self) -> int:
        self._itt = (self._itt + 1) & M32
        if self._itt == RESERVED_TAG:
            self._itt = 1
        return self._itt

    # --------------------------------------------------------------------------------------- login
    async def login(self, cfg: LoginConfig) -> None:
        self._login = InitiatorLogin(cfg, itt=self._next_itt(), cmdsn=self.cmdsn)
        self._login_fut = self.loop.create_future()
        bhs, text = self._login.start()
        self._send(self._frame(bhs, text))
        await self._login_fut
        lg = self._login
        self._login = None
        self.params = lg.params
        self.tsih = lg.tsih
        self.expstatsn = lg.expstatsn
        self.expcmdsn, self.maxcmdsn = lg.expcmdsn, lg.maxcmdsn
        self.cmdsn = lg.expcmdsn
        self._window.set()
        # §13.1: digests start with the first PDU after the login finished
        self.reader.header_digest = self.params.header_digest
        self.reader.data_digest = self.params.data_digest

    def _login_pdu(self, pdu: Pdu) -> None:
        assert self._login is not None and self._login_fut is not None
        if self._login_fut.done():
            return
        try:
            step = self._login.receive(pdu)
        except LoginError as e:
            self._login_fut.set_exception(e)
            self.abort()
            return
        if step.done:
            self._login_fut.set_result(None)
        elif step.request is not None:
            self._send(self._frame(step.request[0], step.request[1]))

    # ------------------------------------------------------------------------------------- receive
    def data_received(self, data: bytes) -> None:
        reader = self.reader
        rest: bytes | memoryview = data
        if (self._login is None and not reader.buffered and not reader.header_digest and not reader.data_digest
                and self.tasks):
            rest = self._read_lane(data)
            if not len(rest):
                return
        try:
            pdus = reader.receive_data(rest)
        except FramingError as e:
            log.warning("%s: %s; dropping the connection", self.name, e)
            self.abort()
            return
        for pdu in pdus:
            if self._login is not None:
                self._login_pdu(pdu)
                continue
            if not pdu.digest_ok:
                # ERL 0: a data digest error cannot be recovered within the connection (§7.8)
                log.warning("%s: data digest error on opcode %#04x; dropping the connection", self.name,
                            pdu.opcode)
                self.abort()
                return
            self._window_update(pdu)
            handler = _HANDLERS.get(pdu.opcode)
            if handler is None:
                log.warning("%s: unexpected opcode %#04x; dropping the connection", self.name, pdu.opcode)
                self.abort()
                return
            handler(self, pdu)

    def _read_lane(self, data: bytes) -> bytes | memoryview:
        """The lane for what a target sends most, at the front of a receive, without digests: a whole read in
        one Data-In with its status (phase collapse, §11.7.4), no residual; and a SCSI Response (§11.4) with
        no residual, no sense data and no AHS, its response "completed" (every write's, with any status). It
        completes its command as _data_in and _scsi_response do (a read's data a view of the receive, the
        window and StatSN taken as for any PDU). Returns what is left for the PDU reader: from the first PDU
        that is anything else, is cut by the end of the receive, or is not exactly the whole read of a
        command waiting for one, or answers no command waiting (the general path judges those)."""
        n = len(data)
        pos = 0
        tasks = self.tasks
        max_dsl = self.reader.max_dsl
        view: memoryview | None = None
        while n - pos >= _BHS:
            op = data[pos] & 0x3F
            if op == _RESPONSE_OP:
                flags, response, status, ahs_dsl, itt, statsn = _RESPONSE.unpack_from(data, pos)
                t = tasks.get(itt)
                if flags != _FINAL or response or ahs_dsl or t is None:
                    break
                self._window_at(data, pos)
                self.expstatsn = (statsn + 1) & M32
                del tasks[itt]
                self._complete(t, status, b"", 0)
                pos += _BHS
                continue
            if op != _DATA_IN_OP or data[pos + 1] != _FINAL_STATUS:
                break
            dsl = _U32.unpack_from(data, pos + 4)[0]   # TotalAHSLength (byte 4) must be 0: then this is the DSL
            end = pos + _BHS + dsl + (-dsl & 3)
            if end > n or dsl > max_dsl:
                break
            _, status, itt, statsn, offset, _ = _DATA_IN.unpack_from(data, pos)
            t = tasks.get(itt)
            if t is None or offset or dsl != t.read_len or t.buf is not None:
                break
            self._window_at(data, pos)
            self.expstatsn = (statsn + 1) & M32
            del tasks[itt]
            if view is None:
                view = memoryview(data)
            t.answer(Completion(status, view[pos + _BHS:pos + _BHS + dsl], b""))
            pos = end
        return data if not pos else (view[pos:] if view is not None else data[pos:])

    def _window_update(self, pdu: Pdu) -> None:
        self._window_at(pdu.bhs, 0)

    def _window_at(self, buf: Buf, pos: int) -> None:
        """§4.2.2.1: take ExpCmdSN/MaxCmdSN (of the target PDU whose header starts at `pos`) when they move
        forward and make sense together."""
        exp, mx = _EXP_MAX.unpack_from(buf, pos + 28)   # same place in every target PDU (§11.3-§11.19)
        if sn_lt((mx + 1) & M32, exp):
            return  # MaxCmdSN < ExpCmdSN - 1: ignore (§4.2.2.1)
        if sn_lt(self.expcmdsn, exp):
            self.expcmdsn = exp
        if sn_lt(self.maxcmdsn, mx):
            self.maxcmdsn = mx
        if self.window_open():
            self._window.set()

    def _status_sn(self, statsn: int) -> None:
        self.expstatsn = (statsn + 1) & M32

    def _scsi_response(self, pdu: Pdu) -> None:  # §11.4
        rsp = Q.ScsiResponse.parse(pdu)
        self._status_sn(rsp.statsn)
        t = self.tasks.pop(rsp.itt, None)
        if t is None:
            return
        if rsp.response != 0:  # §11.4.3: the target failed the command as a transport matter
            t.fail(ConnectionLost(f"iSCSI response {rsp.response:#04x}"))
            return
        self._complete(t, rsp.status, rsp.sense, rsp.residual if rsp.underflow else 0)

    def _data_in(self, pdu: Pdu) -> None:  # §11.7
        flags, status, itt, statsn, offset, residual = _DATA_IN.unpack_from(pdu.bhs)
        t = self.tasks.get(itt)
        if t is None or not t.read_len:
            return
        data = pdu.data
        n = len(data)
        if offset + n > t.read_len:
            log.warning("%s: Data-In past the expected length; dropping the connection", self.name)
            self.abort()
            return
        done = flags & Q.F_STATUS
        if done and offset == 0 and n == t.read_len and t.buf is None:
            # the whole read in one PDU with its status (§11.7.4): its data is the result, no copy (a view of
            # the received bytes, which nothing writes to)
            self._status_sn(statsn)
            del self.tasks[itt]
            t.answer(Completion(status, data, b""))
            return
        if t.buf is None:
            t.buf = bytearray(t.read_len)
        t.buf[offset:offset + n] = data
        t.received += n
        if done:  # phase collapse (§11.7.4): status rides in the last Data-In
            self._status_sn(statsn)
            del self.tasks[itt]
            self._complete(t, status, b"", residual if flags & Q.F_RSP_UNDERFLOW else 0)

    def _complete(self, t: _Task, status: int, sense: bytes, residual: int) -> None:
        data: Buf = b""
        if t.buf is not None:
            data = t.buf if not residual else memoryview(t.buf)[:max(0, len(t.buf) - residual)]
        t.answer(Completion(status, data, sense))

    def _r2t(self, pdu: Pdu) -> None:  # §11.8, Data-Out §10.7
        r = Q.R2T.parse(pdu)
        t = self.tasks.get(r.itt)
        if t is None or t.data is None or r.offset + r.length > len(t.data):
            log.warning("%s: R2T for an unknown command or past its data; dropping the connection", self.name)
            self.abort()
            return
        self._data_out_sequence(t, r.ttt, r.offset, r.offset + r.length)

    def _data_out_sequence(self, t: _Task, ttt: int, start: int, end: int) -> None:
        """One sequence of Data-Out PDUs within the target's MaxRecvDataSegmentLength, DataSN from 0."""
        assert t.data is not None
        step = self.params.send_mrdsl
        out: list[Buf] = []
        datasn, off = 0, start
        while off < end:
            n = min(step, end - off)
            bhs = Q.data_out(t.itt, ttt, t.lun, self.expstatsn, datasn, off, n, final=off + n >= end)
            out += self._frame(bhs, t.data[off:off + n])
            datasn += 1
            off += n
        self._send(out)

    def _nop_in(self, pdu: Pdu) -> None:  # §11.19
        n = Q.NopIn.parse(pdu)
        if n.ttt != RESERVED_TAG:
            # the target pings: answer with its TTT and LUN and the same data (§11.18.3); not a command
            bhs = Q.nop_out(RESERVED_TAG, n.ttt, self.cmdsn, self.expstatsn, lun=n.lun, dsl=len(pdu.data))
            self._send(self._frame(bhs, bytes(pdu.data)))
        if n.itt != RESERVED_TAG:
            self._status_sn(n.statsn)
            fut = self._pings.pop(n.itt, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _text_response(self, pdu: Pdu) -> None:  # §11.11
        r = Q.TextResponse.parse(pdu)
        self._status_sn(r.statsn)
        if self._text_fut is not None and not self._text_fut.done():
            self._text_fut.set_result((r, bytes(pdu.data)))

    def _logout_response(self, pdu: Pdu) -> None:  # §11.15
        r = Q.LogoutResponse.parse(pdu)
        self._status_sn(r.statsn)
        if self._logout_fut is not None and not self._logout_fut.done():
            self._logout_fut.set_result(r)

    def _reject(self, pdu: Pdu) -> None:  # §11.17
        r = Q.Reject.parse(pdu)
        self._status_sn(r.statsn)
        log.warning("%s: target rejected a PDU (reason %#04x)", self.name, r.reason)
        t = self.tasks.pop(r.rejected_itt, None) if r.rejected_itt is not None else None
        if t is not None:
            t.fail(ConnectionLost(f"target rejected the command (reason {r.reason:#04x})"))
        for fut in (self._text_fut, self._logout_fut):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionLost(f"target rejected the request (reason {r.reason:#04x})"))

    def _async(self, pdu: Pdu) -> None:  # §11.9
        a = Q.AsyncMessage.parse(pdu)
        self._status_sn(a.statsn)
        if a.event in (Q.AsyncEvent.LOGOUT_REQUESTED, Q.AsyncEvent.DROPPING_CONNECTION,
                       Q.AsyncEvent.DROPPING_ALL_CONNECTIONS):
            log.info("%s: target asks us to leave (async event %d); reconnecting", self.name, a.event)
            self.loop.call_later(0.05, self.abort)

    def _tmf_response(self, pdu: Pdu) -> None:  # §11.6: we send none yet; keep the StatSN right
        self._status_sn(pdu.u32(24))

    # ---------------------------------------------------------------------------------- commands
    def window_open(self) -> bool:
        return not sn_lt(self.maxcmdsn, self.cmdsn)

    async def wait_window(self) -> None:
        """Wait for the target's MaxCmdSN to admit one more command (§4.2.2.1)."""
        while self.alive and not self.window_open():
            self._window.clear()
            await self._window.wait()
        if not self.alive:
            raise ConnectionLost(f"{self.name}: connection lost")

    def command(self, cdb: bytes, lun: bytes, *, read_len: int = 0,
                data: Buf | None = None) -> asyncio.Future[Completion]:
        """Send one SCSI command (§11.3) with its immediate and unsolicited data; R2Ts bring the rest."""
        fut: asyncio.Future[Completion] = self.loop.create_future()
        self._command(cdb, lun, read_len, data, fut, None)
        return fut

    def command_then(self, cdb: bytes, lun: bytes, read_len: int, data: Buf | None, then: Answer) -> None:
        """command() for a caller with no coroutine (a read_soon, a write_soon): `then(completion, None)` once
        answered, `then(None, exc)` once it failed (the connection lost: in the turn after), called from the
        receive that ends it."""
        self._command(cdb, lun, read_len, data, None, then)

    def _command(self, cdb: bytes, lun: bytes, read_len: int, data: Buf | None,
                 fut: asyncio.Future[Completion] | None, then: Answer | None) -> None:
        if not self.alive:
            raise ConnectionLost(f"{self.name}: not connected")
        mv = memoryview(data).cast("B") if data is not None else None
        t = _Task(lun, read_len, mv, fut, then, self.loop.time())
        t.itt = itt = self._next_itt()
        self.tasks[itt] = t
        cmdsn, self.cmdsn = self.cmdsn, (self.cmdsn + 1) & M32
        p = self.params
        if mv is None:
            self._send(self._frame(Q.scsi_command(itt, lun, cdb, read_len, cmdsn, self.expstatsn,
                                                  read=read_len > 0)))
            return
        n = len(mv)
        imm = min(n, p.first_burst_length, p.send_mrdsl) if p.immediate_data else 0
        unsolicited_end = imm if p.initial_r2t else min(n, p.first_burst_length)  # §13.10, §13.14
        bhs = Q.scsi_command(itt, lun, cdb, n, cmdsn, self.expstatsn, write=True,
                             final=unsolicited_end <= imm, immediate_len=imm)
        self._send(self._frame(bhs, mv[:imm]))
        if unsolicited_end > imm:
            self._data_out_sequence(t, RESERVED_TAG, imm, unsolicited_end)

    def forget(self, fut: asyncio.Future[Completion]) -> None:
        """A caller gave up on a command (timeout): stop routing its responses."""
        for itt, t in list(self.tasks.items()):
            if t.future is fut:
                del self.tasks[itt]

    async def text(self, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """A Text Request and its whole answer, following continuations (§11.10-11, §6.2)."""
        itt = self._next_itt()
        data = encode_text(pairs)
        ttt = RESERVED_TAG
        answer = bytearray()
        while True:
            await self.wait_window()  # a non-immediate text request takes a CmdSN like a command
            self._text_fut = self.loop.create_future()
            cmdsn, self.cmdsn = self.cmdsn, (self.cmdsn + 1) & M32
            bhs = Q.text_request(itt, ttt, cmdsn, self.expstatsn, dsl=len(data), immediate=False)
            self._send(self._frame(bhs, data))
            rsp, chunk = await self._text_fut
            answer += chunk
            if rsp.final and not rsp.cont:
                return parse_text(bytes(answer))
            ttt, data = rsp.ttt, b""  # §11.10.4: an empty request with the target's TTT asks for more

    async def ping(self, payload: bytes = b"") -> None:
        """NOP-Out with an ITT: the target must answer with a NOP-In (§11.18.1)."""
        itt = self._next_itt()
        fut: asyncio.Future[None] = self.loop.create_future()
        self._pings[itt] = fut
        self._send(self._frame(Q.nop_out(itt, RESERVED_TAG, self.cmdsn, self.expstatsn, dsl=len(payload)),
                               payload))
        await fut

    async def logout(self, timeout: float = 5.0) -> None:
        """Logout, close the session (§11.14); then close the TCP connection."""
        if self.alive:
            self._logout_fut = self.loop.create_future()
            itt = self._next_itt()
            self._send(self._frame(Q.logout_request(itt, 0, self.cmdsn, self.expstatsn)))
            try:
                await asyncio.wait_for(self._logout_fut, timeout)
            except (TimeoutError, ConnectionLost):
                pass
        if self.transport is not None:
            self.transport.close()


_HANDLERS: dict[int, Callable[[IscsiConnection, Pdu], None]] = {
    Op.SCSI_RSP: IscsiConnection._scsi_response,
    Op.DATA_IN: IscsiConnection._data_in,
    Op.R2T: IscsiConnection._r2t,
    Op.NOP_IN: IscsiConnection._nop_in,
    Op.TEXT_RSP: IscsiConnection._text_response,
    Op.LOGOUT_RSP: IscsiConnection._logout_response,
    Op.REJECT: IscsiConnection._reject,
    Op.ASYNC_MSG: IscsiConnection._async,
    Op.TASK_MGMT_RSP: IscsiConnection._tmf_response,
}
