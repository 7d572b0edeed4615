"""NVMe/TCP PDU layouts (NVMe/TCP 1.0 §3.6). Every field is little-endian."""

from __future__ import annotations

import struct
from enum import IntEnum


class PduType(IntEnum):
    # NVMe/TCP 1.0 §3.6.1 Figure 11
    IC_REQ = 0x00
    IC_RESP = 0x01
    H2C_TERM_REQ = 0x02
    C2H_TERM_REQ = 0x03
    CAPSULE_CMD = 0x04
    CAPSULE_RESP = 0x05
    H2C_DATA = 0x06
    C2H_DATA = 0x07
    R2T = 0x09


class Fes(IntEnum):
    """Fatal Error Status of a termination request (NVMe/TCP 1.0 §3.6.2.4 Figure 22)."""
    INVALID_PDU_HEADER_FIELD = 0x01    # FEI: byte offset of the field in the PDU header
    PDU_SEQUENCE_ERROR = 0x02
    HEADER_DIGEST_ERROR = 0x03         # FEI: the digest that was received
    DATA_TRANSFER_OUT_OF_RANGE = 0x04
    DATA_TRANSFER_LIMIT_EXCEEDED = 0x05  # also "R2T limit exceeded"
    UNSUPPORTED_PARAMETER = 0x06       # FEI: byte offset of the parameter


# Common header flags (§3.6.1 Figure 12); LAST_PDU and SUCCESS only in data PDUs
F_HDGST = 0x01
F_DDGST = 0x02
F_LAST_PDU = 0x04
F_SUCCESS = 0x08

CH_LEN = 8
DIGEST_LEN = 4
# Fixed header lengths (HLEN) by PDU type (§3.6.2)
HLEN = {PduType.IC_REQ: 128, PduType.IC_RESP: 128, PduType.H2C_TERM_REQ: 24, PduType.C2H_TERM_REQ: 24,
        PduType.CAPSULE_CMD: 72, PduType.CAPSULE_RESP: 24, PduType.H2C_DATA: 24, PduType.C2H_DATA: 24,
        PduType.R2T: 24}
HOST_TO_CONTROLLER = frozenset({PduType.IC_REQ, PduType.H2C_TERM_REQ, PduType.CAPSULE_CMD, PduType.H2C_DATA})
TERM_REQ_MAX_PLEN = 152      # §3.6.2.4: the header (24) plus at most 128 bytes of the PDU in error
MIN_MAXH2CDATA = 4096        # §3.6.2.3

# §3.6.1: PDU-Type, FLAGS, HLEN, PDO, PLEN
CH = struct.Struct("<BBBBI")
# §3.6.2.2 ICReq: PFV u16, HPDA u8, DGST u8, MAXR2T u32 (after the common header)
IC_REQ = struct.Struct("<HBBI")
# §3.6.2.3 ICResp: PFV u16, CPDA u8, DGST u8, MAXH2CDATA u32, then 112 reserved bytes
IC_RESP = struct.Struct("<BBBBIHBBI112x")
# §3.6.2.8 H2CData / §3.6.2.9 C2HData / §3.6.2.10 R2T: CCCID u16, TTAG u16, offset u32, length u32, 4 reserved
DATA_HDR = struct.Struct("<BBBBIHHII4x")
H2C_DATA_FIELDS = struct.Struct("<HHII")
# §3.6.2.4 TermReq: FES u16, FEI u32, 10 reserved
TERM_REQ = struct.Struct("<BBBBIHI10x")
# §3.6.2.6 CapsuleResp: the common header, then the 16-byte completion queue entry
RESP_CH = struct.Struct("<BBBBI")

DGST_HEADER = 0x01  # ICReq/ICResp DGST bits (§3.6.2.2)
DGST_DATA = 0x02


def ic_resp(cpda: int, hdgst: bool, ddgst: bool, maxh2cdata: int) -> bytes:
    """§3.6.2.3: the controller's answer to ICReq (never digested)."""
    dgst = (DGST_HEADER if hdgst else 0) | (DGST_DATA if ddgst else 0)
    return IC_RESP.pack(PduType.IC_RESP, 0, 128, 0, 128, 0, cpda, dgst, maxh2cdata)


def term_req(fes: int, fei: int, offending: bytes | memoryview = b"") -> bytes:
    """§3.6.2.4: C2HTermReq carrying (at most 128 bytes of) the header of the PDU in error; no digests."""
    data = bytes(offending[:TERM_REQ_MAX_PLEN - 24])
    return TERM_REQ.pack(PduType.C2H_TERM_REQ, 0, 24, 0, 24 + len(data), fes, fei & 0xFFFFFFFF) + data


def r2t_header(cccid: int, ttag: int, offset: int, length: int, hdgst: bool) -> bytes:
    """§3.6.2.10 R2T (no data; PDO 0)."""
    plen = 24 + (DIGEST_LEN if hdgst else 0)
    return DATA_HDR.pack(PduType.R2T, F_HDGST if hdgst else 0, 24, 0, plen, cccid, ttag, offset, length)
