"""Commands a host builds (NVMe Base 2.0, NVM Command Set 1.0, NVMe-oF 1.1) and the data it reads back.

Every SQE carries one SGL descriptor (NVMe/TCP 1.0 §3.3): an offset data block for in-capsule data, a
transport data block for data moved by C2HData or by R2T + H2CData.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from openvsan.protocol.nvme.command import FABRICS_OPCODE, SGL_DATA_BLOCK_OFFSET, SGL_TRANSPORT_DATA_BLOCK, SQE

PSDT_SGL = 0x40   # §4.2 Figure 88: FUSE/PSDT byte, SGLs for data

# Admin opcodes (Base 2.0 §5 Figure 139)
ADMIN_GET_LOG_PAGE = 0x02
ADMIN_IDENTIFY = 0x06
ADMIN_SET_FEATURES = 0x09
ADMIN_KEEP_ALIVE = 0x18
# Fabrics command types (NVMe-oF 1.1 §3 Figure 10)
FCTYPE_PROPERTY_SET = 0x00
FCTYPE_CONNECT = 0x01
FCTYPE_PROPERTY_GET = 0x04
FCTYPE_DISCONNECT = 0x08
# NVM I/O opcodes (NVM Command Set 1.0 §3 Figure 20)
IO_FLUSH = 0x00
IO_WRITE = 0x01
IO_READ = 0x02
IO_WRITE_ZEROES = 0x08
IO_DSM = 0x09
# Controller properties (Base 2.0 §3.1.3 Figure 33)
PROP_CAP = 0x00
PROP_VS = 0x08
PROP_CC = 0x14
PROP_CSTS = 0x1C
CC_EN = 1
CC_SHN_NORMAL = 1 << 14
CC_IO_QUEUE_ENTRY_SIZES = (6 << 16) | (4 << 20)   # IOSQES 2^6 = 64, IOCQES 2^4 = 16
CSTS_RDY = 1
CSTS_CFS = 2
FEATURE_NUMBER_OF_QUEUES = 0x07
CNS_NAMESPACE, CNS_CONTROLLER, CNS_ACTIVE_NS_LIST = 0x00, 0x01, 0x02
LID_DISCOVERY = 0x70
LID_ANA = 0x0C     # Base 2.0 §5.16.1.12 Asymmetric Namespace Access
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
CONNECT_DATA_LEN = 1024
IDENTIFY_LEN = 4096
FUA = 1 << 30      # CDW12 bit 30 of Read/Write (NVM Command Set 1.0 §3.2.6)
DEAC = 1 << 25     # CDW12 bit 25 of Write Zeroes: deallocate (§3.2.8)
DSM_AD = 1 << 2    # CDW11 bit 2 of Dataset Management: deallocate (§3.2.3)


def sqe(opcode: int, cid: int, nsid: int = 0, *, cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0,
        cdw14: int = 0, cdw15: int = 0, data_len: int = 0, in_capsule: bool = False) -> bytes:
    """A 64-byte SQE (Base 2.0 §4.2 Figure 88) with its SGL descriptor (NVMe/TCP 1.0 §3.3)."""
    sgl_id = SGL_DATA_BLOCK_OFFSET if in_capsule else SGL_TRANSPORT_DATA_BLOCK
    return SQE.pack(opcode, PSDT_SGL, cid, nsid, 0, data_len, sgl_id, cdw10 & 0xFFFFFFFF, cdw11 & 0xFFFFFFFF,
                    cdw12 & 0xFFFFFFFF, cdw13 & 0xFFFFFFFF, cdw14, cdw15)


def fabrics(fctype: int, cid: int, *, cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0,
            data_len: int = 0, in_capsule: bool = False) -> bytes:
    """Fabrics commands put FCTYPE where NSID sits (NVMe-oF 1.1 §3.3 Figure 10)."""
    return sqe(FABRICS_OPCODE, cid, fctype, cdw10=cdw10, cdw11=cdw11, cdw12=cdw12, cdw13=cdw13, data_len=data_len,
               in_capsule=in_capsule)


CATTR_SQ_FLOW_DISABLE = 0x04   # NVMe-oF 1.1 §3.3 Figure 19: CATTR bit 2, SQ flow control disable


def connect(cid: int, qid: int, sqsize: int, kato_ms: int, *, in_capsule: bool = True,
            sq_flow_off: bool = False) -> bytes:
    """NVMe-oF 1.1 §3.3 Connect: RECFMT 0, QID, SQSIZE (0-based), CATTR, KATO (admin queue only). With SQ
    flow control off, a read ends with its last C2HData (SUCCESS flag, NVMe/TCP 1.0 §3.6.2.9): one PDU."""
    cattr = CATTR_SQ_FLOW_DISABLE if sq_flow_off else 0
    return fabrics(FCTYPE_CONNECT, cid, cdw10=qid << 16, cdw11=(sqsize - 1) | cattr << 16,
                   cdw12=kato_ms if qid == 0 else 0, data_len=CONNECT_DATA_LEN, in_capsule=in_capsule)


def connect_data(hostid: bytes, cntlid: int, subnqn: str, hostnqn: str) -> bytes:
    """NVMe-oF 1.1 §3.3 Figure 20: HOSTID, CNTLID, SUBNQN at 256, HOSTNQN at 512."""
    b = bytearray(CONNECT_DATA_LEN)
    b[0:16] = hostid
    struct.pack_into("<H", b, 16, cntlid)
    b[256:256 + 256] = subnqn.encode()[:255].ljust(256, b"\0")
    b[512:512 + 256] = hostnqn.encode()[:255].ljust(256, b"\0")
    return bytes(b)


def property_get(cid: int, offset: int, *, eight: bool = False) -> bytes:
    """NVMe-oF 1.1 §3.5 Property Get: ATTRIB (size) and OFST; the value comes back in DW0 (and DW1)."""
    return fabrics(FCTYPE_PROPERTY_GET, cid, cdw10=1 if eight else 0, cdw11=offset)


def property_set(cid: int, offset: int, value: int) -> bytes:
    """NVMe-oF 1.1 §3.6 Property Set (4-byte properties)."""
    return fabrics(FCTYPE_PROPERTY_SET, cid, cdw10=0, cdw11=offset, cdw12=value & 0xFFFFFFFF, cdw13=value >> 32)


def identify(cid: int, cns: int, nsid: int = 0) -> bytes:
    """Base 2.0 §5.17 Identify: 4096 bytes back."""
    return sqe(ADMIN_IDENTIFY, cid, nsid, cdw10=cns, data_len=IDENTIFY_LEN)


def set_features(cid: int, fid: int, value: int) -> bytes:
    return sqe(ADMIN_SET_FEATURES, cid, cdw10=fid, cdw11=value)


def number_of_queues(cid: int, n: int) -> bytes:
    """Base 2.0 §5.27.1.5: NSQR and NCQR, both 0-based."""
    return set_features(cid, FEATURE_NUMBER_OF_QUEUES, (n - 1) | ((n - 1) << 16))


def keep_alive(cid: int) -> bytes:
    return sqe(ADMIN_KEEP_ALIVE, cid)


def get_log_page(cid: int, lid: int, length: int, offset: int = 0, nsid: int = 0) -> bytes:
    """Base 2.0 §5.16: NUMD (0-based dwords) split over CDW10/CDW11, offset in CDW12/13."""
    numd = length // 4 - 1
    return sqe(ADMIN_GET_LOG_PAGE, cid, nsid, cdw10=lid | ((numd & 0xFFFF) << 16), cdw11=numd >> 16,
               cdw12=offset & 0xFFFFFFFF, cdw13=offset >> 32, data_len=length)


def read(cid: int, nsid: int, lba: int, blocks: int, nbytes: int) -> bytes:
    """NVM 1.0 §3.2.4: SLBA in CDW10-11, NLB 0-based in CDW12. What sqe() makes of it, packed here (every read
    of our initiators makes one; the unit tests hold it to sqe()'s bytes)."""
    return SQE.pack(*read_fields(cid, nsid, lba, blocks, nbytes))


def read_fields(cid: int, nsid: int, lba: int, blocks: int, nbytes: int) -> tuple[int, ...]:
    """A Read's SQE as SQE's fields, in order: what read() packs, and what a capsule packs after its common header
    in the same call (host_pdus.read_capsule)."""
    return (IO_READ, PSDT_SGL, cid, nsid, 0, nbytes, SGL_TRANSPORT_DATA_BLOCK, lba & 0xFFFFFFFF,
            lba >> 32 & 0xFFFFFFFF, blocks - 1, 0, 0, 0)


def write(cid: int, nsid: int, lba: int, blocks: int, nbytes: int, *, fua: bool, in_capsule: bool) -> bytes:
    """NVM 1.0 §3.2.6. What sqe() makes of it, packed here (a replicated write makes one per peer; the unit tests
    hold it to sqe()'s bytes)."""
    return SQE.pack(*write_fields(cid, nsid, lba, blocks, nbytes, fua, in_capsule))


def write_fields(cid: int, nsid: int, lba: int, blocks: int, nbytes: int, fua: bool, in_capsule: bool) -> tuple[int, ...]:
    """A Write's SQE as SQE's fields, in order: what write() packs, and what a capsule packs after its common
    header in the same call (host_pdus.write_capsule)."""
    return (IO_WRITE, PSDT_SGL, cid, nsid, 0, nbytes, SGL_DATA_BLOCK_OFFSET if in_capsule else SGL_TRANSPORT_DATA_BLOCK,
            lba & 0xFFFFFFFF, lba >> 32 & 0xFFFFFFFF, (blocks - 1) | (FUA if fua else 0), 0, 0, 0)


def flush(cid: int, nsid: int) -> bytes:
    return sqe(IO_FLUSH, cid, nsid)


def write_zeroes(cid: int, nsid: int, lba: int, blocks: int, *, deallocate: bool = False) -> bytes:
    """NVM 1.0 §3.2.8: no data moves."""
    return sqe(IO_WRITE_ZEROES, cid, nsid, cdw10=lba, cdw11=lba >> 32,
               cdw12=(blocks - 1) | (DEAC if deallocate else 0))


def dsm_deallocate(cid: int, nsid: int, ranges: list[tuple[int, int]], *, in_capsule: bool) -> tuple[bytes, bytes]:
    """NVM 1.0 §3.2.3 Dataset Management, AD: the SQE and its 16-byte ranges (attributes, NLB, SLBA)."""
    data = b"".join(struct.pack("<IIQ", 0, n, lba) for lba, n in ranges)
    return sqe(IO_DSM, cid, nsid, cdw10=len(ranges) - 1, cdw11=DSM_AD, data_len=len(data),
               in_capsule=in_capsule), data


IO_RESERVATION_REGISTER, IO_RESERVATION_REPORT, IO_RESERVATION_ACQUIRE, IO_RESERVATION_RELEASE = 0x0D, 0x0E, 0x11, 0x15


def reservation_register(cid: int, nsid: int, action: int, crkey: int, nrkey: int, *,
                         iekey: bool = False) -> tuple[bytes, bytes]:
    """Base 2.0 §7.6 Reservation Register: RREGA (0 register, 1 unregister, 2 replace) and IEKEY in CDW10;
    CRKEY and NRKEY, 8 bytes each, in the data. Returns the SQE and its in-capsule data."""
    data = struct.pack("<QQ", crkey, nrkey)
    return sqe(IO_RESERVATION_REGISTER, cid, nsid, cdw10=action | (8 if iekey else 0), data_len=16,
               in_capsule=True), data


def reservation_acquire(cid: int, nsid: int, action: int, rtype: int, crkey: int, prkey: int = 0, *,
                        iekey: bool = False) -> tuple[bytes, bytes]:
    """Base 2.0 §7.5 Reservation Acquire: RACQA (0 acquire, 1 preempt, 2 preempt and abort), IEKEY, RTYPE
    in CDW10; CRKEY and PRKEY in the data."""
    data = struct.pack("<QQ", crkey, prkey)
    return sqe(IO_RESERVATION_ACQUIRE, cid, nsid, cdw10=action | (8 if iekey else 0) | (rtype << 8), data_len=16,
               in_capsule=True), data


def reservation_release(cid: int, nsid: int, action: int, rtype: int, crkey: int) -> tuple[bytes, bytes]:
    """Base 2.0 §7.7 Reservation Release: RRELA (0 release, 1 clear), RTYPE; CRKEY in the data."""
    data = struct.pack("<Q", crkey)
    return sqe(IO_RESERVATION_RELEASE, cid, nsid, cdw10=action | (rtype << 8), data_len=8, in_capsule=True), data


def reservation_report(cid: int, nsid: int, length: int) -> bytes:
    """Base 2.0 §7.8 Reservation Report, extended data structure (EDS: 128-bit host identifiers)."""
    return sqe(IO_RESERVATION_REPORT, cid, nsid, cdw10=length // 4 - 1, cdw11=1, data_len=length)


# --- data structures read back ------------------------------------------------------------------------

def _text(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("ascii", "replace").strip()


@dataclass(frozen=True)
class IdentifyController:
    """Base 2.0 §5.17.2.1 Figure 275; NVMe-oF 1.1 §4.1 Figure 31 for the fabrics fields."""

    vid: int
    serial: str
    model: str
    firmware: str
    mdts: int
    cntlid: int
    version: int
    kas: int           # keep alive granularity, 100 ms units
    maxcmd: int
    nn: int
    oncs: int
    vwc: int
    subnqn: str
    ioccsz: int        # bytes of a command capsule (SQE + in-capsule data)
    icdoff: int
    cmic: int = 0      # bit 3: the controller reports ANA (Base 2.0 Figure 275, byte 76)

    @classmethod
    def parse(cls, b: bytes) -> IdentifyController:
        vid = struct.unpack_from("<H", b, 0)[0]
        cntlid, ver = struct.unpack_from("<HI", b, 78)
        maxcmd, nn = struct.unpack_from("<HI", b, 514)
        ioccsz, _iorcsz, icdoff = struct.unpack_from("<IIH", b, 1792)
        return cls(vid, _text(b[4:24]), _text(b[24:64]), _text(b[64:72]), b[77], cntlid, ver,
                   struct.unpack_from("<H", b, 320)[0], maxcmd, nn, struct.unpack_from("<H", b, 520)[0], b[525],
                   _text(b[768:1024]), ioccsz * 16, icdoff, b[76])

    @property
    def ana(self) -> bool:
        return bool(self.cmic & 0x08)

    @property
    def write_zeroes(self) -> bool:
        return bool(self.oncs & (1 << 3))

    @property
    def dsm(self) -> bool:
        return bool(self.oncs & (1 << 2))


@dataclass(frozen=True)
class IdentifyNamespace:
    """NVM Command Set 1.0 §4.1.5.1."""

    nsze: int
    ncap: int
    nuse: int
    nsfeat: int
    block_size: int
    nguid: bytes
    eui64: bytes
    anagrpid: int = 0   # the namespace's ANA group (Base 2.0 §5.17.2.1 Figure 276, bytes 95:92); 0: none

    @classmethod
    def parse(cls, b: bytes) -> IdentifyNamespace:
        nsze, ncap, nuse = struct.unpack_from("<QQQ", b, 0)
        flbas = b[26] & 0x0F
        lbads = b[128 + 4 * flbas + 2]
        return cls(nsze, ncap, nuse, b[24], 1 << lbads if lbads else 0, bytes(b[104:120]), bytes(b[120:128]),
                   struct.unpack_from("<I", b, 92)[0])


@dataclass(frozen=True)
class DiscoveryEntry:
    """NVMe-oF 1.1 §5.3 Figure 38: one subsystem on one port."""

    trtype: int
    adrfam: int
    subtype: int
    portid: int
    trsvcid: str
    traddr: str
    subnqn: str


def parse_ana_log(b: bytes) -> tuple[int, dict[int, tuple[int, tuple[int, ...]]]]:
    """(change count, {ANAGRPID: (ANA state, NSIDs)}) of an ANA log page (Base 2.0 §5.16.1.12 Figures 230,
    231): a 16-byte header, then per group a 32-byte descriptor and its NSIDs."""
    if len(b) < 16:
        return 0, {}
    count, n = struct.unpack_from("<QH", b, 0)
    groups: dict[int, tuple[int, tuple[int, ...]]] = {}
    off = 16
    for _ in range(n):
        if off + 32 > len(b):
            break
        gid, nn, _, state = struct.unpack_from("<IIQB", b, off)
        nsids = struct.unpack_from(f"<{nn}I", b, off + 32) if off + 32 + 4 * nn <= len(b) else ()
        groups[gid] = (state & 0x0F, tuple(nsids))
        off += 32 + 4 * nn
    return count, groups


def parse_discovery_log(b: bytes) -> tuple[int, int, list[DiscoveryEntry]]:
    """(GENCTR, NUMREC, entries present in b) of a discovery log page (NVMe-oF 1.1 §5.3 Figure 37)."""
    genctr, numrec = struct.unpack_from("<QQ", b, 0)
    out = []
    for i in range(numrec):
        off = 1024 + 1024 * i
        if off + 1024 > len(b):
            break
        e = b[off:off + 1024]
        # SUBNQN at 256, TRADDR at 512 (Figure 38)
        out.append(DiscoveryEntry(e[0], e[1], e[2], struct.unpack_from("<H", e, 4)[0], _text(e[32:64]),
                                  traddr=_text(e[512:768]), subnqn=_text(e[256:512])))
    return genctr, numrec, out


@dataclass(frozen=True)
class ReservationStatus:
    """An extended Reservation Report (Base 2.0 §7.8 Figures 398-399), as the host reads it."""

    generation: int
    rtype: int                                   # 0: not reserved
    registrants: tuple[tuple[bytes, int, bool], ...]   # (host identifier, key, holds the reservation)

    @property
    def holder_key(self) -> int | None:
        return next((key for _, key, holds in self.registrants if holds), None) if self.rtype else None


def parse_reservation_report(b: bytes) -> ReservationStatus:
    gen, rtype, regs = struct.unpack_from("<IBH", b)
    out = []
    for i in range(regs):
        off = 64 + 64 * i                        # extended header 64 bytes, each entry 64 bytes
        if off + 64 > len(b):
            break
        _, rcsts, key, hostid = struct.unpack_from("<HB5xQ16s", b, off)
        out.append((bytes(hostid), int(key), bool(rcsts & 1)))
    return ReservationStatus(gen, rtype, tuple(out))
