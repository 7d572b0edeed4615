"""A small NVMe/TCP host for tests: PDU builders and parsers written from the spec, independent of the
target's own codec (so a shared misreading cannot hide), and an asyncio host that connects queues.

Used by the unit tests (byte strings through the sans-IO machines) and by the fuzz/interop tests (sockets).
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field

from crc32c import crc32c

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-4333-8444-555555555555"
HOSTID = bytes.fromhex("11111111222243338444555555555555")


def dg(*parts: bytes) -> bytes:
    c = 0
    for p in parts:
        c = crc32c(p, c)
    return c.to_bytes(4, "little")


def icreq(hpda: int = 0, hd: bool = False, dd: bool = False, maxr2t: int = 0, pfv: int = 0) -> bytes:
    return struct.pack("<BBBBIHBBI", 0, 0, 128, 0, 128, pfv, hpda, (1 if hd else 0) | (2 if dd else 0),
                       maxr2t).ljust(128, b"\0")


def sqe(opcode: int, cid: int, nsid: int = 0, *, cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0,
        cdw14: int = 0, cdw15: int = 0, sgl_len: int = 0, in_capsule: bool = False, flags: int = 0x40) -> bytes:
    sgl_id = 0x01 if in_capsule else 0x5A
    return struct.pack("<BBHI16xQI3xBIIIIII", opcode, flags, cid, nsid, 0, sgl_len, sgl_id,
                       cdw10, cdw11, cdw12, cdw13, cdw14, cdw15)


def capsule(cmd: bytes, data: bytes = b"", *, hd: bool = False, dd: bool = False) -> bytes:
    hlen = 72
    hdl = 4 if hd else 0
    ddl = 4 if dd and data else 0
    pdo = hlen + hdl if data else 0
    plen = hlen + hdl + len(data) + ddl
    flags = (1 if hd else 0) | (2 if ddl else 0)
    hdr = struct.pack("<BBBBI", 4, flags, hlen, pdo, plen) + cmd
    out = hdr + (dg(hdr) if hd else b"") + data
    return out + (dg(data) if ddl else b"")


def h2c_data(cccid: int, ttag: int, offset: int, data: bytes, *, last: bool, hd: bool = False,
             dd: bool = False) -> bytes:
    hdl = 4 if hd else 0
    ddl = 4 if dd else 0
    flags = (1 if hd else 0) | (2 if dd else 0) | (4 if last else 0)
    hdr = struct.pack("<BBBBIHHII4x", 6, flags, 24, 24 + hdl, 24 + hdl + len(data) + ddl, cccid, ttag, offset,
                      len(data))
    return hdr + (dg(hdr) if hd else b"") + data + (dg(data) if dd else b"")


def connect_cmd(cid: int, qid: int, sqsize: int, kato: int = 0, cattr: int = 0) -> bytes:
    # NVMe-oF Connect: opcode 7Fh, FCTYPE 01h, RECFMT/QID in CDW10, SQSIZE/CATTR in CDW11, KATO in CDW12
    return sqe(0x7F, cid, 0x01, cdw10=qid << 16, cdw11=sqsize | (cattr << 16), cdw12=kato, sgl_len=1024,
               in_capsule=True)


def connect_data(subnqn: str, hostnqn: str = HOSTNQN, cntlid: int = 0xFFFF, hostid: bytes = HOSTID) -> bytes:
    d = bytearray(1024)
    d[0:16] = hostid
    d[16:18] = cntlid.to_bytes(2, "little")
    d[256:256 + len(subnqn)] = subnqn.encode()
    d[512:512 + len(hostnqn)] = hostnqn.encode()
    return bytes(d)


@dataclass
class Rx:
    """One controller-to-host PDU."""
    type: int
    flags: int
    header: bytes
    data: bytes

    def u16(self, off: int) -> int:
        return int.from_bytes(self.header[off:off + 2], "little")

    def u32(self, off: int) -> int:
        return int.from_bytes(self.header[off:off + 4], "little")

    @property
    def status(self) -> int:        # CapsuleResp: the 15-bit status field
        return self.u16(8 + 14) >> 1

    @property
    def cid(self) -> int:
        return self.u16(8 + 12)


@dataclass
class HostReader:
    hd: bool = False
    dd: bool = False
    buf: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[Rx]:
        self.buf += data
        out = []
        while len(self.buf) >= 8:
            ptype, flags, hlen, pdo, plen = struct.unpack_from("<BBBBI", self.buf)
            if len(self.buf) < plen:
                break
            p = bytes(self.buf[:plen])
            del self.buf[:plen]
            digested = ptype in (5, 7, 9)
            hdl = 4 if digested and flags & 1 else 0
            if hdl:
                assert dg(p[:hlen]) == p[hlen:hlen + 4], "header digest mismatch from target"
            if ptype in (2, 3):
                data = p[hlen:]
            elif pdo:
                ddl = 4 if flags & 2 else 0
                data = p[pdo:plen - ddl]
                if ddl:
                    assert dg(data) == p[plen - 4:], "data digest mismatch from target"
            else:
                data = b""
            out.append(Rx(ptype, flags, p[:hlen], data))
        return out


class Queue:
    """An asyncio host queue: ICReq, Connect, then commands with R2T and C2HData handled."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hd: bool, dd: bool) -> None:
        self.r, self.w = reader, writer
        self.hd, self.dd = hd, dd
        self.rx = HostReader()
        self.cntlid = 0
        self.maxh2cdata = 4096
        self._cid = 0
        self.waiting: dict[int, asyncio.Future[tuple[Rx | None, bytes]]] = {}
        self.wdata: dict[int, bytes] = {}
        self.rdata: dict[int, bytearray] = {}
        self._pump: asyncio.Task[None] | None = None
        self.term: Rx | None = None

    @classmethod
    async def open(cls, port: int, subnqn: str, *, qid: int = 0, cntlid: int = 0xFFFF, hd: bool = False,
                   dd: bool = False, kato: int = 0, sqsize: int = 31, hostnqn: str = HOSTNQN,
                   host: str = "127.0.0.1", cattr: int = 0, hostid: bytes = HOSTID) -> Queue:
        r, w = await asyncio.open_connection(host, port)
        q = cls(r, w, hd, dd)
        w.write(icreq(hd=hd, dd=dd))
        raw = await r.readexactly(128)
        assert raw[0] == 1, raw[:8]
        q.maxh2cdata = int.from_bytes(raw[12:16], "little")
        q.rx.hd, q.rx.dd = hd, dd
        q._pump = asyncio.get_running_loop().create_task(q._run())
        rsp, _ = await q.command(connect_cmd(0, qid, sqsize, kato, cattr), connect_data(subnqn, hostnqn, cntlid, hostid))
        assert rsp is not None
        if rsp.status:
            await q.close()   # its reader task goes with it (left pending, it is destroyed unfinished at exit)
            raise ConnectionRefusedError(f"Connect status {rsp.status:#x}")
        q.cntlid = rsp.u16(8) if qid == 0 else cntlid
        return q

    def next_cid(self) -> int:
        self._cid = (self._cid + 1) & 0xFFFF
        return self._cid

    async def command(self, cmd: bytes, data: bytes = b"") -> tuple[Rx | None, bytes]:
        """Send one SQE (its CID is replaced); returns (CapsuleResp or None when SUCCESS-flagged, C2H data)."""
        cid = self.next_cid()
        cmd = cmd[:2] + cid.to_bytes(2, "little") + cmd[4:]
        fut: asyncio.Future[tuple[Rx | None, bytes]] = asyncio.get_running_loop().create_future()
        self.waiting[cid] = fut
        sgl_id = cmd[39]
        if data and sgl_id == 0x01:
            self.w.write(capsule(cmd, data, hd=self.hd, dd=self.dd))
        else:
            if data:
                self.wdata[cid] = data
            self.w.write(capsule(cmd, hd=self.hd, dd=self.dd))
        return await fut

    async def _run(self) -> None:
        try:
            while True:
                chunk = await self.r.read(1 << 20)
                if not chunk:
                    break
                for p in self.rx.feed(chunk):
                    self._on(p)
        finally:
            for f in self.waiting.values():
                if not f.done():
                    f.set_exception(ConnectionResetError("connection closed"))

    def _on(self, p: Rx) -> None:
        if p.type == 5:
            f = self.waiting.pop(p.cid, None)
            if f is None:
                return  # the answer to a command a test wrote raw (no one waits for it)
            f.set_result((p, bytes(self.rdata.pop(p.cid, b""))))
        elif p.type == 7:
            cccid = p.u16(8)
            self.rdata.setdefault(cccid, bytearray()).extend(p.data)
            if p.flags & 8:
                self.waiting.pop(cccid).set_result((None, bytes(self.rdata.pop(cccid))))
        elif p.type == 9:
            cccid, ttag, off, n = p.u16(8), p.u16(10), p.u32(12), p.u32(16)
            data = self.wdata.pop(cccid)[off:off + n]
            pos = 0
            while pos < n:
                size = min(self.maxh2cdata, n - pos)
                self.w.write(h2c_data(cccid, ttag, off + pos, data[pos:pos + size], last=pos + size >= n,
                                      hd=self.hd, dd=self.dd))
                pos += size
        elif p.type == 3:
            self.term = p

    async def close(self) -> None:
        if self._pump:
            self._pump.cancel()
        self.w.close()
        try:
            await self.w.wait_closed()
        except (ConnectionError, OSError):
            pass

    # --- conveniences ---------------------------------------------------------------------------------
    async def prop_set(self, ofst: int, value: int) -> Rx | None:
        return (await self.command(sqe(0x7F, 0, 0x00, cdw10=0, cdw11=ofst, cdw12=value)))[0]

    async def prop_get(self, ofst: int, size8: bool = False) -> int:
        rsp, _ = await self.command(sqe(0x7F, 0, 0x04, cdw10=1 if size8 else 0, cdw11=ofst))
        assert rsp is not None and rsp.status == 0
        return rsp.u32(8) | (rsp.u32(12) << 32)

    async def enable(self) -> None:
        await self.prop_set(0x14, 1 | (6 << 16) | (4 << 20))
        assert await self.prop_get(0x1C) & 1

    async def identify(self, cns: int, nsid: int = 0, csi: int = 0) -> tuple[int, bytes]:
        rsp, data = await self.command(sqe(0x06, 0, nsid, cdw10=cns, cdw11=csi << 24, sgl_len=4096))
        return (rsp.status if rsp else 0), data

    async def get_log(self, lid: int, size: int, nsid: int = 0xFFFFFFFF, offset: int = 0, lsp: int = 0,
                      rae: bool = False) -> tuple[int, bytes]:
        numd = size // 4 - 1
        cdw10 = lid | (lsp << 8) | ((1 << 15) if rae else 0) | ((numd & 0xFFFF) << 16)
        rsp, data = await self.command(sqe(0x02, 0, nsid, cdw10=cdw10, cdw11=numd >> 16, cdw12=offset & 0xFFFFFFFF,
                                           cdw13=offset >> 32, sgl_len=size))
        return (rsp.status if rsp else 0), data

    async def read(self, nsid: int, lba: int, blocks: int, bs: int = 512) -> tuple[int, bytes]:
        rsp, data = await self.command(sqe(0x02, 0, nsid, cdw10=lba & 0xFFFFFFFF, cdw11=lba >> 32,
                                           cdw12=blocks - 1, sgl_len=blocks * bs))
        return (rsp.status if rsp else 0), data

    async def write(self, nsid: int, lba: int, data: bytes, bs: int = 512, fua: bool = False,
                    in_capsule: bool | None = None) -> int:
        if in_capsule is None:
            in_capsule = len(data) <= 8192
        rsp, _ = await self.command(sqe(0x01, 0, nsid, cdw10=lba & 0xFFFFFFFF, cdw11=lba >> 32,
                                        cdw12=(len(data) // bs - 1) | ((1 << 30) if fua else 0),
                                        sgl_len=len(data), in_capsule=in_capsule), data)
        assert rsp is not None
        return rsp.status


async def connect_controller(port: int, subnqn: str, *, io_queues: int = 1, hd: bool = False, dd: bool = False,
                             kato: int = 0, hostnqn: str = HOSTNQN, sqsize: int = 127,
                             cattr: int = 0) -> tuple[Queue, list[Queue]]:
    """An admin queue, CC.EN, Set Features (Number of Queues), then `io_queues` I/O queues."""
    admin = await Queue.open(port, subnqn, hd=hd, dd=dd, kato=kato, hostnqn=hostnqn)
    await admin.enable()
    n = io_queues - 1
    rsp, _ = await admin.command(sqe(0x09, 0, 0, cdw10=0x07, cdw11=n | (n << 16)))
    assert rsp is not None and rsp.status == 0
    ios = [await Queue.open(port, subnqn, qid=i + 1, cntlid=admin.cntlid, hd=hd, dd=dd, sqsize=sqsize,
                            hostnqn=hostnqn, cattr=cattr) for i in range(io_queues)]
    return admin, ios
