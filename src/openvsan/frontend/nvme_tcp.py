"""The asyncio NVMe/TCP target: portals, connections (one per NVMe queue), keep-alive (NVMe/TCP 1.0,
NVMe-oF 1.1).

A Connection is an asyncio.Protocol that feeds received bytes to the sans-IO TcpQueue
(protocol/nvme_tcp) and runs commands on the controllers of protocol/nvme; it only pumps.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections.abc import Sequence
from typing import Any

from openvsan.frontend.config import NvmeSubsystemConfig
from openvsan.frontend.handoff import Elsewhere
from openvsan.frontend.portals import BatchedConnection, PortalServer
from openvsan.netio import start_eagerly
from openvsan.protocol.auth_throttle import AuthThrottle
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.auth import (
    AUTH_REQUIRED,
    EXPLANATIONS,
    FAILED,
    FAILURE1,
    FCTYPE_AUTH_RECEIVE,
    FCTYPE_AUTH_SEND,
    REPLY,
    ControllerAuth,
    message_id,
)
from openvsan.protocol.nvme.command import FABRICS_OPCODE, Sqe, data_plan
from openvsan.protocol.nvme.controller import FCTYPE_CONNECT, FCTYPE_DISCONNECT, Controller
from openvsan.protocol.nvme.fabrics import Fabric, connect_subnqn
from openvsan.protocol.nvme.identify import MAX_TRANSFER
from openvsan.protocol.nvme.io import OP_READ, OP_WRITE, execute_io, read_now, write_now, write_soon
from openvsan.protocol.nvme.status import Completion
from openvsan.protocol.nvme.subsystem import Namespace, Port, Subsystem
from openvsan.protocol.nvme_tcp.framing import FatalError
from openvsan.protocol.nvme_tcp.host_pdus import capsule_cmd
from openvsan.protocol.nvme_tcp.pdu import DATA_HDR, F_LAST_PDU, F_SUCCESS, Fes, PduType
from openvsan.protocol.nvme_tcp.queue import (
    ADMIN_IN_CAPSULE,
    C2H_CHUNK,
    CapsuleCommand,
    DataReceived,
    Established,
    TcpQueue,
    Terminated,
)

log = logging.getLogger("openvsan.nvme")
_CAPSULE_CMD = int(PduType.CAPSULE_CMD)
_C2H_DATA = int(PduType.C2H_DATA)
_LAST_SUCCESS = F_LAST_PDU | F_SUCCESS
_CH = struct.Struct("<BBBBI")   # a PDU's common header (§3.6.1): type, flags, HLEN, PDO, PLEN

IN_CAPSULE = 8192            # in-capsule data we take on I/O queues (Identify Controller IOCCSZ)
MAXH2CDATA = 131072          # data per H2CData PDU (ICResp)
MAX_QUEUE_ENTRIES = 1024     # CAP.MQES + 1: the deepest queue a host may ask for in Connect
KEEP_ALIVE_TICK = 0.5        # seconds between keep-alive deadline checks
SUSPEND_TIMEOUT = 30.0       # a queue moving with its subsystem: its commands must finish by then
IC_TIMEOUT = 30.0            # a connection must send ICReq and Connect (and authenticate) within this time


def _ports_of(portals: Sequence[tuple[str, int]], ids: dict[tuple[str, int], int]) -> list[Port]:
    out = []
    for host, port in portals:
        key = (host, int(port))
        pid = ids.setdefault(key, len(ids) + 1)
        out.append(Port(pid, host, int(port)))
    return out


class NvmeTcpServer(PortalServer):
    kind = "NVMe/TCP"

    def __init__(self, subsystems: list[NvmeSubsystemConfig], *,
                 discovery_portals: list[tuple[str, int]] | None = None,
                 in_capsule: int = IN_CAPSULE, maxh2cdata: int = MAXH2CDATA) -> None:
        super().__init__()
        self.configs = list(subsystems)
        self.in_capsule = in_capsule
        self.maxh2cdata = maxh2cdata
        self._port_ids: dict[tuple[str, int], int] = {}
        subs: list[Subsystem] = []
        placement: dict[str, list[Port]] = {}
        self.listen: dict[tuple[str, int], None] = {}    # the discovery portals, then the subsystems'
        self.discovery_portals = [(h, int(p)) for h, p in discovery_portals or []]
        self.portals_of: dict[str, list[tuple[str, int]]] = {}
        for c in self.configs:
            subs.append(self._subsystem(c))
            placement[c.nqn] = self._place(c)
        self._relisten()
        self.fabric = Fabric(subs, placement, clock=time.monotonic, in_capsule=in_capsule,
                             maxcmd=MAX_QUEUE_ENTRIES)
        self.fabric.moving = self.moving    # one dict: the node changes it, Connect reads it
        self.queues_of: dict[Controller, set[Connection]] = {}
        self._ka_timer: asyncio.TimerHandle | None = None
        # failed DH-HMAC-CHAP per (host NQN, source address): late answers, then a lockout (set by the node)
        self.auth_throttle: AuthThrottle | None = None

    def _subsystem(self, c: NvmeSubsystemConfig) -> Subsystem:
        nss = [Namespace(n.nsid, n.volume, n.read_only) for n in c.namespaces]
        sub = Subsystem(c.nqn, nss, allowed_hosts=c.allowed_hosts, serial=c.serial, model=c.model,
                        dhchap_hosts=c.dhchap_hosts)
        sub.elsewhere = c.elsewhere
        return sub

    def _place(self, c: NvmeSubsystemConfig) -> list[Port]:
        listen = [(h, int(p)) for h, p in c.portals]
        self.portals_of[c.nqn] = listen
        return _ports_of(c.advertised_portals or listen, self._port_ids)

    def _relisten(self) -> None:
        self.listen = dict.fromkeys([p for c in self.configs for p in self.portals_of[c.nqn]])
        for p in self.discovery_portals:
            self.listen[p] = None

    # --- changes while serving (the node's data plane calls these) ----------------------------------------
    async def add_subsystem(self, c: NvmeSubsystemConfig) -> Subsystem:
        """Serve one more subsystem: it is in the discovery log at once (its generation counter moves, and
        hosts that asked get a discovery log change event), and its portals listen."""
        if c.nqn in self.fabric.subsystems:
            raise ValueError(f"NVMe subsystem {c.nqn} is already served")
        sub = self._subsystem(c)
        self.configs.append(c)
        self.fabric.subsystems[c.nqn] = sub
        self.fabric.placement[c.nqn] = self._place(c)
        self._relisten()
        try:
            await self.sync_portals()
        except OSError:
            await self.remove_subsystem(c.nqn)
            raise
        self._discovery_changed()
        return sub

    async def remove_subsystem(self, nqn: str) -> None:
        """Stop serving a subsystem: its controllers (and their queues) are dropped, its portals close if
        nothing else is served there."""
        sub = self.fabric.subsystems.pop(nqn)
        self.fabric.placement.pop(nqn, None)
        self.configs = [c for c in self.configs if c.nqn != nqn]
        self.portals_of.pop(nqn, None)
        for ctrl in list(sub.controllers.values()):
            self.drop_controller(ctrl, "subsystem removed")
        for ns in list(sub.namespaces):
            sub.remove_namespace(ns)
        self._relisten()
        await self.sync_portals()
        self._discovery_changed()

    async def update_subsystem(self, c: NvmeSubsystemConfig) -> None:
        """A served subsystem's settings change in place (hosts allowed, DH-HMAC-CHAP hosts, model, portals):
        controllers connected stay; new connections and the discovery log see the new settings."""
        sub = self.fabric.subsystems[c.nqn]
        sub.allowed_hosts = None if c.allowed_hosts is None else set(c.allowed_hosts)
        sub.dhchap_hosts = dict(c.dhchap_hosts)
        sub.model = c.model
        cfg = next(x for x in self.configs if x.nqn == c.nqn)
        cfg.portals, cfg.advertised_portals = c.portals, c.advertised_portals
        cfg.allowed_hosts, cfg.dhchap_hosts, cfg.model = c.allowed_hosts, c.dhchap_hosts, c.model
        self.fabric.placement[c.nqn] = self._place(cfg)
        self._relisten()
        await self.sync_portals()
        self._discovery_changed()

    def _discovery_changed(self) -> None:
        self.fabric.generation += 1   # NVMe-oF 1.1 §5.3: GENCTR changes with the log's contents
        for ctrl in list(self.fabric.discovery.controllers.values()):
            ctrl.discovery_changed()

    # --- life cycle -------------------------------------------------------------------------------------
    def portals(self) -> list[tuple[str, int]]:
        return list(self.listen)

    def make_connection(self, portal: tuple[str, int]) -> Connection:
        return Connection(self, portal)

    async def start(self) -> None:
        await super().start()
        self._ka_timer = asyncio.get_running_loop().call_later(KEEP_ALIVE_TICK, self._keep_alive_tick)

    def before_drain(self) -> None:
        if self._ka_timer is not None:
            self._ka_timer.cancel()

    def in_flight(self) -> list[asyncio.Future[None]]:
        return [t for c in self.connections if isinstance(c, Connection)
                for t in (*c.tasks, *((c.soon_idle(),) if c.soon else ()))]

    # --- controllers ------------------------------------------------------------------------------------
    def subsystem(self, nqn: str) -> Subsystem | None:
        return self.fabric.subsystems.get(nqn)

    def set_ana_state(self, nqn: str, group: int, state: int, *, portal: tuple[str, int] | None = None) -> None:
        """Change an ANA group's state, on every portal or one (as listened on); hosts that asked get an
        asynchronous event and re-read the log."""
        sub = self.fabric.subsystems[nqn]
        sub.set_ana_state(group, state, portal=portal)

    def reachable(self, sub: Subsystem, portal: tuple[str, int]) -> bool:
        if sub.discovery:
            return True
        return any((h, p) == portal or (h in ("0.0.0.0", "::") and p == portal[1])
                   for h, p in self.portals_of.get(sub.nqn, []))

    def bind(self, conn: Connection, ctrl: Controller) -> None:
        self.queues_of.setdefault(ctrl, set()).add(conn)

    def drop_controller(self, ctrl: Controller, why: str) -> None:
        """End an association: the controller goes and every queue of it is closed."""
        self.fabric.release(ctrl)
        conns = self.queues_of.pop(ctrl, set())
        if ctrl.subsystem.controllers.get(ctrl.cntlid) is None:
            log.info("controller %d of %s for %s ended: %s", ctrl.cntlid, ctrl.subsystem.nqn, ctrl.hostnqn, why)
        for c in conns:
            c.close()

    def drop_io_queues(self, ctrl: Controller) -> None:
        for c in list(self.queues_of.get(ctrl, ())):
            if c.qid:
                c.close()

    def _keep_alive_tick(self) -> None:
        now = time.monotonic()
        for sub in [self.fabric.discovery, *self.fabric.subsystems.values()]:
            for ctrl in list(sub.controllers.values()):
                if ctrl.expired(now):
                    log.warning("host %s: no Keep Alive within %d ms; dropping controller %d of %s",
                                ctrl.hostnqn, ctrl.kato_ms, ctrl.cntlid, sub.nqn)
                    self.drop_controller(ctrl, "keep-alive timeout")
        if not self.closing:
            self._ka_timer = asyncio.get_running_loop().call_later(KEEP_ALIVE_TICK, self._keep_alive_tick)


class Connection(BatchedConnection):
    """One TCP connection: one NVMe queue (admin or I/O) of one controller."""

    def __init__(self, server: NvmeTcpServer, portal: tuple[str, int]) -> None:
        super().__init__()
        self.server = server
        self.portal = portal
        self.queue = TcpQueue(in_capsule=server.in_capsule, maxh2cdata=server.maxh2cdata)
        self.ctrl: Controller | None = None
        self.qid = 0
        self.sqsize = 32
        self.sq_flow_off = False
        self.sqhd = 0
        self._max_transfer = max(MAX_TRANSFER, ADMIN_IN_CAPSULE)   # a command's data at most (_in_capsule_for)
        self.pending: dict[int, Sqe] = {}      # CID -> command waiting for data, running, or held (AER)
        self.tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._answered_in_read = 0             # completions made while handling the current socket read
        self._lane = False                     # received's capsule lane: an I/O queue, connected, no digests
        self._plain_c2h = False
        self.dhchap: ControllerAuth | None = None   # the host authenticates this queue (DH-HMAC-CHAP)
        self._open = False                     # connected, and authenticated where that is asked: any command
        # moving to another worker with its subsystem (suspend()): command capsules received since, as PDUs,
        # held for the worker that takes the queue over (H2CData of commands already started still go on)
        self._holding: list[bytes] | None = None
        self._moving_ctrl: Controller | None = None   # the controller of a queue detached to move (reattach)

    # --- asyncio.Protocol -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._closed:
            return  # refused: over a connection limit (frontend/limits.py)
        self.server.connections.add(self)
        self._timer = asyncio.get_running_loop().call_later(IC_TIMEOUT, self._setup_deadline)
        if self._resume is not None:
            state, self._resume = self._resume, None
            if not self._resume_from(state):
                return
        self.replay()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # closed, and its place in the connection limits given back
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        ctrl = self.ctrl
        if ctrl is None:
            return
        self.server.queues_of.get(ctrl, set()).discard(self)
        if self.qid == 0:
            self.server.drop_controller(ctrl, "admin queue closed")
        else:
            ctrl.io_queues.discard(self.qid)

    def eof_received(self) -> bool | None:
        if self.dhchap is not None and not self._open and not self.dhchap.failed and self.ctrl is not None:
            # a host that cannot or will not authenticate (no secret, a kernel without NVMe auth) just leaves
            self.dropped("closed by the host before DH-HMAC-CHAP authentication", f"host {self.ctrl.hostnqn}")
        return None   # the transport closes

    def received(self, data: bytes) -> None:
        self._answered_in_read = 0
        rest: bytes | memoryview = data
        if self._lane and not self.queue.reader.buffered:
            rest = self._capsule_lane(data)
            if not len(rest) or self._closed:
                return
        for ev in self.queue.receive_data(rest):
            if self._closed:
                return
            if isinstance(ev, CapsuleCommand):
                if self._holding is not None and ev.data_ok:
                    q = self.queue
                    self._holding.append(b"".join(capsule_cmd(bytes(ev.sqe), ev.data, hdgst=q.hdgst, ddgst=q.ddgst)))
                    continue
                self._command(ev.sqe, ev.data, ev.data_ok)
            elif isinstance(ev, DataReceived):
                self._data(ev)
            elif isinstance(ev, Established):
                self._send(ev.response)
            elif isinstance(ev, Terminated):
                self._terminate(ev)

    def _in_capsule_for(self, qid: int) -> None:
        """The in-capsule data this queue takes (an I/O queue: the server's; the admin queue: ADMIN_IN_CAPSULE),
        and so the most data a command may move (_command's data_plan)."""
        in_capsule = self.server.in_capsule if qid else ADMIN_IN_CAPSULE
        self.queue.reader.max_capsule_data = in_capsule
        self._max_transfer = max(MAX_TRANSFER, in_capsule)

    def _capsule_lane(self, data: bytes) -> bytes | memoryview:
        """The lane for what hosts send most on an I/O queue: CapsuleCmd PDUs (NVMe/TCP 1.0 §3.6.2.5) at the
        front of a receive, without digests, each with its data right behind the 72-byte header. They skip
        the PDU reader and its events; _command does every check as usual. Returns what is left for the
        reader: from the first PDU that is anything else or is cut by the end of the receive."""
        n = len(data)
        pos = 0
        view = memoryview(data)
        max_data = self.queue.reader.max_capsule_data
        while n - pos >= 72:
            t, flags, hlen, pdo, plen = _CH.unpack_from(data, pos)
            end = pos + plen
            if (t != _CAPSULE_CMD or flags or hlen != 72 or plen < 72 or end > n or plen - 72 > max_data
                    or (plen > 72 and pdo != 72)):
                break
            self._command(view[pos + 8:pos + 72], view[pos + 72:end], True)
            pos = end
            if self._closed:
                return b""
        return view[pos:] if pos else data

    def _setup_deadline(self) -> None:
        if self._closed or self._open:
            return
        if self.ctrl is None:
            self.dropped(f"no Connect within {IC_TIMEOUT:.0f} s")
            self.close()
        else:
            self.dropped(f"no DH-HMAC-CHAP authentication within {IC_TIMEOUT:.0f} s", f"host {self.ctrl.hostnqn}")
            self._end_association("authentication timeout")

    # --- sending ----------------------------------------------------------------------------------------
    def _send(self, *parts: bytes | memoryview) -> None:
        self.send_buffers(parts)

    def _terminate(self, ev: Terminated) -> None:
        self.dropped("protocol error", ev.reason)
        if ev.response:
            self._send(ev.response)
        self.close_lingering()   # the host may still be sending: a plain close could reset the C2HTermReq away

    def _fatal(self, fes: int, header: bytes | memoryview, why: str) -> None:
        self._terminate(self.queue.fatal(FatalError(fes, 0, header, why)))

    # --- commands ---------------------------------------------------------------------------------------
    def _command(self, raw: memoryview, data: memoryview, data_ok: bool) -> None:
        """A command capsule (§3.6.2.5): its 64-byte SQE, its in-capsule data (maybe empty), and whether that
        data passed its digest."""
        sqe = Sqe(raw)
        if self.ctrl is not None:
            self.sqhd = self.sqhd + 1 if self.sqhd + 1 < self.sqsize else 0
            # the host knows a slot is free only from a completion it has received: those made during this
            # read of the socket have not left yet, so they still count
            if len(self.pending) + self._answered_in_read >= self.sqsize:
                # the host submitted more commands than its submission queue holds (Connect SQSIZE)
                self._fatal(Fes.PDU_SEQUENCE_ERROR, raw, f"more than {self.sqsize} commands outstanding")
                return
        cid = sqe.cid
        if cid in self.pending:
            self._complete(sqe, Completion(S.CID_CONFLICT), 0)
            return
        status, length, r2t = data_plan(sqe, len(data), self._max_transfer)
        if status:
            self._complete(sqe, Completion(status), 0)
            return
        if not data_ok:
            self._complete(sqe, Completion(S.TRANSIENT_TRANSPORT_ERROR), 0)   # NVMe/TCP 1.0 §3.5.3 data digest
            return
        if self.qid and not r2t and self._open and self._fast_io(sqe, data, length):
            return
        self.pending[cid] = sqe
        if r2t:
            self._send(self.queue.request_data(cid, length))
            return
        self._run(sqe, data if length else b"", length)

    def _fast_io(self, sqe: Sqe, data: bytes | memoryview, length: int) -> bool:
        """A plain Read, or a Write with its data in the capsule, on a namespace whose device answers at
        once (protocol/nvme/io.py read_now / write_now): done and answered here, with no Task. False: the
        command was not touched and takes the normal path."""
        ctrl = self.ctrl
        assert ctrl is not None
        op = sqe.opcode
        if op == OP_READ:
            buf = read_now(ctrl, sqe)
            if buf is None or len(buf) != length:
                return False
            lent = not isinstance(buf, bytes)
            q = self.queue
            if self._plain_c2h and length <= C2H_CHUNK:
                # what _complete sends for it, without its Completion and its general C2HData encoder: §3.6.2.9
                # one C2HData, LAST; with SQ flow control off it carries SUCCESS and no CapsuleResp follows
                self._answered_in_read += 1
                cid = sqe.cid
                if self.sq_flow_off:
                    self.send_buffers((DATA_HDR.pack(_C2H_DATA, _LAST_SUCCESS, 24, 24, 24 + length, cid, 0, 0,
                                                     length), buf))
                else:
                    self.send_buffers((DATA_HDR.pack(_C2H_DATA, F_LAST_PDU, 24, 24, 24 + length, cid, 0, 0, length),
                                       buf, q.respond(cid, 0, 0, 0, self.sqhd, self.qid)))
            else:
                if lent and q.ddgst:
                    buf = bytes(buf)  # a view of the device: the digest must cover exactly what is sent
                self._complete(sqe, Completion(data=buf), length)
            if lent:
                self._batch.flush()  # a lent view leaves before a later command of this read can write there
            return True
        if op == OP_WRITE and len(data) == length:
            if write_now(ctrl, sqe, data):
                self._answered_ok(sqe.cid)
                return True
            # a device whose write waits on others (a replicated volume): started here, answered by
            # _written_soon with _complete, as _execute would answer it, and counted as a command running
            n = len(data)
            self.pending[sqe.cid] = sqe
            self.soon_started(n)
            if write_soon(ctrl, sqe, data, functools.partial(self._written_soon, sqe, n)):
                return True
            self.soon_ended(n)
            del self.pending[sqe.cid]
        return False

    def _answered_ok(self, cid: int) -> None:
        """What _complete sends for a success with no data and nothing in DW0/DW1: the CapsuleResp."""
        self._answered_in_read += 1
        self.send_buffers((self.queue.respond(cid, 0, 0, 0, self._head(), self.qid),))

    def _written_soon(self, sqe: Sqe, n: int, comp: Completion) -> None:
        self.pending.pop(sqe.cid, None)
        if comp is S.OK and not self._closed:
            self._answered_ok(sqe.cid)
        else:
            self._complete(sqe, comp, 0)
        self.soon_ended(n)

    def _data(self, ev: DataReceived) -> None:
        sqe = self.pending.get(ev.cccid)
        if sqe is None:
            return
        if not ev.data_ok:
            del self.pending[ev.cccid]
            self._complete(sqe, Completion(S.TRANSIENT_TRANSPORT_ERROR), 0)
            return
        self._run(sqe, ev.data, 0)

    def _run(self, sqe: Sqe, data: bytes | bytearray | memoryview, c2h_len: int) -> None:
        # a device that answers at once (RAM) completes the command here, with no Task (netio.start_eagerly)
        task = start_eagerly(self._execute(sqe, data, c2h_len))
        if task is not None:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            if len(data):
                self.hold_running(task, len(data))

    async def _execute(self, sqe: Sqe, data: bytes | bytearray | memoryview, c2h_len: int) -> None:
        ctrl = self.ctrl
        comp: Completion | None
        try:
            if sqe.opcode == FABRICS_OPCODE and sqe.fctype == FCTYPE_CONNECT and ctrl is None:
                comp = self._connect(sqe, data)
            elif ctrl is None:
                comp = Completion(S.COMMAND_SEQUENCE_ERROR)       # NVMe-oF 1.1 §3.3: Connect comes first
            elif sqe.opcode == FABRICS_OPCODE and sqe.fctype == FCTYPE_DISCONNECT:
                self._complete(sqe, Completion(), c2h_len)
                self.pending.pop(sqe.cid, None)
                self._disconnect()
                return
            elif self.dhchap is not None and sqe.opcode == FABRICS_OPCODE and \
                    sqe.fctype in (FCTYPE_AUTH_SEND, FCTYPE_AUTH_RECEIVE):
                comp = await self._authenticate(self.dhchap, sqe, data)
            elif not self._open and not (self.qid == 0 and sqe.opcode == FABRICS_OPCODE):
                comp = Completion(AUTH_REQUIRED)   # TP 8006: only fabrics commands until the queue authenticates
            elif self.qid == 0:
                comp = await ctrl.admin(sqe, data)
            elif sqe.opcode == FABRICS_OPCODE:
                comp = Completion(S.COMMAND_SEQUENCE_ERROR if sqe.fctype == FCTYPE_CONNECT else S.INVALID_OPCODE)
            else:
                comp = await execute_io(ctrl, sqe, data)
        except Exception:
            log.exception("%s: command %#04x failed", self.peer, sqe.opcode)
            comp = Completion(S.INTERNAL_ERROR)
        if comp is None:
            return                      # an Asynchronous Event Request, held until there is an event
        self.pending.pop(sqe.cid, None)
        self._complete(sqe, comp, c2h_len)
        if self.dhchap is not None and self.dhchap.failed and not self._closed:
            self._end_association("DH-HMAC-CHAP failed")   # after Failure1 has left (NVMe Base 2.0 §8.13.5.8)

    def _complete(self, sqe: Sqe, comp: Completion, c2h_len: int) -> None:
        if self._closed:
            return
        self._answered_in_read += 1
        cid = sqe.cid
        if comp.status and log.isEnabledFor(logging.DEBUG):
            log.debug("%s: qid %d cid %d opcode %#04x cdw10 %#x: status %#x", self.peer, self.qid, cid, sqe.opcode,
                      sqe.cdw10, comp.status)
        if comp.status == S.SUCCESS and comp.data is not None and c2h_len:
            data = comp.data if len(comp.data) <= c2h_len else memoryview(comp.data)[:c2h_len]
            # NVMe/TCP 1.0 §3.6.2.9: with SQ flow control off the last C2HData can carry the completion
            success = self.sq_flow_off and not comp.dw0 and not comp.dw1
            parts: list[bytes | memoryview] = []
            self.queue.read_data(parts, cid, data, success=success)
            self.send_buffers(parts)
            if success:
                return
        elif comp.status and self.ctrl is not None and comp.status != S.ASYNC_EVENT_LIMIT_EXCEEDED:
            self.ctrl.record_error(self.qid, cid, comp.status, sqe.nsid if self.qid else 0)
        self._send(self.queue.respond(cid, comp.status, comp.dw0, comp.dw1, self._head(), self.qid))

    def _head(self) -> int:
        """SQHD for a completion (NVMe-oF 1.1 §3.3.1.1: 0xFFFF once SQ flow control is off)."""
        return 0xFFFF if self.sq_flow_off else self.sqhd

    # --- fabrics ----------------------------------------------------------------------------------------
    def _connect(self, sqe: Sqe, data: bytes | bytearray | memoryview) -> Completion:
        srv = self.server
        if srv.closing:
            return Completion(S.CONNECT_CONTROLLER_BUSY)
        res = srv.fabric.connect(sqe, data, lambda s: srv.reachable(s, self.portal), portal=self.portal)
        if res.elsewhere is not None:
            try:
                self.elsewhere(res.elsewhere, f"NVMe subsystem {connect_subnqn(data)}")
            except Elsewhere as e:
                self.hand_off(e)   # closed here: the completion is not sent
                return res.completion
        ctrl = res.controller
        if ctrl is None:
            # who was refused: the host and subsystem NQNs the Connect data names (NVMe-oF 1.1 §3.3): unchecked
            # text from the peer, hence repr
            names = [bytes(data[o:o + 256]).split(b"\0", 1)[0].decode("utf-8", "replace") for o in (512, 256)]
            log.info("%s: Connect refused (status %#x): host %r, subsystem %r", self.peer, res.completion.status,
                     *names)
            return res.completion
        self.ctrl, self.qid, self.sqsize, self.sq_flow_off = ctrl, res.qid, res.sqsize, res.sq_flow_disabled
        self.settle()
        self.sqhd = 1 % self.sqsize
        srv.bind(self, ctrl)
        self._in_capsule_for(self.qid)
        self.dhchap = res.auth
        if self.dhchap is None:
            self._open_queue()
        if self.qid == 0:
            ctrl.on_async_event = self._async_event
            ctrl.on_reset = lambda: srv.drop_io_queues(ctrl)
            log.info("%s: host %s connected to %s (controller %d, KATO %d ms)", self.peer,
                     ctrl.hostnqn or "(empty Host NQN)",
                     ctrl.subsystem.nqn, ctrl.cntlid, ctrl.kato_ms)
        else:
            log.debug("%s: I/O queue %d of controller %d, %d entries", self.peer, self.qid, ctrl.cntlid,
                      self.sqsize)
            if res.other_hostid is not None:
                log.warning("%s: I/O queue %d of controller %d came with Host ID %s, the admin queue with %s "
                            "(accepted; reservations see the admin queue's; logged once per controller)",
                            self.peer, self.qid, ctrl.cntlid, res.other_hostid.hex(), ctrl.hostid.hex())
        return res.completion

    def _open_queue(self) -> None:
        """Connected, and authenticated where the host must: every command may come now."""
        self._open = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.logged_in()
        self._lane = bool(self.qid) and not (self.queue.hdgst or self.queue.ddgst)
        # a read's data can leave as one bare C2HData (and a CapsuleResp while SQ flow control is on): no
        # digests, no alignment padding
        self._plain_c2h = self._lane and self.queue.hpda == 0

    async def _authenticate(self, auth: ControllerAuth, sqe: Sqe, data: bytes | bytearray | memoryview) -> Completion:
        """AUTH_Send / AUTH_Receive (TP 8006) on this queue. The Reply that carries the host's response is
        answered late after failures from the same host NQN and address, and refused during a lockout."""
        throttle = self.server.auth_throttle
        key = (auth.hostnqn, self.source)
        if sqe.fctype == FCTYPE_AUTH_RECEIVE:
            status, out = auth.receive(sqe)
            comp = Completion(status, data=None if status else out)
        else:
            reply = message_id(bytes(data[:2])) == REPLY and auth.step == REPLY
            if reply and throttle is not None:
                verdict = throttle.check(key, time.monotonic())
                if verdict.locked:
                    # logged once, when the lockout began (below): a guesser's further tries add no lines
                    log.debug("%s: host %s is locked out for %.0f s more after %d failed DH-HMAC-CHAP attempts",
                              self.peer, auth.hostnqn, verdict.locked_for, verdict.failures)
                    return Completion(auth.refuse())
                if verdict.delay:
                    await asyncio.sleep(verdict.delay)
                    if self._closed:
                        return Completion(S.ABORT_REQUESTED)
            comp = Completion(auth.send(sqe, data))
            if reply and auth.step == FAILURE1 and auth.explanation == FAILED and throttle is not None:
                after = throttle.failed(key, time.monotonic())
                if after.started_lockout:
                    log.warning("%s: host %s is locked out for %.0f s after %d failed DH-HMAC-CHAP attempts",
                                self.peer, auth.hostnqn, after.locked_for, after.failures)
        if auth.failed:
            log.warning("%s: host %s failed DH-HMAC-CHAP on queue %d of %s: %s", self.peer, auth.hostnqn, self.qid,
                        auth.subnqn, EXPLANATIONS.get(auth.explanation, hex(auth.explanation)))
        elif auth.authenticated and not self._open:
            if throttle is not None:
                throttle.succeeded(key)
            assert auth.hash is not None
            log.info("%s: host %s authenticated queue %d of %s (DH-HMAC-CHAP %s, %s, %s)", self.peer, auth.hostnqn,
                     self.qid, auth.subnqn, auth.hash.name, auth.group.name,
                     "bidirectional" if auth.bidirectional else "unidirectional")
            self._open_queue()
        return comp

    def _end_association(self, why: str) -> None:
        """The host may not use this controller (a failed or unfinished authentication): all its queues go."""
        ctrl = self.ctrl
        if ctrl is None:
            self.close()
        else:
            self._batch.flush()
            self.server.drop_controller(ctrl, why)
            self.close()

    def _disconnect(self) -> None:
        """NVMe-oF 1.1 §3.4 Disconnect: an I/O queue goes; on the admin queue, the whole association."""
        ctrl = self.ctrl
        if ctrl is None:
            return
        self._batch.flush()
        if self.qid == 0:
            self.server.drop_controller(ctrl, "Disconnect")
        else:
            self.close()

    # --- moving to another worker with the subsystem (node/workers.py move) ------------------------------
    def _busy(self) -> bool:
        """Commands started and not answered, but held Asynchronous Event Requests (they move along)."""
        ctrl = self.ctrl
        held = set(ctrl.aer_cids) if ctrl is not None and self.qid == 0 else set()
        return bool(self.tasks) or any(cid not in held for cid in self.pending)

    async def suspend(self) -> tuple[dict[str, Any], bytes] | None:
        """Hold every command capsule from now on (H2CData for commands already started still comes in), let
        the commands started finish and their completions leave, then stop reading. The state is the
        queue's (ID, size, SQ head, what ICReq negotiated); the admin queue's also carries its held
        Asynchronous Event Requests, and the node adds the controller's (Controller.moving_state)."""
        ctrl = self.ctrl
        if (ctrl is None or not self._open or self._closed or self._holding is not None or self.transport is None
                or ctrl.subsystem.discovery):
            return None
        self._holding = []
        lane, self._lane = self._lane, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SUSPEND_TIMEOUT
        while self._busy():
            if self._closed or loop.time() > deadline:
                self._unhold(lane)
                return None
            await asyncio.sleep(0.001)
        self.transport.pause_reading()
        held = b"".join(self._holding) + self.queue.reader.take_buffered()
        self._holding = None
        state: dict[str, Any] = {
            "subsystem": ctrl.subsystem.nqn, "cntlid": ctrl.cntlid, "qid": self.qid, "sqsize": self.sqsize,
            "sq_flow_off": self.sq_flow_off, "sqhd": self.sqhd, "queue": self.queue.moving_state(),
            "aers": [bytes(sqe.raw).hex() for sqe in self.pending.values()]}
        if not await self.drained(SUSPEND_TIMEOUT):
            self.resume_here(state, held)
            return None
        return state, held

    def _unhold(self, lane: bool) -> None:
        held, self._holding = self._holding or [], None
        self._lane = lane
        if held:
            self._buffered_first(b"".join(held))

    def _buffered_first(self, data: bytes) -> None:
        """Run `data` as if received now, ahead of what the reader holds of a PDU not yet whole."""
        rest = self.queue.reader.take_buffered()
        self.answer_at_once(self.received, data + rest)

    def detach_for_move(self) -> None:
        """Out of the server's books; the controller stays (the node drops it from the subsystem once every
        queue of it is detached, without closing them: Fabric.release)."""
        self.server.connections.discard(self)
        ctrl = self.ctrl
        if ctrl is not None:
            self.server.queues_of.get(ctrl, set()).discard(self)
            if not self.server.queues_of.get(ctrl):
                self.server.queues_of.pop(ctrl, None)
                self.server.fabric.release(ctrl)
        self.ctrl = None     # losing this connection here ends nothing: the queue lives on elsewhere
        self._moving_ctrl = ctrl

    def reattach(self) -> None:
        ctrl = self._moving_ctrl
        self.server.connections.add(self)
        if ctrl is not None:
            ctrl.subsystem.controllers[ctrl.cntlid] = ctrl
            self.server.bind(self, ctrl)
            if self.qid == 0:
                ctrl.on_async_event = self._async_event
                ctrl.on_reset = lambda: self.server.drop_io_queues(ctrl)
        self.ctrl = ctrl

    def resume_here(self, state: dict[str, Any], received: bytes) -> None:
        self._holding = None
        self._lane = bool(self.qid) and not (self.queue.hdgst or self.queue.ddgst)
        if self.transport is not None and not self._closed:
            self.transport.resume_reading()
        if received:
            self._buffered_first(received)

    def _resume_from(self, state: dict[str, Any]) -> bool:
        """Take over the queue suspend() described; the admin queue brings its controller (state
        "controller"), the I/O queues join it by controller ID."""
        srv = self.server
        nqn = str(state.get("subsystem"))
        sub = srv.fabric.subsystems.get(nqn)
        if sub is None or sub.elsewhere is not None:
            self.moved_on(sub.elsewhere if sub is not None else None, srv.exchange, state,
                          "moved here for a subsystem this worker does not serve", nqn)
            return False
        qid, cntlid = int(state["qid"]), int(state["cntlid"])
        if qid == 0:
            made = srv.fabric.adopt(nqn, dict(state["controller"]), portal=self.portal)
            if isinstance(made, str):
                self.dropped("moved here, but its controller cannot be", made)
                self.close()
                return False
            ctrl = made
            ctrl.on_async_event = self._async_event
            ctrl.on_reset = lambda: srv.drop_io_queues(ctrl)
            for raw in state.get("aers") or ():
                sqe = Sqe(bytes.fromhex(str(raw)))
                self.pending[sqe.cid] = sqe
        else:
            found = sub.controllers.get(cntlid)
            if found is None:
                self.dropped("moved here before its controller's admin queue", f"controller {cntlid} of {nqn}")
                self.close()
                return False
            ctrl = found
        self.ctrl, self.qid, self.sqsize = ctrl, qid, int(state["sqsize"])
        self.sq_flow_off, self.sqhd = bool(state["sq_flow_off"]), int(state["sqhd"])
        self.queue.resume(dict(state["queue"]))
        self._in_capsule_for(qid)
        srv.bind(self, ctrl)
        self._open_queue()
        log.info("%s: %s of controller %d of %s for %s: moved here with its subsystem", self.peer,
                 f"I/O queue {qid}" if qid else "admin queue", cntlid, nqn, ctrl.hostnqn or "(empty Host NQN)")
        return True

    def _async_event(self, cid: int, comp: Completion) -> None:
        sqe = self.pending.pop(cid, None)
        if sqe is not None:
            self._complete(sqe, comp, 0)
