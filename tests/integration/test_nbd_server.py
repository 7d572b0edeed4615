"""The asyncio NbdServer with a small raw-socket client, in process, on RAM and fault-injecting devices."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest

from openvsan.block import FaultDevice, RamDevice
from openvsan.block.errors import NoSpace
from openvsan.frontend.config import NbdExportConfig
from openvsan.frontend.nbd import NbdServer
from openvsan.protocol.nbd import Cmd, CmdFlag, Errno
from openvsan.protocol.nbd.wire import IHAVEOPT, REQUEST_MAGIC, Info, Opt, Rep, ReplyType
from openvsan.volume import Volume

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Client:
    """Just enough of an NBD client: GO with structured replies, then requests and replies by cookie."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer
        self.cookie = 0
        self.reads: dict[int, int] = {}  # cookie -> length: a simple reply's data length is known only here

    @classmethod
    async def connect(cls, port: int, export: str = "disk0", *, structured: bool = True) -> Client:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        c = cls(r, w)
        await r.readexactly(18)
        w.write(struct.pack(">I", 3))
        if structured:
            assert (await c.option(Opt.STRUCTURED_REPLY))[-1][0] == Rep.ACK
        name = export.encode()
        replies = await c.option(Opt.GO, struct.pack(">I", len(name)) + name + struct.pack(">HH", 1, Info.BLOCK_SIZE))
        assert replies[-1][0] == Rep.ACK, replies
        return c

    async def option(self, opt: int, data: bytes = b"") -> list[tuple[int, bytes]]:
        self.w.write(struct.pack(">QII", IHAVEOPT, opt, len(data)) + data)
        out = []
        while True:
            _, _, rep, n = struct.unpack(">QIII", await self.r.readexactly(20))
            out.append((rep, await self.r.readexactly(n)))
            if rep != Rep.INFO and rep != Rep.SERVER:
                return out

    def send(self, cmd: int, offset: int = 0, length: int = 0, data: bytes = b"", flags: int = 0) -> int:
        self.cookie += 1
        if cmd == Cmd.READ:
            self.reads[self.cookie] = length
        self.w.write(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, self.cookie, offset, length) + data)
        return self.cookie

    async def reply(self) -> tuple[int, int, bytes]:
        """(cookie, error, data) of the next reply; structured chunks are gathered up to DONE."""
        magic = struct.unpack(">I", await self.r.readexactly(4))[0]
        if magic == 0x67446698:
            error, cookie = struct.unpack(">IQ", await self.r.readexactly(12))
            n = self.reads.pop(cookie, 0)
            return cookie, error, await self.r.readexactly(n) if n and not error else b""
        data, error = b"", 0
        while True:
            flags, rtype, cookie, n = struct.unpack(">HHQI", await self.r.readexactly(16))
            payload = await self.r.readexactly(n)
            if rtype == ReplyType.OFFSET_DATA:
                data += payload[8:]
            elif rtype & 0x8000:
                error = struct.unpack_from(">I", payload)[0]
            if flags & 1:
                return cookie, error, data
            assert struct.unpack(">I", await self.r.readexactly(4))[0] == 0x668E33EF

    async def call(self, cmd: int, offset: int = 0, length: int = 0, data: bytes = b"",
                   flags: int = 0) -> tuple[int, bytes]:
        cookie = self.send(cmd, offset, length, data, flags)
        got, error, out = await self.reply()
        assert got == cookie
        return error, out

    async def close(self) -> None:
        self.send(Cmd.DISC)
        await self.w.drain()
        assert await self.r.read() == b""  # the server closes after DISC
        self.w.close()


@asynccontextmanager
async def serving(*exports: tuple[str, Any, bool], **kw: Any) -> AsyncIterator[tuple[NbdServer, int]]:
    port = free_port()
    server = NbdServer([NbdExportConfig(name, Volume(dev, name=name), [("127.0.0.1", port)], read_only=ro, description=name.upper())
                        for name, dev, ro in exports], **kw)
    await server.start()
    try:
        yield server, port
    finally:
        await server.stop()


def run(coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 30))


def test_round_trip_flags_and_errors() -> None:
    async def go() -> None:
        dev = RamDevice(2048, 512)
        async with serving(("disk0", dev, False), ("ro", RamDevice(64, 4096), True)) as (_, port):
            c = await Client.connect(port)
            assert await c.call(Cmd.WRITE, 4096, 8192, b"a" * 8192, CmdFlag.FUA) == (0, b"")
            assert await c.call(Cmd.READ, 4096, 8192) == (0, b"a" * 8192)
            assert await c.call(Cmd.WRITE_ZEROES, 4096, 512, flags=CmdFlag.NO_HOLE) == (0, b"")
            assert await c.call(Cmd.WRITE_ZEROES, 4608, 512, flags=CmdFlag.FUA) == (0, b"")
            assert await c.call(Cmd.TRIM, 8192, 4096) == (0, b"")
            assert await c.call(Cmd.READ, 4096, 8192) == (0, bytes(1024) + b"a" * 3072 + bytes(4096))
            assert await c.call(Cmd.FLUSH) == (0, b"")
            assert await c.call(Cmd.CACHE, 0, 4096) == (0, b"")
            assert (await c.call(Cmd.READ, MiB - 512, 1024))[0] == Errno.EINVAL
            assert (await c.call(Cmd.WRITE, MiB, 512, bytes(512)))[0] == Errno.ENOSPC
            assert (await c.call(Cmd.READ, 1, 512))[0] == Errno.EINVAL
            assert await c.call(Cmd.READ, 0, 0) == (0, b"")
            await c.close()
            ro = await Client.connect(port, "ro", structured=False)
            assert (await ro.call(Cmd.WRITE, 0, 4096, bytes(4096)))[0] == Errno.EPERM
            assert (await ro.call(Cmd.READ, 0, 512))[0] == Errno.EINVAL  # 4096-byte minimum block
            assert await ro.call(Cmd.READ, 0, 4096) == (0, bytes(4096))
            await ro.close()

    run(go)


def test_block_errors_map_to_nbd_errors() -> None:
    async def go() -> None:
        dev = FaultDevice(RamDevice(2048, 512))
        dev.fail_reads(10, 1)
        dev.fail_writes(20, 1, error=NoSpace)
        async with serving(("disk0", dev, False)) as (_, port):
            c = await Client.connect(port)
            cookie = c.send(Cmd.READ, 8 * 512, 4 * 512)
            _, flags, rtype, got, n = struct.unpack(">IHHQI", await c.r.readexactly(20))
            payload = await c.r.readexactly(n)
            assert (rtype, got, flags) == (ReplyType.ERROR_OFFSET, cookie, 1)
            err, mlen = struct.unpack_from(">IH", payload)
            assert err == Errno.EIO and struct.unpack(">Q", payload[6 + mlen:]) == (10 * 512,)
            assert (await c.call(Cmd.WRITE, 20 * 512, 512, bytes(512)))[0] == Errno.ENOSPC
            dev.fail_device()
            assert (await c.call(Cmd.FLUSH))[0] == Errno.EIO
            dev.clear_faults()
            assert (await c.call(Cmd.READ, 0, 512))[0] == 0
            await c.close()

    run(go)


def test_multi_connection_sees_one_device() -> None:
    async def go() -> None:
        dev = RamDevice(4096, 512)
        async with serving(("disk0", dev, False)) as (server, port):
            clients = [await Client.connect(port) for _ in range(4)]
            for i, c in enumerate(clients):
                for j in range(8):
                    c.send(Cmd.WRITE, (i * 8 + j) * 4096, 4096, bytes([i * 8 + j + 1]) * 4096)
            for c in clients:
                assert [(await c.reply())[1] for _ in range(8)] == [0] * 8
            assert (await clients[0].call(Cmd.FLUSH))[0] == 0
            for i in range(32):
                c = clients[(i + 1) % 4]
                assert await c.call(Cmd.READ, i * 4096, 4096) == (0, bytes([i + 1]) * 4096)
            assert len(server.connections) == 4
            for c in clients:
                await c.close()

    run(go)


def test_pipelined_requests_and_disconnect_drain() -> None:
    async def go() -> None:
        dev = FaultDevice(RamDevice(4096, 512), latency=0.01)
        async with serving(("disk0", dev, False)) as (_, port):
            c = await Client.connect(port)
            cookies = {c.send(Cmd.WRITE, i * 512, 512, bytes([i]) * 512) for i in range(64)}
            c.send(Cmd.DISC)
            got = {(await c.reply())[0] for _ in range(64)}  # every write answered before the close
            assert got == cookies and await c.r.read() == b""
            assert bytes(await dev.read(63, 1)) == bytes([63]) * 512

    run(go)


def test_garbage_closes_one_connection_others_go_on() -> None:
    async def go() -> None:
        async with serving(("disk0", RamDevice(2048, 512), False)) as (server, port):
            good = await Client.connect(port)
            for junk in (b"\xff" * 64, struct.pack(">I", 0x80)):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                await r.readexactly(18)
                w.write(junk)
                assert await asyncio.wait_for(r.read(), 5) == b""
                w.close()
            bad = await Client.connect(port)
            bad.w.write(b"\x00" * 28)  # a request with a bad magic: hard disconnect
            assert await asyncio.wait_for(bad.r.read(), 5) == b""
            assert await good.call(Cmd.READ, 0, 512) == (0, bytes(512))
            # unknown options and an unknown export: errors, the handshake goes on
            h = Client(*await asyncio.open_connection("127.0.0.1", port))
            await h.r.readexactly(18)
            h.w.write(struct.pack(">I", 1))
            assert (await h.option(77, b"xyz"))[-1][0] == Rep.ERR_UNSUP
            assert (await h.option(Opt.GO, struct.pack(">I", 4) + b"nope" + bytes(2)))[-1][0] == Rep.ERR_UNKNOWN
            listed = await h.option(Opt.LIST)
            assert [rep for rep, _ in listed] == [Rep.SERVER, Rep.ACK] and listed[0][1] == b"\0\0\0\x05disk0DISK0"
            assert (await h.option(Opt.ABORT))[-1][0] == Rep.ACK
            assert await asyncio.wait_for(h.r.read(), 5) == b""
            await good.close()
            await asyncio.sleep(0.05)
            assert not server.connections

    run(go)


def test_handshake_timeout_and_shutdown() -> None:
    async def go() -> None:
        dev = FaultDevice(RamDevice(2048, 512), latency=0.2)
        async with serving(("disk0", dev, False), handshake_timeout=0.3) as (server, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(struct.pack(">I", 3))  # flags, then nothing: the handshake never ends
            assert await asyncio.wait_for(r.read(), 5) == bytes.fromhex("4e42444d41474943") + \
                struct.pack(">QH", IHAVEOPT, 3)  # the greeting, then the close
            c = await Client.connect(port)
            slow = c.send(Cmd.WRITE, 0, 512, b"z" * 512)
            await asyncio.sleep(0.05)
            stopping = asyncio.ensure_future(server.stop())
            await asyncio.sleep(0.05)
            late = c.send(Cmd.READ, 0, 512)
            replies = {(await c.reply())[:2] for _ in range(2)}
            assert replies == {(slow, 0), (late, Errno.ESHUTDOWN)}  # in flight finishes, new is refused
            await stopping
            assert bytes(await dev.read(0, 1)) == b"z" * 512

    run(go)


def test_port_in_use_names_the_address() -> None:
    async def go() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            server = NbdServer([NbdExportConfig("d", Volume(RamDevice(8, 512), name="d"), [("127.0.0.1", port)])])
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
                await server.start()

    run(go)


class CountingDevice(FaultDevice):
    """Counts reads running at once."""

    running = peak = 0

    async def read(self, lba: int, blocks: int) -> Any:
        CountingDevice.running += 1
        CountingDevice.peak = max(CountingDevice.peak, CountingDevice.running)
        try:
            return await super().read(lba, blocks)
        finally:
            CountingDevice.running -= 1


def test_one_chunk_of_many_requests_keeps_to_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from openvsan.frontend import nbd

    monkeypatch.setattr(nbd, "MAX_INFLIGHT_BYTES", 4 * MiB)

    async def go() -> None:
        dev = CountingDevice(RamDevice(8192, 512), latency=0.005)
        async with serving(("disk0", dev, False)) as (_, port):
            c = await Client.connect(port)
            cookies = [c.send(Cmd.READ, 0, MiB) for _ in range(64)]  # 64 MiB asked for in one go
            got = [await c.reply() for _ in cookies]
            assert sorted(r[0] for r in got) == cookies and all(r[1] == 0 and len(r[2]) == MiB for r in got)
            assert CountingDevice.peak == 4  # 4 MiB in flight at most, however many requests came at once
            await c.close()

    run(go)
