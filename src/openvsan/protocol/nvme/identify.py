"""Identify data structures (NVMe Base 2.0 §5.17.2, NVM Command Set 1.0 §4.1.5, NVMe-oF 1.1 §4.1)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from openvsan.protocol.nvme import ana
from openvsan.protocol.nvme.reservations import RESCAP
from openvsan.protocol.nvme.subsystem import Namespace, Subsystem
from openvsan.volume import Volume

if TYPE_CHECKING:
    from openvsan.protocol.nvme.controller import Controller

IDENTIFY_SIZE = 4096
# CNS values (Base 2.0 §5.17.2 Figure 273)
CNS_NAMESPACE = 0x00
CNS_CONTROLLER = 0x01
CNS_ACTIVE_NS_LIST = 0x02
CNS_NS_ID_DESCRIPTORS = 0x03
CNS_CSI_NAMESPACE = 0x05
CNS_CSI_CONTROLLER = 0x06
CNS_CSI_ACTIVE_NS_LIST = 0x07
CNS_CS_INDEPENDENT_NAMESPACE = 0x08
CNS_IO_COMMAND_SET = 0x1C

VERSION = 0x00020000          # NVMe Base 2.0 (VS register and Identify Controller VER)
MDTS = 8                      # 2^8 * 4 KiB (CAP.MPSMIN) = 1 MiB per command
MAX_TRANSFER = 4096 << MDTS
FIRMWARE = b"0.1.0   "
# ONCS (Identify Controller bytes 521:520): Compare, DSM, Write Zeroes, Reservations
ONCS = (1 << 0) | (1 << 2) | (1 << 3) | (1 << 5)
# OAES: namespace attribute notices (bit 8), ANA change notices (bit 11)
OAES_NS_ATTR = 1 << 8
OAES_ANA_CHANGE = 1 << 11
OAES = OAES_NS_ATTR | OAES_ANA_CHANGE
# a discovery controller's one notice: the discovery log page changed (NVMe-oF 1.1 §5.4, OAES bit 31)
OAES_DISCOVERY_CHANGE = 1 << 31
MNAN = 1024                   # NN and MNAN: NSIDs 1..1024; bounds the ANA log size a host reserves (MNAN <= NN)
AERL = 4                      # asynchronous event requests we hold (AERL is 0's based: 3)
ABORT_LIMIT = 4
ELPE = 16                     # error log entries we keep


def _ascii(s: str | bytes, n: int) -> bytes:
    b = s.encode("ascii", "replace") if isinstance(s, str) else s
    return b[:n].ljust(n, b" ")


def controller(ctrl: Controller) -> bytes:
    """Identify Controller (Base 2.0 §5.17.2.1 Figure 275; NVMe-oF 1.1 §4.1 Figure 31 for bytes 1792+)."""
    sub = ctrl.subsystem
    b = bytearray(IDENTIFY_SIZE)
    struct.pack_into("<HH", b, 0, 0x1B36, 0x1B36)        # VID/SSVID: the PCI-SIG id QEMU uses for emulated devices
    b[4:24] = _ascii(sub.serial, 20)
    b[24:64] = _ascii(sub.model, 40)
    b[64:72] = FIRMWARE
    b[72] = 6                                            # RAB: recommended arbitration burst
    if not sub.discovery:
        b[76] = (1 << 0) | (1 << 1) | (1 << 3)           # CMIC: multi-port, multi-controller, ANA reporting
    b[77] = MDTS
    struct.pack_into("<HI", b, 78, ctrl.cntlid, VERSION)
    struct.pack_into("<I", b, 92, OAES_DISCOVERY_CHANGE if sub.discovery else OAES)
    struct.pack_into("<I", b, 96, 0)                     # CTRATT: no traffic-based keep alive, 128-bit host id
    b[111] = 2 if sub.discovery else 1                   # CNTRLTYPE: discovery / I/O controller
    struct.pack_into("<H", b, 256, 0)                    # OACS: no optional admin commands
    b[258] = ABORT_LIMIT - 1                             # ACL (0's based)
    b[259] = AERL - 1                                    # AERL (0's based)
    b[260] = 0x03                                        # FRMW: slot 1 read-only, one slot
    b[261] = 1 << 2                                      # LPA: extended data (NUMDU, offsets) for Get Log Page
    b[262] = ELPE - 1                                    # ELPE (0's based)
    struct.pack_into("<HH", b, 266, 0x0157, 0x0175)      # WCTEMP 343 K, CCTEMP 373 K
    struct.pack_into("<H", b, 320, 1)                    # KAS: keep alive granularity 100 ms
    if not sub.discovery:
        # ANA (Base 2.0 §8.1, ana.py): transition time, states reported, group IDs 1..ANAGRPMAX all usable
        # (fixed, so a group made later is never over what a host read at connect)
        b[340] = ana.ANATT
        b[341] = ana.ANACAP
        struct.pack_into("<II", b, 342, ana.ANAGRPMAX, ana.ANAGRPMAX)   # ANAGRPMAX, NANAGRPID
    b[512] = 0x66                                        # SQES: 64-byte entries
    b[513] = 0x44                                        # CQES: 16-byte entries
    struct.pack_into("<HI", b, 514, ctrl.maxcmd, 0 if sub.discovery else MNAN)   # MAXCMD, NN (NSIDs 1..NN)
    if not sub.discovery:
        struct.pack_into("<H", b, 520, ONCS)
        b[525] = 0x07                                    # VWC present; Flush of NSID FFFFFFFFh supported
    # SGLS: SGLs supported (bits 1:0 = 01b), SGL offsets for in-capsule data (bit 20)
    struct.pack_into("<I", b, 536, (1 << 0) | (1 << 20))
    struct.pack_into("<I", b, 540, 0 if sub.discovery else MNAN)
    nqn = sub.nqn.encode()[:255]
    b[768:768 + len(nqn)] = nqn
    # NVMe over Fabrics attributes: IOCCSZ/IORCSZ in 16-byte units, ICDOFF 0, FCATT 0 (dynamic
    # controllers), MSDBD 1, OFCS bit 0 (Disconnect is supported)
    struct.pack_into("<IIHBBH", b, 1792, (64 + ctrl.in_capsule) // 16, 1, 0, 0, 1, 1)
    # power state 0 (bytes 2048-2079): 25 W maximum, nominal read/write values
    struct.pack_into("<H", b, 2048, 2500)
    return bytes(b)


def allocated_blocks(vol: Volume) -> int:
    """Blocks of a thin volume that have space behind them (NUSE): what its device's allocated_blocks()
    says (capabilities.thin promises it at the bottom of the stack); every block for any other volume."""
    n = vol.num_blocks
    if not vol.capabilities.thin:
        return n
    count = getattr(vol.device, "allocated_blocks", None)
    return n if count is None else max(0, min(n, int(count())))


def namespace(ns: Namespace, sub: Subsystem, ctrl: Controller) -> bytes:
    """Identify Namespace, NVM command set (NVM Command Set 1.0 §4.1.5.1 Figure 97). A thin volume
    (capabilities.thin) sets NSFEAT THINP and reports the blocks allocated now as NUSE; NCAP stays NSZE
    (the group may hold them all, it only promises nothing)."""
    dev = ns.volume
    caps = dev.capabilities
    b = bytearray(IDENTIFY_SIZE)
    n = dev.num_blocks
    struct.pack_into("<QQQ", b, 0, n, n, allocated_blocks(dev))   # NSZE, NCAP, NUSE
    b[24] = (1 << 3) | (1 << 4)                          # NSFEAT: ids never reused, NPWG/NOWS fields valid
    if caps.thin:
        b[24] |= 1 << 0                                  # NSFEAT THINP: thin provisioning, NUSE is real
    b[25] = 0                                            # NLBAF: one format
    b[26] = 0                                            # FLBAS: format 0
    b[30] = 1                                            # NMIC: may be shared by several controllers
    b[31] = RESCAP
    # DLFEAT: bits 2:0 001b deallocated blocks read as zeroes (000b: not reported); bit 3 Write Zeroes
    # may deallocate
    b[33] = (0x01 if caps.unmap_reads_zero else 0) | 0x08
    per_block = max(1, 4096 // dev.block_size) - 1
    struct.pack_into("<HHHHH", b, 64, per_block, per_block, per_block, per_block, per_block)  # NPWG..NOWS
    struct.pack_into("<I", b, 92, ns.ana_group)          # ANAGRPID
    b[99] = 1 if ns.read_only else 0                     # NSATTR: write protected
    b[104:120] = ns.nguid
    b[120:128] = ns.eui64
    lbads = dev.block_size.bit_length() - 1
    struct.pack_into("<HBB", b, 128, 0, lbads, 0)        # LBAF0: no metadata, 2^LBADS bytes, best performance
    return bytes(b)


def cs_independent_namespace(ns: Namespace) -> bytes:
    """I/O Command Set Independent Identify Namespace (Base 2.0 §5.17.2.9 Figure 284)."""
    b = bytearray(IDENTIFY_SIZE)
    b[0] = (1 << 3)                                      # NSFEAT: ids never reused
    b[1] = 1                                             # NMIC: shareable
    b[2] = RESCAP
    struct.pack_into("<I", b, 12, ns.ana_group)          # ANAGRPID
    b[16] = 1 if ns.read_only else 0                     # NSATTR
    return bytes(b)


def active_namespaces(sub: Subsystem, after: int) -> bytes:
    """Active Namespace ID list (Base 2.0 §5.17.2.2): NSIDs greater than `after`, ascending."""
    ids = sorted(n for n in sub.namespaces if n > after)[:1024]
    return struct.pack(f"<{len(ids)}I", *ids).ljust(IDENTIFY_SIZE, b"\0")


def ns_descriptors(ns: Namespace) -> bytes:
    """Namespace Identification Descriptor list (Base 2.0 §5.17.2.3 Figure 277): EUI64, NGUID, UUID, CSI."""
    out = bytearray()
    out += bytes([1, 8, 0, 0]) + ns.eui64
    out += bytes([2, 16, 0, 0]) + ns.nguid
    out += bytes([3, 16, 0, 0]) + ns.uuid.bytes
    out += bytes([4, 1, 0, 0, 0])                        # CSI 0: NVM command set
    return bytes(out.ljust(IDENTIFY_SIZE, b"\0"))


def nvm_controller() -> bytes:
    """I/O command set specific Identify Controller, NVM (NVM Command Set 1.0 §4.1.5.2): no limits set."""
    return bytes(IDENTIFY_SIZE)


def io_command_sets() -> bytes:
    """Identify I/O Command Set data structure (Base 2.0 §5.17.2.19): one combination, NVM only."""
    return struct.pack("<Q", 1).ljust(IDENTIFY_SIZE, b"\0")
