"""Primary commands (SPC-4 6): INQUIRY, sense, mode, reservations, medium, what-is-supported reports."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from openvsan.protocol.scsi import inquiry as inq
from openvsan.protocol.scsi.alua import TPGS_IMPLICIT
from openvsan.protocol.scsi.cdb import u16, u32
from openvsan.protocol.scsi.mode import mode_select, mode_sense
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.opcodes import COMMANDS, SERVICE_ACTION_OPCODES, Access, CommandSpec
from openvsan.protocol.scsi.sense import (
    ASC_LU_COMMUNICATION_FAILURE,
    ASC_MEDIUM_REMOVAL_PREVENTED,
    ASC_NO_ADDITIONAL,
    GOOD,
    ILLEGAL_REQUEST,
    NO_SENSE,
    NOT_READY,
    UNIT_ATTENTION,
    ScsiError,
    ScsiResult,
    build_sense,
    invalid_field,
    param_list_length_error,
    reservation_conflict,
)

if TYPE_CHECKING:
    from openvsan.protocol.scsi.lun import Lun

Handler = Callable[["Lun", bytes, memoryview, Nexus], Awaitable[ScsiResult]]
_GOOD = ScsiResult(GOOD)


def _params(data: memoryview, length: int) -> bytes:
    if len(data) < length:
        raise invalid_field(0)
    return bytes(data[:length])


async def test_unit_ready(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    return _GOOD   # SPC-4 6.47: the dispatcher has already reported a missing medium


async def request_sense(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """REQUEST SENSE (SPC-4 6.39): a pending unit attention is returned (and cleared) as data."""
    if cdb[1] & 0x01:   # DESC: only fixed format here
        raise invalid_field(1, 0)
    asc = lun.pop_ua(nexus)
    sense = build_sense(UNIT_ATTENTION, asc) if asc is not None else build_sense(NO_SENSE, ASC_NO_ADDITIONAL)
    return ScsiResult(GOOD, sense[:cdb[4]])


async def inquiry(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """INQUIRY (SPC-4 6.6)."""
    alloc = u16(cdb, 3)
    page = cdb[2]
    if not cdb[1] & 0x01:
        if page:
            raise invalid_field(2)
        out = inq.standard_inquiry(inq.PERIPHERAL_DISK, removable=lun.removable, third_party_copy=True,
                                   tpgs=TPGS_IMPLICIT)
    elif page == 0x00:
        out = inq.supported_vpd_pages()
    elif page == 0x80:
        out = inq.unit_serial(lun.serial)
    elif page == 0x83:
        # the iSCSI target portal group is the target port: its tag is the relative target port id
        group = lun.alua.group_of(nexus.tpgt)
        out = inq.device_identification(lun.uuid, lun.name, nexus.target_name, nexus.tpgt, nexus.tpgt,
                                        None if group is None else group.id)
    elif page == 0xB0:
        out = inq.block_limits(lun.limits)
    elif page == 0xB1:
        out = inq.block_device_characteristics()
    elif page == 0xB2:
        out = inq.logical_block_provisioning(lbprz=lun.lbprz, thin=lun.thin)
    else:
        raise invalid_field(2)
    return ScsiResult(GOOD, out[:alloc])


async def mode_sense6(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    out = mode_sense(lun.mode, cdb, ten=False, write_protect=lun.write_protected, block_size=lun.block_size,
                     num_blocks=lun.num_blocks)
    return ScsiResult(GOOD, out[:cdb[4]])


async def mode_sense10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    out = mode_sense(lun.mode, cdb, ten=True, write_protect=lun.write_protected, block_size=lun.block_size,
                     num_blocks=lun.num_blocks)
    return ScsiResult(GOOD, out[:u16(cdb, 7)])


async def _mode_select(lun: Lun, cdb: bytes, params: bytes, nexus: Nexus, ten: bool) -> ScsiResult:
    if mode_select(lun.mode, cdb, params, ten=ten, block_size=lun.block_size):
        lun.mode_changed(nexus)   # SPC-4 5.14: MODE PARAMETERS CHANGED to the other I_T nexuses
    return _GOOD


async def mode_select6(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    return await _mode_select(lun, cdb, _params(data, cdb[4]), nexus, False)


async def mode_select10(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    return await _mode_select(lun, cdb, _params(data, u16(cdb, 7)), nexus, True)


# ---- RESERVE / RELEASE (SPC-2 7.21, 7.18): kept for old initiators, e.g. Windows 2003 clusters

async def reserve(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    if lun.pr.keys or (lun.spc2_holder is not None and lun.spc2_holder != nexus):
        raise reservation_conflict()   # SPC-4 5.13.3: persistent registrations exclude SPC-2 reservations
    lun.spc2_holder = nexus
    return _GOOD


async def release(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    if lun.pr.keys:
        raise reservation_conflict()
    if lun.spc2_holder == nexus:
        lun.spc2_holder = None
    return _GOOD   # releasing someone else's reservation is a no-op (SPC-2 7.18.1)


# ---- medium: PREVENT ALLOW MEDIUM REMOVAL (SBC-4 5.13 / SPC-4 6.13), START STOP UNIT (SBC-4 5.25)

async def prevent_allow(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    prevent = cdb[4] & 0x03
    if prevent & 0x02:
        raise invalid_field(4, 1)   # medium changer values: not a changer
    if prevent:
        if lun.pr.type and lun.pr.conflicts(nexus, Access.WRITE):
            raise reservation_conflict()
        lun.prevent.add(nexus)
    else:
        lun.prevent.discard(nexus)
    return _GOOD


async def start_stop_unit(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    power_condition = cdb[4] >> 4
    if power_condition:   # START and LOEJ are ignored with a power condition (SBC-4 5.25)
        return _GOOD
    loej, start = cdb[4] & 0x02, cdb[4] & 0x01
    if loej and lun.removable:
        if lun.prevent:
            raise ScsiError(ILLEGAL_REQUEST, ASC_MEDIUM_REMOVAL_PREVENTED)
        if not cdb[4] & 0x04:   # NO_FLUSH clear: whatever is cached goes to the medium before it leaves
            await lun.volume.flush()
        lun.medium_present = bool(start)
    return _GOOD


# ---- PERSISTENT RESERVE IN / OUT (SPC-4 6.15, 6.16)

async def persistent_reserve_in(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    if lun.pr_sync is not None:
        async with lun.pr_lock:
            await _pr_refresh(lun)
    out = lun.pr.persistent_reserve_in(cdb[1] & 0x1F)
    return ScsiResult(GOOD, out[:u16(cdb, 7)])


PR_SYNC_TRIES = 8     # PR OUT commands of other nodes that may come first before this one gives up


async def _pr_refresh(lun: Lun) -> None:
    try:
        await lun.pr_sync.refresh(lun.pr)
    except Exception as e:
        # the shared state cannot be read: no answer from a stale copy (SPC-4 5.13: one state per LU)
        raise ScsiError(NOT_READY, ASC_LU_COMMUNICATION_FAILURE) from e


async def persistent_reserve_out(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    plen = u32(cdb, 5)
    if len(data) < plen:
        raise param_list_length_error()
    params = bytes(data[:plen])
    async with lun.pr_lock:
        sync = lun.pr_sync
        for _ in range(PR_SYNC_TRIES):
            if sync is not None:
                await _pr_refresh(lun)        # a replicated volume: the state every node shares, latest
            state = lun.pr.state()
            before = lun.pr.snapshot()
            uas = lun.pr.persistent_reserve_out(nexus, cdb, params)
            if sync is not None and lun.pr.state() != state:
                try:
                    committed = await sync.commit(lun.pr.state())
                except Exception as e:
                    lun.pr.apply_state(state)      # not shared: not done
                    raise ScsiError(NOT_READY, ASC_LU_COMMUNICATION_FAILURE) from e
                if not committed:                  # another node's command came first: do it again on it
                    lun.pr.apply_state(state)
                    continue
            for n, asc in uas:
                lun.add_ua(n, asc)
            after = lun.pr.snapshot()
            if after != before:
                # the new state is durable before the command completes (APTPL)
                await asyncio.to_thread(lun.pr.save, after)
            return _GOOD
    raise ScsiError(NOT_READY, ASC_LU_COMMUNICATION_FAILURE)


# ---- REPORT SUPPORTED OPERATION CODES (SPC-4 6.35), REPORT SUPPORTED TMFs (SPC-4 6.36)

def _timeouts(spec: CommandSpec) -> bytes:
    return struct.pack(">HBBII", 0x0A, 0, 0, spec.timeout[0], spec.timeout[1])


async def report_supported_opcodes(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    from openvsan.protocol.scsi.lun import SUPPORTED
    rctd = bool(cdb[2] & 0x80)
    option = cdb[2] & 0x07
    opcode, sa, alloc = cdb[3], u16(cdb, 4), u32(cdb, 6)
    if option == 0:
        body = bytearray()
        for spec in SUPPORTED:
            flags = (0x02 if rctd else 0) | (0x01 if spec.sa is not None else 0)
            body += struct.pack(">BxHxBH", spec.opcode, spec.sa or 0, flags, len(spec.usage))
            if rctd:
                body += _timeouts(spec)
        out = struct.pack(">I", len(body)) + body
    elif option in (1, 2, 3):
        has_sa = opcode in SERVICE_ACTION_OPCODES
        if option == 1 and has_sa:
            raise invalid_field(2, 2)
        if option == 2 and not has_sa and any(c.opcode == opcode for c in COMMANDS):
            raise invalid_field(2, 2)
        if option == 3:
            found = [c for c in SUPPORTED if c.opcode == opcode and (c.sa is None or c.sa == sa)]
        else:
            found = [c for c in SUPPORTED if c.opcode == opcode and (option == 1 or c.sa == sa)]
        if found:
            spec = found[0]
            out = bytes((0, (0x80 if rctd else 0) | 0x03)) + struct.pack(">H", len(spec.usage)) + spec.usage
            if rctd:
                out += _timeouts(spec)
        else:
            out = bytes((0, 0x01, 0, 0))   # SUPPORT 001b: not supported
    else:
        raise invalid_field(2, 2)
    return ScsiResult(GOOD, out[:alloc])


async def report_supported_tmfs(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    # ABORT TASK, ABORT TASK SET, CLEAR TASK SET, LU RESET, TARGET RESET (iSCSI warm/cold); QUERY TASK no
    out = bytes((0x80 | 0x40 | 0x20 | 0x08 | 0x02, 0, 0, 0))
    if cdb[2] & 0x80:   # REPD: the extended format, 16 bytes (SPC-4 6.36.3)
        out = bytes((out[0], 0, 0, 0x0C)) + bytes(12)
    return ScsiResult(GOOD, out[:u32(cdb, 6)])


async def report_target_port_groups(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    """REPORT TARGET PORT GROUPS (SPC-4 6.36): PARAMETER DATA FORMAT 000b (length only header) or 001b
    (extended header), cut to the ALLOCATION LENGTH. The ports the LU was reached through go under the
    default group when no group names them."""
    fmt = cdb[1] >> 5
    if fmt > 1:
        raise invalid_field(1, 7)
    out = lun.alua.report(extended=fmt == 1, seen_ports={n.tpgt for n in lun.nexuses} | {nexus.tpgt})
    return ScsiResult(GOOD, out[:u32(cdb, 6)])


async def report_luns(lun: Lun, cdb: bytes, data: memoryview, nexus: Nexus) -> ScsiResult:
    # A Lun on its own knows no other LUNs; ScsiTarget answers REPORT LUNS for the whole target.
    if cdb[2] > 2:
        raise invalid_field(2)
    alloc = u32(cdb, 6)
    if alloc < 16:
        raise invalid_field(6)
    return ScsiResult(GOOD, (struct.pack(">I4x", 8) + bytes(8))[:alloc])


HANDLERS: dict[tuple[int, int | None], Handler] = {
    (0x00, None): test_unit_ready, (0x03, None): request_sense, (0x12, None): inquiry,
    (0x1A, None): mode_sense6, (0x5A, None): mode_sense10, (0x15, None): mode_select6, (0x55, None): mode_select10,
    (0x16, None): reserve, (0x56, None): reserve, (0x17, None): release, (0x57, None): release,
    (0x1E, None): prevent_allow, (0x1B, None): start_stop_unit,
    **{(0x5E, sa): persistent_reserve_in for sa in range(4)},
    **{(0x5F, sa): persistent_reserve_out for sa in range(8)},
    (0xA3, 0x0C): report_supported_opcodes, (0xA3, 0x0D): report_supported_tmfs,
    (0xA3, 0x0A): report_target_port_groups,
    (0xA0, None): report_luns,
}

DATA_OUT: dict[int, Callable[[bytes, int], int]] = {
    0x15: lambda cdb, bs: cdb[4],
    0x55: lambda cdb, bs: u16(cdb, 7),
    0x5F: lambda cdb, bs: u32(cdb, 5),
}
