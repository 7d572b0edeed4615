"""Log pages (NVMe Base 2.0 §5.16.1; the discovery log page of NVMe-oF 1.1 §5.3)."""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from openvsan.protocol.nvme.ana import Portal
from openvsan.protocol.nvme.subsystem import Port, Subsystem

# Log page identifiers (§5.16 Figure 202)
LID_ERROR = 0x01
LID_SMART = 0x02
LID_FW_SLOT = 0x03
LID_CHANGED_NS = 0x04
LID_ANA = 0x0C
LID_DISCOVERY = 0x70


@dataclass(slots=True)
class ErrorEntry:
    """Error Information log entry (§5.16.1.2 Figure 205)."""
    count: int
    sqid: int
    cid: int
    status: int
    nsid: int = 0
    lba: int = 0

    def pack(self) -> bytes:
        # ERRCNT, SQID, CID, STATUS (with phase bit 0), PEL (FFFFh: no parameter location), LBA, NSID
        return struct.pack("<QHHHHQI", self.count, self.sqid, self.cid, (self.status << 1) & 0xFFFF, 0xFFFF,
                           self.lba, self.nsid).ljust(64, b"\0")


def error_log(entries: Sequence[ErrorEntry], n: int) -> bytes:
    """Newest first; room for `n` entries (ELPE+1)."""
    out = b"".join(e.pack() for e in reversed(entries[-n:]))
    return out.ljust(64 * n, b"\0")


def smart_log(sub: Subsystem) -> bytes:
    """SMART / Health Information (§5.16.1.3 Figure 207): counters of this subsystem, a healthy device.
    Data units are thousands of 512-byte units, rounded up."""
    b = bytearray(512)
    struct.pack_into("<BHBBB", b, 0, 0, 0x0131, 100, 10, 0)   # no warning, 305 K, 100 % spare, threshold 10 %
    for off, value in ((32, -(-sub.bytes_read // 512000)), (48, -(-sub.bytes_written // 512000)), (64, sub.read_commands),
                       (80, sub.write_commands), (160, sub.media_errors)):
        b[off:off + 16] = value.to_bytes(16, "little")
    return bytes(b)


def fw_slot_log(firmware: bytes) -> bytes:
    """Firmware Slot Information (§5.16.1.4): slot 1 active."""
    return (bytes([1]) + bytes(7) + firmware).ljust(512, b"\0")


def changed_ns_log(nsids: Sequence[int]) -> bytes:
    """Changed Namespace List (§5.16.1.5): up to 1024 NSIDs, or FFFFFFFFh first when more changed."""
    ids = list(nsids) if len(nsids) <= 1024 else [0xFFFFFFFF]
    return struct.pack(f"<{len(ids)}I", *ids).ljust(4096, b"\0")


def ana_log(sub: Subsystem, portal: Portal | None, rgo: bool) -> bytes:
    """Asymmetric Namespace Access (§5.16.1.12): what a controller on `portal` reports (ana.py builds it)."""
    return sub.ana.log({ns.nsid: ns.ana_group for ns in sub.namespaces.values()}, portal, rgo)


# Discovery log page entry (NVMe-oF 1.1 §5.3 Figure 40); TCP: TRTYPE 3, TSAS SECTYPE 0 (no TLS)
TRTYPE_TCP = 3
SUBTYPE_NVME = 2
SUBTYPE_CURRENT_DISCOVERY = 3
TREQ = 0x02 | 0x04          # secure channel not required; SQ flow control may be disabled


def discovery_log(entries: Sequence[tuple[Subsystem, Port]], generation: int) -> bytes:
    """NVMe-oF 1.1 §5.3 Figure 39: GENCTR, NUMREC, RECFMT, then 1024-byte entries."""
    out = bytearray(struct.pack("<QQH", generation, len(entries), 0).ljust(1024, b"\0"))
    for sub, port in entries:
        try:
            family = 2 if ipaddress.ip_address(port.host).version == 6 else 1
        except ValueError:
            family = 1
        e = bytearray(1024)
        subtype = SUBTYPE_CURRENT_DISCOVERY if sub.discovery else SUBTYPE_NVME
        # TRTYPE, ADRFAM, SUBTYPE, TREQ, PORTID, CNTLID (FFFFh: dynamic), ASQSZ, EFLAGS
        struct.pack_into("<BBBBHHHH", e, 0, TRTYPE_TCP, family, subtype, TREQ, port.portid, 0xFFFF,
                         32, 0)
        e[32:64] = str(port.port).encode().ljust(32, b" ")           # TRSVCID, space padded
        nqn = sub.nqn.encode()[:255]
        e[256:256 + len(nqn)] = nqn
        addr = port.host.encode()[:255]
        e[512:768] = addr.ljust(256, b" ")                            # TRADDR, space padded
        out += e
    return bytes(out)
