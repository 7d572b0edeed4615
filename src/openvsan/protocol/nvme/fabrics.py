"""The fabric: subsystems on ports, the discovery subsystem, Connect and Disconnect (NVMe-oF 1.1 §3.3, §5)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openvsan.protocol.nvme import logpages as LP
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.ana import Portal
from openvsan.protocol.nvme.auth import CONNECT_ATR, ControllerAuth
from openvsan.protocol.nvme.command import Sqe
from openvsan.protocol.nvme.controller import Controller
from openvsan.protocol.nvme.status import Completion
from openvsan.protocol.nvme.subsystem import DISCOVERY_NQN, Port, Subsystem

CONNECT_DATA_LEN = 1024
ADMIN_MIN_SQSIZE = 31         # NVMe-oF 1.1 §3.3: an admin queue has at least 32 entries
CATTR_SQ_FLOW_DISABLE = 0x04  # Connect attribute: no SQHD flow control (TREQ bit 2 offers it)
CNTLID_DYNAMIC = 0xFFFF


@dataclass(slots=True)
class ConnectResult:
    completion: Completion
    controller: Controller | None = None
    qid: int = 0
    sqsize: int = 0               # entries (SQSIZE + 1)
    sq_flow_disabled: bool = False
    auth: ControllerAuth | None = None   # the queue must authenticate (DH-HMAC-CHAP) before other commands
    # an I/O queue that joined its controller with another Host ID than the admin queue's (the first such
    # queue of a controller only: the transport logs it once); the controller's own Host ID is kept
    other_hostid: bytes | None = None
    elsewhere: int | None = None  # the subsystem is served by that worker process of this node: hand the queue over


def _nqn(raw: bytes | bytearray | memoryview) -> str:
    b = bytes(raw)
    return b.split(b"\0", 1)[0].decode("utf-8", "replace").strip()


def connect_subnqn(data: bytes | bytearray | memoryview) -> str:
    """The subsystem NQN a Connect's data names (NVMe-oF 1.1 §3.3 Figure 20: bytes 256-511)."""
    return _nqn(data[256:512])


def _invalid(offset: int, in_data: bool) -> ConnectResult:
    # NVMe-oF 1.1 §3.3 Figure 21: IPO (bits 15:0) and IATTR (bits 23:16; 1 = in the Connect data)
    return ConnectResult(Completion(S.CONNECT_INVALID_PARAMETERS, offset | ((1 if in_data else 0) << 16)))


class Fabric:
    """Every subsystem served, the ports each is on, and the controllers connected to them."""

    def __init__(self, subsystems: Sequence[Subsystem], placement: dict[str, list[Port]], *,
                 clock: Callable[[], float], in_capsule: int = 8192, maxcmd: int = 1024,
                 rng: Callable[[int], bytes] = os.urandom) -> None:
        self.rng = rng                        # challenges and sequence numbers of DH-HMAC-CHAP
        self.discovery = Subsystem(DISCOVERY_NQN, discovery=True, model="openvsan discovery")
        self.subsystems = {s.nqn: s for s in subsystems}
        self.placement = placement            # subsystem NQN -> ports advertised in the discovery log
        # subsystems moving to another worker process of this node right now, by NQN: the worker that serves
        # them next; a Connect naming one is answered as for a shell of that worker (handed over)
        self.moving: dict[str, int] = {}
        self.clock = clock
        self.in_capsule = in_capsule
        self.maxcmd = maxcmd
        self.generation = 1

    def subsystem(self, nqn: str) -> Subsystem | None:
        return self.discovery if nqn == DISCOVERY_NQN else self.subsystems.get(nqn)

    def discovery_entries(self, hostnqn: str) -> list[tuple[Subsystem, Port]]:
        """NVMe-oF 1.1 §5.3: one entry per subsystem and port, for the subsystems this host may use."""
        return [(s, p) for nqn, s in self.subsystems.items() if s.allows(hostnqn)
                for p in self.placement.get(nqn, [])]

    def discovery_log(self, hostnqn: str) -> bytes:
        return LP.discovery_log(self.discovery_entries(hostnqn), self.generation)

    def connect(self, sqe: Sqe, data: bytes | bytearray | memoryview,
                reachable: Callable[[Subsystem], bool] = lambda s: True, *,
                portal: Portal | None = None) -> ConnectResult:
        """NVMe-oF 1.1 §3.3 Connect: an admin queue makes a controller, an I/O queue joins one. `portal` is
        where the queue came in: a new controller reports that portal's ANA states (ana.py)."""
        recfmt = sqe.cdw10 & 0xFFFF
        qid = sqe.cdw10 >> 16
        sqsize = sqe.cdw11 & 0xFFFF
        cattr = (sqe.cdw11 >> 16) & 0xFF
        kato = sqe.cdw12
        if recfmt != 0:
            return ConnectResult(Completion(S.CONNECT_INCOMPATIBLE_FORMAT))
        if len(data) < CONNECT_DATA_LEN:
            return ConnectResult(Completion(S.DATA_SGL_LENGTH_INVALID))
        hostid = bytes(data[0:16])
        cntlid = int.from_bytes(data[16:18], "little")
        subnqn = connect_subnqn(data)
        hostnqn = _nqn(data[512:768])
        sub = self.subsystem(subnqn)
        if sub is not None and not reachable(sub):
            return _invalid(256, True)
        elsewhere = self.moving.get(subnqn, sub.elsewhere if sub is not None else None)
        if elsewhere is not None:
            res = _invalid(256, True)     # the answer where the queue cannot be handed over
            res.elsewhere = elsewhere
            return res
        if sub is None:
            return _invalid(256, True)
        # an empty Host NQN (SPDK's perf tool sends one by default) is a host like any other: admitted where
        # any host is (Linux nvmet and SPDK's target do the same), refused by a host list or DH-HMAC-CHAP
        if not sub.allows(hostnqn):
            return ConnectResult(Completion(S.CONNECT_INVALID_HOST))
        if sqsize == 0 or sqsize >= self.maxcmd or (qid == 0 and sqsize < ADMIN_MIN_SQSIZE):
            return _invalid(44, False)
        flow_off = bool(cattr & CATTR_SQ_FLOW_DISABLE)
        if qid == 0:
            if cntlid not in (CNTLID_DYNAMIC, 0xFFFE):
                return _invalid(16, True)
            new_id = sub.allocate_cntlid()
            if new_id is None:
                return ConnectResult(Completion(S.CONNECT_CONTROLLER_BUSY))
            ctrl = Controller(sub, new_id, hostnqn, hostid, kato, clock=self.clock, in_capsule=self.in_capsule,
                              maxcmd=self.maxcmd, portal=portal)
            if sub.discovery:
                ctrl.discovery_source = self.discovery_log
            sub.controllers[new_id] = ctrl
            return self._admitted(ConnectResult(Completion(S.SUCCESS, new_id), ctrl, 0, sqsize + 1, flow_off))
        if sub.discovery:
            return _invalid(42, False)            # a discovery controller has an admin queue only
        # an I/O queue joins its controller by controller ID and Host NQN (Linux nvmet_ctrl_find_get, SPDK):
        # a host that makes a new Host ID per connection still reaches its controller, whose Host ID (the
        # admin queue's) is the one reservations see
        joined = sub.controllers.get(cntlid)
        if joined is None or joined.hostnqn != hostnqn:
            return _invalid(16, True)
        if not joined.ready:
            return ConnectResult(Completion(S.COMMAND_SEQUENCE_ERROR))
        if qid > joined.nr_io_queues or qid in joined.io_queues:
            return _invalid(42, False)
        joined.io_queues.add(qid)
        res = self._admitted(ConnectResult(Completion(S.SUCCESS, cntlid), joined, qid, sqsize + 1, flow_off))
        if joined.hostid != hostid and not joined.other_hostid_seen:   # reported by the first queue admitted
            joined.other_hostid_seen = True
            res.other_hostid = hostid
        return res

    def _admitted(self, res: ConnectResult) -> ConnectResult:
        """A host with a DH-HMAC-CHAP secret: the Connect response asks for an authentication transaction
        (AUTHREQ.ATR, TP 8006) on this queue, admin and I/O queues alike, as Linux nvmet does."""
        ctrl = res.controller
        assert ctrl is not None
        policy = ctrl.subsystem.dhchap_hosts.get(ctrl.hostnqn)
        if policy is not None:
            res.completion = Completion(S.SUCCESS, res.completion.dw0 | CONNECT_ATR)
            res.auth = ControllerAuth(policy, ctrl.hostnqn, ctrl.subsystem.nqn, rng=self.rng)
        return res

    def adopt(self, nqn: str, state: dict[str, Any], *, portal: Portal | None = None) -> Controller | str:
        """A controller that moved here with its subsystem (Controller.moving_state on the worker it left):
        registered under its own controller ID. A string says why it cannot be."""
        sub = self.subsystems.get(nqn)
        if sub is None or sub.elsewhere is not None:
            return f"subsystem {nqn} is not served here"
        cntlid = int(state["cntlid"])
        if cntlid in sub.controllers:
            return f"controller {cntlid} of {nqn} exists here already"
        ctrl = Controller.moved(sub, state, clock=self.clock, in_capsule=self.in_capsule, maxcmd=self.maxcmd,
                                portal=portal)
        sub.controllers[cntlid] = ctrl
        return ctrl

    def release(self, ctrl: Controller) -> None:
        """The controller's association ended (admin queue gone, keep-alive expired)."""
        sub = ctrl.subsystem
        if sub.controllers.get(ctrl.cntlid) is ctrl:
            del sub.controllers[ctrl.cntlid]
        ctrl.on_async_event = None
        ctrl.on_reset = None
