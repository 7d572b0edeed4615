"""iSCSI sessions and tasks on the target (RFC 7143 §4.2 command numbering, §4.4 sessions, §7.1 ERL 0)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from openvsan.protocol.iscsi.keys import Params
from openvsan.protocol.iscsi.login import CMD_WINDOW
from openvsan.protocol.iscsi.pdu import Pdu
from openvsan.protocol.iscsi.sequencing import WriteTransfer, sn_in_window, sn_lt
from openvsan.protocol.scsi import Nexus

if TYPE_CHECKING:
    from openvsan.frontend.config import IscsiTargetConfig
    from openvsan.frontend.iscsi import Connection
    from openvsan.protocol.scsi import Lun


@dataclass(eq=False, slots=True)
class Task:
    """One SCSI command in flight, from its Command PDU to its status."""

    itt: int
    lun_raw: bytes
    lun: int
    cdb: bytes
    edtl: int
    read: bool
    write: bool
    immediate: bool
    session: Session
    transfer: WriteTransfer | None = None
    needed_out: int = -1      # Data-Out bytes the CDB asks for; -1 until asked (one SCSI lookup per task)
    runner: asyncio.Task[None] | None = None   # set only when the command suspended (see netio.start_eagerly)
    running: bool = False
    aborted: bool = False


@dataclass(eq=False)
class Session:
    """One iSCSI session: a nexus between an initiator port (name + ISID) and a target portal group.

    We run ErrorRecoveryLevel 0 with MaxConnections=1: a session has one connection, and when that
    connection fails the session ends (§7.1.1, §6.3.5 with DefaultTime2Retain=0)."""

    tsih: int
    isid: bytes
    initiator_name: str
    target: IscsiTargetConfig | None        # None for a discovery session
    params: Params
    exp_cmdsn: int
    cid: int
    conn: Connection | None = None
    tasks: dict[int, Task] = field(default_factory=dict)
    # Non-immediate PDUs that arrived ahead of ExpCmdSN, by CmdSN (§3.2.2.1: delivered in order).
    pending: dict[int, tuple[Pdu, Callable[[Pdu], None]]] = field(default_factory=dict)
    nexus: Nexus | None = None
    closed: bool = False
    write_buffered: int = 0     # bytes of Data-Out buffers held by this session's tasks
    # LUN field as sent -> the Lun, for the fast path (a target's LUN map does not change while it runs)
    fast_luns: dict[bytes, Lun] = field(default_factory=dict)

    @property
    def discovery(self) -> bool:
        return self.target is None

    @property
    def max_cmdsn(self) -> int:
        return (self.exp_cmdsn + CMD_WINDOW - 1) & 0xFFFFFFFF

    def key(self) -> tuple[str, bytes, str]:
        return (self.initiator_name, self.isid, self.target.iqn if self.target else "")

    def order(self, pdu: Pdu, cmdsn: int, handler: Callable[[Pdu], None]) -> None:
        """Deliver a PDU in CmdSN order: immediate ones at once, others when their turn comes; anything
        outside [ExpCmdSN, MaxCmdSN] is silently ignored (§4.2.2.1)."""
        if pdu.immediate:
            handler(pdu)
            return
        if not sn_in_window(cmdsn, self.exp_cmdsn, self.max_cmdsn):
            return
        if cmdsn != self.exp_cmdsn:
            self.pending.setdefault(cmdsn, (pdu, handler))
            return
        self.exp_cmdsn = (self.exp_cmdsn + 1) & 0xFFFFFFFF
        handler(pdu)
        while self.exp_cmdsn in self.pending:
            queued, h = self.pending.pop(self.exp_cmdsn)
            self.exp_cmdsn = (self.exp_cmdsn + 1) & 0xFFFFFFFF
            h(queued)

    def forget(self, task: Task) -> None:
        """The task is over (done or aborted): drop it and give back its write buffer budget."""
        if self.tasks.get(task.itt) is task:
            del self.tasks[task.itt]
            if task.transfer is not None:
                self.write_buffered -= task.edtl

    def consider_received(self, refcmdsn: int, own_cmdsn: int) -> bool:
        """ABORT TASK of a command not (yet) seen: §11.5.1 — a RefCmdSN inside the window and below the
        TMF's own CmdSN counts as received."""
        return sn_in_window(refcmdsn, self.exp_cmdsn, self.max_cmdsn) and sn_lt(refcmdsn, own_cmdsn)
