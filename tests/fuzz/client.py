"""A minimal blocking iSCSI initiator over a raw socket, for the live fuzz tests (RFC 7143).

Enough to log in without authentication, run READ(10)/WRITE(10) (immediate data, R2T/Data-Out when the
target asks), ping with NOP-Out, answer the target's NOP-In pings, and log out. No digests unless asked;
ErrorRecoveryLevel 0; one connection per session. Written for the tests, not for speed.
"""

from __future__ import annotations

import itertools
import socket
import struct
from dataclasses import dataclass, field

import pdus


class Closed(Exception):
    """The target closed the connection (EOF or reset)."""


class ProtocolViolation(AssertionError):
    """The target sent something RFC 7143 does not allow here."""


TARGET_OPCODES = {pdus.NOP_IN, pdus.SCSI_RSP, pdus.TMF_RSP, pdus.LOGIN_RSP, pdus.TEXT_RSP, pdus.DATA_IN,
                  pdus.LOGOUT_RSP, pdus.R2T, pdus.ASYNC, pdus.REJECT}

STATUS_OPCODES = {pdus.NOP_IN, pdus.SCSI_RSP, pdus.TMF_RSP, pdus.LOGIN_RSP, pdus.TEXT_RSP, pdus.LOGOUT_RSP,
                  pdus.ASYNC, pdus.REJECT}


@dataclass
class ScsiOutcome:
    status: int
    data: bytes = b""
    sense: bytes = b""
    response: int = 0


@dataclass
class Initiator:
    host: str
    port: int
    target: str
    name: str = "iqn.2026-11.org.openvsan.test:fuzz-good"
    isid: bytes = pdus.ISID
    timeout: float = 10.0
    header_digest: bool = False
    data_digest: bool = False
    sock: socket.socket | None = None
    cmdsn: int = 1
    expstatsn: int = 0
    params: dict[str, str] = field(default_factory=dict)
    _itt: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _buf: bytes = b""
    replies_seen: int = 0

    # --- transport --------------------------------------------------------------------------------
    def connect(self) -> Initiator:
        self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send_raw(self, wire: bytes) -> None:
        assert self.sock is not None
        try:
            self.sock.sendall(wire)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise Closed(str(e)) from e

    def _fill(self, n: int) -> None:
        assert self.sock is not None
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(max(65536, n - len(self._buf)))
            except ConnectionResetError as e:
                raise Closed("reset") from e
            if not chunk:
                raise Closed("EOF")
            self._buf += chunk

    def recv(self) -> pdus.Reply:
        """The next target PDU, checked for a legal opcode and, with digests on, right digests."""
        self._fill(pdus.BHS_LEN)
        bhs = self._buf[:pdus.BHS_LEN]
        ahs = bhs[4] * 4
        dsl = int.from_bytes(bhs[5:8], "big")
        hd = 4 if self.header_digest else 0
        dd = 4 if self.data_digest and dsl else 0
        total = pdus.BHS_LEN + ahs + hd + dsl + (-dsl & 3) + dd
        self._fill(total)
        raw, self._buf = self._buf[:total], self._buf[total:]
        if hd and pdus.crc(raw[:pdus.BHS_LEN + ahs]) != raw[pdus.BHS_LEN + ahs:pdus.BHS_LEN + ahs + 4]:
            raise ProtocolViolation("bad header digest from the target")
        start = pdus.BHS_LEN + ahs + hd
        data = raw[start:start + dsl]
        if dd and pdus.crc(raw[start:start + dsl + (-dsl & 3)]) != raw[-4:]:
            raise ProtocolViolation("bad data digest from the target")
        reply = pdus.Reply(bytes(bhs), bytes(data))
        if reply.opcode not in TARGET_OPCODES:
            raise ProtocolViolation(f"target sent opcode 0x{reply.opcode:02x}")
        self.replies_seen += 1
        # StatSN advances with every status-bearing PDU; R2T and the target's own pings only repeat it (§4.2.2.2)
        pings = reply.opcode == pdus.NOP_IN and reply.itt == pdus.RESERVED_TAG
        if reply.opcode in STATUS_OPCODES and not pings or reply.opcode == pdus.DATA_IN and reply.flags & 0x01:
            self.expstatsn = (reply.statsn + 1) & 0xFFFFFFFF
        # a rejected or ignored command may have used a CmdSN: follow the target's ExpCmdSN (§4.2.2.1)
        if (reply.opcode in STATUS_OPCODES | {pdus.DATA_IN, pdus.R2T} and reply.opcode != pdus.LOGIN_RSP
                and 0 < (reply.expcmdsn - self.cmdsn) & 0xFFFFFFFF < 1 << 31):
            self.cmdsn = reply.expcmdsn
        return reply

    def recv_for(self, itt: int) -> pdus.Reply:
        """The next PDU for our task itt, answering target pings on the way (§11.19)."""
        while True:
            r = self.recv()
            if r.opcode == pdus.NOP_IN and r.itt == pdus.RESERVED_TAG:
                self.send_raw(pdus.nop_out(itt=pdus.RESERVED_TAG, ttt=r.ttt, cmdsn=self.cmdsn,
                                           expstatsn=self.expstatsn, hd=self.header_digest, dd=self.data_digest))
                continue
            if r.opcode == pdus.ASYNC:
                continue
            if r.itt != itt and r.opcode != pdus.REJECT:
                raise ProtocolViolation(f"reply 0x{r.opcode:02x} for ITT {r.itt:#x}, waiting for {itt:#x}")
            return r

    def next_itt(self) -> int:
        return next(self._itt) & 0x7FFFFFFF

    # --- login ------------------------------------------------------------------------------------
    def login(self, **keys: str) -> pdus.Reply:
        """One-PDU operational login straight to full feature phase (§6.3: security stage skipped)."""
        offer = {"InitiatorName": self.name, "TargetName": self.target, "SessionType": "Normal",
                 "HeaderDigest": "CRC32C" if self.header_digest else "None",
                 "DataDigest": "CRC32C" if self.data_digest else "None",
                 "ImmediateData": "Yes", "InitialR2T": "Yes", "MaxRecvDataSegmentLength": "262144",
                 "MaxBurstLength": "262144", "FirstBurstLength": "65536", "ErrorRecoveryLevel": "0"}
        offer.update(keys)
        hd, dd = self.header_digest, self.data_digest
        self.header_digest = self.data_digest = False  # digests start after login (§13.1)
        itt = self.next_itt()
        self.send_raw(pdus.login_request(offer, itt=itt, cmdsn=self.cmdsn, isid=self.isid))
        r = self.recv()
        if r.opcode != pdus.LOGIN_RSP:
            raise ProtocolViolation(f"answer to login was opcode 0x{r.opcode:02x}")
        if r.login_status != (0, 0):
            raise ProtocolViolation(f"login failed: {r.login_status}")
        if not r.flags & 0x80 or r.flags & 3 != 3:
            raise ProtocolViolation("target did not move to full feature phase")
        self.params = r.keys()
        self.header_digest = self.params.get("HeaderDigest") == "CRC32C" and hd
        self.data_digest = self.params.get("DataDigest") == "CRC32C" and dd
        self.cmdsn = r.expcmdsn
        return r

    # --- full feature phase -----------------------------------------------------------------------
    def _take_cmdsn(self, immediate: bool) -> int:
        sn = self.cmdsn
        if not immediate:
            self.cmdsn = (self.cmdsn + 1) & 0xFFFFFFFF
        return sn

    def nop(self, data: bytes = b"") -> pdus.Reply:
        """An immediate NOP-Out ping; the answer must echo our ITT and data (§11.18, §11.19)."""
        itt = self.next_itt()
        self.send_raw(pdus.nop_out(itt=itt, cmdsn=self.cmdsn, expstatsn=self.expstatsn, data=data,
                                   hd=self.header_digest, dd=self.data_digest))
        r = self.recv_for(itt)
        if r.opcode != pdus.NOP_IN or r.data != data:
            raise ProtocolViolation(f"ping answered with opcode 0x{r.opcode:02x}")
        return r

    def command(self, cdb: bytes, *, data_out: bytes = b"", read_len: int = 0, immediate: bool = False,
                lun: int = 0) -> ScsiOutcome:
        itt = self.next_itt()
        first_burst = min(int(self.params.get("FirstBurstLength", "65536")),
                          int(self.params.get("MaxRecvDataSegmentLength", "8192")))
        imm = data_out[:first_burst] if self.params.get("ImmediateData", "Yes") == "Yes" else b""
        self.send_raw(pdus.scsi_command(cdb, itt=itt, cmdsn=self._take_cmdsn(immediate), expstatsn=self.expstatsn,
                                        edtl=len(data_out) or read_len, read=bool(read_len),
                                        write=bool(data_out), data=imm, immediate=immediate, lun=lun,
                                        hd=self.header_digest, dd=self.data_digest))
        got = bytearray()
        mrdsl = int(self.params.get("MaxRecvDataSegmentLength", "8192"))
        while True:
            r = self.recv_for(itt)
            if r.opcode == pdus.R2T:  # §11.8: send the burst asked for, in PDUs the target can take
                offset, length = struct.unpack(">II", r.bhs[40:48])
                for datasn, off in enumerate(range(offset, offset + length, mrdsl)):
                    chunk = data_out[off:min(off + mrdsl, offset + length)]
                    self.send_raw(pdus.data_out(chunk, itt=itt, ttt=r.ttt, datasn=datasn, offset=off, lun=lun,
                                                final=off + mrdsl >= offset + length, expstatsn=self.expstatsn,
                                                hd=self.header_digest, dd=self.data_digest))
            elif r.opcode == pdus.DATA_IN:
                offset = int.from_bytes(r.bhs[40:44], "big")
                got[offset:offset + len(r.data)] = r.data
                if r.flags & 0x01:
                    return ScsiOutcome(r.scsi_status, bytes(got))
            elif r.opcode == pdus.SCSI_RSP:
                sense = r.data[2:2 + int.from_bytes(r.data[:2], "big")] if len(r.data) >= 2 else b""
                return ScsiOutcome(r.scsi_status, bytes(got), sense, r.bhs[2])
            else:
                raise ProtocolViolation(f"opcode 0x{r.opcode:02x} (reason {r.reject_reason:#x}) for a command")

    def write(self, lba: int, data: bytes, block_size: int = 512) -> ScsiOutcome:
        return self.command(pdus.write10(lba, len(data) // block_size), data_out=data)

    def read(self, lba: int, blocks: int, block_size: int = 512) -> ScsiOutcome:
        return self.command(pdus.read10(lba, blocks), read_len=blocks * block_size)

    def logout(self) -> None:
        itt = self.next_itt()
        self.send_raw(pdus.logout_request(itt=itt, cmdsn=self.cmdsn, expstatsn=self.expstatsn, hd=self.header_digest))
        r = self.recv_for(itt)
        if r.opcode != pdus.LOGOUT_RSP or r.bhs[2] != 0:
            raise ProtocolViolation(f"logout answered with opcode 0x{r.opcode:02x} response {r.bhs[2]}")
