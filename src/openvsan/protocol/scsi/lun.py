"""A SCSI logical unit over a Volume: its state (mode pages, reservations, unit attentions, medium)
and the dispatch of one command.

Every precondition of a command is written once, in `Lun.admit()` (SAM-5 5.14 order: unit attention, CDB,
the target port's asymmetric access state, reservations, medium) and, for the medium-access commands,
`sbc.admit_rw()` (write protection, LBA range, transfer length); the normal path (execute and its handlers)
and the fast path (read_now / write_now) both ask them, so a new check (QoS, thin space) goes in one place."""

from __future__ import annotations

import asyncio
import pathlib
import struct
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from openvsan.block.device import Buffer
from openvsan.block.errors import BlockError
from openvsan.protocol.scsi import provisioning, sbc, spc, xcopy
from openvsan.protocol.scsi.alua import TargetPortGroups
from openvsan.protocol.scsi.inquiry import BlockLimits
from openvsan.protocol.scsi.locks import RangeLock
from openvsan.protocol.scsi.mode import ModeState
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.opcodes import COMMANDS, Access, CommandSpec
from openvsan.protocol.scsi.pr import PersistentReservations
from openvsan.protocol.scsi.sense import (
    ASC_ASYMMETRIC_ACCESS_STATE_CHANGED,
    ASC_CAPACITY_DATA_HAS_CHANGED,
    ASC_INVALID_FIELD_IN_CDB,
    ASC_INVALID_OPCODE,
    ASC_LU_NOT_ACCESSIBLE_STANDBY,
    ASC_LU_NOT_ACCESSIBLE_TRANSITION,
    ASC_LU_NOT_ACCESSIBLE_UNAVAILABLE,
    ASC_MEDIUM_NOT_PRESENT,
    ASC_MODE_PARAMETERS_CHANGED,
    ASC_THIN_PROVISIONING_SOFT_THRESHOLD_REACHED,
    CHECK_CONDITION,
    ILLEGAL_REQUEST,
    NOT_READY,
    RESERVATION_CONFLICT,
    UNIT_ATTENTION,
    ScsiError,
    ScsiResult,
    block_error_result,
    build_sense,
)
from openvsan.volume import Volume

Handler = Callable[["Lun", bytes, memoryview, Nexus], Awaitable[ScsiResult]]
DataOutLength = Callable[[bytes, int], int]

HANDLERS: dict[tuple[int, int | None], Handler] = {**spc.HANDLERS, **sbc.HANDLERS, **provisioning.HANDLERS,
                                                    **xcopy.HANDLERS}
DATA_OUT: dict[int, DataOutLength] = {**spc.DATA_OUT, **sbc.DATA_OUT, **provisioning.DATA_OUT, **xcopy.DATA_OUT}

# One slot per opcode: (spec, handler, CDB length, the bits that must be clear) or, for service-action
# opcodes, a dict of them by service action.
Entry = tuple[CommandSpec, Handler, int, int]
_TABLE: list[Entry | dict[int, Entry] | None] = [None] * 256
for _spec in COMMANDS:
    _h = HANDLERS.get((_spec.opcode, _spec.sa))
    if _h is None:
        continue
    _entry = (_spec, _h, len(_spec.usage), ~_spec.check_mask & ((1 << 8 * len(_spec.usage)) - 1))
    if _spec.sa is None:
        _TABLE[_spec.opcode] = _entry
    else:
        _slot = _TABLE[_spec.opcode]
        if not isinstance(_slot, dict):
            _slot = _TABLE[_spec.opcode] = {}
        _slot[_spec.sa] = _entry

SUPPORTED: tuple[CommandSpec, ...] = tuple(c for c in COMMANDS if (c.opcode, c.sa) in HANDLERS)

# commands that do not consume a pending unit attention (SPC-4 5.14)
_UA_EXEMPT = frozenset((0x12, 0x03, 0xA0))
# commands that work with no medium loaded (SBC-4 4.9: the others get NOT READY, MEDIUM NOT PRESENT)
_NO_MEDIUM_OK = frozenset((0x12, 0x03, 0xA0, 0xA3, 0x1B, 0x1E, 0x1A, 0x5A, 0x15, 0x55, 0x5E, 0x5F,
                           0x16, 0x17, 0x56, 0x57))

# COMPARE AND WRITE, WRITE SAME(10)/(16): Data-Out must be exactly what the CDB says, not just enough
_EXACT_DATA_OUT = frozenset((0x89, 0x41, 0x93))

_OPCODE_UNSUPPORTED = ScsiError(ILLEGAL_REQUEST, ASC_INVALID_OPCODE)
_RESERVATION_CONFLICT = ScsiResult(RESERVATION_CONFLICT)
# NOT READY, LOGICAL UNIT NOT ACCESSIBLE, by ASC/ASCQ (SPC-4 5.15.2.4)
_NOT_ACCESSIBLE = {asc: ScsiResult(CHECK_CONDITION, b"", build_sense(NOT_READY, asc))
                   for asc in (ASC_LU_NOT_ACCESSIBLE_STANDBY, ASC_LU_NOT_ACCESSIBLE_UNAVAILABLE,
                               ASC_LU_NOT_ACCESSIBLE_TRANSITION)}

# The fast path's commands: READ(10)/(16) and WRITE(10)/(16), by opcode: where LBA and TRANSFER LENGTH sit
# and the CDB byte of TRANSFER LENGTH (SBC-4 5.15, 5.17, 5.41, 5.43)
_LBA10 = struct.Struct(">xxIxH")
_LBA16 = struct.Struct(">xxQI")
_FAST_READ = {0x28: (_LBA10, 7), 0x88: (_LBA16, 10)}
_FAST_WRITE = {0x2A: (_LBA10, 7), 0x8A: (_LBA16, 10)}


def _unit_attention(asc: int) -> ScsiResult:
    return ScsiResult(CHECK_CONDITION, b"", build_sense(UNIT_ATTENTION, asc))


def is_unit_attention(result: ScsiResult) -> bool:
    """Whether admit() refused with a unit attention, which the reporting path then consumes (SAM-5 5.14)."""
    return len(result.sense) > 2 and result.sense[2] & 0x0F == UNIT_ATTENTION


class Lun:
    def __init__(self, volume: Volume, *, read_only: bool = False, pr_state_path: pathlib.Path | None = None,
                 removable: bool = False, alua: TargetPortGroups | None = None) -> None:
        self.volume = volume
        # the LU's identity is the volume's (VPD 80h serial, 83h NAA and names)
        self.name = volume.name
        self.uuid = volume.uuid
        self.serial = volume.serial
        self.read_only = read_only
        self.removable = removable
        self.block_size = volume.block_size
        # physical block of 4 KiB under 512-byte logical blocks: initiators align to it (SBC-4 6.6.4)
        self.lbppb_exponent = 3 if self.block_size == 512 else 0
        self._read_capabilities()
        self._unlisten_volume = volume.listen(self._volume_changed)
        # the target port groups the LU is seen through (SPC-4 5.15); by default one, active/optimized
        self.alua = alua if alua is not None else TargetPortGroups.single()
        self._unlisten_alua = self.alua.listen(self._alua_changed)
        self.mode = ModeState()
        self.pr = PersistentReservations(pr_state_path)
        self.pr.load()
        self.pr_lock = asyncio.Lock()
        # a replicated volume's nodes share one PR state (node/replicas.py PrSync: refresh(pr), then
        # commit(state) -> False when another node's command came first); None: this LU's own
        self.pr_sync: Any = None
        self.spc2_holder: Nexus | None = None       # RESERVE(6)/(10) (SPC-2 7.21)
        self.prevent: set[Nexus] = set()            # PREVENT ALLOW MEDIUM REMOVAL (SPC-4 6.13)
        self.medium_present = True
        self.unit_attentions: dict[Nexus, list[int]] = {}
        self.nexuses: set[Nexus] = set()            # every I_T nexus this LU has heard from
        self.locks = RangeLock()
        # set when the whole LU was just deallocated (SANITIZE, a whole-LU UNMAP): GET LBA STATUS can then
        # answer for every block without reading any; the first write clears it
        self.all_deallocated = False
        self.copy_results: dict[tuple[Nexus, int], tuple[int, int, int]] = {}   # EXTENDED COPY, by list id
        # the other LUs of the target, for EXTENDED COPY between them (set by ScsiTarget)
        self.peers: Callable[[], Iterable[Lun]] | None = None

    def unlisten(self) -> None:
        """The LU is going: stop hearing of its volume and its target port groups."""
        self._unlisten_volume()
        self._unlisten_alua()

    # ---- asymmetric access (SPC-4 5.15): the node sets the states; the LU reports and enforces them

    def set_alua(self, alua: TargetPortGroups) -> None:
        """Put the LU under another target port group model (a volume that became replicated while
        exported); its nexuses hear of it if any port's group or state differs."""
        before = self.alua.snapshot(), self.alua.default
        self._unlisten_alua()
        self.alua = alua
        self._unlisten_alua = alua.listen(self._alua_changed)
        if (alua.snapshot(), alua.default) != before:
            self._alua_changed()

    def _alua_changed(self) -> None:
        # SPC-4 5.15.2.6: after an implicit change, every I_T nexus learns of it
        self.add_ua_others(ASC_ASYMMETRIC_ACCESS_STATE_CHANGED, None)

    # ---- admission: every precondition of a command, asked by the normal and the fast path alike

    def admit(self, cdb: Buffer, nexus: Nexus, *, expected_length: int | None = None) -> Entry | ScsiResult:
        """The command's (spec, handler) if it may run now, else the result that refuses it, checked in the
        order of SAM-5 5.14: a unit attention pending for this nexus (SPC-4 5.14: not for INQUIRY, REPORT
        LUNS, REQUEST SENSE), the CDB (opcode, service action, length, bits outside its usage data), the
        asymmetric access state of the target port the command came in on (SPC-4 5.15.2.4), an
        SPC-2 reservation (SPC-2 5.5.1), a persistent reservation (SPC-4 PERSISTENT RESERVE), the medium (SBC-4 4.9),
        and the transport's expected length where the CDB alone fixes the Data-Out split (SBC-4 5.3).

        Pure: nothing is consumed or recorded, so the fast path may ask and decline; execute() consumes
        the unit attention it reports (is_unit_attention) and adds the nexus."""
        op = cdb[0]
        if self.unit_attentions and op not in _UA_EXEMPT:
            pending = self.unit_attentions.get(nexus)
            if pending:
                return _unit_attention(pending[0])
        entry = _TABLE[op]
        if entry is None:
            return _OPCODE_UNSUPPORTED.result()
        if isinstance(entry, dict):
            found = entry.get(cdb[1] & 0x1F) if len(cdb) > 1 else None
            if found is None:
                return ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB,
                                                                    field=1, bit=4))
            entry = found
        spec, _, n, reserved = entry
        if len(cdb) < n:
            return ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB, field=0))
        stray = int.from_bytes(cdb[:n], "big") & reserved
        if stray:
            return _stray_bits(stray, n).result()
        if not self.alua.all_active:
            asc = self.alua.refusal(op, spec.sa, nexus.tpgt)
            if asc is not None:
                return _NOT_ACCESSIBLE[asc]
        if self.spc2_holder is not None and self.spc2_holder != nexus and not spec.spc2_allowed:
            return _RESERVATION_CONFLICT
        if self.pr.type and self.pr.conflicts(nexus, spec.access):
            return _RESERVATION_CONFLICT
        if not self.medium_present and op not in _NO_MEDIUM_OK:
            return ScsiResult(CHECK_CONDITION, b"", build_sense(NOT_READY, ASC_MEDIUM_NOT_PRESENT))
        if expected_length is not None and op in _EXACT_DATA_OUT and expected_length != self.data_out_length(
                bytes(cdb[:n])):
            # the transport's expected length disagrees with the CDB: for these commands the split of the
            # Data-Out (compare/write halves, the one block of WRITE SAME) would be a guess (SBC-4 5.3)
            return ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB,
                                                                field=13 if op == 0x89 else 0))
        return entry

    # ---- the synchronous fast path: what admit() lets through, done at once by a device that can

    def read_now(self, cdb: Buffer, nexus: Nexus) -> Buffer | None:
        """The data of a READ(10)/(16) that admit() and sbc.admit_rw() let through, read at once, or None:
        then the command must take execute(), which reports whatever refuses it. Side-effect free, so a
        caller may ask first. A nexus's first command takes execute(), which records the nexus."""
        found = _FAST_READ.get(cdb[0])
        if found is None or nexus not in self.nexuses or type(self.admit(cdb, nexus)) is not tuple:
            return None
        layout, lenfield = found
        lba, blocks = layout.unpack_from(cdb)
        if not blocks or sbc.admit_rw(self, lba, blocks, lenfield) is not None:
            return None
        return self.volume.read_now(lba, blocks)

    def write_now(self, cdb: Buffer, data: Buffer, nexus: Nexus) -> bool:
        """Do a WRITE(10)/(16) that admit() and sbc.admit_rw() let through at once, with exactly the data it
        asks for; False (nothing written): the command must take execute(). FUA needs nothing more: a
        SyncWrite write is durable on return. An atomic command holding a range (CAW, WRITE ATOMIC) makes
        every write take execute(), which waits for it."""
        found = _FAST_WRITE.get(cdb[0])
        if (found is None or nexus not in self.nexuses or not self.locks.exclusive_idle
                or type(self.admit(cdb, nexus)) is not tuple):
            return False
        layout, lenfield = found
        lba, blocks = layout.unpack_from(cdb)
        if (not blocks or len(data) != blocks * self.block_size
                or sbc.admit_rw(self, lba, blocks, lenfield, write=True) is not None
                or not self.volume.write_now(lba, data)):
            return False
        self.all_deallocated = False
        return True

    @property
    def num_blocks(self) -> int:
        return self.volume.num_blocks

    @property
    def write_protected(self) -> bool:
        return self.read_only or self.mode.swp

    # ---- unit attentions (SAM-5 5.14, SPC-4 5.14)

    def add_ua(self, nexus: Nexus, asc: int) -> None:
        pending = self.unit_attentions.setdefault(nexus, [])
        if asc not in pending:
            pending.append(asc)

    def add_ua_others(self, asc: int, issuer: Nexus | None) -> None:
        for n in self.nexuses | self.pr.keys.keys():
            if n != issuer:
                self.add_ua(n, asc)

    def pop_ua(self, nexus: Nexus) -> int | None:
        pending = self.unit_attentions.get(nexus)
        if not pending:
            return None
        asc = pending.pop(0)
        if not pending:
            del self.unit_attentions[nexus]
        return asc

    def mode_changed(self, issuer: Nexus) -> None:
        self.add_ua_others(ASC_MODE_PARAMETERS_CHANGED, issuer)

    def capacity_changed(self) -> None:
        """Call after the device grew or shrank: every nexus gets CAPACITY DATA HAS CHANGED (SBC-4 4.6)."""
        self.add_ua_others(ASC_CAPACITY_DATA_HAS_CHANGED, None)

    def soft_threshold_reached(self) -> None:
        """Call once each time the space under a thin volume crosses its soft threshold (the node watches
        its group; or volume.notify("thin-threshold"), which reaches here): every I_T nexus the LU knows
        gets UNIT ATTENTION, THIN PROVISIONING SOFT THRESHOLD REACHED (SBC-4 4.7.3.7; SITUA clear, so not
        only the nexus whose write crossed it). One pending per nexus: a second call before an initiator
        has seen the first queues nothing more."""
        self.add_ua_others(ASC_THIN_PROVISIONING_SOFT_THRESHOLD_REACHED, None)

    def _read_capabilities(self) -> None:
        """What the volume's stack states, as the LU reports it: the Block Limits VPD page (SBC-4 6.6.4;
        a transfer no larger than the stack takes), LBPRZ (unmapped blocks read back as zeros) and whether
        the volume is thin provisioned (VPD B2h)."""
        caps = self.volume.capabilities
        bs = self.block_size
        self.limits = BlockLimits(
            max_compare_write=255, opt_granularity=1 << self.lbppb_exponent,
            max_transfer=min(16 << 20, caps.max_transfer) // bs, opt_transfer=(1 << 20) // bs,
            max_prefetch=(16 << 20) // bs, max_unmap_lbas=(512 << 20) // bs, max_unmap_descriptors=4096,
            unmap_granularity=1 << self.lbppb_exponent, max_write_same=0xFFFF,
            max_atomic=(1 << 20) // bs, atomic_alignment=0, atomic_granularity=0)
        self.lbprz = caps.unmap_reads_zero
        self.thin = caps.thin     # VPD B2h PROVISIONING TYPE thin (else 000b)

    def _volume_changed(self, what: str) -> None:
        if what == "resized":
            self.capacity_changed()
        elif what == "stack":
            self._read_capabilities()
        elif what == "thin-threshold":
            self.soft_threshold_reached()

    # ---- resets and nexus loss (SAM-5 6.3, 6.6; SPC-2 5.5.1)

    def reset(self, asc: int) -> None:
        """LOGICAL UNIT RESET or a target reset (SAM-5 6.3.3): every I_T nexus, the issuer's too, learns
        of it through a unit attention; SPC-2 reservations, PREVENT and mode changes do not survive it."""
        self.spc2_holder = None
        self.prevent.clear()
        self.mode = ModeState()
        self.add_ua_others(asc, None)

    def nexus_lost(self, nexus: Nexus) -> None:
        if self.spc2_holder == nexus:
            self.spc2_holder = None
        self.prevent.discard(nexus)
        self.unit_attentions.pop(nexus, None)
        self.nexuses.discard(nexus)

    # ---- moving to another worker process with its volume (node/workers.py move)

    def moving_state(self) -> dict[str, Any]:
        """What this LU holds for its I_T nexuses beyond its volume, as data: reservations (persistent and
        SPC-2), PREVENT, mode parameters, pending unit attentions and the nexuses it has heard from. The LU
        that serves the volume next takes it (take_state), so initiators whose sessions move see no change."""
        def nx(n: Nexus) -> list[Any]:
            return [n.initiator_name, n.isid, n.target_name, n.tpgt]

        return {"pr": self.pr.state(), "spc2": nx(self.spc2_holder) if self.spc2_holder is not None else None,
                "prevent": sorted(nx(n) for n in self.prevent), "medium": self.medium_present,
                "mode": {"wce": self.mode.wce, "swp": self.mode.swp},
                "ua": [[nx(n), list(v)] for n, v in self.unit_attentions.items()],
                "nexuses": sorted(nx(n) for n in self.nexuses)}

    def take_state(self, state: dict[str, Any]) -> None:
        def nx(v: list[Any]) -> Nexus:
            return Nexus(str(v[0]), int(v[1]), str(v[2]), int(v[3]))

        self.pr.apply_state(state["pr"])
        self.spc2_holder = nx(state["spc2"]) if state.get("spc2") else None
        self.prevent = {nx(v) for v in state.get("prevent") or ()}
        self.medium_present = bool(state.get("medium", True))
        mode = state.get("mode") or {}
        self.mode.wce, self.mode.swp = bool(mode.get("wce", True)), bool(mode.get("swp", False))
        self.unit_attentions = {nx(n): [int(a) for a in v] for n, v in state.get("ua") or ()}
        self.nexuses = {nx(v) for v in state.get("nexuses") or ()}

    # ---- the Data-Out a CDB asks for

    def data_out_length(self, cdb: bytes) -> int:
        fn = DATA_OUT.get(cdb[0])
        if fn is None:
            return 0
        try:
            return fn(cdb, self.block_size)
        except (IndexError, ValueError):  # struct.error is a ValueError: a short CDB asks for nothing
            return 0

    # ---- one command

    async def execute(self, cdb: bytes, data_out: memoryview, nexus: Nexus, *,
                      expected_length: int | None = None) -> ScsiResult:
        if nexus not in self.nexuses:
            self.nexuses.add(nexus)
        admitted = self.admit(cdb, nexus, expected_length=expected_length)
        if isinstance(admitted, ScsiResult):
            if self.unit_attentions and is_unit_attention(admitted):
                self.pop_ua(nexus)   # SAM-5 5.14: a unit attention reported is cleared
            return admitted
        spec, handler, n, _ = admitted
        try:
            return await handler(self, bytes(cdb[:n]), data_out, nexus)
        except ScsiError as e:
            return e.result()
        except BlockError as e:
            return block_error_result(e, write=spec.access is Access.WRITE)


def _stray_bits(stray: int, n: int) -> ScsiError:
    """INVALID FIELD IN CDB pointing at the first bit set outside the command's CDB usage data."""
    raw = stray.to_bytes(n, "big")
    for i, b in enumerate(raw):
        if b:
            return ScsiError(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB, field=i, bit=b.bit_length() - 1)
    return ScsiError(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB, field=0)
