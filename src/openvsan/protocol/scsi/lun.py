"""A SCSI logical unit over a Volume: its state (mode pages, reservations, unit attentions, medium)
and the dispatch of one command (SAM-5 5.14 order of checks: unit attention, CDB, reservations, medium)."""

from __future__ import annotations

import asyncio
import pathlib
import struct
from collections.abc import Awaitable, Callable, Iterable

from openvsan.block.device import Buffer
from openvsan.block.errors import BlockError
from openvsan.protocol.scsi import provisioning, sbc, spc, xcopy
from openvsan.protocol.scsi.inquiry import BlockLimits
from openvsan.protocol.scsi.locks import RangeLock
from openvsan.protocol.scsi.mode import ModeState
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.opcodes import COMMANDS, Access, CommandSpec
from openvsan.protocol.scsi.pr import PersistentReservations
from openvsan.protocol.scsi.sense import (
    ASC_CAPACITY_DATA_HAS_CHANGED,
    ASC_INVALID_FIELD_IN_CDB,
    ASC_INVALID_OPCODE,
    ASC_MEDIUM_NOT_PRESENT,
    ASC_MODE_PARAMETERS_CHANGED,
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

# One slot per opcode: (spec, handler) or, for service-action opcodes, a dict of them by service action.
Entry = tuple[CommandSpec, Handler]
_TABLE: list[Entry | dict[int, Entry] | None] = [None] * 256
for _spec in COMMANDS:
    _h = HANDLERS.get((_spec.opcode, _spec.sa))
    if _h is None:
        continue
    if _spec.sa is None:
        _TABLE[_spec.opcode] = (_spec, _h)
    else:
        _slot = _TABLE[_spec.opcode]
        if not isinstance(_slot, dict):
            _slot = _TABLE[_spec.opcode] = {}
        _slot[_spec.sa] = (_spec, _h)

SUPPORTED: tuple[CommandSpec, ...] = tuple(c for c in COMMANDS if (c.opcode, c.sa) in HANDLERS)

# commands that do not consume a pending unit attention (SPC-4 5.14)
_UA_EXEMPT = frozenset((0x12, 0x03, 0xA0))
# commands that work with no medium loaded (SBC-4 4.9: the others get NOT READY, MEDIUM NOT PRESENT)
_NO_MEDIUM_OK = frozenset((0x12, 0x03, 0xA0, 0xA3, 0x1B, 0x1E, 0x1A, 0x5A, 0x15, 0x55, 0x5E, 0x5F,
                           0x16, 0x17, 0x56, 0x57))

# COMPARE AND WRITE, WRITE SAME(10)/(16): Data-Out must be exactly what the CDB says, not just enough
_EXACT_DATA_OUT = frozenset((0x89, 0x41, 0x93))

_OPCODE_UNSUPPORTED = ScsiError(ILLEGAL_REQUEST, ASC_INVALID_OPCODE)

# The fast path's commands: READ(10)/(16) and WRITE(10)/(16), by opcode: (CDB length, where LBA and
# TRANSFER LENGTH sit, the CDB bits that may be set) (SBC-4 5.15, 5.17, 5.41, 5.43)
_LBA10 = struct.Struct(">xxIxH")
_LBA16 = struct.Struct(">xxQI")


def _fast_entry(op: int) -> tuple[int, struct.Struct, int]:
    entry = _TABLE[op]
    assert isinstance(entry, tuple)
    spec = entry[0]
    return len(spec.usage), _LBA16 if len(spec.usage) == 16 else _LBA10, spec.check_mask


_FAST_READ = {op: _fast_entry(op) for op in (0x28, 0x88)}
_FAST_WRITE = {op: _fast_entry(op) for op in (0x2A, 0x8A)}


class Lun:
    def __init__(self, volume: Volume, *, read_only: bool = False, pr_state_path: pathlib.Path | None = None,
                 removable: bool = False) -> None:
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
        bs = self.block_size
        self.limits = BlockLimits(
            max_compare_write=255, opt_granularity=1 << self.lbppb_exponent,
            max_transfer=(16 << 20) // bs, opt_transfer=(1 << 20) // bs, max_prefetch=(16 << 20) // bs,
            max_unmap_lbas=(512 << 20) // bs, max_unmap_descriptors=4096,
            unmap_granularity=1 << self.lbppb_exponent, max_write_same=0xFFFF,
            max_atomic=(1 << 20) // bs, atomic_alignment=0, atomic_granularity=0)
        # unmapped blocks read back as zeros (LBPRZ), unless the stack says otherwise; re-read on a swap
        self.lbprz = volume.capabilities.unmap_reads_zero
        self.unlisten = volume.listen(self._volume_changed)
        self.mode = ModeState()
        self.pr = PersistentReservations(pr_state_path)
        self.pr.load()
        self.pr_lock = asyncio.Lock()
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

    # ---- the synchronous fast path

    def _fast_ok(self, nexus: Nexus) -> bool:
        """Nothing stands between a plain READ/WRITE from this nexus and the device: no unit attention to
        report, no reservation to weigh, a medium present."""
        return (not self.unit_attentions and self.spc2_holder is None and not self.pr.type and self.medium_present
                and nexus in self.nexuses)

    def _fast_range(self, table: dict[int, tuple[int, struct.Struct, int]], cdb: Buffer) -> tuple[int, int]:
        """(LBA, blocks) of a plain command in table whose CDB has nothing unusual, else (0, 0)."""
        found = table.get(cdb[0])
        if found is None:
            return 0, 0
        n, layout, mask = found
        if len(cdb) < n or int.from_bytes(cdb[:n], "big") & ~mask:
            return 0, 0
        lba, blocks = layout.unpack_from(cdb)
        if not blocks or lba + blocks > self.volume.num_blocks or blocks > self.limits.max_transfer:
            return 0, 0
        return lba, blocks

    def read_now(self, cdb: Buffer, nexus: Nexus) -> Buffer | None:
        """The data of a plain READ(10)/(16), read at once, or None: then the command must take execute(),
        which does every check and reports every condition. Side-effect free, so a caller may ask first."""
        if not self._fast_ok(nexus):
            return None
        lba, blocks = self._fast_range(_FAST_READ, cdb)
        return self.volume.read_now(lba, blocks) if blocks else None

    def write_now(self, cdb: Buffer, data: Buffer, nexus: Nexus) -> bool:
        """Do a plain WRITE(10)/(16) at once, with exactly the data it asks for; False (nothing written):
        the command must take execute(). FUA needs nothing more: a SyncWrite write is durable on return."""
        if not self._fast_ok(nexus) or self.write_protected or not self.locks.exclusive_idle:
            return False
        lba, blocks = self._fast_range(_FAST_WRITE, cdb)
        if not blocks or len(data) != blocks * self.block_size or not self.volume.write_now(lba, data):
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

    def _volume_changed(self, what: str) -> None:
        if what == "resized":
            self.capacity_changed()
        elif what == "stack":
            self.lbprz = self.volume.capabilities.unmap_reads_zero

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
        op = cdb[0]
        if self.unit_attentions and op not in _UA_EXEMPT:
            asc = self.pop_ua(nexus)
            if asc is not None:
                return ScsiResult(CHECK_CONDITION, b"", build_sense(UNIT_ATTENTION, asc))
        entry = _TABLE[op]
        if entry is None:
            return _OPCODE_UNSUPPORTED.result()
        if isinstance(entry, dict):
            found = entry.get(cdb[1] & 0x1F) if len(cdb) > 1 else None
            if found is None:
                return ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB,
                                                                    field=1, bit=4))
            entry = found
        spec, handler = entry
        n = len(spec.usage)
        if len(cdb) < n:
            return ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB, field=0))
        cdb = bytes(cdb[:n])
        stray = int.from_bytes(cdb, "big") & ~spec.check_mask
        if stray:
            return _stray_bits(stray, n).result()
        if self.spc2_holder is not None and self.spc2_holder != nexus and not spec.spc2_allowed:
            return ScsiResult(RESERVATION_CONFLICT)
        if self.pr.type and self.pr.conflicts(nexus, spec.access):
            return ScsiResult(RESERVATION_CONFLICT)
        if not self.medium_present and op not in _NO_MEDIUM_OK:
            return ScsiResult(CHECK_CONDITION, b"", build_sense(NOT_READY, ASC_MEDIUM_NOT_PRESENT))
        if expected_length is not None and op in _EXACT_DATA_OUT and expected_length != self.data_out_length(cdb):
            # the transport's expected length disagrees with the CDB: for these commands the split of the
            # Data-Out (compare/write halves, the one block of WRITE SAME) would be a guess (SBC-4 5.3)
            return ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB,
                                                                field=13 if op == 0x89 else 0))
        try:
            return await handler(self, cdb, data_out, nexus)
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
