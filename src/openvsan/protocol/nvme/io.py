"""I/O commands of the NVM command set over a namespace's BlockDevice (NVM Command Set 1.0 §3, §4.2;
reservation commands: NVMe Base 2.0 §7.5-7.8)."""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable

from openvsan.block.device import Buffer
from openvsan.block.errors import BlockError
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.command import NSID_ALL, Sqe
from openvsan.protocol.nvme.controller import Controller
from openvsan.protocol.nvme.identify import MAX_TRANSFER
from openvsan.protocol.nvme.status import Completion
from openvsan.protocol.nvme.subsystem import Namespace

log = logging.getLogger(__name__)

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


def _range(sqe: Sqe) -> tuple[int, int]:
    """(slba, nlb) of a Read/Write/Compare/Write Zeroes: SLBA in CDW10-11, NLB 0's based in CDW12."""
    return sqe.cdw10 | (sqe.cdw11 << 32), (sqe.cdw12 & 0xFFFF) + 1


def _reserved_away(ctrl: Controller, ns: Namespace, write: bool) -> bool:
    res = ns.reservations
    return res.gated and not res.allows(ctrl.hostid, write)


def admit(ctrl: Controller, sqe: Sqe, ns: Namespace | None, data_len: int) -> int:
    """The status that refuses this I/O command from `ctrl` on `ns` (the namespace sqe.nsid names, None if
    there is none) with data_len bytes of host data, or SUCCESS: it may run. In this order: the namespace,
    its ANA state (Base 2.0 §8.1: inaccessible, persistent loss, change), the command's own fields (NVM
    Command Set 1.0 §3.2), then the reservation (Base 2.0 §8.19, Figure 518).

    Pure, so the fast path (read_now / write_now) asks it first and may decline; execute_io asks the same.
    Dataset Management's ranges lie in its data and are checked by the command; unknown opcodes get
    INVALID_OPCODE from execute_io after these checks."""
    if ns is None:
        return S.INVALID_NAMESPACE
    # Base 2.0 §8.1.3: the group's state as this controller reports it (ana.py ANA_REFUSAL; a group it has
    # not heard of is inaccessible)
    st = ctrl.ana_refusals.get(ns.ana_group, S.ANA_INACCESSIBLE)
    if st:
        return st
    op = sqe.opcode
    # Read and Write spelled out (not _range, _reserved_away): the fast path asks for every one of them
    if op == OP_READ:
        # NVM Command Set 1.0 §3.2.4 Read
        nlb = (sqe.cdw12 & 0xFFFF) + 1
        vol = ns.volume
        if (sqe.cdw10 | (sqe.cdw11 << 32)) + nlb > vol.num_blocks:
            return S.LBA_OUT_OF_RANGE
        n = nlb * vol.block_size
        if n > MAX_TRANSFER:
            return S.INVALID_FIELD
        if n != sqe.sgl_len:
            return S.DATA_SGL_LENGTH_INVALID
        res = ns.reservations
        return S.RESERVATION_CONFLICT if res.gated and not res.allows(ctrl.hostid, False) else S.SUCCESS
    if op == OP_WRITE:
        # NVM Command Set 1.0 §3.2.6 Write
        nlb = (sqe.cdw12 & 0xFFFF) + 1
        vol = ns.volume
        if (sqe.cdw10 | (sqe.cdw11 << 32)) + nlb > vol.num_blocks:
            return S.LBA_OUT_OF_RANGE
        if data_len != nlb * vol.block_size:
            return S.DATA_SGL_LENGTH_INVALID
        if ns.read_only:
            return S.NS_WRITE_PROTECTED
        res = ns.reservations
        return S.RESERVATION_CONFLICT if res.gated and not res.allows(ctrl.hostid, True) else S.SUCCESS
    if op == OP_FLUSH:
        # NVM Command Set 1.0 §3.2.2 / Base 2.0 §7.1 Flush
        return S.RESERVATION_CONFLICT if _reserved_away(ctrl, ns, True) else S.SUCCESS
    if op == OP_COMPARE:
        # NVM Command Set 1.0 §3.2.1 Compare
        slba, nlb = _range(sqe)
        if slba + nlb > ns.volume.num_blocks:
            return S.LBA_OUT_OF_RANGE
        if data_len != nlb * ns.volume.block_size:
            return S.DATA_SGL_LENGTH_INVALID
        return S.RESERVATION_CONFLICT if _reserved_away(ctrl, ns, False) else S.SUCCESS
    if op == OP_WRITE_ZEROES:
        # NVM Command Set 1.0 §3.2.8 Write Zeroes
        slba, nlb = _range(sqe)
        if slba + nlb > ns.volume.num_blocks:
            return S.LBA_OUT_OF_RANGE
        if ns.read_only:
            return S.NS_WRITE_PROTECTED
        return S.RESERVATION_CONFLICT if _reserved_away(ctrl, ns, True) else S.SUCCESS
    if op == OP_DATASET_MANAGEMENT:
        # NVM Command Set 1.0 §3.2.3: NR (0's based) ranges of 16 bytes; only a deallocation (AD) writes
        if data_len < ((sqe.cdw10 & 0xFF) + 1) * 16:
            return S.DATA_SGL_LENGTH_INVALID
        if not sqe.cdw11 & 4:
            return S.SUCCESS
        if ns.read_only:
            return S.NS_WRITE_PROTECTED
        return S.RESERVATION_CONFLICT if _reserved_away(ctrl, ns, True) else S.SUCCESS
    return S.SUCCESS


# CDW12 bits a Read/Write may carry for the fast path: NLB and FUA (LR, PRINFO, DTYPE, ...: execute_io)
_PLAIN_CDW12 = 0xFFFF | FUA


def read_now(ctrl: Controller, sqe: Sqe) -> Buffer | None:
    """The data of a Read that admit() lets through, from a namespace whose device can answer at once
    (SyncRead), or None: then execute_io must run it, and reports whatever refuses it. Side-effect free
    until it returns data."""
    sub = ctrl.subsystem
    ns = sub.namespaces.get(sqe.nsid)
    if ns is None or sqe.cdw12 & ~_PLAIN_CDW12 or admit(ctrl, sqe, ns, 0):
        return None
    buf = ns.volume.read_now(sqe.cdw10 | (sqe.cdw11 << 32), (sqe.cdw12 & 0xFFFF) + 1)
    if buf is None:
        return None
    sub.read_commands += 1
    sub.bytes_read += sqe.sgl_len   # admit: exactly the blocks read
    return buf


def write_now(ctrl: Controller, sqe: Sqe, data: Buffer) -> bool:
    """Do a Write that admit() lets through, with its data, at once (durable on return: FUA needs nothing
    more), or return False with nothing written: execute_io must run it."""
    sub = ctrl.subsystem
    ns = sub.namespaces.get(sqe.nsid)
    if (ns is None or not ns.volume.capabilities.sync_write or sqe.cdw12 & ~_PLAIN_CDW12
            or admit(ctrl, sqe, ns, len(data)) or not ns.volume.write_now(sqe.cdw10 | (sqe.cdw11 << 32), data)):
        return False
    sub.write_commands += 1
    sub.bytes_written += len(data)
    return True


def write_soon(ctrl: Controller, sqe: Sqe, data: Buffer, done: Callable[[Completion], None]) -> bool:
    """A Write that admit() lets through, with its data, started on a device whose write waits on others
    (Volume.write_soon: a replicated volume's mirror) with no coroutine; `done(completion)` is called once
    it ends, with what execute_io would have answered. False: nothing was written; execute_io must run it."""
    sub = ctrl.subsystem
    ns = sub.namespaces.get(sqe.nsid)
    if ns is None or sqe.cdw12 & ~_PLAIN_CDW12 or admit(ctrl, sqe, ns, len(data)):
        return False
    n = len(data)

    def ended(e: BaseException | None) -> None:
        if e is None:
            sub.write_commands += 1
            sub.bytes_written += n
            done(S.OK)
        elif isinstance(e, BlockError):
            done(_device_failed(ctrl, sqe, e, write=True))
        else:
            log.error("write of %d bytes at lba %d failed: %r", n, sqe.cdw10 | (sqe.cdw11 << 32), e)
            done(Completion(S.INTERNAL_ERROR))

    return ns.volume.write_soon(sqe.cdw10 | (sqe.cdw11 << 32), data, bool(sqe.cdw12 & FUA) or not ctrl.write_cache,
                                ended)


async def execute_io(ctrl: Controller, sqe: Sqe, data: bytes | bytearray | memoryview) -> Completion:
    """Run one I/O command for `ctrl`; data is what the host sent (Write, Compare, DSM, reservations)."""
    op = sqe.opcode
    sub = ctrl.subsystem
    ns = sub.namespaces.get(sqe.nsid)
    if ns is None and op == OP_FLUSH and sqe.nsid == NSID_ALL:
        return await _flush_all(ctrl)
    st = admit(ctrl, sqe, ns, len(data))
    if st:
        return S.fail(st)
    assert ns is not None
    dev = ns.volume
    try:
        if op == OP_READ:
            slba, nlb = _range(sqe)
            buf = await dev.read(slba, nlb)
            sub.read_commands += 1
            sub.bytes_read += sqe.sgl_len
            return Completion(data=buf)
        if op == OP_WRITE:
            # FUA: durable before the completion
            slba, _ = _range(sqe)
            await dev.write(slba, data, fua=bool(sqe.cdw12 & FUA) or not ctrl.write_cache)
            sub.write_commands += 1
            sub.bytes_written += len(data)
            return S.OK
        if op == OP_FLUSH:
            await dev.flush()
            return S.OK
        if op == OP_COMPARE:
            # the medium against the host's data; Compare Failure if they differ
            slba, nlb = _range(sqe)
            have = await dev.read(slba, nlb)
            return S.OK if memoryview(have) == memoryview(data) else S.fail(S.COMPARE_FAILURE)
        if op == OP_WRITE_ZEROES:
            # DEAC: deallocation allowed; ours read zeroes either way
            slba, nlb = _range(sqe)
            await dev.write_zeroes(slba, nlb)
            if sqe.cdw12 & FUA or not ctrl.write_cache:
                await dev.flush()
            return S.OK
        if op == OP_DATASET_MANAGEMENT:
            return await _dataset_management(sqe, ns, data)
        if op in (OP_RESERVATION_REGISTER, OP_RESERVATION_ACQUIRE, OP_RESERVATION_RELEASE, OP_RESERVATION_REPORT):
            if ns.reservation_sync is not None:
                return await _shared_reservation(ctrl, sqe, ns, data)
            return _reservation(ctrl, sqe, ns, data)
    except BlockError as e:
        return _device_failed(ctrl, sqe, e, write=op not in (OP_READ, OP_COMPARE))
    return S.fail(S.INVALID_OPCODE)


def _device_failed(ctrl: Controller, sqe: Sqe, e: BlockError, *, write: bool) -> Completion:
    """The completion of a command the device failed with `e`, recorded in the error log (and the media
    error count)."""
    st = S.block_error_status(e, write=write)
    if st in (S.WRITE_FAULT, S.UNRECOVERED_READ_ERROR):
        ctrl.subsystem.media_errors += 1
    ctrl.record_error(0, sqe.cid, st, sqe.nsid, getattr(e, "lba", None) or 0)
    return S.fail(st)


async def _flush_all(ctrl: Controller) -> Completion:
    # Flush of NSID FFFFFFFFh (NVM Command Set 1.0 §3.2.2): every namespace, so none may be behind a path
    # that refuses I/O (the same ANA answer admit() gives for one)
    namespaces = list(ctrl.subsystem.namespaces.values())
    for ns in namespaces:
        st = ctrl.ana_refusals.get(ns.ana_group, S.ANA_INACCESSIBLE)
        if st:
            return S.fail(st)
    for ns in namespaces:
        try:
            await ns.volume.flush()
        except BlockError as e:
            return S.fail(S.block_error_status(e, write=True))
    return S.OK


async def _dataset_management(sqe: Sqe, ns: Namespace, data: bytes | bytearray | memoryview) -> Completion:
    # NVM Command Set 1.0 §3.2.3 Dataset Management (admit checked the data length, AD, write protection
    # and the reservation): with AD (CDW11 bit 2) the ranges are deallocated, all or none
    if not sqe.cdw11 & 4:
        return S.OK                       # attribute hints only: nothing to do
    ranges = [_RANGE.unpack_from(data, i * 16) for i in range((sqe.cdw10 & 0xFF) + 1)]
    dev = ns.volume
    for _, nlb, slba in ranges:
        if slba + nlb > dev.num_blocks:
            return S.fail(S.LBA_OUT_OF_RANGE)
    for _, nlb, slba in ranges:
        if nlb:
            await dev.unmap(slba, nlb)
    return S.OK


RESERVATION_SYNC_TRIES = 8    # reservation commands of other nodes that may come first before one gives up


async def _shared_reservation(ctrl: Controller, sqe: Sqe, ns: Namespace,
                              data: bytes | bytearray | memoryview) -> Completion:
    """A replicated volume's reservations, one state on every node: read the latest, run the command, commit
    it (compare-and-swap; another node's command first: run again on its result). A store that does not
    answer fails the command with Internal Error, DNR clear (the host retries), the state unchanged."""
    res, sync = ns.reservations, ns.reservation_sync
    async with ns.reservation_lock:
        for _ in range(RESERVATION_SYNC_TRIES):
            try:
                await sync.refresh(res)
            except Exception:  # noqa: BLE001 - not answered: no answer from a stale copy
                return S.fail(S.INTERNAL_ERROR)
            before = res.state()
            done = _reservation(ctrl, sqe, ns, data)
            if res.state() == before:
                return done
            try:
                committed = await sync.commit(res.state())
            except Exception:  # noqa: BLE001
                res.apply_state(before)
                return S.fail(S.INTERNAL_ERROR)
            if committed:
                return done
            res.apply_state(before)
    return S.fail(S.INTERNAL_ERROR)


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
