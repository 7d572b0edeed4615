"""The asyncio iSCSI target: portals, connections and the full feature phase (RFC 7143).

A Connection is an asyncio.Protocol that feeds received bytes to the sans-IO parts in protocol/iscsi
(framing, login machine, transfer bookkeeping) and runs SCSI commands on the target's ScsiTarget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import struct
from collections.abc import Sequence
from typing import Any

from openvsan.frontend.config import IscsiTargetConfig
from openvsan.frontend.handoff import Elsewhere
from openvsan.frontend.iscsi_session import Session, Task
from openvsan.frontend.portals import BatchedConnection, PortalServer
from openvsan.netio import start_eagerly
from openvsan.protocol.auth_throttle import AuthThrottle
from openvsan.protocol.iscsi import pdu as P
from openvsan.protocol.iscsi.framing import (
    HARD_MAX_AHS,
    LOGIN_MAX_DSL,
    FramingError,
    LengthError,
    PduReader,
    frame,
    wire_bytes,
)
from openvsan.protocol.iscsi.keys import Params, TextError, encode_text, parse_text
from openvsan.protocol.iscsi.login import (
    CMD_WINDOW,
    VERSION,
    LoginFailed,
    LoginMachine,
    LoginResult,
    LoginState,
    Status,
)
from openvsan.protocol.iscsi.sequencing import WriteTransfer, data_in_segments
from openvsan.protocol.scsi import Nexus, ScsiResult
from openvsan.protocol.scsi.sense import ABORTED_COMMAND, CHECK_CONDITION, GOOD, ILLEGAL_REQUEST, build_sense

log = logging.getLogger("openvsan.iscsi")

OUR_MRDSL = 262144                 # the data segment we accept per PDU (declared in login)
MAX_TRANSFER = 16 * 1024 * 1024    # the largest command we buffer, as VPD 0xB0 advertises
SESSION_WRITE_BUDGET = 256 * 1024 * 1024  # write data one session may have us buffer at once
LOGIN_TIMEOUT = 30.0               # a connection must finish its login within this time
MAX_HELD_LOGIN_PDUS = 8            # PDUs kept while a login response is held (AuthThrottle) before we give up
TASK_SET_FULL = 0x28               # SAM-5 status: come back when fewer commands are in flight
SUSPEND_TIMEOUT = 30.0             # a session moving with its volume: its commands must finish by then
NOP_INTERVAL = 15.0                # idle seconds before we ping the initiator (§11.19)
NOP_TIMEOUT = 30.0                 # no answer to a ping for this long: the connection is dead
ASC_INVALID_FIELD_IN_IU = 0x0E03   # SAM-5: EDTL smaller than the command's transfer
# Where WRITE and WRITE AND VERIFY keep their TRANSFER LENGTH (SBC-4 5.40-5.46): (offset, size)
WRITE_TRANSFER_LENGTH = {0x2A: (7, 2), 0xAA: (6, 4), 0x8A: (10, 4), 0x2E: (7, 2), 0xAE: (6, 4), 0x8E: (10, 4)}
_U32 = struct.Struct(">I")
_ITT_EDTL_CMDSN = struct.Struct(">III")                  # BHS bytes 16-27 of a SCSI Command (§11.3)
_DATA_IN_STATUS = struct.Struct(">BBBBI8sIIIIIIII")      # §11.7.1, the phase-collapsed Data-In
_SCSI_RSP_GOOD = struct.Struct(">BBBBI8xIIIIIIII")      # §11.4
_READ_FLAGS, _WRITE_FLAGS = P.F_FINAL | P.F_READ, P.F_FINAL | P.F_WRITE
# plain ints for the fast path (an IntEnum member costs a lookup and a slower compare on every use)
_OP_SCSI_CMD, _OP_DATA_IN, _OP_SCSI_RSP = int(P.Op.SCSI_CMD), int(P.Op.DATA_IN), int(P.Op.SCSI_RSP)
_TAG = P.RESERVED_TAG
_FINAL_STATUS = P.F_FINAL | P.F_STATUS


class IscsiServer(PortalServer):
    kind = "iSCSI"

    def __init__(self, targets: Sequence[IscsiTargetConfig], *, nop_interval: float = NOP_INTERVAL,
                 nop_timeout: float = NOP_TIMEOUT) -> None:
        super().__init__()
        self.targets = {t.iqn: t for t in targets}
        self.nop_interval = nop_interval
        self.nop_timeout = nop_timeout
        self.sessions: dict[tuple[str, bytes, str], Session] = {}
        self.by_tsih: dict[int, Session] = {}
        self._tsih = itertools.count(1)
        # a worker of several: TSIHs of worker i are i modulo N (set by the node), so a session that moves to
        # another worker with its volume keeps its TSIH there (node/workers.py move)
        self.tsih_stride, self.tsih_offset = 1, 0
        # failed CHAP logins per (initiator, address); the node replaces it with one made from [node] auth_*
        self.auth_throttle = AuthThrottle()

    # --- life cycle ---------------------------------------------------------------------------------
    def portals(self) -> list[tuple[str, int]]:
        seen: dict[tuple[str, int], None] = {}
        for t in self.targets.values():
            for p in t.portals:
                seen[(p[0], int(p[1]))] = None
        return list(seen)

    def make_connection(self, portal: tuple[str, int]) -> Connection:
        return Connection(self, portal)

    def in_flight(self) -> list[asyncio.Future[None]]:
        return [t.runner for s in list(self.sessions.values()) + list(self.by_tsih.values())
                for t in s.tasks.values() if t.runner]

    # --- changes while serving (the node's data plane calls these) ------------------------------------
    async def add_target(self, t: IscsiTargetConfig) -> None:
        """Serve one more target, listening on its portals if no other target does yet."""
        if t.iqn in self.targets:
            raise ValueError(f"iSCSI target {t.iqn} is already served")
        self.targets[t.iqn] = t
        try:
            await self.sync_portals()
        except OSError:
            del self.targets[t.iqn]
            raise

    async def remove_target(self, iqn: str) -> IscsiTargetConfig:
        """Stop serving a target: its sessions end (their commands are aborted), its portals close if no
        other target is on them."""
        t = self.targets.pop(iqn)
        for s in [s for s in list(self.by_tsih.values()) if s.target is t]:
            self.end_session(s, "target removed")
        await self.sync_portals()
        return t

    # --- directory --------------------------------------------------------------------------------
    def target_on_portal(self, name: str, portal: tuple[str, int]) -> IscsiTargetConfig | None:
        t = self.targets.get(name)
        if t is None or not any((h, int(p)) == portal or h in ("0.0.0.0", "::") and int(p) == portal[1]
                                for h, p in t.portals):
            return None
        return t

    def admit(self, conn: Connection, st: LoginState) -> int:
        """Bind a finished login to a session: new, reinstated (§6.3.5) or refused."""
        key = (st.initiator_name, st.isid, st.target_name)
        if st.tsih == 0:
            old = self.sessions.get(key)
            if old is not None:
                log.info("reinstating session tsih=%d of %s", old.tsih, st.initiator_name)
                self.end_session(old, "reinstated")
            tsih = self._new_tsih()
            while tsih == 0 or tsih in self.by_tsih:  # §11.12.6: non-zero, unique among live sessions
                tsih = self._new_tsih()
            s = Session(tsih, st.isid, st.initiator_name, st.target, st.params, st.cmdsn, st.cid)  # type: ignore[arg-type]
            if st.target is not None:
                s.nexus = Nexus(st.initiator_name, int.from_bytes(st.isid, "big"), st.target_name,
                                st.target.portal_group_tag)
            self.sessions[key] = s
            self.by_tsih[tsih] = s
            conn.attach(s)
            return tsih
        found = self.by_tsih.get(st.tsih)
        if found is None or found.key() != key:
            raise LoginFailed(Status.SESSION_DOES_NOT_EXIST, f"no session with TSIH {st.tsih}")
        s = found
        if s.conn is not None and s.cid != st.cid:
            raise LoginFailed(Status.TOO_MANY_CONNECTIONS, "MaxConnections=1: one connection per session")
        # connection reinstatement: at ERL 0 the old connection's tasks are gone with it (§7.1.1)
        if s.conn is not None:
            s.conn.detach_and_close()
        self.abort_tasks(s, lambda t: True)
        s.params = st.params
        s.exp_cmdsn = st.cmdsn
        s.pending.clear()
        conn.attach(s)
        return s.tsih

    def _new_tsih(self) -> int:
        return (next(self._tsih) * self.tsih_stride + self.tsih_offset) & 0xFFFF

    def end_session(self, s: Session, why: str) -> None:
        if s.closed:
            return
        s.closed = True
        self.abort_tasks(s, lambda t: True)
        if self.sessions.get(s.key()) is s:
            del self.sessions[s.key()]
        if self.by_tsih.get(s.tsih) is s:
            del self.by_tsih[s.tsih]
        if s.target is not None and s.nexus is not None:
            s.target.scsi.nexus_lost(s.nexus)
        if s.conn is not None:
            s.conn.detach_and_close()
        log.debug("session tsih=%d ended: %s", s.tsih, why)

    def abort_tasks(self, s: Session, match: object) -> None:
        for t in list(s.tasks.values()):
            if match(t):  # type: ignore[operator]
                t.aborted = True
                s.forget(t)


class Connection(BatchedConnection):
    """One TCP connection to a portal: login, then the full feature phase."""

    def __init__(self, server: IscsiServer, portal: tuple[str, int]) -> None:
        super().__init__()
        self.server = server
        self.portal = portal
        self.reader = PduReader()
        self.login: LoginMachine | None = LoginMachine(self._lookup, self._admit, our_mrdsl=OUR_MRDSL,
                                                       throttle=server.auth_throttle)
        self._held: list[P.Pdu] | None = None   # PDUs that came while a login response is held (AuthThrottle)
        self.session: Session | None = None
        self.statsn = 0
        self.hd = self.dd = False
        self._ttt = itertools.count(1)
        self._ping_ttt: int | None = None
        self._ping_sent = 0.0
        self._last_rx = 0.0
        self._rx = self._rx_seen = 0    # receives so far, and as _idle_check last saw them
        self._lane = False              # received's command lane is open: full feature phase, no digests
        self._connected = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._text_pending: dict[int, bytes] = {}
        # moving to another worker with its volume (suspend()): PDUs received since, as they came, held for
        # the worker that takes the session over (Data-Out of commands already started still go on here)
        self._holding: list[bytes] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._closed:
            return  # refused: over a connection limit (frontend/limits.py)
        self.server.connections.add(self)
        loop = asyncio.get_running_loop()
        self._last_rx = self._connected = loop.time()
        self._timer = loop.call_later(min(self.server.nop_interval, 5.0), self._idle_check)
        self.reader.max_dsl = LOGIN_MAX_DSL   # refused from the header beyond this, before login
        self.reader.max_ahs = 0               # §11.2.1.2: AHS belong to SCSI Commands, none in a login
        if self._resume is not None:
            state, self._resume = self._resume, None
            if not self._resume_from(state):
                return
        self.replay()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # closed, and its place in the connection limits given back
        self.server.connections.discard(self)
        if self._timer:
            self._timer.cancel()
        s = self.session
        if s is not None and s.conn is self:
            s.conn = None
            self.server.end_session(s, "connection lost")

    def received(self, data: bytes) -> None:
        self._rx += 1   # _idle_check notices; no clock read per receive
        rest: bytes | memoryview = data
        if self._lane and not self.reader.buffered:
            rest = self._command_lane(data)
            if not len(rest):
                return
        try:
            pdus = self.reader.receive_data(rest)
        except LengthError as e:
            self._refuse_length(e)
            return
        except FramingError as e:
            self.dropped("framing error", str(e))
            self.close()
            return
        self._dispatch(pdus)

    def _dispatch(self, pdus: Sequence[P.Pdu]) -> None:
        for pdu in pdus:
            if self._closed:
                return
            if self.login is not None:
                self._login_pdu(pdu)
            else:
                self._ffp_pdu(pdu)

    def _refuse_length(self, e: LengthError) -> None:
        """A header declaring more than the phase allows, refused before any of its data was held; the
        stream cannot be followed past it, so the connection ends (ERL 0, §7.1.1)."""
        bhs = P.Pdu(memoryview(e.bhs), memoryview(b""), memoryview(b""))
        self.dropped("declared length beyond the limit", str(e))
        if self.login is not None:
            # §11.13.5: status class 2 (initiator error); an opcode other than Login is "invalid during login"
            status = Status.INVALID_DURING_LOGIN if bhs.opcode != P.Op.LOGIN_REQ else Status.INITIATOR_ERROR
            st = self.login.state
            cmdsn = bhs.u32(24)   # the Login Request's CmdSN, which a login keeps unchanged (§11.12.8)
            self.send(P.login_response(0, VERSION, VERSION, st.isid or e.bhs[8:14], st.tsih, bhs.itt,
                                       self.login.statsn, cmdsn, (cmdsn + CMD_WINDOW - 1) & 0xFFFFFFFF,
                                       status[0], status[1], 0))
        else:
            self._reject(bhs, P.RejectReason.PROTOCOL_ERROR)  # §11.17.1 / §13.12: beyond our MaxRecvDataSegmentLength
        self.close_lingering()

    def _command_lane(self, data: bytes) -> bytes | memoryview:
        """The lane for what initiators send most: SCSI Command PDUs (READs, WRITEs with their data) at the
        front of a receive, with no AHS, no digests and nothing buffered from before, each handled by the
        fast path straight from the received bytes, with no reader and no Pdu. Returns what is left for the
        reader: from the first PDU that is anything else, is cut by the end of the receive, or that the fast
        path declines (that one goes the general way with the same bytes)."""
        s = self.session
        if s is None:
            return data
        n = len(data)
        pos = 0
        view: memoryview | None = None
        max_dsl = self.reader.max_dsl
        while n - pos >= 48 and data[pos] == _OP_SCSI_CMD:
            dsl = _U32.unpack_from(data, pos + 4)[0]   # TotalAHSLength (must be 0) and DataSegmentLength
            end = pos + 48 + dsl
            if dsl & 3 or dsl > max_dsl or end > n:
                break
            if end == n and not pos:
                # the whole receive is one command (queue depth 1): the header needs no view
                ok = self._fast_scsi_cmd(data, memoryview(data)[48:] if dsl else b"", s)
            else:
                if view is None:
                    view = memoryview(data)
                ok = self._fast_scsi_cmd(view[pos:pos + 48], view[pos + 48:end] if dsl else b"", s)
            if not ok:
                break
            pos = end
        if not pos:
            return data
        return (view if view is not None else memoryview(data))[pos:]

    # --- sending ----------------------------------------------------------------------------------
    def send(self, bhs: bytes, data: bytes | memoryview | Sequence[bytes | memoryview] = b"") -> None:
        self.send_buffers(frame(bhs, data, header_digest=self.hd, data_digest=self.dd))

    def _send_pdu(self, bhs: bytes, data: bytes | memoryview = b"") -> None:
        """send(), minus the framing work a PDU without digests or padding does not need."""
        if self.hd or self.dd or len(data) & 3:
            self.send(bhs, data)
        elif not self._closed:
            self._batch.send((bhs, data) if data else (bhs,))

    def next_statsn(self) -> int:
        sn = self.statsn
        self.statsn = (sn + 1) & 0xFFFFFFFF
        return sn

    def detach_and_close(self) -> None:
        self.session = None
        self.close()

    def attach(self, s: Session) -> None:
        self.session = s
        s.conn = self

    # --- login ------------------------------------------------------------------------------------
    def _lookup(self, name: str) -> IscsiTargetConfig | None:
        t = self.server.target_on_portal(name, self.portal)
        w = self.server.moving.get(name, t.elsewhere if t is not None else None)
        if w is not None:
            self.elsewhere(w, f"iSCSI target {name}")   # hands the connection over, if it still can
            return None
        return t

    def _admit(self, st: LoginState) -> int:
        if self.server.closing:
            raise LoginFailed(Status.SERVICE_UNAVAILABLE, "target is shutting down")
        return self.server.admit(self, st)

    def _login_pdu(self, pdu: P.Pdu) -> None:
        assert self.login is not None
        if self._held is not None:
            # a login is one request, one response (§6.3): nothing more should come while we hold ours
            self._held.append(pdu)
            if len(self._held) > MAX_HELD_LOGIN_PDUS:
                log.info("%s: login: %d PDUs sent without waiting for the response; closing the connection",
                         self.peer, len(self._held))
                self.close()
            return
        if not self.login.address:
            self.login.address = self.source
        try:
            result = self.login.receive(pdu)
        except Elsewhere as e:
            self.hand_off(e)
            return
        if result.delay > 0:
            # earlier failed CHAP logins from this initiator and address: the answer waits, the loop does not
            self._held = []
            if self.transport is not None:
                self.transport.pause_reading()
            asyncio.get_running_loop().call_later(result.delay, self._release_login, result)
            return
        self._login_result(result)

    def _release_login(self, result: LoginResult) -> None:
        held, self._held = self._held or [], None
        if self._closed:
            return
        if self.transport is not None:
            self.transport.resume_reading()
        self._login_result(result)
        self._dispatch(held)

    def _login_result(self, result: LoginResult) -> None:
        assert self.login is not None
        bhs, *data = result.response
        self.send(bhs, data[0] if data else b"")
        if result.failed:
            if result.notice:
                log.warning("%s: %s", self.peer, result.notice)
            # the CHAP user, the initiator and its address are in the reason; never a secret
            log.log(logging.DEBUG if result.quiet else logging.INFO, "%s: login failed: %s", self.peer,
                    result.reason)
            self.close()
        elif result.done:
            self.statsn = self.login.statsn
            params = self.login.state.params
            self.login = None
            self.hd, self.dd = params.header_digest, params.data_digest
            self.reader.header_digest, self.reader.data_digest = self.hd, self.dd
            self.reader.max_dsl = params.target_mrdsl
            self.reader.max_ahs = HARD_MAX_AHS
            s = self.session
            assert s is not None
            self._lane = not (self.hd or self.dd or s.discovery)
            if not s.discovery:
                self.reader.place = self._place
            self.logged_in()
            self.settle()
            log.info("%s: %s session tsih=%d for %s%s", self.peer, "discovery" if s.discovery else "normal",
                     s.tsih, s.initiator_name, "" if s.discovery else f" on {s.target.iqn}")  # type: ignore[union-attr]

    # --- full feature phase -----------------------------------------------------------------------
    def _reject(self, pdu: P.Pdu, reason: int) -> None:
        s = self.session
        exp, mx = (s.exp_cmdsn, s.max_cmdsn) if s else (0, 0)
        self.send(P.reject(reason, self.next_statsn(), exp, mx), bytes(pdu.bhs))

    def _ffp_pdu(self, pdu: P.Pdu) -> None:
        s = self.session
        if s is None:
            return
        op = pdu.opcode
        if len(pdu.data) > self.reader.max_dsl:
            self._reject(pdu, P.RejectReason.PROTOCOL_ERROR)  # §13.12: beyond our MaxRecvDataSegmentLength
            return
        if not pdu.digest_ok:
            self._reject(pdu, P.RejectReason.DATA_DIGEST_ERROR)  # §7.8: discard, Reject
            return
        if self._holding is not None and not (op == P.Op.DATA_OUT and pdu.itt in s.tasks):
            self._holding.append(wire_bytes(pdu, header_digest=self.hd, data_digest=self.dd))
            return
        if op == P.Op.DATA_OUT:
            self._data_out(pdu)
            return
        if op == P.Op.NOP_OUT:
            if pdu.itt == P.RESERVED_TAG:
                # a reply to our ping (or a ping that wants no answer); must be immediate (§11.18)
                if self._ping_ttt is not None and pdu.u32(20) == self._ping_ttt:
                    self._ping_ttt = None
                return
            s.order(pdu, pdu.u32(24), self._nop_out)
            return
        if op == P.Op.SCSI_CMD:
            if len(pdu.ahs) or not self._fast_scsi_cmd(pdu.bhs, pdu.data, s):
                s.order(pdu, pdu.u32(24), self._scsi_cmd)
        elif op == P.Op.TASK_MGMT_REQ:
            s.order(pdu, pdu.u32(24), self._task_mgmt)
        elif op == P.Op.TEXT_REQ:
            s.order(pdu, pdu.u32(24), self._text)
        elif op == P.Op.LOGOUT_REQ:
            s.order(pdu, pdu.u32(24), self._logout)
        elif op == P.Op.SNACK:
            self._reject(pdu, P.RejectReason.SNACK_REJECT)  # ErrorRecoveryLevel 0 has no SNACK (§7.1.4)
        elif op == P.Op.LOGIN_REQ:
            self._reject(pdu, P.RejectReason.PROTOCOL_ERROR)
        else:
            self._reject(pdu, P.RejectReason.COMMAND_NOT_SUPPORTED)

    # --- moving to another worker with the volume (node/workers.py move) -------------------------------
    async def suspend(self) -> tuple[dict[str, Any], bytes] | None:
        """Hold every PDU from now on but the Data-Out of commands already started, let those commands finish
        and their answers leave, then stop reading. The state is the session's and the connection's (TSIH,
        ISID, the parameters negotiated, ExpCmdSN, StatSN); what was received and not acted on goes with it
        as the initiator sent it. A connection still logging in, a discovery session or one in the middle of
        a text negotiation cannot move."""
        s = self.session
        if (s is None or s.discovery or self.login is not None or self._closed or self._text_pending
                or self._holding is not None or self.transport is None or s.target is None):
            return None
        self._holding = []
        lane, self._lane = self._lane, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SUSPEND_TIMEOUT
        while s.tasks:
            if self._closed or s.closed or loop.time() > deadline:
                self._unhold(lane)
                return None
            await asyncio.sleep(0.001)
        self.transport.pause_reading()
        waiting = [wire_bytes(pdu, header_digest=self.hd, data_digest=self.dd)
                   for _, (pdu, _) in sorted(s.pending.items(), key=lambda kv: (kv[0] - s.exp_cmdsn) & 0xFFFFFFFF)]
        held = b"".join([*waiting, *self._holding]) + self.reader.take_buffered()
        s.pending.clear()
        self._holding = None
        state = {"tsih": s.tsih, "isid": s.isid.hex(), "initiator": s.initiator_name, "target": s.target.iqn,
                 "cid": s.cid, "exp_cmdsn": s.exp_cmdsn, "statsn": self.statsn, "ttt": next(self._ttt),
                 "params": {**dataclasses.asdict(s.params), "negotiated": sorted(s.params.negotiated)}}
        if not await self.drained(SUSPEND_TIMEOUT):
            self.resume_here(state, held)
            return None
        return state, held

    def detach_for_move(self) -> None:
        self.server.connections.discard(self)
        s = self.session
        if s is not None:
            if self.server.sessions.get(s.key()) is s:
                del self.server.sessions[s.key()]
            if self.server.by_tsih.get(s.tsih) is s:
                del self.server.by_tsih[s.tsih]
            s.conn = None     # losing this connection here no longer ends the session: it lives on elsewhere

    def reattach(self) -> None:
        self.server.connections.add(self)
        s = self.session
        if s is not None:
            self.server.sessions[s.key()] = s
            self.server.by_tsih[s.tsih] = s
            s.conn = self

    def logging_in_to(self) -> str | None:
        """The target a login still under way named (None: none yet, or logged in)."""
        t = getattr(self.login.state, "target", None) if self.login is not None else None
        return t.iqn if t is not None else None

    def _unhold(self, lane: bool) -> None:
        held, self._holding = self._holding or [], None
        self._lane = lane
        if held:
            self._buffered_first(b"".join(held))

    def _buffered_first(self, data: bytes) -> None:
        """Run `data` as if received now, ahead of what the reader holds of a PDU not yet whole."""
        rest = self.reader.take_buffered()
        self.answer_at_once(self.received, data + rest)

    def resume_here(self, state: dict[str, Any], received: bytes) -> None:
        self._holding = None
        s = self.session
        self._lane = not (self.hd or self.dd or s is None or s.discovery)
        if self.transport is not None and not self._closed:
            self.transport.resume_reading()
        if received:
            self._buffered_first(received)

    def _resume_from(self, state: dict[str, Any]) -> bool:
        """Take over the session suspend() described, in its full feature phase, as this connection's."""
        name = str(state.get("target"))
        t = self.server.targets.get(name)
        if t is None or t.elsewhere is not None:
            self.moved_on(t.elsewhere if t is not None else None, self.server.exchange, state,
                          "moved here for a target this worker does not serve", name)
            return False
        fields = dict(state["params"])
        params = Params(**{**fields, "negotiated": set(fields.get("negotiated") or ())})
        isid = bytes.fromhex(str(state["isid"]))
        tsih = int(state["tsih"])
        initiator = str(state["initiator"])
        key = (initiator, isid, t.iqn)
        if tsih in self.server.by_tsih or key in self.server.sessions:
            self.dropped("moved here, but its TSIH or its I_T nexus is taken by a session of this worker",
                         f"tsih={tsih}")
            self.close()
            return False
        s = Session(tsih, isid, initiator, t, params, int(state["exp_cmdsn"]), int(state["cid"]))
        s.nexus = Nexus(initiator, int.from_bytes(isid, "big"), t.iqn, t.portal_group_tag)
        self.server.sessions[key] = s
        self.server.by_tsih[tsih] = s
        self.attach(s)
        self.login = None
        self.statsn = int(state["statsn"])
        self._ttt = itertools.count(int(state["ttt"]))
        self.hd, self.dd = params.header_digest, params.data_digest
        self.reader.header_digest, self.reader.data_digest = self.hd, self.dd
        self.reader.max_dsl = params.target_mrdsl
        self.reader.max_ahs = HARD_MAX_AHS
        self.reader.place = self._place
        self._lane = not (self.hd or self.dd)
        self.logged_in()
        log.info("%s: normal session tsih=%d for %s on %s: moved here with its volume", self.peer, tsih,
                 initiator, t.iqn)
        return True

    def _nop_out(self, pdu: P.Pdu) -> None:
        s = self.session
        assert s is not None
        data = pdu.data[:s.params.initiator_mrdsl]
        # §11.19: answer with the same ITT and the ping data; StatSN advances
        self.send(P.nop_in(pdu.itt, P.RESERVED_TAG, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn,
                           lun=pdu.lun_raw, dsl=len(data)), data)

    def _idle_check(self) -> None:
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._rx != self._rx_seen:
            self._rx_seen = self._rx
            self._last_rx = now
        s = self.session
        if self.login is not None and now - self._connected > LOGIN_TIMEOUT:
            self.dropped(f"login not finished in {LOGIN_TIMEOUT:.0f} s")
            self.close()
            return
        if self._ping_ttt is not None and now - self._ping_sent > self.server.nop_timeout:
            self.dropped(f"no answer to NOP-In for {self.server.nop_timeout:.0f} s")
            self.close()
            return
        if (self.login is None and s is not None and self._ping_ttt is None
                and now - self._last_rx >= self.server.nop_interval):
            self._ping_ttt = next(self._ttt) & 0xFFFFFFFF
            self._ping_sent = now
            # target-initiated ping: ITT reserved, a TTT the initiator echoes; StatSN not advanced (§11.19)
            self.send(P.nop_in(P.RESERVED_TAG, self._ping_ttt, self.statsn, s.exp_cmdsn, s.max_cmdsn))
        self._timer = loop.call_later(min(self.server.nop_interval, 5.0), self._idle_check)

    # --- SCSI commands ----------------------------------------------------------------------------
    def _fast_scsi_cmd(self, b: bytes | memoryview, payload: bytes | memoryview, s: Session) -> bool:
        """A plain READ or WRITE (BHS b, no AHS, its immediate data), next in CmdSN order, on a LUN whose
        device answers at once (Lun.read_now / write_now): done here, with no Task, and answered at once.
        False: the command was not touched and takes the normal path, which does the same with every check
        and every corner of the RFC."""
        if b[0] != _OP_SCSI_CMD or s.pending or s.target is None or s.nexus is None:
            return False  # b[0] with the I bit clear: not immediate; queued commands go first
        itt, edtl, cmdsn = _ITT_EDTL_CMDSN.unpack_from(b, 16)
        if cmdsn != s.exp_cmdsn or itt in s.tasks:
            return False
        flags = b[1] & 0xE0
        lun_raw = bytes(b[8:16])
        unit = s.fast_luns.get(lun_raw)
        if unit is None:
            unit = s.target.scsi.luns.get(P.decode_lun(lun_raw))
            if unit is None:
                return False
            s.fast_luns[lun_raw] = unit
        params = s.params
        if flags == _READ_FLAGS:
            if len(payload):
                return False
            data = unit.read_now(b[32:48], s.nexus)
            if data is None or len(data) != edtl:
                return False  # nothing was done: residuals and every error take the normal path
            s.exp_cmdsn = exp = (cmdsn + 1) & 0xFFFFFFFF
            maxsn = (exp + CMD_WINDOW - 1) & 0xFFFFFFFF
            statsn = self.statsn
            self.statsn = (statsn + 1) & 0xFFFFFFFF
            if self.dd and not isinstance(data, bytes):
                data = bytes(data)  # a view of the device: the digest must cover exactly what is sent
            if edtl <= params.initiator_mrdsl and edtl <= params.max_burst_length:
                # §11.7: data and GOOD status in one Data-In (phase collapse)
                self._send_pdu(_DATA_IN_STATUS.pack(_OP_DATA_IN, _FINAL_STATUS, 0, GOOD, edtl, lun_raw,
                                                    itt, _TAG, statsn, exp, maxsn, 0, 0, 0), data)
            else:
                view = memoryview(data)
                segs = data_in_segments(edtl, params)
                last = len(segs) - 1
                for datasn, (off, size, final) in enumerate(segs):
                    # §11.7.4: within MaxRecvDataSegmentLength and MaxBurstLength; status in the last one
                    if datasn == last:
                        hdr = _DATA_IN_STATUS.pack(_OP_DATA_IN, _FINAL_STATUS, 0, GOOD, size, lun_raw,
                                                   itt, _TAG, statsn, exp, maxsn, datasn, off, 0)
                    else:
                        hdr = _DATA_IN_STATUS.pack(_OP_DATA_IN, P.F_FINAL if final else 0, 0, 0, size, lun_raw,
                                                   itt, _TAG, 0, exp, maxsn, datasn, off, 0)
                    self._send_pdu(hdr, view[off:off + size])
            if not isinstance(data, bytes):
                # a lent view (SyncRead.read_now) goes to the transport now, before a later command of this
                # read can write the same blocks
                self._batch.flush()
            return True
        if flags == _WRITE_FLAGS:
            data = payload
            if (len(data) != edtl or not params.immediate_data or edtl > params.first_burst_length
                    or not unit.write_now(b[32:48], data, s.nexus)):
                return False
            s.exp_cmdsn = exp = (cmdsn + 1) & 0xFFFFFFFF
            statsn = self.statsn
            self.statsn = (statsn + 1) & 0xFFFFFFFF
            self._send_pdu(_SCSI_RSP_GOOD.pack(_OP_SCSI_RSP, 0x80, 0, GOOD, 0, itt, 0, statsn, exp,
                                               (exp + CMD_WINDOW - 1) & 0xFFFFFFFF, 0, 0, 0))
            return True
        return False

    def _scsi_cmd(self, pdu: P.Pdu) -> None:
        s = self.session
        assert s is not None
        if s.discovery:
            self._reject(pdu, P.RejectReason.PROTOCOL_ERROR)  # §4.3: no SCSI in a discovery session
            return
        b = pdu.bhs
        flags = b[1]
        itt = pdu.itt
        if itt in s.tasks:
            self._reject(pdu, P.RejectReason.TASK_IN_PROGRESS)
            return
        cdb = bytes(b[32:48])
        ahs = pdu.ahs
        pos = 0
        while pos + 4 <= len(ahs):  # §11.3.5 extended CDB AHS (type 1)
            alen = int.from_bytes(ahs[pos:pos + 2], "big")
            if ahs[pos + 2] == 1:
                cdb += bytes(ahs[pos + 4:pos + 3 + alen])
            pos += 4 + alen + (-alen & 3)
        edtl = pdu.u32(20)
        lun_raw = bytes(b[8:16])
        task = Task(itt, lun_raw, P.decode_lun(lun_raw), cdb, edtl, bool(flags & P.F_READ),
                    bool(flags & P.F_WRITE), pdu.immediate, s)
        imm = pdu.data
        if len(imm) and (not s.params.immediate_data or not task.write or len(imm) > edtl
                         or len(imm) > s.params.first_burst_length):
            self._reject(pdu, P.RejectReason.PROTOCOL_ERROR)  # §10.3.4 / §13.11
            return
        s.tasks[itt] = task
        if task.write and edtl:
            if edtl > MAX_TRANSFER:
                self._respond(task, ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, 0x2400)))
                return
            if s.write_buffered + edtl > SESSION_WRITE_BUDGET:
                self._respond(task, ScsiResult(TASK_SET_FULL))
                return
            s.write_buffered += edtl
            needed = self._needed_out(task)
            want = min(edtl, needed)
            task.transfer = WriteTransfer.start(edtl, want, imm, bool(flags & P.F_FINAL), s.params)
            self._send_r2ts(task)
            if not task.transfer.complete:
                return
        self._run(task)

    def _send_r2ts(self, task: Task) -> None:
        s = task.session
        assert task.transfer is not None
        for r in task.transfer.r2ts(self._ttt):
            self.send(P.r2t(task.itt, r.ttt & 0xFFFFFFFF, task.lun_raw, self.statsn, s.exp_cmdsn, s.max_cmdsn,
                            r.r2tsn, r.offset, r.length))

    def _receiving(self, itt: int) -> Task | None:
        """The task whose Data-Out this is, while it still takes data; None for a task already ended (aborted,
        or failed early) or running (its buffer is being written): its data is dropped quietly."""
        s = self.session
        task = s.tasks.get(itt) if s is not None else None
        if task is None or task.transfer is None or task.running:
            return None
        return task

    def _place(self, bhs: memoryview, dsl: int) -> memoryview | None:
        """framing.PduReader.place: where a Data-Out that straddles receives is copied to, its command's buffer
        at its Buffer Offset; None where _data_out would drop it (_receiving) or its transfer has no room for
        it. _data_out then judges it as any other."""
        task = self._receiving(_U32.unpack_from(bhs, 16)[0])
        if task is None:
            return None
        assert task.transfer is not None   # _receiving: a task taking data
        return task.transfer.placed(_U32.unpack_from(bhs, 40)[0], dsl)

    def _data_out(self, pdu: P.Pdu) -> None:
        task = self._receiving(pdu.itt)
        if task is None:
            return
        assert task.transfer is not None   # _receiving: a task taking data
        t = task.transfer
        t.data_out(pdu.u32(20), pdu.u32(36), pdu.u32(40), pdu.data, bool(pdu.flags & P.F_FINAL))
        if t.error is None:
            self._send_r2ts(task)
        if t.complete:
            self._run(task)

    def _run(self, task: Task) -> None:
        task.running = True
        task.runner = runner = start_eagerly(self._execute(task))
        if runner is not None and task.transfer is not None:
            self.hold_running(runner, task.edtl)

    async def _execute(self, task: Task) -> None:
        s = task.session
        assert s.target is not None and s.nexus is not None
        t = task.transfer
        if t is not None and t.error is not None:
            result = ScsiResult(CHECK_CONDITION, b"", build_sense(ABORTED_COMMAND, t.error.asc))
        else:
            cdb: bytes | None = task.cdb
            want = t.want if t is not None else 0
            needed = self._needed_out(task)
            if needed and task.edtl != needed and task.cdb[0] in WRITE_TRANSFER_LENGTH:
                # WRITE and WRITE AND VERIFY carry on with a mismatched EDTL (FCP-4 9.4.2 semantics); for
                # other commands the SCSI layer judges the mismatch (it gets EDTL as expected_length).
                cdb = self._shorten_write(task, want)
            if cdb is None:
                result = ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_IU))
                self._respond(task, result)
                return
            data_out = memoryview(t.buffer)[:want] if t is not None else memoryview(b"")
            try:
                result = await s.target.scsi.execute(task.lun, cdb, data_out, s.nexus, expected_length=task.edtl)
            except Exception:
                log.exception("SCSI command 0x%02x failed", task.cdb[0])
                result = ScsiResult(CHECK_CONDITION, b"", build_sense(0x04, 0x4400))  # HARDWARE ERROR
        self._respond(task, result)

    @staticmethod
    def _needed_out(task: Task) -> int:
        if task.needed_out < 0:
            target = task.session.target
            task.needed_out = target.scsi.data_out_length(task.lun, task.cdb) if target is not None else 0
        return task.needed_out

    def _shorten_write(self, task: Task, want: int) -> bytes | None:
        """EDTL below the CDB's transfer length: like FCP (FCP-4 9.4.2), write what the initiator sent, in
        whole blocks, and report the overflow; None where the CDB cannot be shortened that way."""
        s = task.session
        assert s.target is not None
        off, size = WRITE_TRANSFER_LENGTH[task.cdb[0]]
        blocks = int.from_bytes(task.cdb[off:off + size], "big")
        needed = self._needed_out(task)
        if needed <= want:
            return task.cdb  # underflow: the CDB is whole, the residual says the rest went unused
        if not blocks or needed % blocks:
            return None
        block_size = needed // blocks
        cdb = bytearray(task.cdb)
        cdb[off:off + size] = (want // block_size).to_bytes(size, "big")
        return bytes(cdb)

    def _respond(self, task: Task, result: ScsiResult) -> None:
        s = task.session
        if task.aborted or s.closed or s.conn is not self:
            return
        s.forget(task)
        data = result.data
        n = len(data)
        flags = residual = 0
        needed_out = self._needed_out(task)
        if needed_out:
            # §11.4.5.1: residuals count against the command's own transfer length
            if needed_out > task.edtl:
                flags, residual = P.F_OVERFLOW, needed_out - task.edtl
            elif needed_out < task.edtl:
                flags, residual = P.F_UNDERFLOW, task.edtl - needed_out
        else:
            expected = task.edtl if task.read else 0
            if n > expected:
                flags, residual = P.F_OVERFLOW, n - expected
                n = expected
            elif n < expected:
                flags, residual = P.F_UNDERFLOW, expected - n
        datasn = 0
        if n and result.status == GOOD and not result.sense and n <= s.params.initiator_mrdsl \
                and n <= s.params.max_burst_length:
            # the common read: one Data-In carrying the data and the status (§11.7, phase collapse)
            self.send(P.data_in(task.itt, 0, 0, n, final=True, expcmdsn=s.exp_cmdsn, maxcmdsn=s.max_cmdsn,
                                lun=task.lun_raw, status=GOOD, statsn=self.next_statsn(), flags=flags,
                                residual=residual), memoryview(data)[:n])
            return
        if n:
            view = memoryview(data)
            segs = data_in_segments(n, s.params)
            collapse = result.status == GOOD and not result.sense
            last = len(segs) - 1
            for i, (off, size, final) in enumerate(segs):
                if i == last and collapse:
                    # §11.7: status in the last Data-In (phase collapse), residuals there too
                    self.send(P.data_in(task.itt, datasn, off, size, final=True, expcmdsn=s.exp_cmdsn,
                                        maxcmdsn=s.max_cmdsn, lun=task.lun_raw, status=result.status,
                                        statsn=self.next_statsn(), flags=flags, residual=residual),
                              view[off:off + size])
                    return
                self.send(P.data_in(task.itt, datasn, off, size, final=final, expcmdsn=s.exp_cmdsn,
                                    maxcmdsn=s.max_cmdsn, lun=task.lun_raw), view[off:off + size])
                datasn += 1
        sense = result.sense
        payload = struct.pack(">H", len(sense)) + sense if sense else b""
        self.send(P.scsi_response(task.itt, result.status, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn,
                                  dsl=len(payload), flags=flags, expdatasn=datasn, residual=residual), payload)

    # --- task management (§11.5) ------------------------------------------------------------------
    def _task_mgmt(self, pdu: P.Pdu) -> None:
        s = self.session
        assert s is not None
        fn = pdu.flags & 0x7F
        lun_raw = pdu.lun_raw
        lun = P.decode_lun(lun_raw)
        resp = P.TmfResponse.COMPLETE
        srv = self.server
        scsi = s.target.scsi if s.target else None
        lun_known = scsi is not None and lun in scsi.luns
        if s.discovery:
            resp = P.TmfResponse.REJECTED
        elif fn == P.TmfFunction.ABORT_TASK:
            ref = pdu.u32(20)
            t = s.tasks.get(ref)
            if t is not None and t.lun == lun:
                srv.abort_tasks(s, lambda x: x is t)
            elif not s.consider_received(pdu.u32(32), pdu.u32(24)):
                resp = P.TmfResponse.NO_TASK
        elif fn in (P.TmfFunction.ABORT_TASK_SET, P.TmfFunction.CLEAR_TASK_SET, P.TmfFunction.LOGICAL_UNIT_RESET):
            if not lun_known:
                resp = P.TmfResponse.NO_LUN
            else:
                everyone = fn != P.TmfFunction.ABORT_TASK_SET
                for other in list(srv.by_tsih.values()):
                    if other is s or (everyone and other.target is s.target):
                        srv.abort_tasks(other, lambda x: x.lun == lun)
                if fn == P.TmfFunction.LOGICAL_UNIT_RESET:
                    assert scsi is not None and s.nexus is not None
                    scsi.logical_unit_reset(lun, s.nexus)
        elif fn in (P.TmfFunction.TARGET_WARM_RESET, P.TmfFunction.TARGET_COLD_RESET):
            assert scsi is not None and s.nexus is not None
            for other in list(srv.by_tsih.values()):
                if other.target is s.target:
                    srv.abort_tasks(other, lambda x: True)
            scsi.target_reset(s.nexus, fn == P.TmfFunction.TARGET_COLD_RESET)
            if fn == P.TmfFunction.TARGET_COLD_RESET:
                # §11.5.1: a cold reset also drops every connection of the target, after this response
                self.send(P.tmf_response(pdu.itt, resp, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn))
                for other in list(srv.by_tsih.values()):
                    if other.target is s.target:
                        srv.end_session(other, "target cold reset")
                return
        elif fn == P.TmfFunction.TASK_REASSIGN:
            resp = P.TmfResponse.REASSIGN_NOT_SUPPORTED
        else:
            resp = P.TmfResponse.NOT_SUPPORTED
        self.send(P.tmf_response(pdu.itt, resp, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn))

    # --- text and logout --------------------------------------------------------------------------
    def _text(self, pdu: P.Pdu) -> None:
        s = self.session
        assert s is not None
        ttt = pdu.u32(20)
        if ttt != P.RESERVED_TAG and ttt in self._text_pending:
            body = self._text_pending.pop(ttt)
        else:
            try:
                pairs = parse_text(pdu.data)
            except TextError:
                self._reject(pdu, P.RejectReason.PROTOCOL_ERROR)
                return
            answer: list[tuple[str, str]] = []
            for k, v in pairs:
                if k == "SendTargets":
                    answer.extend(self._send_targets(v, s))
                else:
                    answer.append((k, "NotUnderstood"))
            body = encode_text(answer)
        limit = s.params.initiator_mrdsl
        if len(body) > limit:
            # §11.11: a long answer goes out in pieces; the initiator asks for each with our TTT
            nttt = next(self._ttt) & 0xFFFFFFFF
            self._text_pending[nttt] = body[limit:]
            self.send(P.text_response(pdu.itt, nttt, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn, final=False,
                                      cont=True, dsl=limit), body[:limit])
            return
        self.send(P.text_response(pdu.itt, P.RESERVED_TAG, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn,
                                  final=True, cont=False, dsl=len(body)), body)

    def _send_targets(self, which: str, s: Session) -> list[tuple[str, str]]:
        """§13.3 / Appendix C: targets this initiator may reach through this portal, with their addresses."""
        out: list[tuple[str, str]] = []
        if s.discovery:
            if which not in ("All", "") and which not in self.server.targets:
                return out
            names = list(self.server.targets) if which == "All" else [which]
        else:
            assert s.target is not None
            names = [s.target.iqn] if which in ("", s.target.iqn) else []
        for name in names:
            t = self.server.target_on_portal(name, self.portal)
            if t is None:
                continue
            if t.allowed_initiators is not None and s.initiator_name not in t.allowed_initiators:
                continue
            out.append(("TargetName", t.iqn))
            for host, port in (t.advertised_portals or t.portals):
                if host in ("0.0.0.0", "::"):
                    host = self.portal[0] if self.portal[0] not in ("0.0.0.0", "::") else self._local_host()
                h = f"[{host}]" if ":" in host else host
                out.append(("TargetAddress", f"{h}:{port},{t.portal_group_tag}"))
        return out

    def _local_host(self) -> str:
        assert self.transport is not None
        sock = self.transport.get_extra_info("sockname")
        return str(sock[0]) if sock else "127.0.0.1"

    def _logout(self, pdu: P.Pdu) -> None:
        s = self.session
        assert s is not None
        reason = pdu.flags & 0x7F
        if reason == 2:
            self.send(P.logout_response(pdu.itt, 2, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn))
            return
        if reason == 1 and pdu.u16(20) != s.cid:
            self.send(P.logout_response(pdu.itt, 1, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn))
            return
        asyncio.get_running_loop().create_task(self._finish_logout(pdu.itt, s))

    async def _finish_logout(self, itt: int, s: Session) -> None:
        # §11.14: commands received before the logout are completed first
        runners = [t.runner for t in s.tasks.values() if t.runner]
        if runners:
            await asyncio.wait(runners, timeout=30)
        self.send(P.logout_response(itt, 0, self.next_statsn(), s.exp_cmdsn, s.max_cmdsn,
                                    time2wait=s.params.default_time2wait,
                                    time2retain=s.params.default_time2retain))
        self.server.end_session(s, "logout")
