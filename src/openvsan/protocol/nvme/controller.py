"""A controller: the admin command set, properties, features, asynchronous events and keep-alive
(NVMe Base 2.0 §3.1.3-4, §5; NVMe-oF 1.1 §3.5 properties, §3.9 keep alive). I/O commands are in io.py."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from openvsan.block.errors import BlockError
from openvsan.protocol.nvme import ana
from openvsan.protocol.nvme import identify as ID
from openvsan.protocol.nvme import logpages as LP
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.ana import Portal
from openvsan.protocol.nvme.command import FABRICS_OPCODE, NSID_ALL, Sqe
from openvsan.protocol.nvme.status import Completion
from openvsan.protocol.nvme.subsystem import Subsystem

# Admin opcodes (Base 2.0 §5 Figure 138)
OP_GET_LOG_PAGE = 0x02
OP_IDENTIFY = 0x06
OP_ABORT = 0x08
OP_SET_FEATURES = 0x09
OP_GET_FEATURES = 0x0A
OP_ASYNC_EVENT_REQUEST = 0x0C
OP_KEEP_ALIVE = 0x18
# Fabrics command types (NVMe-oF 1.1 §3.3 Figure 9)
FCTYPE_PROPERTY_SET = 0x00
FCTYPE_CONNECT = 0x01
FCTYPE_PROPERTY_GET = 0x04
FCTYPE_DISCONNECT = 0x08
# Properties (NVMe-oF 1.1 §3.5.1 Figure 20, Base 2.0 §3.1.3)
PROP_CAP = 0x00
PROP_VS = 0x08
PROP_CC = 0x14
PROP_CSTS = 0x1C
CC_EN = 1
CSTS_RDY = 1
CSTS_CFS = 2
SHST_PROCESSING = 1 << 2
SHST_COMPLETE = 2 << 2
# Feature identifiers (Base 2.0 §5.27.1 Figure 317)
FID_ARBITRATION = 0x01
FID_POWER_MANAGEMENT = 0x02
FID_TEMPERATURE_THRESHOLD = 0x04
FID_ERROR_RECOVERY = 0x05
FID_VOLATILE_WRITE_CACHE = 0x06
FID_NUMBER_OF_QUEUES = 0x07
FID_INTERRUPT_COALESCING = 0x08
FID_ASYNC_EVENT_CONFIG = 0x0B
FID_KEEP_ALIVE_TIMER = 0x0F
FID_HOST_IDENTIFIER = 0x81
FID_RESERVATION_PERSISTENCE = 0x83
# Asynchronous event (Base 2.0 §5.2 Figure 145-150): type Notice, info: NS attribute changed / ANA change
AE_NOTICE = 0x02
AEI_NS_ATTR_CHANGED = 0x00
AEI_ANA_CHANGE = 0x03
AEI_DISCOVERY_CHANGE = 0xF0   # NVMe-oF 1.1 Figure 36: Discovery Log Page Change

MAX_IO_QUEUES = 64            # I/O queues a controller may have (each one TCP connection)
KEEP_ALIVE_GRACE = 0.5        # seconds past KATO before a silent host counts as dead
TO_500MS = 15                 # CAP.TO: worst time to become ready, 7.5 s


class Controller:
    def __init__(self, subsystem: Subsystem, cntlid: int, hostnqn: str, hostid: bytes, kato_ms: int, *,
                 clock: Callable[[], float], in_capsule: int = 8192, maxcmd: int = 1024,
                 portal: Portal | None = None) -> None:
        self.subsystem = subsystem
        self.portal = portal                    # where the admin queue came in: whose ANA states it reports
        # ANA group -> the status that refuses I/O there now (0: none), for io.py admit(): one dict lookup
        self.ana_refusals: dict[int, int] = subsystem.ana.refusals(portal)
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.other_hostid_seen = False     # an I/O queue connected with another Host ID (fabrics.py connect)
        self.kato_ms = kato_ms
        self.clock = clock
        self.in_capsule = in_capsule
        self.maxcmd = maxcmd
        self.cc = 0
        self.csts = 0
        self.io_queues: set[int] = set()
        self.nr_io_queues = MAX_IO_QUEUES       # until Set Features (Number of Queues) says otherwise
        self.features: dict[int, int] = {FID_ARBITRATION: 0, FID_POWER_MANAGEMENT: 0,
                                          FID_TEMPERATURE_THRESHOLD: 0x0157, FID_ERROR_RECOVERY: 0,
                                          FID_INTERRUPT_COALESCING: 0, FID_ASYNC_EVENT_CONFIG: 0}
        self.write_cache = True
        self.aer_cids: list[int] = []
        self.pending_events: list[int] = []
        self.masked_logs: set[int] = set()      # a reported event's log page not read yet (§5.2.1)
        self.changed_nsids: list[int] = []
        self.errors: list[LP.ErrorEntry] = []
        self.error_count = 0
        self.last_keep_alive = clock()
        # set by the transport: completes a held Asynchronous Event Request; drops the I/O queues
        self.on_async_event: Callable[[int, Completion], None] | None = None
        self.on_reset: Callable[[], None] | None = None
        self.discovery_source: Callable[[str], bytes] | None = None

    # --- moving to another worker process with its subsystem (node/workers.py move) ----------------------
    def moving_state(self) -> dict[str, object]:
        """The controller as data: what the host set (properties, features), what it is owed (held events,
        the Changed Namespace list, the error log) and its queues, for the worker that takes it over."""
        return {"cntlid": self.cntlid, "hostnqn": self.hostnqn, "hostid": self.hostid.hex(),
                "other_hostid_seen": self.other_hostid_seen, "kato_ms": self.kato_ms, "cc": self.cc,
                "csts": self.csts, "io_queues": sorted(self.io_queues), "nr_io_queues": self.nr_io_queues,
                "features": {str(k): v for k, v in self.features.items()}, "write_cache": self.write_cache,
                "aer_cids": list(self.aer_cids), "pending_events": list(self.pending_events),
                "masked_logs": sorted(self.masked_logs), "changed_nsids": list(self.changed_nsids),
                "errors": [[e.count, e.sqid, e.cid, e.status, e.nsid, e.lba] for e in self.errors],
                "error_count": self.error_count}

    @classmethod
    def moved(cls, subsystem: Subsystem, state: dict[str, Any], *, clock: Callable[[], float], in_capsule: int,
              maxcmd: int, portal: Portal | None) -> Controller:
        """The controller moving_state() described, on this worker's subsystem."""
        c = cls(subsystem, int(state["cntlid"]), str(state["hostnqn"]), bytes.fromhex(str(state["hostid"])),
                int(state["kato_ms"]), clock=clock, in_capsule=in_capsule, maxcmd=maxcmd, portal=portal)
        c.other_hostid_seen = bool(state["other_hostid_seen"])
        c.cc, c.csts = int(state["cc"]), int(state["csts"])
        c.io_queues = {int(q) for q in state["io_queues"]}
        c.nr_io_queues = int(state["nr_io_queues"])
        c.features = {int(k): int(v) for k, v in dict(state["features"]).items()}
        c.write_cache = bool(state["write_cache"])
        c.aer_cids = [int(x) for x in state["aer_cids"]]
        c.pending_events = [int(x) for x in state["pending_events"]]
        c.masked_logs = {int(x) for x in state["masked_logs"]}
        c.changed_nsids = [int(x) for x in state["changed_nsids"]]
        c.errors = [LP.ErrorEntry(*map(int, e)) for e in state["errors"]]
        c.error_count = int(state["error_count"])
        return c

    # --- registers (properties) -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return bool(self.csts & CSTS_RDY)

    @property
    def cap(self) -> int:
        # MQES (0's based), CQR, TO, CSS: NVM command set; MPSMIN = MPSMAX = 4 KiB
        return (self.maxcmd - 1) | (1 << 16) | (TO_500MS << 24) | (1 << 37)

    def property_get(self, sqe: Sqe) -> Completion:
        # NVMe-oF 1.1 §3.5.4 Property Get: ATTRIB (CDW10 bits 2:0 size), OFST (CDW11)
        size8 = sqe.cdw10 & 7 == 1
        ofst = sqe.cdw11
        if ofst == PROP_CAP:
            value = self.cap
        elif ofst == PROP_VS:
            value = ID.VERSION
        elif ofst == PROP_CC:
            value = self.cc
        elif ofst == PROP_CSTS:
            value = self.csts
        elif ofst in (0x0C, 0x10, 0x20):   # INTMS, INTMC, NSSR: fabrics reserve them; read as 0
            value = 0
        else:
            return S.fail(S.INVALID_FIELD)
        if not size8:
            value &= 0xFFFFFFFF
        return Completion(S.SUCCESS, value & 0xFFFFFFFF, value >> 32)

    async def property_set(self, sqe: Sqe) -> Completion:
        # NVMe-oF 1.1 §3.5.5 Property Set: ATTRIB, OFST (CDW11), VALUE (CDW12-13)
        if sqe.cdw11 != PROP_CC:
            return S.fail(S.INVALID_FIELD)
        value = sqe.cdw12
        old, self.cc = self.cc, value
        if value & CC_EN and not old & CC_EN:
            self.csts = CSTS_RDY if self._cc_valid(value) else CSTS_CFS
        elif not value & CC_EN and old & CC_EN:
            self._reset()
        shn = (value >> 14) & 3
        if shn and not (old >> 14) & 3:
            # Base 2.0 §3.6.2: shutdown; the volatile write cache is flushed before SHST says complete
            self.csts = (self.csts & ~0xC) | SHST_PROCESSING
            await self.flush_all()
            self.csts = (self.csts & ~0xC) | SHST_COMPLETE
        elif not shn:
            self.csts &= ~0xC
        return S.OK

    def _cc_valid(self, cc: int) -> bool:
        css = (cc >> 4) & 7
        mps = (cc >> 7) & 0xF
        if css not in (0, 6, 7) or mps != 0:
            return False
        if self.subsystem.discovery:
            return True
        return (cc >> 16) & 0xF == 6 and (cc >> 20) & 0xF == 4   # IOSQES 64 bytes, IOCQES 16 bytes

    def _reset(self) -> None:
        """CC.EN 1 -> 0 (Base 2.0 §3.7.2): I/O queues go, held events go, the controller is not ready."""
        self.csts = 0
        self.aer_cids.clear()
        self.io_queues.clear()
        if self.on_reset is not None:
            self.on_reset()

    async def flush_all(self) -> None:
        for ns in list(self.subsystem.namespaces.values()):
            with contextlib.suppress(BlockError):   # shutdown goes on; the device reports its own failure
                await ns.volume.flush()

    # --- keep alive (NVMe-oF 1.1 §3.9 / Base 2.0 §3.9) -------------------------------------------------
    def keep_alive(self) -> None:
        self.last_keep_alive = self.clock()

    def expired(self, now: float) -> bool:
        return self.kato_ms > 0 and now - self.last_keep_alive > self.kato_ms / 1000 + KEEP_ALIVE_GRACE

    # --- errors ------------------------------------------------------------------------------------------
    def record_error(self, sqid: int, cid: int, status: int, nsid: int = 0, lba: int = 0) -> None:
        last = self.errors[-1] if self.errors else None
        if last is not None and last.cid == cid and last.status == status and last.sqid == 0 and sqid:
            last.sqid = sqid      # the command's handler logged it already (with its LBA); the queue adds its ID
            return
        self.error_count += 1
        self.errors.append(LP.ErrorEntry(self.error_count, sqid, cid, status, nsid, lba))
        del self.errors[:-ID.ELPE]

    # --- asynchronous events (Base 2.0 §5.2) ----------------------------------------------------------
    def namespace_changed(self, nsid: int) -> None:
        if nsid not in self.changed_nsids:
            self.changed_nsids.append(nsid)
        if self.features[FID_ASYNC_EVENT_CONFIG] & ID.OAES_NS_ATTR:
            self._event(AE_NOTICE, AEI_NS_ATTR_CHANGED, LP.LID_CHANGED_NS)

    def discovery_changed(self) -> None:
        if self.features[FID_ASYNC_EVENT_CONFIG] & ID.OAES_DISCOVERY_CHANGE:
            self._event(AE_NOTICE, AEI_DISCOVERY_CHANGE, LP.LID_DISCOVERY)

    def refresh_ana(self) -> None:
        self.ana_refusals = self.subsystem.ana.refusals(self.portal)

    def ana_changed(self) -> None:
        """What this controller reports in the ANA log changed: I/O sees it at once, the host by the
        Asymmetric Namespace Access Change notice if it enabled it (Set Features 0Bh bit 11), once until it
        reads the log page (§5.2.1: reading it without RAE re-arms the notice)."""
        self.refresh_ana()
        if self.features[FID_ASYNC_EVENT_CONFIG] & ID.OAES_ANA_CHANGE:
            self._event(AE_NOTICE, AEI_ANA_CHANGE, LP.LID_ANA)

    def _event(self, etype: int, info: int, lid: int) -> None:
        if lid in self.masked_logs:
            return          # reported once already; the host has not read the log page yet
        self.masked_logs.add(lid)
        dw0 = etype | (info << 8) | (lid << 16)
        if self.aer_cids and self.on_async_event is not None:
            self.on_async_event(self.aer_cids.pop(0), Completion(S.SUCCESS, dw0))
        else:
            self.pending_events.append(dw0)

    def _async_event_request(self, sqe: Sqe) -> Completion | None:
        # Base 2.0 §5.2: held until there is an event to report
        if self.pending_events:
            return Completion(S.SUCCESS, self.pending_events.pop(0))
        if len(self.aer_cids) >= ID.AERL:
            return S.fail(S.ASYNC_EVENT_LIMIT_EXCEEDED)
        self.aer_cids.append(sqe.cid)
        return None

    # --- admin command dispatch -------------------------------------------------------------------------
    async def admin(self, sqe: Sqe, data: bytes | bytearray | memoryview) -> Completion | None:
        """Run one admin command; None means it is held (an Asynchronous Event Request)."""
        op = sqe.opcode
        if op == FABRICS_OPCODE:
            ft = sqe.fctype
            if ft == FCTYPE_PROPERTY_GET:
                return self.property_get(sqe)
            if ft == FCTYPE_PROPERTY_SET:
                return await self.property_set(sqe)
            if ft == FCTYPE_CONNECT:
                return S.fail(S.COMMAND_SEQUENCE_ERROR)   # this queue is connected already
            return S.fail(S.INVALID_OPCODE)
        if not self.ready:
            return S.fail(S.COMMAND_SEQUENCE_ERROR)   # NVMe-oF 1.1 §3.2: only fabrics commands before CC.EN
        if op == OP_KEEP_ALIVE:
            self.keep_alive()
            return S.OK
        if op == OP_IDENTIFY:
            return self._identify(sqe)
        if op == OP_GET_LOG_PAGE:
            return self._get_log_page(sqe)
        if op == OP_ASYNC_EVENT_REQUEST:
            return self._async_event_request(sqe)
        if op == OP_SET_FEATURES:
            return await self._set_features(sqe, data)
        if op == OP_GET_FEATURES:
            return self._get_features(sqe)
        if op == OP_ABORT:
            # Base 2.0 §5.1: "not aborted" (DW0 bit 0) is always a valid answer; our commands run to the end
            return Completion(S.SUCCESS, 1)
        return S.fail(S.INVALID_OPCODE)

    def _identify(self, sqe: Sqe) -> Completion:
        # Base 2.0 §5.17: CNS in CDW10 bits 7:0, CSI in CDW11 bits 31:24
        cns = sqe.cdw10 & 0xFF
        csi = sqe.cdw11 >> 24
        sub = self.subsystem
        if cns == ID.CNS_CONTROLLER:
            return Completion(data=ID.controller(self))
        if sub.discovery:
            return S.fail(S.INVALID_FIELD)
        if cns in (ID.CNS_ACTIVE_NS_LIST, ID.CNS_CSI_ACTIVE_NS_LIST):
            if sqe.nsid >= 0xFFFFFFFE or (cns == ID.CNS_CSI_ACTIVE_NS_LIST and csi != 0):
                return S.fail(S.INVALID_NAMESPACE if sqe.nsid >= 0xFFFFFFFE else S.INVALID_FIELD)
            return Completion(data=ID.active_namespaces(sub, sqe.nsid))
        if cns == ID.CNS_CSI_CONTROLLER:
            return Completion(data=ID.nvm_controller()) if csi == 0 else S.fail(S.INVALID_FIELD)
        if cns == ID.CNS_IO_COMMAND_SET:
            return Completion(data=ID.io_command_sets())
        if cns in (ID.CNS_NAMESPACE, ID.CNS_NS_ID_DESCRIPTORS, ID.CNS_CSI_NAMESPACE,
                   ID.CNS_CS_INDEPENDENT_NAMESPACE):
            ns = sub.namespaces.get(sqe.nsid)
            if ns is None:
                if sqe.nsid == 0 or sqe.nsid == NSID_ALL or sqe.nsid > ID.MNAN:
                    return S.fail(S.INVALID_NAMESPACE)
                return Completion(data=bytes(ID.IDENTIFY_SIZE))   # an inactive NSID: zeroes (§5.17.2.1)
            if cns == ID.CNS_NAMESPACE:
                return Completion(data=ID.namespace(ns, sub, self))
            if cns == ID.CNS_NS_ID_DESCRIPTORS:
                return Completion(data=ID.ns_descriptors(ns))
            if cns == ID.CNS_CSI_NAMESPACE:
                return Completion(data=bytes(ID.IDENTIFY_SIZE)) if csi == 0 else S.fail(S.INVALID_FIELD)
            return Completion(data=ID.cs_independent_namespace(ns))
        return S.fail(S.INVALID_FIELD)

    def _get_log_page(self, sqe: Sqe) -> Completion:
        # Base 2.0 §5.16: LID, LSP, RAE in CDW10; NUMDL/NUMDU; LPOL/LPOU offset in bytes
        lid = sqe.cdw10 & 0xFF
        lsp = (sqe.cdw10 >> 8) & 0x7F
        rae = bool(sqe.cdw10 & (1 << 15))
        size = ((sqe.cdw10 >> 16) | ((sqe.cdw11 & 0xFFFF) << 16)) * 4 + 4
        if size > sqe.sgl_len:
            return S.fail(S.DATA_SGL_LENGTH_INVALID)    # NUMD asks for more than the host's buffer holds
        offset = sqe.cdw12 | (sqe.cdw13 << 32)
        sub = self.subsystem
        if sub.discovery:
            if lid != LP.LID_DISCOVERY:
                return S.fail(S.INVALID_LOG_PAGE)
            page = self.discovery_log()
        elif lid == LP.LID_ERROR:
            page = LP.error_log(self.errors, ID.ELPE)
        elif lid == LP.LID_SMART:
            page = LP.smart_log(sub)
        elif lid == LP.LID_FW_SLOT:
            page = LP.fw_slot_log(ID.FIRMWARE)
        elif lid == LP.LID_CHANGED_NS:
            page = LP.changed_ns_log(self.changed_nsids)
            if not rae:
                self.changed_nsids.clear()
        elif lid == LP.LID_ANA:
            page = LP.ana_log(sub, self.portal, rgo=bool(lsp & ana.LSP_RGO))
        else:
            return S.fail(S.INVALID_LOG_PAGE)
        if offset & 3 or offset > len(page):
            return S.fail(S.INVALID_FIELD)
        if not rae:
            self.masked_logs.discard(lid)        # reading the log re-arms its events (§5.2.1)
        out = page[offset:offset + size]
        return Completion(data=out if len(out) == size else out.ljust(size, b"\0"))

    def discovery_log(self) -> bytes:
        """The fabric, which knows every subsystem and port, sets discovery_source."""
        if self.discovery_source is None:
            return LP.discovery_log([], 0)
        return self.discovery_source(self.hostnqn)

    async def _set_features(self, sqe: Sqe, data: bytes | bytearray | memoryview) -> Completion:
        # Base 2.0 §5.27: FID in CDW10 bits 7:0, SV bit 31
        fid = sqe.cdw10 & 0xFF
        if sqe.cdw10 & (1 << 31):
            return S.fail(S.FEATURE_NOT_SAVEABLE)
        v = sqe.cdw11
        if fid == FID_NUMBER_OF_QUEUES:
            nsqr, ncqr = v & 0xFFFF, v >> 16
            if nsqr == 0xFFFF or ncqr == 0xFFFF:
                return S.fail(S.INVALID_FIELD)
            n = min(max(nsqr, ncqr) + 1, MAX_IO_QUEUES)
            self.nr_io_queues = n
            return Completion(S.SUCCESS, (n - 1) | ((n - 1) << 16))
        if fid == FID_VOLATILE_WRITE_CACHE:
            if self.subsystem.discovery:
                return S.fail(S.INVALID_FIELD)
            self.write_cache = bool(v & 1)
            if not self.write_cache:
                await self.flush_all()           # what was cached must be durable once the cache is off
            return S.OK
        if fid == FID_KEEP_ALIVE_TIMER:
            self.kato_ms = v
            self.keep_alive()
            return S.OK
        if fid == FID_ASYNC_EVENT_CONFIG:
            supported = ID.OAES_DISCOVERY_CHANGE if self.subsystem.discovery else ID.OAES
            self.features[fid] = v & supported
            return S.OK
        if fid == FID_POWER_MANAGEMENT:
            return S.OK if v & 0x1F == 0 else S.fail(S.INVALID_FIELD)   # one power state
        if fid in (FID_ARBITRATION, FID_TEMPERATURE_THRESHOLD, FID_ERROR_RECOVERY, FID_INTERRUPT_COALESCING):
            self.features[fid] = v
            return S.OK
        if fid == FID_HOST_IDENTIFIER:
            return S.fail(S.COMMAND_SEQUENCE_ERROR)   # fabrics: the host ID comes with Connect (§5.27.1.26)
        if fid == FID_RESERVATION_PERSISTENCE:
            return S.OK if v & 1 == 0 else S.fail(S.INVALID_FIELD)
        return S.fail(S.INVALID_FIELD)

    def _get_features(self, sqe: Sqe) -> Completion:
        # Base 2.0 §5.15: SEL (CDW10 bits 10:8): 0 current, 1 default, 2 saved, 3 supported capabilities
        fid = sqe.cdw10 & 0xFF
        sel = (sqe.cdw10 >> 8) & 7
        known = set(self.features) | {FID_VOLATILE_WRITE_CACHE, FID_NUMBER_OF_QUEUES, FID_KEEP_ALIVE_TIMER,
                                       FID_HOST_IDENTIFIER, FID_RESERVATION_PERSISTENCE}
        if fid not in known or (self.subsystem.discovery and fid == FID_VOLATILE_WRITE_CACHE):
            return S.fail(S.INVALID_FIELD)
        if sel == 3:
            return Completion(S.SUCCESS, 1 << 2)        # changeable, not saveable, not namespace specific
        if fid == FID_VOLATILE_WRITE_CACHE:
            value = 1 if sel != 0 else int(self.write_cache)
        elif fid == FID_NUMBER_OF_QUEUES:
            n = self.nr_io_queues - 1
            value = n | (n << 16)
        elif fid == FID_KEEP_ALIVE_TIMER:
            value = self.kato_ms
        elif fid == FID_HOST_IDENTIFIER:
            if not sqe.cdw11 & 1:
                return S.fail(S.HOST_ID_INCONSISTENT)   # 128-bit host identifiers only (EXHID)
            return Completion(data=self.hostid)
        elif fid == FID_RESERVATION_PERSISTENCE:
            value = 0
        else:
            value = self.features[fid] if sel == 0 else 0
        return Completion(S.SUCCESS, value)


