"""I/O commands of the NVM command set over a namespace's BlockDevice (NVM Command Set 1.0 §3, §4.2;
reservation commands: NVMe Base 2.0 §7.5-7.8)."""

from __future__ import annotations

import struct

from openvsan.block.device import Buffer
from openvsan.block.errors import BlockError
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.command import NSID_ALL, Sqe
from openvsan.protocol.nvme.controller import Controller
from openvsan.protocol.nvme.identify import MAX_TRANSFER
from openvsan.protocol.nvme.status import Completion
from openvsan.protocol.nvme.subsystem import (
    ANA_CHANGE,
    ANA_INACCESSIBLE,
    ANA_NON_OPTIMIZED,
    ANA_OPTIMIZED,
    Namespace,
)

# NVM command set opcodes (NVM Command Set 1.0 §3 Figure 16; Base 2.0 Figure 139)
OP_FLUSH = 0x00
OP_WRITE = 0x01
OP_READ = 0x02
OP_COMPARE = 0x05
OP_WRITE_ZEROES = 0x08
OP_DATASET_MANAGEMENT = 0x09
OP_RESERVATION_REGISTER = 0x0D
OP_RESERVATION_REPORT = 0x0E
OP_RESERVATION_ACQUIRE = 0x11
OP_RESERVATION_RELEASE = 0x15
FUA = 1 << 30            # CDW12 bit 30, Read/Write/Write Zeroes
DEAC = 1 << 25           # CDW12 bit 25, Write Zeroes: may deallocate
_KEYS = struct.Struct("<QQ")
_RANGE = struct.Struct("<IIQ")   # DSM range (§3.2.3 Figure 39): context attributes, NLB, SLBA


def _ana_status(state: int) -> int:
    if state in (ANA_OPTIMIZED, ANA_NON_OPTIMIZED):
        return S.SUCCESS
    if state == ANA_INACCESSIBLE:
        return S.ANA_INACCESSIBLE
    if state == ANA_CHANGE:
        return S.ANA_TRANSITION
    return S.ANA_PERSISTENT_LOSS


def _range(sqe: Sqe, ns: Namespace) -> tuple[int, int, int]:
    """(status, slba, nlb) of a Read/Write/Compare/Write Zeroes: SLBA in CDW10-11, NLB 0's based."""
    slba = sqe.cdw10 | (sqe.cdw11 << 32)
    nlb = (sqe.cdw12 & 0xFFFF) + 1
    if slba + nlb > ns.volume.num_blocks:
        return S.LBA_OUT_OF_RANGE, slba, nlb
    return S.SUCCESS, slba, nlb


# CDW12 bits a plain Read/Write may carry for the fast path: NLB and FUA (LR, PRINFO, DTYPE: execute_io)
_PLAIN_CDW12 = 0xFFFF | FUA


def _fast_namespace(ctrl: Controller, sqe: Sqe) -> Namespace | None:
    sub = ctrl.subsystem
    ns = sub.namespaces.get(sqe.nsid)
    if (ns is None or ns.reservations.registrants or sqe.cdw12 & ~_PLAIN_CDW12
            or sub.ana_states.get(ns.ana_group) != ANA_OPTIMIZED):
        return None
    return ns


def read_now(ctrl: Controller, sqe: Sqe) -> Buffer | None:
    """The data of a plain Read from a namespace whose device can answer at once (SyncRead), or None: then
    execute_io must run it, with every check and every status. Side-effect free until it returns data."""
    ns = _fast_namespace(ctrl, sqe)
    if ns is None:
        return None
    slba, nlb = sqe.cdw10 | (sqe.cdw11 << 32), (sqe.cdw12 & 0xFFFF) + 1
    n = nlb * ns.volume.block_size
    if slba + nlb > ns.volume.num_blocks or n > MAX_TRANSFER or n != sqe.sgl_len:
        return None
    buf = ns.volume.read_now(slba, nlb)
    if buf is None:
        return None
    ctrl.subsystem.read_commands += 1
    ctrl.subsystem.bytes_read += n
    return buf


def write_now(ctrl: Controller, sqe: Sqe, data: Buffer) -> bool:
    """Do a plain Write with exactly its data at once (durable on return: FUA needs nothing more), or
    return False with nothing written: execute_io must run it."""
    ns = _fast_namespace(ctrl, sqe)
    if ns is None or ns.read_only:
        return False
    slba, nlb = sqe.cdw10 | (sqe.cdw11 << 32), (sqe.cdw12 & 0xFFFF) + 1
    if (slba + nlb > ns.volume.num_blocks or len(data) != nlb * ns.volume.block_size
            or not ns.volume.write_now(slba, data)):
        return False
    ctrl.subsystem.write_commands += 1
    ctrl.subsystem.bytes_written += len(data)
    return True


async def execute_io(ctrl: Controller, sqe: Sqe, data: bytes | bytearray | memoryview) -> Completion:
    """Run one I/O command for `ctrl`; data is what the host sent (Write, Compare, DSM, reservations)."""
    op = sqe.opcode
    sub = ctrl.subsystem
    ns = sub.namespaces.get(sqe.nsid)
    if ns is None:
        if op == OP_FLUSH and sqe.nsid == NSID_ALL:
            return await _flush_all(ctrl)
        return S.fail(S.INVALID_NAMESPACE)
    state = sub.ana_states.get(ns.ana_group, ANA_INACCESSIBLE)
    if state != ANA_OPTIMIZED:
        st = _ana_status(state)
        if st:
            return S.fail(st)
    res = ns.reservations
    dev = ns.volume
    try:
        if op == OP_READ:
            # NVM Command Set 1.0 §3.2.4 Read
            st, slba, nlb = _range(sqe, ns)
            n = nlb * dev.block_size
            if st:
                return S.fail(st)
            if n > MAX_TRANSFER:
                return S.fail(S.INVALID_FIELD)
            if n != sqe.sgl_len:
                return S.fail(S.DATA_SGL_LENGTH_INVALID)
            if res.registrants and not res.allows(ctrl.hostid, False):
                return S.fail(S.RESERVATION_CONFLICT)
            buf = await dev.read(slba, nlb)
            sub.read_commands += 1
            sub.bytes_read += n
            return Completion(data=buf)
        if op == OP_WRITE:
            # NVM Command Set 1.0 §3.2.6 Write (FUA: durable before the completion)
            st, slba, nlb = _range(sqe, ns)
            if st:
                return S.fail(st)
            if len(data) != nlb * dev.block_size:
                return S.fail(S.DATA_SGL_LENGTH_INVALID)
            if ns.read_only:
                return S.fail(S.NS_WRITE_PROTECTED)
            if res.registrants and not res.allows(ctrl.hostid, True):
                return S.fail(S.RESERVATION_CONFLICT)
            await dev.write(slba, data, fua=bool(sqe.cdw12 & FUA) or not ctrl.write_cache)
            sub.write_commands += 1
            sub.bytes_written += len(data)
            return S.OK
        if op == OP_FLUSH:
            # NVM Command Set 1.0 §3.2.2 / Base 2.0 §7.1 Flush
            if res.registrants and not res.allows(ctrl.hostid, True):
                return S.fail(S.RESERVATION_CONFLICT)
            await dev.flush()
            return S.OK
        if op == OP_COMPARE:
            return await _compare(ctrl, sqe, ns, data)
        if op == OP_WRITE_ZEROES:
            # NVM Command Set 1.0 §3.2.8 Write Zeroes (DEAC: deallocation allowed; ours read zeroes either way)
            st, slba, nlb = _range(sqe, ns)
            if st:
                return S.fail(st)
            if ns.read_only:
                return S.fail(S.NS_WRITE_PROTECTED)
            if res.registrants and not res.allows(ctrl.hostid, True):
                return S.fail(S.RESERVATION_CONFLICT)
            await dev.write_zeroes(slba, nlb)
            if sqe.cdw12 & FUA or not ctrl.write_cache:
                await dev.flush()
            return S.OK
        if op == OP_DATASET_MANAGEMENT:
            return await _dataset_management(ctrl, sqe, ns, data)
        if op in (OP_RESERVATION_REGISTER, OP_RESERVATION_ACQUIRE, OP_RESERVATION_RELEASE, OP_RESERVATION_REPORT):
            return _reservation(ctrl, sqe, ns, data)
    except BlockError as e:
        write = op not in (OP_READ, OP_COMPARE)
        st = S.block_error_status(e, write=write)
        if st in (S.WRITE_FAULT, S.UNRECOVERED_READ_ERROR):
            sub.media_errors += 1
        ctrl.record_error(0, sqe.cid, st, sqe.nsid, getattr(e, "lba", None) or 0)
        return S.fail(st)
    return S.fail(S.INVALID_OPCODE)


async def _flush_all(ctrl: Controller) -> Completion:
    for ns in list(ctrl.subsystem.namespaces.values()):
        try:
            await ns.volume.flush()
        except BlockError as e:
            return S.fail(S.block_error_status(e, write=True))
    return S.OK


async def _compare(ctrl: Controller, sqe: Sqe, ns: Namespace, data: bytes | bytearray | memoryview) -> Completion:
    # NVM Command Set 1.0 §3.2.1 Compare: the medium against the host's data; Compare Failure if they differ
    st, slba, nlb = _range(sqe, ns)
    if st:
        return S.fail(st)
    if len(data) != nlb * ns.volume.block_size:
        return S.fail(S.DATA_SGL_LENGTH_INVALID)
    if ns.reservations.registrants and not ns.reservations.allows(ctrl.hostid, False):
        return S.fail(S.RESERVATION_CONFLICT)
    have = await ns.volume.read(slba, nlb)
    return S.OK if memoryview(have) == memoryview(data) else S.fail(S.COMPARE_FAILURE)


async def _dataset_management(ctrl: Controller, sqe: Sqe, ns: Namespace,
                              data: bytes | bytearray | memoryview) -> Completion:
    # NVM Command Set 1.0 §3.2.3 Dataset Management: NR (0's based) ranges; AD (CDW11 bit 2) deallocates
    nr = (sqe.cdw10 & 0xFF) + 1
    if len(data) < nr * 16:
        return S.fail(S.DATA_SGL_LENGTH_INVALID)
    if not sqe.cdw11 & 4:
        return S.OK                       # attribute hints only: nothing to do
    if ns.read_only:
        return S.fail(S.NS_WRITE_PROTECTED)
    if ns.reservations.registrants and not ns.reservations.allows(ctrl.hostid, True):
        return S.fail(S.RESERVATION_CONFLICT)
    ranges = [_RANGE.unpack_from(data, i * 16) for i in range(nr)]
    dev = ns.volume
    for _, nlb, slba in ranges:
        if slba + nlb > dev.num_blocks:
            return S.fail(S.LBA_OUT_OF_RANGE)
    for _, nlb, slba in ranges:
        if nlb:
            await dev.unmap(slba, nlb)
    return S.OK


def _reservation(ctrl: Controller, sqe: Sqe, ns: Namespace, data: bytes | bytearray | memoryview) -> Completion:
    res = ns.reservations
    c = sqe.cdw10
    action, iekey, rtype = c & 7, bool(c & 8), (c >> 8) & 0xFF
    op = sqe.opcode
    if op == OP_RESERVATION_REPORT:
        # Base 2.0 §7.8: NUMD (0's based) in CDW10, EDS in CDW11 bit 0
        size = (c + 1) * 4
        if size > sqe.sgl_len:
            return S.fail(S.DATA_SGL_LENGTH_INVALID)
        st, out = res.report(bool(sqe.cdw11 & 1), size)
        return Completion(st, data=out.ljust(size, b"\0")) if st == S.SUCCESS else S.fail(st)
    need = 8 if op == OP_RESERVATION_RELEASE else 16
    if len(data) < need:
        return S.fail(S.DATA_SGL_LENGTH_INVALID)
    crkey = int.from_bytes(data[:8], "little")
    second = int.from_bytes(data[8:16], "little") if need == 16 else 0
    if op == OP_RESERVATION_REGISTER:
        return S.fail(res.register(ctrl.hostid, action, iekey, c >> 30, crkey, second))
    if op == OP_RESERVATION_ACQUIRE:
        return S.fail(res.acquire(ctrl.hostid, action, rtype, iekey, crkey, second))
    return S.fail(res.release(ctrl.hostid, action, rtype, iekey, crkey))
